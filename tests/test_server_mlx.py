"""python -m kvarn_mlx.server (mlx-lm's server on KVarN caches) in a subprocess,
on a tiny random-weight llama with the embedded model's tokenizer
(tests/model_folder.py), talked to with the `openai` client.

The preset is k4v2_g64 with a 16-token sink so prompts of a few hundred
tokens fill tiles while requests are batched.
"""

import concurrent.futures
import contextlib
import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest

from model_folder import tiny_model_folder
from server_process import free_port, running

openai = pytest.importorskip("openai")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TIMEOUT = 120  # seconds; only ever hit when something is broken
WORDS = (
    "the quick brown fox jumps over a lazy dog while seven wizards quietly hex jolly brave kings"
).split()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tiny_model_folder(tmp_path_factory.mktemp("tiny") / "model")


@contextlib.contextmanager
def server(model_dir, *flags):
    """The server on a free port; yields (base URL, the log file's path)."""
    port = free_port()
    cmd = [
        sys.executable,
        "-m",
        "kvarn_mlx.server",
        "--model",
        str(model_dir),
        "--port",
        str(port),
        "--kv-preset",
        "k4v2_g64",
        "--kv-sink",
        "16",
        "--kv-tail-tokens",
        "64",
        "--max-tokens",
        "16",
        *flags,
    ]
    url = f"http://127.0.0.1:{port}"
    with open(model_dir.parent / f"server-{port}.log", "w+") as log, running(cmd, url, log):
        yield url, log.name


def get(url, headers=None):
    with urllib.request.urlopen(
        urllib.request.Request(url, headers=headers or {}), timeout=TIMEOUT
    ) as r:
        return json.loads(r.read())


def request(url, method="POST", body=b"{}", headers=None):
    """(status, parsed JSON body) of a raw request."""
    req = urllib.request.Request(
        url, data=body if method == "POST" else None, method=method, headers=headers or {}
    )
    try:
        with urllib.request.urlopen(req, timeout=TIMEOUT) as r:
            return r.status, json.loads(r.read() or b"null")
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"null")


def client(url):
    return openai.OpenAI(base_url=url + "/v1", api_key="none", timeout=TIMEOUT, max_retries=0)


def prompt(i, n_words):
    return " ".join(WORDS[(i * 7 + j * 3) % len(WORDS)] for j in range(n_words))


def stream_chat(c, messages, max_tokens=16):
    """The streamed reply's text and the finish reason."""
    text, finish = [], None
    for chunk in c.chat.completions.create(
        model="default_model",
        messages=messages,
        max_tokens=max_tokens,
        temperature=0.0,
        stream=True,
    ):
        if chunk.choices:
            text.append(chunk.choices[0].delta.content or "")
            finish = chunk.choices[0].finish_reason or finish
    return "".join(text), finish


def test_concurrent_streams_equal_the_same_requests_one_at_a_time(model_dir):
    # --prompt-cache-size 0: every request is computed from scratch in both runs.
    conversations = [[{"role": "user", "content": prompt(i, 40 + 45 * i)}] for i in range(8)]
    with server(model_dir, "--prompt-cache-size", "0") as (url, _):
        c = client(url)
        # answers long enough that the requests overlap in the batch even when the
        # machine is busy (the stats are sampled, not recorded)
        alone = [stream_chat(c, m, max_tokens=48) for m in conversations]
        seen = []
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            futures = [pool.submit(stream_chat, c, m, 48) for m in conversations]
            while not all(f.done() for f in futures):
                seen.append(get(url + "/v1/kv_stats")["live"])
                time.sleep(0.02)
            together = [f.result() for f in futures]
        stats = get(url + "/v1/kv_stats")
    assert all(finish == "length" for _, finish in alone)
    assert together == alone
    batched = max(seen, key=lambda s: s["sequences"])  # sequences holding tokens at once
    assert batched["sequences"] > 1, "the requests were never batched"
    assert batched["held"] > 0 and batched["plain"] > 0
    assert stats["live"]["sequences"] == 0 and stats["prompt_cache"]["sequences"] == 0
    assert (stats["kv_preset"], stats["kv_sink"], stats["kv_tail_tokens"]) == ("k4v2_g64", 16, 64)


def test_a_continued_conversation_prefills_only_its_new_tokens(model_dir):
    # The random model's replies would not tokenize back to the tokens it generated;
    # a logit bias makes it repeat "1" (token 33 of SmolLM2's tokenizer, which
    # splits numbers into digits), which does.
    with server(model_dir) as (url, _):
        c = client(url)
        first = [{"role": "user", "content": prompt(1, 200)}]
        ask = dict(model="default_model", max_tokens=16, temperature=0.0, logit_bias={"33": 100})
        r1 = c.chat.completions.create(messages=first, **ask)
        assert r1.choices[0].message.content == "1" * 16
        # the server stores the conversation's cache just after answering: wait for it
        deadline = time.monotonic() + TIMEOUT
        while (before := get(url + f"/v1/kv_stats?request={r1.id}"))["request"] is None:
            assert time.monotonic() < deadline, "the request's figures never appeared"
            time.sleep(0.05)
        unknown = get(url + "/v1/kv_stats?request=chatcmpl-unknown")
        second = first + [
            {"role": "assistant", "content": r1.choices[0].message.content},
            {"role": "user", "content": prompt(2, 30)},
        ]
        r2 = c.chat.completions.create(messages=second, **ask)
        after = get(url + "/v1/kv_stats")
    # ?request=: the figures of the cache this conversation left in the prompt cache
    one = before["request"]
    assert r1.usage.prompt_tokens < one["tokens"] <= r1.usage.prompt_tokens + 16
    assert one["tiles"] >= 2 and one["kvarn_layers"] == one["layers"] > 0
    assert one["plain"] > one["held"] > 0 and one["ratio_plain"] == pytest.approx(
        one["plain"] / one["held"]
    )
    assert one["dtype"] == "float32" and one["saving_from"] > 16 and one["live"] is False
    assert unknown["request"] is None
    assert "request" not in after
    cached = r2.usage.prompt_tokens_details.cached_tokens
    processed = after["prompt_tokens_processed"] - before["prompt_tokens_processed"]
    # the first prompt and the reply's tokens (all but the last, which the cache
    # never sees: generation stops after sampling it) came from the cache
    assert cached >= r1.usage.prompt_tokens + 15
    assert processed == r2.usage.prompt_tokens - cached
    assert processed < 45  # the second question and the chat template's turn markers
    # the prompt cache holds the conversation as KVarN tiles: less than the plain cache
    held = after["prompt_cache"]
    assert held["sequences"] >= 1 and held["tokens"] >= r2.usage.prompt_tokens
    assert held["plain"] > held["held"] > 0


