"""Checking request bodies and messages before any work starts.

Plain functions of the parsed body (no web framework, no MLX): each problem
is a ChatError (HTTP 400) that names the field, in OpenAI's error format.
"""

import json
import re

from .errors import ChatError

ROLES = ("system", "user", "assistant")
MAX_DEPTH = 32  # JSON nesting levels; a chat request needs 5


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


def only_fields(data, allowed):
    """data, if it has no field besides `allowed`."""
    for field in data:
        if field not in allowed:
            raise ChatError(f"unsupported field {field!r} (this endpoint takes {', '.join(allowed)})", param=field)
    return data
