"""Property-based fuzz of the chat app's HTTP API (hypothesis): whatever
arrives, the answer is 2xx or 4xx (never a 5xx but 501 for HTTP methods it
does not implement, never a reset), the server
keeps answering, no saved chat changes unless a valid save was asked for, and
nothing reaches the model that mlx-lm's or kvarn_mlx.server's checks, the
Host, Origin and Content-Type rules refuse. In-process handler in front of a
stub generator (no model: a request that reaches it is answered with mlx-lm's
404); bounded to a CI-sized run."""

import hashlib
import json
import os
import re

import pytest

from chat_server import port_of, post, serve, user

hypothesis = pytest.importorskip(
    "hypothesis", reason="the fuzz test needs the 'test' extra: pip install -e '.[test]'"
)
import httpx  # noqa: E402
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

EXAMPLES = int(os.environ.get("KVARN_FUZZ_EXAMPLES", 100))


def nested(depth):
    """A list nested `depth` levels deep, deeper than json.dumps can write: a marker encode()
    expands."""
    return f"<deep {depth}>"


scalars = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.floats(), st.text(max_size=12)
)
anything = st.one_of(
    st.recursive(
        scalars,
        lambda kids: (
            st.lists(kids, max_size=3) | st.dictionaries(st.text(max_size=8), kids, max_size=3)
        ),
        max_leaves=8,
    ),
    st.integers(20, 5000).map(nested),
)
text = st.text(min_size=1, max_size=30).filter(str.strip)
message = st.fixed_dictionaries(
    {
        "role": st.sampled_from(["user", "assistant", "system", "tool", 1]),
        "content": st.one_of(text, anything),
    }
)
valid_messages = st.one_of(
    text.map(user),
    st.tuples(text, text).map(
        lambda t: [{"role": "system", "content": t[0]}, {"role": "user", "content": t[1]}]
    ),
)
# Valid lengths stay tiny: this is about input handling, not long generations.
lengths = st.one_of(
    st.integers(1, 3),
    st.integers(max_value=0),
    st.integers(min_value=10**4),
    st.floats(),
    st.text(max_size=3),
    anything,
)
numbers = st.one_of(
    st.floats(), st.integers(-3, 3), st.sampled_from([0.5, 1, 1.0]), st.text(max_size=3), anything
)
CHAT_FIELDS = {
    "model": st.sampled_from(["default_model", "nope", "", None, ["x"], 5, {"a": 1}]),
    "max_tokens": lengths,
    "max_completion_tokens": lengths,
    "temperature": numbers,
    "top_p": numbers,
    "seed": st.one_of(st.integers(-5, 2**70), anything),
    "stream": st.one_of(st.booleans(), anything),
    "stream_options": st.one_of(st.just({"include_usage": True}), st.just("yes"), anything),
    "stop": st.one_of(text, st.lists(st.text(max_size=3), max_size=5), anything),
    "top_k": numbers,
    "min_p": numbers,
    "logprobs": st.one_of(st.booleans(), anything),
    "top_logprobs": st.one_of(st.integers(-2, 12), anything),
    "logit_bias": st.one_of(
        st.just({"5": 1}), st.dictionaries(st.text(max_size=3), anything, max_size=2), anything
    ),
    "repetition_penalty": numbers,
    "tools": anything,
    "user": st.one_of(text, anything),
    "extra_field": anything,
}


@st.composite
def chat_body(draw):
    """Mostly a valid request with up to three fields of any kind."""
    body = {
        "messages": draw(
            st.one_of(valid_messages, valid_messages, valid_messages, st.lists(message), anything)
        )
    }
    for field in draw(st.lists(st.sampled_from(sorted(CHAT_FIELDS)), max_size=3, unique=True)):
        body[field] = draw(CHAT_FIELDS[field])
    return body


names = st.sampled_from(
    ["a", "b-1", "foreign", "../x", "", "a/b", ".hidden", "x" * 70, 5, None, ["a"]]
)
transcripts = st.one_of(valid_messages, st.lists(message, max_size=3), anything)
page_body = st.one_of(
    st.fixed_dictionaries({"name": names}),
    st.fixed_dictionaries({"name": names, "messages": transcripts}),
    st.fixed_dictionaries({}, optional={"messages": transcripts, "name": names, "other": anything}),
    anything,
)
endpoints = st.one_of(
    st.tuples(
        st.just("POST"),
        st.sampled_from(["/v1/chat/completions", "/chat/completions", "/v1/completions"]),
        chat_body(),
    ),
    st.tuples(st.just("POST"), st.sampled_from(["/api/save", "/api/load"]), page_body),
    st.tuples(
        st.sampled_from(["GET", "HEAD", "PUT", "DELETE", "OPTIONS", "POST"]),
        st.sampled_from(
            [
                "/",
                "/health",
                "/api/chats",
                "/v1/kv_stats",
                "/v1/kv_stats?request=x",
                "/v1/chat/completions",
                "/api/../apps/chat/server.py",
                "/static/../../pyproject.toml",
                "/%2e%2e/%2e%2e/etc/passwd",
                "/api/chats/../x",
                "/v1/chat/completions/",
                "/nope",
            ]
        ),
        anything,
    ),
)


