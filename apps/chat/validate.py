"""Checking a chat request completely before any work starts.

Plain functions of the parsed body (no web framework, no MLX): each problem
is a ChatError (HTTP 400) that names the field, in OpenAI's error format.
"""

import json
import math
import re

from .errors import ChatError

ROLES = ("system", "user", "assistant")
MAX_DEPTH = 32  # JSON nesting levels; a chat request needs 5
MAX_STOPS = 4  # as OpenAI
TEMPERATURE_MAX = 2.0  # as OpenAI

# Fields of OpenAI's API this server does not implement: accepted only with
# the value that means "off", refused otherwise (never silently ignored).
NEUTRAL = {
    "n": (1,),
    "logprobs": (False,),
    "top_logprobs": (0,),
    "presence_penalty": (0,),
    "frequency_penalty": (0,),
    "logit_bias": ({},),
    "tools": ([],),
    "functions": ([],),
    "tool_choice": ("none",),
    "parallel_tool_calls": (True, False),  # meaningless without tools
    "response_format": ({"type": "text"},),
}
SUPPORTED = {"messages", "model", "kv_preset", "preset", "max_tokens", "max_completion_tokens", "temperature",
             "top_p", "stream", "stream_options", "stop", "seed", "user"}


def parse_json(body):
    """The request body as a JSON object (ChatError if it is not one)."""
    try:
        data = json.loads(body or b"{}")
    except RecursionError:
        field = _deep_field(body)
        raise ChatError(f"{field or 'the JSON'} is nested more than {MAX_DEPTH} levels deep", param=field,
                        code="invalid_json")
    except ValueError as e:  # also bad UTF-8 and integers of more than 4300 digits
        raise ChatError(f"malformed JSON: {e}", code="invalid_json")
    if not isinstance(data, dict):
        raise ChatError("the request body must be a JSON object", code="invalid_json")
    for key, value in data.items():
        if _depth(value) > MAX_DEPTH:
            raise ChatError(f"{key} is nested more than {MAX_DEPTH} levels deep", param=key)
    return data


def _deep_field(body):
    """The top-level field whose value is too deep for the parser (to name it in the error)."""
    text = body.decode("utf-8", "replace") if isinstance(body, bytes) else body
    decoder, space = json.JSONDecoder(), re.compile(r"[ \t\n\r]*")
    i = space.match(text).end()
    if text[i:i + 1] != "{":
        return None
    try:
        while True:
            i = space.match(text, i + 1).end()
            key, i = json.decoder.scanstring(text, i + 1)
            i = space.match(text, space.match(text, i).end() + 1).end()  # past the colon
            try:
                _, i = decoder.raw_decode(text, i)
            except RecursionError:
                return key
            i = space.match(text, i).end()  # at the comma
    except (ValueError, IndexError):
        return None


def _depth(value):
    depth, level = 0, [value]
    while level:
        depth += 1
        level = [v for x in level if isinstance(x, (dict, list)) for v in (x.values() if isinstance(x, dict) else x)]
        if depth > MAX_DEPTH:
            break
    return depth


def _shown(value):
    text = json.dumps(value) if not isinstance(value, float) or math.isfinite(value) else repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _fail(field, must, value):
    raise ChatError(f"{field} must be {must} (got {_shown(value)})", param=field)


