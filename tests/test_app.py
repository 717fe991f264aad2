"""The chat app (apps/chat): the terminal chat's engine (cache reuse,
save/resume, the CLI), and `python -m apps.chat` (kvarn_mlx.server with the
page) in a subprocess on the embedded model: the OpenAI API under bad input,
saved chats, and the page in headless Chromium, streaming from
/v1/chat/completions with its memory panel from /v1/kv_stats."""

import io
import json
import os
import re
import time
from pathlib import Path

import pytest

from apps.chat.engine import Engine
from browser import chromium
from kvarn_mlx.guard import Refused

ROOT = Path(__file__).resolve().parents[1]
ARTIFACTS = ROOT / "tests" / "artifacts"
MAX_TOKENS = int(
    os.environ.get("KVARN_APP_TEST_MAX_TOKENS", "12")
)  # the server's default reply length


def long_text(words):
    """Real prose (Python's own reference text): several hundred tokens so whole tiles get
    quantized."""
    import pydoc_data.topics

    return " ".join(" ".join(pydoc_data.topics.topics.values()).split()[:words])


# -- engine (in-process, the session model) ---------------------------------


@pytest.fixture
def engine(smollm):
    return Engine(preset="fp16", max_tokens=6, loaded=smollm)


def run(eng, messages, **kw):
    events = list(eng.chat(messages, **kw))
    start = next(e for e in events if e["type"] == "start")
    done = events[-1]
    assert done["type"] == "done"
    assert eng.cache[0].offset == len(eng.tokens)  # the engine knows what the cache holds
    return start, done


def test_engine_prefills_only_the_new_turn(engine):
    first = [{"role": "user", "content": "Name a color."}]
    s1, d1 = run(engine, first)
    assert s1["reused"] == 0 and s1["prefill"] == s1["prompt_tokens"]
    second = first + [
        {"role": "assistant", "content": d1["text"]},
        {"role": "user", "content": "Another one?"},
    ]
    s2, d2 = run(engine, second)
    # Everything up to the end of the first reply comes from the cache.
    assert s2["reused"] >= s1["prompt_tokens"] + d1["usage"]["completion_tokens"] - 1
    assert s2["prefill"] < 20
    assert d2["stats"]["reused"] == s2["reused"]


def test_engine_regenerate_and_edit_trim(engine):
    msgs = [{"role": "user", "content": "Say hello."}]
    s1, d1 = run(engine, msgs)
    offset = engine.cache[0].offset
    # Regenerate: the reply is trimmed away, the prompt reused, greedy decoding repeats itself.
    s2, d2 = run(engine, msgs)
    assert s2["reused"] == s1["prompt_tokens"] - 1 and s2["prefill"] == 1
    assert d2["text"] == d1["text"]
    # Edit the message: the cache goes back to the common prefix.
    s3, _ = run(engine, [{"role": "user", "content": "Say goodbye."}])
    assert s3["reused"] < s1["prompt_tokens"] - 1 and s3["reused"] < offset


