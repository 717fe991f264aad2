"""The chat page on python -m kvarn_mlx.server: one server for the page and the API.

ChatHandler is kvarn_mlx.server's request handler (mlx-lm's server on KVarN
caches, behind kvarn_mlx.guard's checks) plus:
- GET /: the page. It holds no conversation, so it is served without the API
  key; it asks for the key and sends it as a Bearer token like any client.
- GET /api/chats, POST /api/save, POST /api/load: saved conversations, JSON
  files in --save-dir, written atomically and never over a file they did not write.

The page itself streams replies from /v1/chat/completions and reads its memory
panel from /v1/kv_stats (?request= its last reply's id).
"""

import json
import os
import re
import tempfile
from pathlib import Path
from urllib.parse import urlsplit

from kvarn_mlx.guard import Refused
from kvarn_mlx.server import APIHandler, http_io

from .validate import ROLES, only_fields

STATIC = Path(__file__).parent / "static"
FORMAT = "kvarn-chat"  # the saved files' marker: only files carrying it are ever replaced
MAX_BODY = 4 << 20  # bytes; far beyond any context this app can hold
_SAFE_NAME = re.compile(r"[A-Za-z0-9][\w.-]{0,63}")


# -- saved chats ------------------------------------------------------------------------


def chat_path(save_dir, data):
    """The file a {"name": ...} body names in save_dir (NAME.json)."""
    name = data.get("name")
    if not isinstance(name, str) or not _SAFE_NAME.fullmatch(name.removesuffix(".json")):
        raise Refused("a chat name is 1-64 letters, digits, '.', '_' or '-'", param="name")
    return Path(save_dir) / (name.removesuffix(".json") + ".json")


def check_transcript(messages):
    """A saved conversation: a list of {"role", "content": text} (any last role)."""
    if not isinstance(messages, list) or not messages:
        raise Refused("messages must be a non-empty list", param="messages")
    for m in messages:
        if (
            not isinstance(m, dict)
            or set(m) != {"role", "content"}
            or m["role"] not in ROLES
            or not isinstance(m["content"], str)
        ):
            raise Refused(
                f'messages: each message is {{"role": one of {", ".join(ROLES)}, "content": text}}',
                param="messages",
            )
    return messages


def read_chat(path, limit=MAX_BODY):
    """The saved file's parsed JSON if it is a saved chat, else None."""
    try:
        if path.is_symlink() or not path.is_file() or path.stat().st_size > limit:
            return None
        data = http_io.parse_json(path.read_bytes())
    except (OSError, Refused):
        return None
    return data if data.get("format") == FORMAT else None


def save_chat(save_dir, data):
    data = only_fields(data, ("name", "messages"))
    path = chat_path(save_dir, data)
    messages = check_transcript(data.get("messages"))
    if (path.exists() or path.is_symlink()) and read_chat(path) is None:
        raise Refused(
            f"{path} exists and is not a saved chat; refusing to overwrite it. Pick another name",
            code="cannot_save",
            status=409,
            param="name",
        )
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    except OSError as e:
        raise Refused(
            f"cannot save to {path.parent}: {e.strerror}", code="cannot_save", status=500
        ) from None
    try:  # a temp file, then a rename: an interrupted save leaves the old file or none
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump({"format": FORMAT, "version": 1, "messages": messages}, f, ensure_ascii=False)
            f.flush()
            os.fsync(f.fileno())
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # mkstemp makes it private; a saved chat is an ordinary file
        os.replace(tmp, path)
    except OSError as e:
        Path(tmp).unlink(missing_ok=True)
        raise Refused(
            f"could not save to {path}: {e.strerror}", code="cannot_save", status=500
        ) from None
    return {"name": path.stem, "file": str(path)}


def load_chat(save_dir, data):
    path = chat_path(save_dir, only_fields(data, ("name",)))
    if not path.exists():
        raise Refused(f"no saved chat at {path}", code="not_found", status=404, param="name")
    saved = read_chat(path)
    if saved is None:
        raise Refused(f"{path} is not a saved chat", param="name")
    try:
        return {"name": path.stem, "messages": check_transcript(saved.get("messages"))}
    except Refused as e:
        raise Refused(f"{path} is damaged: {e}", param="name") from None


def chat_names(save_dir):
    """The saved chats in save_dir (other files there are not listed)."""
    save_dir = Path(save_dir)
    return (
        sorted(p.stem for p in save_dir.glob("*.json") if read_chat(p) is not None)
        if save_dir.is_dir()
        else []
    )


# -- requests ---------------------------------------------------------------------------


class ChatHandler(APIHandler):
    """kvarn_mlx.server's handler plus the page and the saved chats (settings.save_dir)."""

    def do_GET(self):
        path = urlsplit(self.path).path
        if path == "/":
            if not self.refused(post=False, public=True):
                http_io.send(
                    self, 200, (STATIC / "index.html").read_bytes(), "text/html; charset=utf-8"
                )
        elif path == "/api/chats":
            if not self.refused(post=False):
                save_dir = self.settings.save_dir
                self.send_json({"chats": chat_names(save_dir), "dir": str(save_dir)})
        else:
            super().do_GET()

    def do_POST(self):
        act = {"/api/save": save_chat, "/api/load": load_chat}.get(urlsplit(self.path).path)
        if act is None:
            return super().do_POST()
        if self.refused(post=True):
            return
        try:
            out = act(self.settings.save_dir, http_io.parse_json(http_io.read_body(self, MAX_BODY)))
        except Refused as e:
            return http_io.send_error(self, e)
        self.send_json(out)
