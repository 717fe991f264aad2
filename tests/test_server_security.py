"""The chat app's server (kvarn_mlx.server's handler with the page) against
hostile web pages and the network: Host names (DNS rebinding), Origin and
Content-Type (cross-site requests), CORS, the API key, and the warning on a
network bind. In-process handler in front of a stub generator (no model):
what these checks refuse never reaches it."""

import os
import socket
import subprocess
import sys
from pathlib import Path

import httpx  # noqa: E402  (chat_server skipped the module already if it is missing)
import pytest

from browser import chromium
from chat_server import port_of, post, serve, user

ROOT = Path(__file__).resolve().parents[1]
CHAT = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]


@pytest.fixture
def server(tmp_path):
    with serve(tmp_path / "saved") as (u, stub):
        yield u, stub, tmp_path / "saved"


def get(url, path, headers=None):
    return httpx.get(url + path, headers=headers or {}, timeout=60)


def test_host_must_name_this_server(server):
    url, stub, _ = server
    port = port_of(url)
    # A page on evil.example whose DNS is rebound to 127.0.0.1 sends its own name as Host.
    for host in (
        f"evil.example:{port}",
        "evil.example",
        f"127.0.0.1.evil.example:{port}",
        f"localhost.evil:{port}",
    ):
        for path in ("/", "/api/chats", "/v1/kv_stats"):
            r = get(url, path, {"Host": host})
            assert r.status_code == 400, (host, path, r.status_code)
            assert (
                "Host" in r.json()["error"]["message"]
                and "--allowed-hosts" in r.json()["error"]["message"]
            )
        r = post(url + "/v1/chat/completions", {"messages": user("hi")}, headers={"Host": host})
        assert r.status_code == 400
    assert not stub.requests
    for host in (
        f"127.0.0.1:{port}",
        f"localhost:{port}",
        f"LocalHost:{port}",
        f"[::1]:{port}",
        f"app.localhost:{port}",
        "localhost",
    ):
        assert get(url, "/api/chats", {"Host": host}).status_code == 200, host


def test_allowed_hosts_configured(tmp_path):
    with serve(tmp_path, allowed_hosts=["chat.lan"]) as (u, _):
        port = port_of(u)
        assert get(u, "/api/chats", {"Host": f"chat.lan:{port}"}).status_code == 200
        assert get(u, "/api/chats", {"Host": f"localhost:{port}"}).status_code == 200
        assert get(u, "/api/chats", {"Host": f"other.lan:{port}"}).status_code == 400


def test_json_endpoints_require_json(server):
    # A text/plain POST needs no CORS preflight: any page could send it.
    url, stub, saved = server
    for path, body in (
        ("/api/save", '{"name": "pwned", "messages": [{"role": "user", "content": "x"}]}'),
        ("/api/load", '{"name": "x"}'),
        ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "hi"}]}'),
    ):
        for ctype in (
            "text/plain",
            "application/x-www-form-urlencoded",
            "multipart/form-data; boundary=x",
            None,
        ):
            headers = {"Content-Type": ctype} if ctype else {}
            r = httpx.post(url + path, content=body, headers=headers, timeout=60)
            assert r.status_code == 415, (path, ctype, r.status_code)
            assert "application/json" in r.json()["error"]["message"]
    assert not saved.exists() and not stub.requests
    r = post(
        url + "/api/save",
        {"name": "ok", "messages": CHAT},
        headers={"Content-Type": "application/json; charset=utf-8"},
    )
    assert r.status_code == 200, r.text


