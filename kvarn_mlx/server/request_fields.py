"""The fields of an OpenAI completion request, checked before it is queued.

mlx-lm's server reads these fields from the body (mlx_lm.server, 0.32) and
checks most of their types, but takes NaN and infinity (Python's JSON parser
reads them), booleans where it wants integers, and some fields it indexes
without checking (stream_options, stop, messages). check() refuses each with
a 400 naming the field, in OpenAI's error format (guard.Refused).
"""

import math

from ..guard import Refused

MAX_SEED = 2**64 - 1  # mx.random.seed takes an unsigned 64-bit integer
MAX_TOP_LOGPROBS = 11  # mlx-lm's limit (-1: none)


def _refuse(field, rule, value):
    shown = repr(value) if len(repr(value)) <= 40 else repr(value)[:40] + "..."
    raise Refused(f"{field} must be {rule} (got {shown})", code="invalid_value", param=field)


def _integer(body, field, low=None, high=None):
    value = body[field]
    if (
        isinstance(value, bool)
        or not isinstance(value, int)
        or (low is not None and value < low)
        or (high is not None and value > high)
    ):
        bounds = " and ".join(
            b for b in (low is not None and f">= {low}", high is not None and f"<= {high}") if b
        )
        _refuse(field, "an integer" + (f" {bounds}" if bounds else ""), value)


def _number(body, field, low=None, high=None):
    value = body[field]
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not math.isfinite(value)
        or (low is not None and value < low)
        or (high is not None and value > high)
    ):
        bounds = " and ".join(
            b for b in (low is not None and f">= {low}", high is not None and f"<= {high}") if b
        )
        _refuse(field, "a finite number" + (f" {bounds}" if bounds else ""), value)


def _boolean(body, field):
    if not isinstance(body[field], bool):
        _refuse(field, "true or false", body[field])


def _string(body, field):
    if not isinstance(body[field], str):
        _refuse(field, "a string", body[field])


def _object(body, field):
    if not isinstance(body[field], dict):
        _refuse(field, "a JSON object", body[field])


def _list(body, field):
    if not isinstance(body[field], list):
        _refuse(field, "a list", body[field])


# field: its check, for a value that is not null. Numbers: mlx-lm's ranges.
FIELDS = {
    "model": _string,
    "draft_model": _string,
    "adapters": _string,
    "stream": _boolean,
    "stream_options": _object,
    "max_tokens": lambda b, f: _integer(b, f, low=1),
    "max_completion_tokens": lambda b, f: _integer(b, f, low=1),
    "num_draft_tokens": lambda b, f: _integer(b, f, low=0),
    "temperature": lambda b, f: _number(b, f, low=0),
    "top_p": lambda b, f: _number(b, f, low=0, high=1),
    "top_k": lambda b, f: _integer(b, f, low=0),
    "min_p": lambda b, f: _number(b, f, low=0, high=1),
    "repetition_penalty": lambda b, f: _number(b, f, low=0),
    "repetition_context_size": lambda b, f: _integer(b, f, low=0),
    "presence_penalty": _number,
    "presence_context_size": lambda b, f: _integer(b, f, low=0),
    "frequency_penalty": _number,
    "frequency_context_size": lambda b, f: _integer(b, f, low=0),
    "xtc_probability": lambda b, f: _number(b, f, low=0, high=1),
    "xtc_threshold": lambda b, f: _number(b, f, low=0, high=1),
    "logprobs": _boolean,
    "top_logprobs": lambda b, f: _integer(b, f, low=-1, high=MAX_TOP_LOGPROBS),
    "seed": lambda b, f: _integer(b, f, low=0, high=MAX_SEED),
    "logit_bias": _object,
    "chat_template_kwargs": _object,
    "role_mapping": _object,
    "tools": _list,
    "n": lambda b, f: _integer(b, f, low=1, high=1),  # one choice per request
}
# Fields whose null mlx-lm does not take (it reads a null as the value).
NOT_NULL = (
    "stream",
    "max_tokens",
    "num_draft_tokens",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "repetition_penalty",
    "repetition_context_size",
    "presence_penalty",
    "presence_context_size",
    "frequency_penalty",
    "frequency_context_size",
    "xtc_probability",
    "xtc_threshold",
    "logprobs",
    "top_logprobs",
    "model",
    "draft_model",
)


def check(body, chat):
    """Refused (400, naming the field) unless every field mlx-lm reads from this
    completion request body (a dict) has a value it serves. chat: a chat
    completion (messages), else a text completion (prompt). Fills in
    stream_options.include_usage, which mlx-lm reads without a default."""
    for field in NOT_NULL:
        if field in body and body[field] is None:
            _refuse(field, "given a value, or left out", None)
    for field, rule in FIELDS.items():
        if body.get(field) is not None:
            rule(body, field)
    _stop(body.get("stop"))
    if body.get("logit_bias") is not None:
        _logit_bias(body["logit_bias"])
    if body.get("stream_options") is not None:
        options = body["stream_options"]
        if "include_usage" in options and not isinstance(options["include_usage"], bool):
            _refuse("stream_options.include_usage", "true or false", options["include_usage"])
        options.setdefault("include_usage", False)
    for i, tool in enumerate(body.get("tools") or []):
        if not isinstance(tool, dict):
            _refuse(f"tools[{i}]", "a JSON object", tool)
    if chat:
        _messages(body.get("messages"))
    elif not isinstance(body.get("prompt"), str):
        _refuse("prompt", "a string (the text to continue)", body.get("prompt"))
    return body


def _stop(stop):
    if stop is None or isinstance(stop, str):
        return
    if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
        _refuse("stop", "a string or a list of strings", stop)


def _logit_bias(bias):
    for key, value in bias.items():
        try:
            token = int(key)
        except ValueError:
            token = -1
        if token < 0:
            _refuse("logit_bias", "an object of token ids (integers >= 0) to biases", key)
        if (
            isinstance(value, bool)
            or not isinstance(value, (int, float))
            or not math.isfinite(value)
        ):
            _refuse("logit_bias", "an object of token ids to finite numbers", value)


def _messages(messages):
    if not isinstance(messages, list) or not messages:
        _refuse("messages", "a non-empty list of messages", messages)
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            _refuse(f"messages[{i}]", 'an object with a "role" string', m)
