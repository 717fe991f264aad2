"""Requests to the chat app's server are checked before any work starts:
/v1/chat/completions by mlx-lm's checks and kvarn_mlx.server's (body size,
nesting, UTF-8), the saved-chat endpoints completely; saved chats are written
atomically and never over a file they did not write. In-process handler in
front of a stub generator that records what reached it."""

import json
import os
import select
import socket

import pytest

from apps.chat import server as chat  # noqa: E402
from chat_server import port_of, post, read_response, serve, user
from kvarn_mlx.server import http_io  # noqa: E402

API = "/v1/chat/completions"
CHAT = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]


@pytest.fixture
def app(tmp_path):
    with serve(tmp_path / "saved") as (url, stub):
        yield url, stub, tmp_path / "saved"


def body_with(**fields):
    return json.dumps({"messages": user("Hi"), **fields})


INVALID = [  # (body, what the error names): refused with 400 before the request is queued
    ("{not json", "Invalid JSON"),
    ("[1, 2]", "JSON dictionary"),
    (json.dumps({"max_tokens": 3}), "messages"),
    (body_with(stream="yes"), "stream"),
    (body_with(max_tokens=2.5), "max_tokens"),
    (body_with(max_tokens="5"), "max_tokens"),
    (body_with(max_tokens=-3), "max_tokens"),
    (body_with(max_tokens=0), "max_tokens"),
    (body_with(temperature=-0.5), "temperature"),
    (body_with(temperature="hot"), "temperature"),
    (body_with(top_p=1.5), "top_p"),
    (body_with(top_k=-1), "top_k"),
    (body_with(seed="x"), "seed"),
    (body_with(logprobs="yes"), "logprobs"),
    (body_with(top_logprobs=30), "top_logprobs"),
    (body_with(logit_bias=[1]), "logit_bias"),
    (body_with(logit_bias={"a": 1}), "logit_bias"),
    (body_with(model=5), "model"),
    (
        body_with(temperature=float("nan")),
        "temperature",
    ),  # json.dumps writes NaN, json.loads reads it
    (body_with(temperature=float("inf")), "temperature"),
    (body_with(top_p=float("-inf")), "top_p"),
    (body_with(min_p=1.5), "min_p"),
    (body_with(repetition_penalty=float("nan")), "repetition_penalty"),
    (body_with(presence_penalty=float("inf")), "presence_penalty"),
    (body_with(frequency_penalty="x"), "frequency_penalty"),
    (body_with(xtc_probability=2), "xtc_probability"),
    (body_with(max_tokens=True), "max_tokens"),
    (body_with(max_completion_tokens=0), "max_completion_tokens"),
    (body_with(top_k=2.0), "top_k"),
    (body_with(seed=-1), "seed"),
    (body_with(seed=2**64), "seed"),
    (body_with(stream_options="yes"), "stream_options"),
    (
        body_with(stream=True, stream_options={"include_usage": "yes"}),
        "stream_options.include_usage",
    ),
    (body_with(stop=5), "stop"),
    (body_with(stop=["a", 1]), "stop"),
    (body_with(logit_bias={"33": float("nan")}), "logit_bias"),
    (body_with(logit_bias={"-1": 1}), "logit_bias"),
    (body_with(n=2), "n"),
    (body_with(tools={"a": 1}), "tools"),
    (body_with(num_draft_tokens=-1), "num_draft_tokens"),
    (body_with(chat_template_kwargs=[1]), "chat_template_kwargs"),
    (json.dumps({"messages": [{"content": "hi"}]}), "messages[0]"),
    ('{"messages": ' + "[" * 100_000 + "]" * 100_000 + "}", "nested too deeply"),
    ('{"user": ' + '{"a": ' * 50_000 + "1" + "}" * 50_000 + "}", "nested too deeply"),
    (b'{"messages": [{"role": "user", "content": "\xff"}]}', "not valid UTF-8"),
]


def test_invalid_requests_are_refused_before_any_work(app):
    url, stub, _ = app
    for body, what in INVALID:
        r = post(url + API, content=body)
        assert r.status_code == 400, (what, body[:120], r.status_code, r.text[:300])
        assert what in json.dumps(r.json()), (body[:120], r.text[:300])
    assert stub.requests == []  # nothing was queued for the model
    r = post(url + API, content=body_with(max_tokens=2, temperature=0, seed=3, stop=None))
    assert len(stub.requests) == 1  # a valid request reaches it


def stream_body(port, chunks, head):
    """Send chunks of a body until the server answers; returns (bytes sent, response)."""
    sent = 0
    with socket.create_connection(("127.0.0.1", port), timeout=60) as s:
        s.sendall(head)
        for chunk in chunks:
            readable, _, _ = select.select([s], [], [], 0)
            if readable:
                break
            try:
                s.sendall(chunk)
            except (BrokenPipeError, ConnectionResetError):
                break
            sent += len(chunk)
        else:
            readable, _, _ = select.select([s], [], [], 60)
        data = read_response(s)
    return sent, data


