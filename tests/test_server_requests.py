"""Requests to the chat server are checked completely before any work starts;
over-large bodies are refused while they stream in; OpenAI's `stop` works;
unsupported fields are refused. In-process server, session model."""

import json
import select
import socket

import pytest

from chat_server import MODEL, chat_worker, port_of, post, read_response, serve, user

import httpx  # noqa: E402

from apps.chat.server import MAX_BODY, create_app  # noqa: E402

API = "/v1/chat/completions"


@pytest.fixture(scope="module")
def worker(smollm):
    with chat_worker(smollm) as w:
        yield w


@pytest.fixture(scope="module")
def url(worker, tmp_path_factory):
    with serve(create_app(worker, tmp_path_factory.mktemp("saved"))) as u:
        yield u


@pytest.fixture
def submitted(worker, monkeypatch):
    """The jobs handed to the engine during the test."""
    jobs = []
    submit = worker.submit

    def spy(fn):
        jobs.append(fn)
        return submit(fn)

    monkeypatch.setattr(worker, "submit", spy)
    return jobs


def body_with(**fields):
    return json.dumps({"messages": user("Hi"), **fields})


def raw_body(fragment):
    """A body with a field written as raw JSON text (NaN, Infinity, 1e400 are not expressible otherwise)."""
    return '{"messages": [{"role": "user", "content": "Hi"}], ' + fragment + "}"


def nested(depth):
    value = []
    for _ in range(depth):
        value = [value]
    return value


INVALID = [
    (body_with(stream=True, stream_options="yes"), "stream_options"),
    (body_with(stream=True, stream_options={"include_usage": "yes"}), "stream_options"),
    (body_with(stream=True, stream_options={"colour": 1}), "stream_options"),
    (body_with(stream_options={"include_usage": True}), "stream_options"),  # only with stream
    (body_with(stream="yes"), "stream"),
    (body_with(model=["x"]), "model"),
    (body_with(model=5), "model"),
    (body_with(kv_preset=["fp16"]), "kv_preset"),
    (body_with(preset={"a": 1}), "preset"),
    (body_with(max_tokens=2.5), "max_tokens"),
    (body_with(max_tokens="5"), "max_tokens"),
    (body_with(max_tokens=True), "max_tokens"),
    (body_with(max_tokens=-3), "max_tokens"),
    (body_with(max_tokens=0), "max_tokens"),
    (body_with(max_tokens=10**12), "max_tokens"),
    (body_with(max_tokens=[4]), "max_tokens"),
    (body_with(max_completion_tokens=10**30), "max_completion_tokens"),
    (raw_body('"max_tokens": Infinity'), "max_tokens"),
    (raw_body('"max_tokens": 1e400'), "max_tokens"),
    (raw_body('"max_tokens": NaN'), "max_tokens"),
    (raw_body('"temperature": NaN'), "temperature"),
    (raw_body('"temperature": Infinity'), "temperature"),
    (body_with(temperature=-0.5), "temperature"),
    (body_with(temperature=2.5), "temperature"),
    (body_with(temperature="hot"), "temperature"),
    (raw_body('"top_p": NaN'), "top_p"),
    (body_with(top_p=1.5), "top_p"),
    (body_with(top_p=0), "top_p"),
    (body_with(top_p=-1), "top_p"),
    (body_with(seed="x"), "seed"),
    (body_with(seed=1.5), "seed"),
    (body_with(stop=5), "stop"),
    (body_with(stop=["a", 1]), "stop"),
    (body_with(stop=[""]), "stop"),
    (body_with(stop=""), "stop"),
    (body_with(stop=["a", "b", "c", "d", "e"]), "stop"),
    (body_with(n=2), "n"),
    (body_with(n="1"), "n"),
    (body_with(logprobs=True), "logprobs"),
    (body_with(top_logprobs=3), "top_logprobs"),
    (body_with(presence_penalty=0.5), "presence_penalty"),
    (body_with(frequency_penalty=1), "frequency_penalty"),
    (body_with(logit_bias={"50": 10}), "logit_bias"),
    (body_with(tools=[{"type": "function", "function": {"name": "f"}}]), "tools"),
    (body_with(tool_choice="required"), "tool_choice"),
    (body_with(response_format={"type": "json_object"}), "response_format"),
    (body_with(user=["me"]), "user"),
    (body_with(frobnicate=1), "frobnicate"),
    (body_with(messages=None), "messages"),
    (json.dumps({"messages": [{"role": "user", "content": "hi", "extra": nested(60)}]}), "messages"),
    ('{"messages": ' + "[" * 100_000 + "]" * 100_000 + "}", "messages"),
    ('{"user": ' + '{"a": ' * 50_000 + "1" + "}" * 50_000 + "}", "user"),
]