def test_cross_origin_requests_refused(server, tmp_path):
    url, stub, saved = server
    port = port_of(url)
    for origin in (
        "http://evil.example",
        f"http://evil.example:{port}",
        "null",
        f"https://127.0.0.1:{port}",
        f"http://127.0.0.1:{port + 1}",
    ):
        r = post(url + "/api/save", {"name": "x", "messages": CHAT}, headers={"Origin": origin})
        assert r.status_code == 403, (origin, r.status_code)
        assert "Origin" in r.json()["error"]["message"]
        r = post(
            url + "/v1/chat/completions",
            {"messages": user("hi"), "max_tokens": 1},
            headers={"Origin": origin},
        )
        assert r.status_code == 403
    assert not saved.exists() and not stub.requests
    # The page itself: same origin.
    for origin in (f"http://127.0.0.1:{port}", f"http://localhost:{port}"):
        host = origin.split("//")[1]
        r = post(
            url + "/api/save",
            {"name": "x", "messages": CHAT},
            headers={"Origin": origin, "Host": host},
        )
        assert r.status_code == 200, (origin, r.text)
    # A configured origin (another local front end).
    with serve(tmp_path / "other", allowed_origins=["http://localhost:5173"]) as (u, _):
        body = {"name": "x", "messages": CHAT}
        assert (
            post(u + "/api/save", body, headers={"Origin": "http://localhost:5173"}).status_code
            == 200
        )
        assert (
            post(u + "/api/save", body, headers={"Origin": "http://localhost:5174"}).status_code
            == 403
        )


def test_no_cors_grant_for_other_pages(server):
    """No Access-Control-Allow-Origin for another page: browsers keep it from reading any answer."""
    url, _, _ = server
    evil = {"Origin": "http://evil.example"}
    pre = httpx.options(
        url + "/v1/chat/completions",
        timeout=60,
        headers={
            **evil,
            "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "content-type",
        },
    )
    responses = [
        pre,
        get(url, "/v1/kv_stats", evil),
        get(url, "/api/chats", evil),
        get(url, "/", evil),
        post(url + "/v1/chat/completions", {"messages": user("hi"), "max_tokens": 1}, headers=evil),
    ]
    for r in responses:
        assert "access-control-allow-origin" not in {h.lower() for h in r.headers}, r.headers


def test_api_key_protects_every_endpoint(tmp_path):
    key = "s3cret-key"
    with serve(tmp_path / "saved", api_key=key) as (u, stub):
        good, bad = {"Authorization": f"Bearer {key}"}, {"Authorization": "Bearer nope"}
        for path in ("/api/chats", "/v1/kv_stats", "/v1/models", "/health"):
            for headers in ({}, bad, {"Authorization": key}, {"Authorization": f"Basic {key}"}):
                r = get(u, path, headers)
                assert r.status_code == 401, (path, headers, r.status_code)
                assert r.headers["www-authenticate"].startswith("Bearer")
        for path in ("/api/chats", "/v1/kv_stats", "/health"):
            assert get(u, path, good).status_code == 200, path
        for path, body in (
            ("/api/save", {"name": "k", "messages": CHAT}),
            ("/api/load", {"name": "k"}),
            ("/v1/chat/completions", {"messages": user("hi")}),
        ):
            assert post(u + path, body).status_code == 401, path
            assert post(u + path, body, headers=bad).status_code == 401, path
        assert not (tmp_path / "saved").exists() and not stub.requests  # all refused
        assert (
            post(u + "/api/save", {"name": "k", "messages": CHAT}, headers=good).status_code == 200
        )
        # The page is static (no conversation in it); it asks for the key.
        page = get(u, "/")
        assert page.status_code == 200 and 'id="apikey"' in page.text
        # OpenAI clients send the key as a Bearer token: accepted, the request reaches the
        # generator.
        openai = pytest.importorskip("openai")
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(
                base_url=u + "/v1", api_key="wrong", max_retries=0
            ).chat.completions.create(model="default_model", messages=user("hi"))
        assert not stub.requests
        with pytest.raises(openai.NotFoundError):  # mlx-lm answers a failed generation with 404
            openai.OpenAI(base_url=u + "/v1", api_key=key, max_retries=0).chat.completions.create(
                model="default_model", messages=user("hi")
            )
        assert len(stub.requests) == 1


