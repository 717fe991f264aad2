"""The one error type of the chat app: a refusal with a message for the user."""


class ChatError(ValueError):
    """A request refused, with a message that names the problem and the fix.
    code follows OpenAI's error codes where one fits; param names the
    offending request field, if any."""

    def __init__(self, message, code="invalid_request_error", status=400, param=None):
        super().__init__(message)
        self.code, self.status, self.param = code, status, param