def encode(body, how):
    text = json.dumps(
        body
    )  # NaN and Infinity come out as such: the server must refuse them by field
    text = re.sub(r'"<deep (\d+)>"', lambda m: "[" * int(m[1]) + "]" * int(m[1]), text)
    if how == "json":
        return text.encode()
    if how == "truncated":
        return text[: len(text) // 2].encode()
    return b"\xff\xfe" + text.encode("utf-16-le")  # not UTF-8


requests = st.fixed_dictionaries(
    {
        "endpoint": endpoints,
        "encoding": st.sampled_from(["json", "json", "json", "truncated", "utf16"]),
        "raw": st.one_of(st.none(), st.none(), st.binary(max_size=64)),
        "content_type": st.sampled_from(
            [
                "application/json",
                "application/json",
                "application/json; charset=utf-8",
                "text/plain",
                None,
                "application/x-www-form-urlencoded",
            ]
        ),
        "origin": st.sampled_from([None, None, "same", "http://evil.example", "null"]),
        "host": st.sampled_from(["default", "default", "default", "localhost", "evil.example"]),
    }
)


def snapshot(folder):
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in folder.iterdir()}


def test_fuzz_http_api(tmp_path):
    saved = tmp_path / "saved"
    saved.mkdir()
    (saved / "foreign.json").write_bytes(b"somebody else's file")
    with serve(saved) as (url, stub):
        port = port_of(url)
        # The fuzzer never names "kept", so it must come through untouched; "a" is a chat the app
        # created that the fuzzer may legitimately overwrite.
        assert post(url + "/api/save", {"name": "kept", "messages": user("Hi")}).status_code == 200
        assert post(url + "/api/save", {"name": "a", "messages": user("Hi")}).status_code == 200
        client = httpx.Client(timeout=120)

        @settings(
            max_examples=EXAMPLES,
            deadline=None,
            database=None,
            print_blob=True,
            suppress_health_check=list(HealthCheck),
        )
        @given(req=requests)
        def one_request(req):
            method, path, body = req["endpoint"]
            content = req["raw"] if req["raw"] is not None else encode(body, req["encoding"])
            headers = {}
            if req["content_type"]:
                headers["Content-Type"] = req["content_type"]
            if req["host"] != "default":
                headers["Host"] = f"{req['host']}:{port}"
            if req["origin"]:
                headers["Origin"] = (
                    f"http://127.0.0.1:{port}" if req["origin"] == "same" else req["origin"]
                )
            before, reached = snapshot(saved), len(stub.requests)
            send = {} if method in ("GET", "HEAD", "OPTIONS") else {"content": content}
            r = client.request(method, url + path, headers=headers, **send)
            unknown = method not in ("GET", "POST", "OPTIONS")  # http.server: 501 Not Implemented
            assert r.status_code // 100 in (2, 4) or (unknown and r.status_code == 501), (
                method,
                path,
                r.status_code,
                r.text[:500],
            )
            allowed = (
                (req["content_type"] or "").startswith("application/json")
                and req["origin"] in (None, "same")
                and req["host"] in ("default", "localhost")
            )
            if len(stub.requests) > reached:  # reached the model: only through the rules
                assert method == "POST" and "completions" in path and allowed, (method, path, req)
            after = snapshot(saved)
            changed = {n for n in before.keys() | after.keys() if before.get(n) != after.get(n)}
            if changed:  # only a valid save, and only the file it names
                assert path == "/api/save" and r.status_code == 200, (
                    method,
                    path,
                    r.status_code,
                    changed,
                )
                assert allowed and changed == {body["name"].removesuffix(".json") + ".json"}
            # Still answering.
            assert client.get(url + "/health").status_code == 200

        one_request()
        assert (saved / "foreign.json").read_bytes() == b"somebody else's file"
        assert post(url + "/api/load", {"name": "kept"}).json()["messages"] == user("Hi")
        client.close()