@pytest.mark.parametrize("path,limit", [(API, http_io.MAX_BODY), ("/api/save", chat.MAX_BODY)])
def test_declared_length_over_limit_refused_at_once(app, path, limit):
    url, stub, _ = app
    head = (
        f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: "
        f"application/json\r\nContent-Length: {limit + 1}\r\n\r\n"
    ).encode()
    sent, response = stream_body(port_of(url), iter(()), head)
    assert response.startswith(b"HTTP/1.0 413"), response[:300]
    assert b"too large" in response and not stub.requests


def test_body_without_length_refused_at_once(app):
    """A chunked body (no declared length) is refused before the client finished sending it."""
    url, stub, _ = app
    piece = b"x" * 65536
    total = chat.MAX_BODY * 4  # never fully sent: the server must answer before the end
    for path in (API, "/api/save"):
        head = (
            f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: "
            "application/json\r\nTransfer-Encoding: chunked\r\n\r\n"
        ).encode()
        chunks = (b"%x\r\n" % len(piece) + piece + b"\r\n" for _ in range(total // len(piece)))
        sent, response = stream_body(port_of(url), chunks, head)
        assert response.startswith(b"HTTP/1.0 411"), response[:300]
        assert sent < total
    assert not stub.requests


SAVE_INVALID = [
    ({"name": "../escape", "messages": CHAT}, "name"),
    ({"name": "a/b", "messages": CHAT}, "name"),
    ({"name": ".hidden", "messages": CHAT}, "name"),
    ({"name": "x" * 70, "messages": CHAT}, "name"),
    ({"name": 5, "messages": CHAT}, "name"),
    ({"messages": CHAT}, "name"),
    ({"name": "ok"}, "messages"),
    ({"name": "ok", "messages": []}, "messages"),
    ({"name": "ok", "messages": "hi"}, "messages"),
    ({"name": "ok", "messages": [{"role": "wizard", "content": "hi"}]}, "messages"),
    ({"name": "ok", "messages": [{"role": "user", "content": 5}]}, "messages"),
    ({"name": "ok", "messages": [{"role": "user", "content": "hi", "extra": 1}]}, "messages"),
    ({"name": "ok", "messages": CHAT, "other": 1}, "other"),
]


def test_saved_chat_requests_checked(app):
    url, _, saved = app
    for body, field in SAVE_INVALID:
        r = post(url + "/api/save", body)
        assert r.status_code == 400, (body, r.text)
        assert r.json()["error"]["param"] == field, (body, r.text)
    assert not saved.exists()
    for body, status in (
        ({"name": "nothing"}, 404),
        ({"name": "../x"}, 400),
        ({"name": "a", "x": 1}, 400),
        ("[1]", 400),
        ('{"name": ' + "[" * 60 + "]" * 60 + "}", 400),
    ):
        r = post(
            url + "/api/load", **({"content": body} if isinstance(body, str) else {"body": body})
        )
        assert r.status_code == status, (body, r.text)


def test_saved_chats_never_replace_other_files(app, monkeypatch):
    url, _, saved = app
    saved.mkdir()
    foreign = saved / "notes.json"
    foreign.write_text('{"my": "notes"}')
    (saved / "link.json").symlink_to(foreign)
    for name in ("notes", "notes.json", "link"):
        r = post(url + "/api/save", {"name": name, "messages": CHAT})
        assert r.status_code == 409 and "refusing to overwrite" in r.json()["error"]["message"], (
            r.text
        )
    assert foreign.read_text() == '{"my": "notes"}' and (saved / "link.json").is_symlink()
    assert post(url + "/api/load", {"name": "notes"}).status_code == 400  # not a saved chat
    # Its own files are replaced; loading gives back what was saved.
    assert post(url + "/api/save", {"name": "mine", "messages": CHAT}).status_code == 200
    longer = CHAT + [{"role": "user", "content": "again <b>ü</b>"}]
    r = post(url + "/api/save", {"name": "mine", "messages": longer})
    assert r.status_code == 200 and r.json()["file"] == str(saved / "mine.json")
    assert post(url + "/api/load", {"name": "mine"}).json()["messages"] == longer
    import httpx

    assert httpx.get(url + "/api/chats").json()["chats"] == ["mine"]  # only saved chats are listed
    # An interrupted save (the rename fails) leaves the old file whole and no temp file behind.
    before = (saved / "mine.json").read_bytes()

    def fail(src, dst):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", fail)
    r = post(url + "/api/save", {"name": "mine", "messages": CHAT})
    assert r.status_code == 500 and "No space left" in r.json()["error"]["message"]
    assert (saved / "mine.json").read_bytes() == before
    assert sorted(p.name for p in saved.iterdir()) == ["link.json", "mine.json", "notes.json"]
