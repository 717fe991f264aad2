"""One request's way in and out, for every endpoint of the server and the chat
app: kvarn_mlx.guard's rules applied to its headers, its body read and parsed
as JSON by one rule, and JSON, page and error responses written.

Functions of a http.server.BaseHTTPRequestHandler `h`; failures are
guard.Refused, answered with send_error.
"""

import json

from .. import guard

MAX_BODY = (
    64 << 20
)  # bytes of a request body; far beyond any prompt text (images come base64-encoded)
MAX_DEPTH = (
    64  # JSON nesting levels of a field; a chat request needs 5, a tool's JSON schema a few more
)


def check_request(h, settings, post, public=False):
    """Refused if the request breaks a rule of kvarn_mlx.guard: a Host this server
    answers to; for a POST an allowed Origin and a JSON Content-Type; the API key
    unless public (a page that holds nothing, and asks for the key)."""
    guard.check_host(h.headers.get("Host"), h.connection.getsockname()[0], settings.allowed_hosts)
    if post:
        if "*" not in settings.allowed_origins:
            guard.check_origin(
                h.headers.get("Origin"), h.headers.get("Host"), allowed=settings.allowed_origins
            )
        guard.check_json_type(h.headers.get("Content-Type"))
    if not public:
        guard.check_api_key(h.headers.get("Authorization"), settings.api_key)


def read_body(h, limit=MAX_BODY):
    """The body, once its declared length is known to be at most `limit` bytes
    (a longer one is refused unread, and the connection closed)."""
    try:
        n = int(h.headers.get("Content-Length"))
    except (TypeError, ValueError):
        raise guard.Refused(
            "send the body with a Content-Length header", code="length_required", status=411
        ) from None
    if not 0 <= n <= limit:
        h.close_connection = True
        raise guard.Refused(
            f"request body too large (limit {limit} bytes)", code="request_too_large", status=413
        )
    return h.rfile.read(n)


def parse_json(body):
    """The body as a JSON object: valid UTF-8, well-formed, a dictionary, and no
    field nested more than MAX_DEPTH levels deep (Refused naming the problem)."""
    try:
        data = json.loads(body.decode() if isinstance(body, bytes) else body)
    except RecursionError:
        raise guard.Refused(
            f"the JSON body is nested too deeply (more than {MAX_DEPTH} levels)",
            code="invalid_json",
        ) from None
    except UnicodeDecodeError as e:
        raise guard.Refused(
            f"the body is not valid UTF-8 ({e.reason} at byte {e.start})", code="invalid_json"
        ) from None
    except ValueError as e:  # also integers of more than 4300 digits
        raise guard.Refused(f"Invalid JSON in request body: {e}", code="invalid_json") from None
    if not isinstance(data, dict):
        raise guard.Refused(
            "the request body must be a JSON dictionary (an object)", code="invalid_json"
        )
    for key, value in data.items():
        if _depth(value) > MAX_DEPTH:
            raise guard.Refused(
                f"{key} is nested too deeply (more than {MAX_DEPTH} levels)",
                param=key,
                code="invalid_json",
            )
    return data


def _depth(value):
    depth, level = 0, [value]
    while level:
        depth += 1
        level = [
            v
            for x in level
            if isinstance(x, (dict, list))
            for v in (x.values() if isinstance(x, dict) else x)
        ]
        if depth > MAX_DEPTH:
            break
    return depth


def send(h, status, body, content_type, allowed_origins=(), headers=()):
    """A whole response: body (bytes), its type, CORS headers for the origins
    allowed_origins lists, and any (name, value) headers."""
    h.send_response(status)
    h.send_header("Content-Type", content_type)
    h.send_header("Content-Length", str(len(body)))
    h.send_header("Cache-Control", "no-store")
    origin = h.headers.get("Origin")
    if "*" in allowed_origins:
        h.send_header("Access-Control-Allow-Origin", "*")
    elif origin and origin.lower().rstrip("/") in allowed_origins:
        h.send_header("Access-Control-Allow-Origin", origin)
        h.send_header("Vary", "Origin")
    for name, value in headers:
        h.send_header(name, value)
    h.end_headers()
    h.wfile.write(body)


def send_json(h, data, status=200, allowed_origins=()):
    send(h, status, json.dumps(data).encode(), "application/json", allowed_origins)


def send_error(h, e):
    """guard.Refused e, in OpenAI's error format."""
    error = {
        "message": str(e),
        "type": "invalid_request_error" if e.status < 500 else "server_error",
        "code": e.code,
        "param": e.param,
    }
    send(
        h,
        e.status,
        json.dumps({"error": error}).encode(),
        "application/json",
        headers=[("WWW-Authenticate", "Bearer")] if e.status == 401 else (),
    )