def test_the_guard(model_dir):
    with server(model_dir, "--allowed-hosts", "box.lan") as (url, _):
        chat = url + "/v1/chat/completions"
        body = json.dumps(
            {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
        ).encode()
        json_type = {"Content-Type": "application/json"}
        status, err = request(url + "/v1/kv_stats", "GET", headers={"Host": "evil.example"})
        assert status == 400 and err["error"]["code"] == "invalid_host"
        assert request(url + "/v1/kv_stats", "GET", headers={"Host": "box.lan:8080"})[0] == 200
        status, err = request(
            chat, body=body, headers={**json_type, "Origin": "http://evil.example"}
        )
        assert status == 403 and err["error"]["code"] == "forbidden_origin"
        status, err = request(chat, body=body, headers={"Content-Type": "text/plain"})
        assert status == 415 and "application/json" in err["error"]["message"]
        status, reply = request(
            chat, body=body, headers={**json_type, "Origin": url}
        )  # same origin
        assert status == 200 and reply["usage"]["completion_tokens"] == 1
        status, _ = request(chat, "OPTIONS", headers={"Host": "evil.example"})
        assert status == 400


def run_server(*args):
    """python -m kvarn_mlx.server with args, to its exit (flags it refuses, --help)."""
    return subprocess.run(
        [sys.executable, "-m", "kvarn_mlx.server", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
    )


def test_flags():
    r = run_server("--kv-bits", "4")
    assert r.returncode == 2 and "--kv-preset" in r.stderr
    r = run_server("--kv-preset", "k3v3")
    assert r.returncode == 2 and "k4v2_g128" in r.stderr and "kXvY_gG_auto" in r.stderr
    r = run_server("--help")
    assert r.returncode == 0 and "--kv-preset" in r.stdout and "--prompt-cache-bytes" in r.stdout


# -m slow: tests/test_speculative.py checks the tokens of draft-model decoding over KVarN
# caches; this adds the server's flag.
@pytest.mark.slow
def test_speculative_decoding_with_a_draft_model(model_dir, tmp_path):
    # --draft-model: mlx-lm serves the request alone with speculative decoding; the
    # main model's KVarN cache gives the tokens of plain greedy decoding (the
    # draft, another random model, proposes mostly wrong tokens; its cache is plain).
    draft_dir = tiny_model_folder(tmp_path / "draft", seed=1)
    conversations = [[{"role": "user", "content": prompt(i, 30 + 25 * i)}] for i in range(3)]
    with server(model_dir) as (url, _):
        want = [stream_chat(client(url), m, max_tokens=80) for m in conversations]
    with server(model_dir, "--draft-model", str(draft_dir), "--num-draft-tokens", "3") as (url, _):
        got = [stream_chat(client(url), m, max_tokens=80) for m in conversations]
    assert got == want


def test_preset_names():
    """--kv-preset takes what kvarn_mlx.config.get_preset takes, as generate does (one rule)."""
    from kvarn_mlx.config import preset_error as _preset_error

    for name in ("auto4v2", "k4v2_g128", "k3v3_g64", "k5v2_g128_auto"):
        assert _preset_error(name) is None, name
    for name in ("k3v3", "k7v2_g128", "k4v2_g32", ""):
        assert "valid presets" in _preset_error(name), name


def test_request_figures_while_it_is_decoded(model_dir):
    """?request=ID while the reply streams: its own row of the batch (live), growing."""
    with server(model_dir) as (url, _):
        stream = client(url).chat.completions.create(
            model="default_model",
            messages=[{"role": "user", "content": prompt(3, 150)}],
            max_tokens=5000,
            temperature=0.0,
            stream=True,
        )
        seen, deadline = [], time.monotonic() + TIMEOUT
        for chunk in stream:
            fig = get(url + f"/v1/kv_stats?request={chunk.id}")["request"]
            if fig is not None:
                seen.append(fig)
            if len({f["tokens"] for f in seen}) >= 2 or time.monotonic() > deadline:
                break
        stream.close()  # the server stops this generation
    assert len({f["tokens"] for f in seen}) >= 2, seen
    assert all(
        f["live"] and f["kvarn_layers"] == f["layers"] == 2 and f["plain"] > f["held"] > 0
        for f in seen
    )
    # sink 16 and --kv-tail-tokens 64: the first tile leaves the tail at 144 tokens
    assert seen[0]["tokens"] < seen[-1]["tokens"] and seen[-1]["tiles"] >= seen[0]["tiles"] >= 1