@pytest.mark.parametrize("path", [API, "/api/chat"])
def test_invalid_requests_are_refused_before_any_work(url, worker, submitted, path):
    eng = worker.engine
    before = (eng.name, eng.preset, list(eng.tokens))
    for body, field in INVALID:
        r = post(url + path, content=body)
        assert r.status_code == 400, (field, body[:120], r.status_code, r.text[:300])
        err = r.json()["error"]
        assert err["param"] == field and field in err["message"], (body[:120], err)
    assert submitted == []  # nothing was queued for the engine
    assert (eng.name, eng.preset, list(eng.tokens)) == before
    # Neutral values of unsupported features are fine.
    ok = {"n": 1, "logprobs": False, "presence_penalty": 0, "frequency_penalty": 0.0, "logit_bias": {},
          "tools": [], "tool_choice": "none", "response_format": {"type": "text"}, "user": "me", "seed": 3,
          "stream_options": None, "top_p": 1, "temperature": 0, "max_tokens": 2, "stop": None}
    r = post(url + path, content=body_with(**ok))
    assert r.status_code == 200, r.text


def test_nested_json_limit_names_the_field(url):
    deep = {"role": "user", "content": "hi"}
    for _ in range(40):
        deep = {"x": deep}
    r = post(url + API, {"messages": [deep]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"


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


def test_chunked_body_refused_while_it_streams_in(url):
    """A chunked body (no declared length) over the limit is refused before the client finished sending it."""
    piece = b"x" * 65536
    total = MAX_BODY * 4  # never fully sent: the server must answer before the end
    head = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            b"Transfer-Encoding: chunked\r\n\r\n")
    chunks = (b"%x\r\n" % len(piece) + piece + b"\r\n" for _ in range(total // len(piece)))
    sent, response = stream_body(port_of(url), chunks, head)
    assert response.startswith(b"HTTP/1.1 413"), response[:300]
    assert b"too large" in response
    assert sent < total


def test_declared_length_over_limit_refused_at_once(url):
    head = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n" % (MAX_BODY + 1))
    sent, response = stream_body(port_of(url), iter(()), head)
    assert response.startswith(b"HTTP/1.1 413"), response[:300]


# -- stop ------------------------------------------------------------------


def complete(url, stream=False, **fields):
    body = {"model": MODEL, "messages": user("List the days of the week, one per line."), "max_tokens": 24,
            "temperature": 0, **fields}
    if not stream:
        r = post(url + API, body)
        assert r.status_code == 200, r.text
        out = r.json()
        return out["choices"][0]["message"]["content"], out["choices"][0]["finish_reason"]
    text, finish = "", None
    with httpx.stream("POST", url + API, json={**body, "stream": True}, timeout=120) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: {"):
                for c in json.loads(line[6:])["choices"]:
                    text += c["delta"].get("content") or ""
                    finish = c["finish_reason"] or finish
    return text, finish


def test_stop_strings(url):
    full, _ = complete(url)
    assert len(full) > 12, full
    # A stop string from the middle of the reply, spanning tokens.
    p = len(full) // 2
    stop = full[p:p + 4]
    cut = full.find(stop)
    assert cut > 0
    for stream in (False, True):
        assert complete(url, stream, stop=stop) == (full[:cut], "stop")
        assert complete(url, stream, stop=["never-appears", stop]) == (full[:cut], "stop")
        # The earliest of several stop strings wins.
        early = full[2:4]
        assert complete(url, stream, stop=[stop, early]) == (full[:full.find(early)], "stop")
        assert complete(url, stream, stop="never-appears")[0] == full
    # The page's endpoint too.
    r = post(url + "/api/chat", {"messages": user("List the days of the week, one per line."), "max_tokens": 24,
                                 "temperature": 0, "stop": stop})
    done = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {\"type\": \"done\"")]
    assert done and done[0]["text"] == full[:cut] and done[0]["finish_reason"] == "stop"


def test_stop_matching_rules():
    from apps.chat.engine import find_stop, held_back

    assert find_stop("Hello world", ["wor", "lo"], 0) == 3  # the earliest match wins
    assert find_stop("Hello world", ["xyz"], 0) is None
    assert find_stop("Hello world", ["Hello"], 6) is None  # already searched before
    assert find_stop("Hello world", ["o w"], 5) == 4  # a match straddling the new text
    assert held_back("Hello wo", ["world"]) == 2  # "wo" may begin "world": not shown yet
    assert held_back("Hello", ["world", "lo!"]) == 2
    assert held_back("Hello", ["xyz"]) == 0 and held_back("", ["a"]) == 0
