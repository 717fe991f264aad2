"""Headless Chromium for the chat page's tests: Debian's chromium, driven by the
playwright Python package (no `playwright install`)."""

import contextlib
import os
import shutil

import pytest

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]


@contextlib.contextmanager
def chromium():
    """A headless Chromium browser; skips the test without chromium or playwright."""
    if CHROMIUM is None:
        pytest.skip("Debian's chromium is not installed (apt-get install -y chromium)")
    sync_api = pytest.importorskip(
        "playwright.sync_api", reason="pip install playwright (no `playwright install`)"
    )
    # OpenBLAS preloaded into node and chromium makes them crash (pthread_create: Invalid
    # argument): start the driver and the browser without it (this process keeps the library it
    # already loaded).
    preload = os.environ.pop("LD_PRELOAD", None)
    try:
        with sync_api.sync_playwright() as p:
            browser = p.chromium.launch(executable_path=CHROMIUM, args=ARGS, timeout=60_000)
            try:
                yield browser
            finally:
                browser.close()
    finally:
        if preload is not None:
            os.environ["LD_PRELOAD"] = preload
