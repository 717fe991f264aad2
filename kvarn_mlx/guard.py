"""Who may talk to a local server: Host, Origin, API key and Content-Type.

Plain functions of header values (no web framework), each raising Refused
with the HTTP status to answer, so any HTTP server can apply the same rules
(python -m kvarn_mlx.server and the chat app).
"""

import hmac
import ipaddress
from urllib.parse import urlsplit


class Refused(ValueError):
    """A request refused, with a message that names the problem and the fix.
    code follows OpenAI's error codes where one fits; param names the
    offending request field, if any."""

    def __init__(self, message, code="invalid_request_error", status=400, param=None):
        super().__init__(message)
        self.code, self.status, self.param = code, status, param


def split_host(value):
    """'name', 'name:port', '[v6]:port' or 'v6' -> lower-case name without brackets (None if
    malformed)."""
    value = (value or "").strip().lower()
    if value.startswith("["):
        name, sep, rest = value[1:].partition("]")
        if not sep or (rest and not (rest.startswith(":") and rest[1:].isdigit())):
            return None
        return name
    if value.count(":") > 1:  # a bare IPv6 address
        return value
    name, _, port = value.partition(":")
    if not name or (port and not port.isdigit()):
        return None
    return name


def _ip(name):
    try:
        return ipaddress.ip_address(name)
    except ValueError:
        return None


def is_local_name(name):
    """localhost, *.localhost (browsers resolve both to loopback themselves) or a loopback
    address."""
    ip = _ip(name)
    return name == "localhost" or name.endswith(".localhost") or (ip is not None and ip.is_loopback)


def check_host(host, local_addr=None, allowed=()):
    """Refuse a Host this server does not answer to.

    DNS rebinding: a page on evil.example whose name is re-pointed at
    127.0.0.1 reaches this server from the user's browser, as its own origin,
    but its requests carry `Host: evil.example`. Accepted: localhost names,
    the address the connection arrived on (an IP literal cannot be
    rebound), and the configured names ("*" accepts any). Any port: the name
    is what a rebinding attack cannot forge, and a forwarded port is common.
    """
    name = split_host(host)
    if name is None:
        raise Refused(f"bad or missing Host header {host!r}", code="invalid_host")
    if "*" in allowed or name in allowed or is_local_name(name):
        return
    ip = _ip(name)
    if ip is not None and local_addr and ip == _ip(str(local_addr).lower()):
        return
    raise Refused(
        f"Host {host!r} is not a name of this server; if it is (a reverse proxy, a LAN name), "
        "start the server with --allowed-hosts NAME",
        code="invalid_host",
    )


def check_origin(origin, host, scheme="http", allowed=()):
    """Refuse requests from another web page. Browsers send Origin with every
    cross-site request and every POST; non-browser clients send none."""
    if origin is None:
        return
    origin = origin.strip().lower().rstrip("/")
    if origin in allowed:
        return
    parts = urlsplit(origin)
    if origin != "null" and parts.scheme == scheme and parts.netloc == (host or "").strip().lower():
        return
    raise Refused(
        f"requests from the web page at Origin {origin!r} are not allowed; to allow it, start the "
        "server with --allowed-origins ORIGIN",
        code="forbidden_origin",
        status=403,
    )


def check_api_key(authorization, key):
    """`Authorization: Bearer <key>`, as OpenAI clients send it (no-op without a key)."""
    if not key:
        return
    scheme, _, token = (authorization or "").strip().partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), key.encode()):
        raise Refused(
            "this server needs its API key: send `Authorization: Bearer <key>`",
            code="invalid_api_key",
            status=401,
        )


def check_json_type(content_type):
    """JSON endpoints take application/json only: a text/plain or form POST,
    which any page may send without a CORS preflight, is refused."""
    mime = (content_type or "").partition(";")[0].strip().lower()
    if mime != "application/json":
        raise Refused(
            f"send the body as application/json (got Content-Type {content_type!r})",
            code="unsupported_media_type",
            status=415,
        )
