"""The local chat server against hostile web pages and the network: Host
names (DNS rebinding), Origin and Content-Type (cross-site requests), no CORS,
the API key, and the warning on a network bind. In-process server, session model."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from chat_server import MODEL, chat_worker, port_of, post, serve, user

import httpx  # noqa: E402  (chat_server skipped the module already if it is missing)

from apps.chat.server import create_app  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]


@pytest.fixture(scope="module")
def worker(smollm):
    with chat_worker(smollm) as w:
        yield w


@pytest.fixture(scope="module")
def url(worker, tmp_path_factory):
    with serve(create_app(worker, tmp_path_factory.mktemp("saved"))) as u:
        yield u


def get(url, path, headers=None):
    return httpx.get(url + path, headers=headers or {}, timeout=60)


def test_host_must_name_this_server(url):
    port = port_of(url)
    # A page on evil.example whose DNS is rebound to 127.0.0.1 sends its own name as Host.
    for host in (f"evil.example:{port}", "evil.example", f"127.0.0.1.evil.example:{port}", f"localhost.evil:{port}"):
        r = get(url, "/api/info", {"Host": host})
        assert r.status_code == 400, (host, r.status_code)
        assert "Host" in r.json()["error"]["message"] and "--allowed-hosts" in r.json()["error"]["message"]
        assert "messages" not in r.text
    for host in (f"127.0.0.1:{port}", f"localhost:{port}", f"LocalHost:{port}", f"[::1]:{port}",
                 f"app.localhost:{port}", "localhost"):
        assert get(url, "/api/info", {"Host": host}).status_code == 200, host


def test_allowed_hosts_configured(worker, tmp_path):
    with serve(create_app(worker, tmp_path, allowed_hosts=["chat.lan"])) as u:
        port = port_of(u)
        assert get(u, "/api/info", {"Host": f"chat.lan:{port}"}).status_code == 200
        assert get(u, "/api/info", {"Host": f"localhost:{port}"}).status_code == 200
        assert get(u, "/api/info", {"Host": f"other.lan:{port}"}).status_code == 400


def test_json_endpoints_require_json(url, tmp_path):
    # A text/plain POST needs no CORS preflight: any page could send it.
    before = get(url, "/api/chats").json()["chats"]
    for path, body in (("/api/save", '{"name": "pwned"}'), ("/api/new", "{}"), ("/api/load", '{"name": "x"}'),
                       ("/api/chat", '{"messages": [{"role": "user", "content": "hi"}]}'),
                       ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "hi"}]}')):
        for ctype in ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x", None):
            headers = {"Content-Type": ctype} if ctype else {}
            r = httpx.post(url + path, content=body, headers=headers, timeout=60)
            assert r.status_code == 415, (path, ctype, r.status_code)
            assert "application/json" in r.json()["error"]["message"]
    assert get(url, "/api/chats").json()["chats"] == before
    r = post(url + "/api/new", {}, headers={"Content-Type": "application/json; charset=utf-8"})
    assert r.status_code == 200, r.text


def test_cross_origin_requests_refused(url, worker, tmp_path):
    port = port_of(url)
    for origin in ("http://evil.example", f"http://evil.example:{port}", "null", f"https://127.0.0.1:{port}",
                   f"http://127.0.0.1:{port + 1}"):
        r = post(url + "/api/new", {}, headers={"Origin": origin})
        assert r.status_code == 403, (origin, r.status_code)
        assert "Origin" in r.json()["error"]["message"]
        r = post(url + "/v1/chat/completions", {"messages": user("hi"), "max_tokens": 1}, headers={"Origin": origin})
        assert r.status_code == 403
    # The page itself: same origin.
    for origin in (f"http://127.0.0.1:{port}", f"http://localhost:{port}"):
        host = origin.split("//")[1]
        r = post(url + "/api/new", {}, headers={"Origin": origin, "Host": host})
        assert r.status_code == 200, (origin, r.text)
    # A configured origin (another local front end).
    with serve(create_app(worker, tmp_path, allowed_origins=["http://localhost:5173"])) as u:
        assert post(u + "/api/new", {}, headers={"Origin": "http://localhost:5173"}).status_code == 200
        assert post(u + "/api/new", {}, headers={"Origin": "http://localhost:5174"}).status_code == 403


def test_no_cors_headers(url):
    pre = httpx.options(url + "/v1/chat/completions", timeout=60, headers={
        "Origin": "http://evil.example", "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "content-type"})
    assert pre.status_code >= 400
    responses = [pre, get(url, "/api/info", {"Origin": "http://evil.example"}), get(url, "/api/info"),
                 post(url + "/v1/chat/completions", {"messages": user("hi"), "max_tokens": 1})]
    for r in responses:
        assert not [h for h in r.headers if h.lower().startswith("access-control-")], r.headers


def test_api_key_protects_every_endpoint(worker, tmp_path):
    key = "s3cret-key"
    with serve(create_app(worker, tmp_path, api_key=key)) as u:
        good, bad = {"Authorization": f"Bearer {key}"}, {"Authorization": "Bearer nope"}
        for path in ("/api/info", "/api/health", "/api/stats", "/api/chats", "/v1/models"):
            for headers in ({}, bad, {"Authorization": key}, {"Authorization": f"Basic {key}"}):
                r = get(u, path, headers)
                assert r.status_code == 401, (path, headers, r.status_code)
                assert r.headers["www-authenticate"].startswith("Bearer")
            assert get(u, path, good).status_code == 200, path
        for path, body in (("/api/new", {}), ("/api/save", {"name": "k"}), ("/api/load", {"name": "k"}),
                           ("/api/chat", {"messages": user("hi")}), ("/v1/chat/completions", {"messages": user("hi")})):
            assert post(u + path, body).status_code == 401, path
            assert post(u + path, body, headers=bad).status_code == 401, path
        assert not list(tmp_path.iterdir())  # the save above was refused
        # The page is static (no conversation in it); it asks for the key.
        page = get(u, "/")
        assert page.status_code == 200 and 'id="apikey"' in page.text
        # OpenAI clients send the key as a Bearer token.
        openai = pytest.importorskip("openai")
        client = openai.OpenAI(base_url=u + "/v1", api_key=key, timeout=120, max_retries=0)
        r = client.chat.completions.create(model=MODEL, messages=user("Hi"), max_tokens=2)
        assert r.choices[0].message.content is not None
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=u + "/v1", api_key="wrong", max_retries=0).models.list()


def test_api_key_option_and_environment(monkeypatch):
    from apps.chat.__main__ import parse_args

    monkeypatch.delenv("KVARN_CHAT_API_KEY", raising=False)
    assert parse_args([]).api_key is None
    assert parse_args(["--api-key", "abc"]).api_key == "abc"
    monkeypatch.setenv("KVARN_CHAT_API_KEY", "from-env")
    assert parse_args([]).api_key == "from-env"
    assert parse_args(["--api-key", "abc"]).api_key == "abc"
    args = parse_args(["--allowed-hosts", "a.lan,b.lan", "--allowed-origins", "http://x:1"])
    assert args.allowed_hosts == ["a.lan", "b.lan"] and args.allowed_origins == ["http://x:1"]


def run_main(*args):
    """python -m apps.chat with a model that does not exist: it prints its warnings, then exits."""
    env = {k: v for k, v in os.environ.items() if k != "KVARN_CHAT_API_KEY"}
    return subprocess.run([sys.executable, "-m", "apps.chat", "--model", "/nonexistent/model", "--port", "0", *args],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)


def test_network_bind_warns():
    out = run_main("--host", "0.0.0.0")
    assert out.returncode != 0
    assert "reachable from the network" in out.stderr and "--api-key" in out.stderr, out.stderr
    out = run_main("--host", "0.0.0.0", "--api-key", "k")
    assert "reachable from the network" in out.stderr and "API key" in out.stderr
    out = run_main()  # loopback: quiet
    assert "reachable from the network" not in out.stderr and "WARNING" not in out.stderr


def chromium_page(test):
    """Run test(page, url) in headless Chromium against `url`; skips without chromium/playwright."""
    if CHROMIUM is None:
        pytest.skip("Debian's chromium is not installed (apt-get install -y chromium)")
    sync_api = pytest.importorskip("playwright.sync_api", reason="pip install playwright (no `playwright install`)")

    def run(url):
        preload = os.environ.pop("LD_PRELOAD", None)  # see tests/test_app.py: OpenBLAS breaks chromium
        try:
            with sync_api.sync_playwright() as p:
                browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, timeout=60_000)
                try:
                    page = browser.new_page()
                    page.set_default_timeout(150_000)
                    test(page, url)
                finally:
                    browser.close()
        finally:
            if preload is not None:
                os.environ["LD_PRELOAD"] = preload

    return run


HOSTILE = ['<img src=x onerror="window.pwned=1">', "<script>window.pwned=2</script>",
           '<svg onload="window.pwned=3"></svg>', "[link](javascript:window.pwned=4)",
           '**<b onclick="window.pwned=5">bold</b>**', "```\n<img src=y onerror=window.pwned=6>\n```",
           "<think><img src=z onerror=window.pwned=7></think>"]


def test_page_shows_html_as_text(worker, url):
    """Markup in the conversation (the user's or the model's) is shown, never run."""
    eng = worker.engine
    saved = eng.messages
    eng.messages = [{"role": "user", "content": "\n".join(HOSTILE)},
                    {"role": "assistant", "content": "\n\n".join(HOSTILE)}]

    def check(page, u):
        page.goto(u + "/")
        page.wait_for_selector("body[data-ready='1']")
        assert page.evaluate("window.pwned") is None
        assert not page.query_selector_all("#messages img, #messages script, #messages svg, #messages b, "
                                           "#messages a[href^='javascript']")
        shown = page.inner_text("#messages")
        assert '<img src=x onerror="window.pwned=1">' in shown and "<script>window.pwned=2</script>" in shown

    try:
        chromium_page(check)(url)
    finally:
        eng.messages = saved


def test_page_with_api_key(worker, tmp_path):
    """The page served with a key: it asks for the key once, then chats."""
    key = "page-key"

    def check(page, u):
        page.goto(u + "/")
        page.wait_for_selector("#apikey", state="visible")
        page.fill("#apikey", "wrong")
        page.press("#apikey", "Enter")
        page.wait_for_function("document.getElementById('status').textContent.includes('API key was refused')")
        page.fill("#apikey", key)
        page.press("#apikey", "Enter")
        page.wait_for_selector("body[data-ready='1']")
        shown = len(page.query_selector_all(".msg[data-idx]"))  # the engine's conversation so far
        page.fill("#input", "Hi!")
        page.click("#send")
        page.wait_for_selector(f".msg.assistant[data-idx='{shown + 1}'][data-done='1']")
        assert not page.query_selector_all(".msg.error")
        assert page.is_hidden("#apikey")

    with serve(create_app(worker, tmp_path, api_key=key)) as u:
        chromium_page(check)(u)