def test_engine_trims_into_quantized_tiles(smollm):
    eng = Engine(preset="k4v2_g64", max_tokens=4, loaded=smollm)
    text = long_text(220)
    s1, d1 = run(eng, [{"role": "user", "content": text + "\nWhat is this?"}])
    assert d1["stats"]["tiles_per_layer"] >= 3
    # An edit inside the quantized region: trim dequantizes the boundary tile back into the tail.
    s2, d2 = run(eng, [{"role": "user", "content": text[: len(text) // 2] + "\nSummarize."}])
    assert 64 < s2["reused"] < s1["prompt_tokens"] - 64
    assert d2["usage"]["completion_tokens"] >= 1


def test_engine_memory_figures(smollm):
    """The panel's figures: bytes held against mlx-lm's plain cache in the model's dtype
    (float32 here) and the 2-byte equivalent; before the first tile, from which token KVarN
    saves."""
    from kvarn_mlx import memory
    from kvarn_mlx.config import PRESETS

    short = [{"role": "user", "content": "Name a color."}]
    kvarn, plain = (
        Engine(preset="k4v2_g128", max_tokens=4, loaded=smollm),
        Engine(preset="fp16", max_tokens=4, loaded=smollm),
    )
    _, dk = run(kvarn, short)
    _, dp = run(plain, short)
    s, p = dk["stats"], dp["stats"]
    assert s["context_tokens"] == p["context_tokens"] < 128
    assert s["dtype"] == p["dtype"] == "float32"
    # What mlx-lm's plain cache really holds for these tokens: its arrays up to the offset.
    actual = sum(
        c.keys[..., : c.offset, :].nbytes + c.values[..., : c.offset, :].nbytes for c in plain.cache
    )
    assert s["plain"] == p["plain"] == actual and s["fp16"] == actual // 2
    assert s["tiles_per_layer"] == 0
    assert (
        s["saving_from"]
        == memory.saving_starts_at(PRESETS["k4v2_g128"], 64, 4)
        > s["context_tokens"]
    )
    assert p["saving_from"] is None and p["kvarn_layers"] == 0
    _, d = run(kvarn, [{"role": "user", "content": long_text(400) + "\nWhat is this?"}])
    s = d["stats"]
    assert s["tiles_per_layer"] >= 2 and s["ratio_plain"] > 1 and s["ratio_fp16"] > 0
    assert s["ratio_plain"] == pytest.approx(s["plain"] / s["held"]) and s[
        "ratio_fp16"
    ] == pytest.approx(s["fp16"] / s["held"])


def test_engine_save_and_resume(engine, smollm, tmp_path):
    msgs = [{"role": "user", "content": "Name a fruit."}]
    _, d1 = run(engine, msgs)
    path = engine.save(tmp_path / "chat")
    assert path.name == "chat.safetensors" and path.exists()
    other = Engine(preset="k4v2_g128", max_tokens=6, loaded=smollm)
    resumed = other.load(path)
    assert resumed == msgs + [{"role": "assistant", "content": d1["text"]}]
    assert other.preset == "fp16" and other.cache[0].offset == engine.cache[0].offset
    import mlx.core as mx

    for a, b in zip(engine.cache, other.cache):  # bit for bit what was saved
        assert all(mx.array_equal(x, y).item() for x, y in zip(a.state, b.state))
    assert other.tokens == engine.tokens
    s, _ = run(other, resumed + [{"role": "user", "content": "And a vegetable?"}])
    assert s["reused"] >= engine.cache[0].offset - 1  # the loaded cache is reused, not recomputed
    with pytest.raises(Refused, match="no saved conversation"):
        other.load(tmp_path / "missing.safetensors")
    (tmp_path / "junk.safetensors").write_bytes(b"not a cache")
    with pytest.raises(Refused, match="cannot load"):
        other.load(tmp_path / "junk.safetensors")
    # A file of another kind under the same name is never overwritten.
    with pytest.raises(Refused, match="refusing to overwrite"):
        engine.save(tmp_path / "junk")
    assert (tmp_path / "junk.safetensors").read_bytes() == b"not a cache"
    assert engine.save(tmp_path / "chat") == path  # its own earlier save is replaced


def test_engine_refuses_bad_turns(engine):
    with pytest.raises(Refused, match="empty message"):
        list(engine.chat([{"role": "user", "content": "  \n"}]))
    with pytest.raises(Refused, match="8192-token context"):
        list(engine.chat([{"role": "user", "content": " word" * 9000}]))
    with pytest.raises(Refused, match="last message"):
        list(engine.chat([{"role": "assistant", "content": "hi"}]))
    with pytest.raises(Refused, match="unknown KVarN preset"):
        engine.use(preset="k3v3")
    with pytest.raises(Refused, match="unknown model"):
        engine.use("no-such-model")
    run(engine, [{"role": "user", "content": "Still there?"}])


def test_cli_commands(smollm, tmp_path):
    from apps.chat.cli import run_cli

    lines = iter(["Hi!", "", f"/save {tmp_path / 'c'}", "/new", "/quit"])
    out = io.StringIO()
    assert (
        run_cli(
            dict(preset="k4v2_g128", max_tokens=5, loaded=smollm),
            inp=lambda _: next(lines),
            out=out,
        )
        == 0
    )
    text = out.getvalue()
    assert re.search(
        r"\[\d+ ctx tokens \| KV [\d.]+ MiB vs fp16 [\d.]+ MiB = [\d.]+x \| [\d.]+ tok/s", text
    ), text
    assert "saved to" in text and "(new chat)" in text
    out = io.StringIO()
    run_cli(
        dict(preset="k4v2_g128", max_tokens=5, loaded=smollm),
        resume=str(tmp_path / "c.safetensors"),
        inp=lambda _: "/quit",
        out=out,
    )
    assert "resumed 2 messages" in out.getvalue()


# -- python -m apps.chat (subprocess, embedded model) ----------------------------------


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from chat_server import chat_app

    saved = tmp_path_factory.mktemp("chat") / "saved"
    with chat_app(saved, "--max-tokens", str(MAX_TOKENS), "--kv-preset", "k4v2_g128") as url:
        yield url


def post(url, body, timeout=120, headers=None):
    import httpx

    data = body if isinstance(body, (bytes, str)) else json.dumps(body)
    return httpx.post(
        url,
        content=data,
        headers={"Content-Type": "application/json", **(headers or {})},
        timeout=timeout,
    )


def user(text):
    return [{"role": "user", "content": text}]


def test_openai_client(server):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=server + "/v1", api_key="local", timeout=120, max_retries=0)
    r = client.chat.completions.create(
        model="default_model",
        messages=user("What is the capital of France?"),
        max_tokens=8,
        temperature=0,
    )
    assert r.choices[0].message.role == "assistant" and r.choices[0].message.content.strip()
    assert r.choices[0].finish_reason in ("stop", "length")
    assert r.usage.completion_tokens <= 8 and r.usage.prompt_tokens > 10

    stream = client.chat.completions.create(
        model="default_model",
        messages=user("Count to five."),
        max_tokens=8,
        stream=True,
        stream_options={"include_usage": True},
    )
    pieces, finish, usage, ids = [], None, None, set()
    for chunk in stream:
        ids.add(chunk.id)
        if chunk.usage:
            usage = chunk.usage
        for c in chunk.choices:
            pieces.append(c.delta.content or "")
            finish = c.finish_reason or finish
    assert len([p for p in pieces if p]) > 1 and "".join(pieces).strip()
    assert finish in ("stop", "length") and usage.completion_tokens >= 1
    # The page's memory panel: the figures of the cache this reply left on the server.
    import httpx

    (rid,) = ids
    deadline = time.monotonic() + 60
    while (s := httpx.get(f"{server}/v1/kv_stats?request={rid}", timeout=10).json())[
        "request"
    ] is None:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    fig = s["request"]
    assert s["kv_preset"] == "k4v2_g128" and fig["kvarn_layers"] == fig["layers"] == 30
    assert usage.prompt_tokens < fig["tokens"] <= usage.prompt_tokens + usage.completion_tokens
    assert (
        fig["tiles"] == 0 and fig["held"] == fig["plain"] == 2 * fig["fp16"]
    )  # float32, no tile yet


def test_bad_input_leaves_server_up(server):
    api = server + "/v1/chat/completions"
    cases = [  # mlx-lm's checks, before the request is queued
        ("{not json", 400, "Invalid JSON"),
        ("[1, 2]", 400, "JSON dictionary"),
        ({"messages": user("hi"), "max_tokens": -5}, 400, "max_tokens"),
        ({"messages": user("hi"), "max_tokens": "lots"}, 400, "max_tokens"),
        ({"messages": user("hi"), "temperature": -1}, 400, "temperature"),
        ({"messages": user("hi"), "stream": "yes"}, 400, "stream"),
    ]
    for body, status, text in cases:
        r = post(api, body)
        assert r.status_code == status, (body if isinstance(body, str) else str(body)[:80], r.text)
        assert text in json.dumps(r.json())
    r = post(api, "{}", headers={"Content-Type": "text/plain"})
    assert r.status_code == 415
    r = post(server + "/api/save", {"name": "../escape", "messages": user("hi")})
    assert r.status_code == 400 and "chat name" in r.json()["error"]["message"]
    r = post(api, {"messages": user("Hi"), "max_tokens": 3})
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"]


# -- the page in headless Chromium ------------------------------------------


@pytest.mark.e2e
@pytest.mark.slow  # the server's pages in Chromium by default: test_server_security
def test_page_end_to_end(server):
    with chromium() as browser:
        ARTIFACTS.mkdir(exist_ok=True)
        _drive_page(browser, server)


def _drive_page(browser, server):
    """Two chats through the page (the server's preset: k4v2_g128); checks streaming, the memory
    panel before and after the first tile, saving and resuming; saves a screenshot."""
    from kvarn_mlx import memory
    from kvarn_mlx.config import PRESETS

    page = browser.new_page(viewport={"width": 1280, "height": 860})
    page.set_default_timeout(150_000)
    page.goto(server + "/")
    page.wait_for_selector("body[data-ready='1']")
    assert page.inner_text("#preset") == "k4v2_g128"
    # A short first turn: no tile yet, and the panel says so instead of showing a ratio.
    page.fill("#input", "Hi!")
    page.click("#send")
    page.wait_for_selector(".msg.assistant[data-idx='1'][data-done='1']")
    page.wait_for_function("document.getElementById('ctx').textContent !== '0'")
    start = memory.saving_starts_at(PRESETS["k4v2_g128"], 64, 4)
    assert page.inner_text("#ratio") == "–"
    assert (
        "No tile quantized yet: every token is held in float32, as in mlx-lm's plain cache. "
        "KVarN starts "
        f"saving memory from token {start}." == page.inner_text("#saving")
    )
    assert re.fullmatch(r"\d+ new, \d+ reused", page.inner_text("#reuse"))
    # Saved and resumed: the same messages come back.
    page.once("dialog", lambda d: d.accept("hello-chat"))
    page.click("#save")
    page.wait_for_function("document.getElementById('status').textContent.startsWith('saved to')")
    first = page.inner_text("#messages")
    page.click("#new")
    page.wait_for_function("document.getElementById('ctx').textContent === '0'")
    assert not page.query_selector_all(".msg")
    page.select_option("#resume", "hello-chat")
    page.wait_for_function(
        "document.getElementById('status').textContent.startsWith('resumed hello-chat')"
    )
    assert page.inner_text("#messages") == first
    page.click("#new")

    def say(text, n):
        page.fill("#input", text)
        page.click("#send")
        reply = f".msg.assistant[data-idx='{2 * n - 1}']"
        # Part of the reply is on screen while it is still streaming...
        page.wait_for_function(
            "() => { const e = document.querySelector('.msg.assistant.streaming .body'); "
            "return e && e.textContent.trim().length > 0 }"
        )
        page.wait_for_selector(reply + "[data-done='1']")
        el = page.query_selector(reply)
        assert int(el.get_attribute("data-chunks")) > 1  # ...and it came in several pieces
        assert el.inner_text().strip()
        # the figures after the reply (and any while it streamed) are on the chart, from 0
        assert int(page.get_attribute("#chart", "data-points")) >= n + 1
        return float(page.inner_text("#ratio").rstrip("×"))

    # A long first message (~900 tokens): whole tiles get quantized, so the ratio is real.
    ratio1 = say("Here is a text:\n\n" + long_text(700) + "\n\nWhat is this document about?", 1)
    ratio2 = say("Thanks. What is the *assert* statement for?", 2)
    assert ratio1 > 1 and ratio2 > 1, (ratio1, ratio2)
    assert "per layer" in page.inner_text("#tiles") and not page.inner_text("#tiles").startswith(
        "0 "
    )
    # The second turn reused the first from the server's prompt cache.
    new, reused = map(
        int, re.fullmatch(r"(\d+) new, (\d+) reused", page.inner_text("#reuse")).groups()
    )
    assert reused > 500 and new < 40, (new, reused)
    assert len(page.query_selector_all("#chart polyline")) == 3
    assert "(float32)" in page.inner_text("#plain-label") and page.inner_text("#ratio16").endswith(
        "×"
    )
    assert "prompt cache: " in page.inner_text("#server")
    page.screenshot(path=str(ARTIFACTS / "chat.png"))


def test_only_loopback_is_quiet():
    from apps.chat.__main__ import PORT, arg_parser, network_warning
    from kvarn_mlx.cli_support import flag
    from kvarn_mlx.guard import is_local_name as is_loopback

    assert flag([], "--host", "127.0.0.1") == "127.0.0.1" and flag(["--host=::"], "--host") == "::"
    assert PORT == 8321 and arg_parser().parse_known_args([])[0].save_dir.name == "chats"
    assert all(map(is_loopback, ("127.0.0.1", "::1", "localhost", "127.0.0.2")))
    assert not any(map(is_loopback, ("0.0.0.0", "::", "192.168.1.5", "example.com")))
    assert network_warning("127.0.0.1", None) is None
    assert "reachable from the network" in network_warning(
        "0.0.0.0", None
    ) and "--api-key" in network_warning("0.0.0.0", None)
    assert "travels unencrypted" in network_warning("0.0.0.0", "k")