def test_api_key_option_and_environment(monkeypatch):
    from apps.chat.__main__ import arg_parser

    parse = lambda argv: arg_parser().parse_known_args(argv)[0]  # noqa: E731
    monkeypatch.delenv("KVARN_API_KEY", raising=False)
    assert parse([]).api_key is None
    assert parse(["--api-key", "abc"]).api_key == "abc"
    monkeypatch.setenv("KVARN_API_KEY", "from-env")
    assert parse([]).api_key == "from-env"
    assert parse(["--api-key", "abc"]).api_key == "abc"
    args = parse(["--allowed-hosts", "a.lan,b.lan", "--allowed-origins", "http://x:1"])
    assert args.allowed_hosts == ["a.lan", "b.lan"] and args.allowed_origins == ["http://x:1"]


def run_main(*args):
    """python -m apps.chat on a port already taken, with a model that does not exist: it
    prints its warnings, then exits."""
    env = {k: v for k, v in os.environ.items() if k != "KVARN_API_KEY"}
    with socket.socket() as taken:
        taken.bind(("0.0.0.0", 0))
        taken.listen()
        return subprocess.run(
            [
                sys.executable,
                "-m",
                "apps.chat",
                "--model",
                "/nonexistent/model",
                "--port",
                str(taken.getsockname()[1]),
                *args,
            ],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )


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

    def run(url):
        with chromium() as browser:
            page = browser.new_page()
            page.set_default_timeout(150_000)
            test(page, url)

    return run


HOSTILE = [
    '<img src=x onerror="window.pwned=1">',
    "<script>window.pwned=2</script>",
    '<svg onload="window.pwned=3"></svg>',
    "[link](javascript:window.pwned=4)",
    '**<b onclick="window.pwned=5">bold</b>**',
    "```\n<img src=y onerror=window.pwned=6>\n```",
    "<think><img src=z onerror=window.pwned=7></think>",
]


def test_page_shows_html_as_text(server):
    """Markup in a conversation (the user's or the model's, here from a saved chat) is shown,
    never run."""
    url, _, _ = server
    chat = [
        {"role": "user", "content": "\n".join(HOSTILE)},
        {"role": "assistant", "content": "\n\n".join(HOSTILE)},
    ]
    assert post(url + "/api/save", {"name": "hostile", "messages": chat}).status_code == 200

    def check(page, u):
        page.goto(u + "/")
        page.wait_for_selector("body[data-ready='1']")
        page.select_option("#resume", "hostile")
        page.wait_for_selector(".msg.assistant")
        assert page.evaluate("window.pwned") is None
        assert not page.query_selector_all(
            "#messages img, #messages script, #messages svg, #messages b, #messages "
            "a[href^='javascript']"
        )
        shown = page.inner_text("#messages")
        assert (
            '<img src=x onerror="window.pwned=1">' in shown
            and "<script>window.pwned=2</script>" in shown
        )

    chromium_page(check)(url)


def test_page_with_api_key(tmp_path):
    """The page served with a key: it asks for the key once, then lists and resumes saved chats."""
    key = "page-key"

    def check(page, u):
        page.goto(u + "/")
        page.wait_for_selector("#apikey", state="visible")
        page.fill("#apikey", "wrong")
        page.press("#apikey", "Enter")
        page.wait_for_function(
            "document.getElementById('status').textContent.includes('API key was refused')"
        )
        page.fill("#apikey", key)
        page.press("#apikey", "Enter")
        page.wait_for_selector("body[data-ready='1']")
        assert (
            page.inner_text("#preset") == "k4v2_g128" and page.inner_text("#model") == "stub-model"
        )
        page.select_option("#resume", "keyed")
        page.wait_for_selector(".msg.assistant[data-idx='1']")
        assert not page.query_selector_all(".msg.error")
        assert page.is_hidden("#apikey")

    with serve(tmp_path / "saved", api_key=key) as (u, _):
        r = post(
            u + "/api/save",
            {"name": "keyed", "messages": CHAT},
            headers={"Authorization": f"Bearer {key}"},
        )
        assert r.status_code == 200
        chromium_page(check)(u)