def text_of(content, field="messages"):
    """OpenAI message content (a string or a list of text parts) as plain text."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text"
                                         and isinstance(p.get("text"), str) for p in content):
        return "".join(p["text"] for p in content)
    raise ChatError(f"{field}: message content must be a string or a list of text parts "
                    "(only text is supported)", param=field)


def check_messages(messages):
    """Validated [{role, content}]. The last message must be a non-empty user
    message (that is what gets answered)."""
    if not isinstance(messages, list) or not messages:
        raise ChatError("messages must be a non-empty list", param="messages")
    out = []
    for m in messages:
        if not isinstance(m, dict) or m.get("role") not in ROLES:
            raise ChatError(f"messages: each message needs a role in {', '.join(ROLES)}", param="messages")
        out.append({"role": m["role"], "content": text_of(m.get("content"))})
    if out[-1]["role"] != "user":
        raise ChatError("messages: the last message must be from the user", param="messages")
    if not out[-1]["content"].strip():
        raise ChatError("messages: empty message: type something to send", param="messages")
    return out


def _number(data, field, low, high, low_open=False):
    value = data.get(field)
    if value is None:
        return None
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if not ok or value > high or value < low or (low_open and value == low):
        _fail(field, f"a number {'>' if low_open else '>='} {low} and <= {high}", value)
    return float(value)


def _integer(data, field, low, high):
    value = data.get(field)
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
        _fail(field, f"an integer from {low} to {high}", value)
    return value


def check_name(data, field, choices):
    """data[field]: None or one of choices (a model or a KV preset name)."""
    value = data.get(field)
    if value is None:
        return None
    if not isinstance(value, str):
        _fail(field, "a string", value)
    if value not in choices:
        if field == "model":
            raise ChatError(f"unknown model {value!r}; this server has: {', '.join(choices)}", param=field,
                            code="model_not_found", status=404)
        raise ChatError(f"unknown KV preset {value!r} in {field}; valid presets: {', '.join(choices)}",
                        param=field, code="invalid_preset")
    return value


def only_fields(data, allowed):
    """data, if it has no field besides `allowed`."""
    for field in data:
        if field not in allowed:
            raise ChatError(f"unsupported field {field!r} (this endpoint takes {', '.join(allowed)})", param=field)
    return data


def check_stop(value):
    """OpenAI's stop: null, a string, or a list of up to 4 strings; returns a list."""
    stops = [value] if isinstance(value, str) else value
    if stops is None:
        return []
    if (not isinstance(stops, list) or len(stops) > MAX_STOPS
            or not all(isinstance(s, str) and s for s in stops)):
        _fail("stop", f"a non-empty string or a list of up to {MAX_STOPS} non-empty strings", value)
    return stops


def check_chat_request(data, models, presets, max_tokens_limit):
    """Every field of a chat request, checked before any work; returns the
    engine's arguments (None = the engine's default)."""
    for field in data:
        if field in NEUTRAL:
            if data[field] is not None and data[field] not in NEUTRAL[field]:
                raise ChatError(f"{field} is not supported by this server (only "
                                f"{' or '.join(_shown(v) for v in NEUTRAL[field])})", param=field)
        elif field not in SUPPORTED:
            raise ChatError(f"unsupported field {field!r}", param=field)
    if data.get("n") is not None and (type(data["n"]) is not int):  # 1.0 or True would pass the table
        _fail("n", "1", data["n"])
    for field in ("logprobs", "parallel_tool_calls"):
        if data.get(field) is not None and not isinstance(data[field], bool):
            _fail(field, "true or false", data[field])
    messages = check_messages(data.get("messages"))
    model = check_name(data, "model", models)
    preset = check_name(data, "kv_preset", presets) or check_name(data, "preset", presets)
    max_tokens = _integer(data, "max_tokens", 1, max_tokens_limit)
    max_tokens = _integer(data, "max_completion_tokens", 1, max_tokens_limit) or max_tokens
    stream = data.get("stream")
    if stream is not None and not isinstance(stream, bool):
        _fail("stream", "true or false", stream)
    options = data.get("stream_options")
    if options is not None:
        if not stream:
            raise ChatError("stream_options is only allowed with stream: true", param="stream_options")
        if not isinstance(options, dict) or set(options) - {"include_usage"} or \
                not isinstance(options.get("include_usage", False), bool):
            _fail("stream_options", 'an object {"include_usage": true|false}', options)
    user = data.get("user")
    if user is not None and not isinstance(user, str):
        _fail("user", "a string", user)
    return dict(messages=messages, model=model, preset=preset, max_tokens=max_tokens,
                temp=_number(data, "temperature", 0, TEMPERATURE_MAX), top_p=_number(data, "top_p", 0, 1, low_open=True),
                seed=_integer(data, "seed", 0, 2**63 - 1), stop=check_stop(data.get("stop")), stream=bool(stream),
                include_usage=bool((options or {}).get("include_usage")))
