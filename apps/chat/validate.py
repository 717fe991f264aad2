"""Checking the chat's messages and saved-chat bodies before any work starts.

Plain functions of the parsed body (parsed by kvarn_mlx.server.http_io.parse_json,
the server's one rule for JSON bodies): each problem is a Refused (HTTP 400)
that names the field, in OpenAI's error format.
"""

from kvarn_mlx.guard import Refused

ROLES = ("system", "user", "assistant")


def text_of(content, field="messages"):
    """OpenAI message content (a string or a list of text parts) as plain text."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(
        isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
        for p in content
    ):
        return "".join(p["text"] for p in content)
    raise Refused(
        f"{field}: message content must be a string or a list of text parts (only text is "
        "supported)",
        param=field,
    )


def check_messages(messages):
    """Validated [{role, content}]. The last message must be a non-empty user
    message (that is what gets answered)."""
    if not isinstance(messages, list) or not messages:
        raise Refused("messages must be a non-empty list", param="messages")
    out = []
    for m in messages:
        if not isinstance(m, dict) or m.get("role") not in ROLES:
            raise Refused(
                f"messages: each message needs a role in {', '.join(ROLES)}", param="messages"
            )
        out.append({"role": m["role"], "content": text_of(m.get("content"))})
    if out[-1]["role"] != "user":
        raise Refused("messages: the last message must be from the user", param="messages")
    if not out[-1]["content"].strip():
        raise Refused("messages: empty message: type something to send", param="messages")
    return out


def only_fields(data, allowed):
    """data, if it has no field besides `allowed`."""
    for field in data:
        if field not in allowed:
            raise Refused(
                f"unsupported field {field!r} (this endpoint takes {', '.join(allowed)})",
                param=field,
            )
    return data
