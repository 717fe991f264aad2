"""More than one Mac, on one machine: `mlx.launch --backend ring -n 2` runs two
ranks over TCP, each holding half of a tiny llama's 4 kv heads (tensor
parallel through mlx-lm's sharded_load). Greedy output equals the single
process's, and each rank's KVarN caches hold half the bytes.
"""

import json
import os
import shutil
import signal
import subprocess
import sys
import urllib.error
import urllib.request

import pytest

from model_folder import tiny_model_folder
from server_process import free_port, running

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LAUNCH = shutil.which("mlx.launch") or os.path.join(os.path.dirname(sys.executable), "mlx.launch")
TIMEOUT = 240
PRESET = ["--kv-preset", "k4v2_g64", "--kv-sink", "16"]

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.skipif(not os.path.exists(LAUNCH), reason="mlx.launch is not installed"),
]

GENERATE = """
import json, sys
import mlx.core as mx
from mlx_lm.generate import generate_step
from mlx_lm.utils import load, sharded_load
from kvarn_mlx.config import KVarNConfig
from kvarn_mlx.integration import make_cache

group = mx.distributed.init()
model, tok = (sharded_load if group.size() > 1 else load)(sys.argv[1])
cache = make_cache(model, KVarNConfig(k_bits=4, v_bits=2, group_size=64, sink=16))
prompt = mx.array(tok.encode("the quick brown fox " * 30))
tokens = [t for t, _ in generate_step(prompt, model, prompt_cache=cache, max_tokens=60)]
print(json.dumps({"rank": group.rank(), "size": group.size(), "tokens": tokens,
                  "nbytes": sum(c.nbytes for c in cache), "tiles": cache[0].n_tiles}), flush=True)
"""


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tiny_model_folder(
        tmp_path_factory.mktemp("tiny4") / "model", num_attention_heads=4, num_key_value_heads=4
    )


def launch(n, *command, **kwargs):
    # "--": mlx.launch would take the command's own flags it shares (e.g. --verbose).
    return subprocess.Popen(
        [LAUNCH, "--backend", "ring", "-n", str(n), "--python", sys.executable, "--", *command],
        cwd=ROOT,
        **kwargs,
    )


def test_two_ranks_generate_what_one_does_with_half_the_kv_bytes_each(model_dir, tmp_path):
    script = tmp_path / "generate.py"
    script.write_text(GENERATE)
    one = subprocess.run(
        [sys.executable, str(script), str(model_dir)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
    )
    assert one.returncode == 0, one.stderr
    alone = json.loads(one.stdout.strip().splitlines()[-1])
    proc = launch(
        2, str(script), str(model_dir), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    out, err = proc.communicate(timeout=TIMEOUT)
    assert proc.returncode == 0, err
    ranks = sorted(
        (json.loads(line) for line in out.splitlines() if line.startswith("{")),
        key=lambda r: r["rank"],
    )
    assert [r["rank"] for r in ranks] == [0, 1] and all(r["size"] == 2 for r in ranks)
    assert alone["tiles"] >= 2
    for r in ranks:
        assert r["tokens"] == alone["tokens"]
        assert r["tiles"] == alone["tiles"]
        assert 2 * r["nbytes"] == alone["nbytes"]


def get(url):
    with urllib.request.urlopen(url, timeout=TIMEOUT) as r:
        return json.loads(r.read())


def post(url, body):
    req = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=TIMEOUT) as r:
        return json.loads(r.read())


def serve_and_ask(command, port, log):
    """Start a server (a list of argv), ask one chat request, return (reply, kv stats)."""
    url = f"http://127.0.0.1:{port}"
    with running(command, url, log, timeout=TIMEOUT, new_session=True):
        reply = post(
            url + "/v1/chat/completions",
            {
                "messages": [{"role": "user", "content": "tell me " * 60}],
                "max_tokens": 40,
                "temperature": 0.0,
            },
        )
        return reply["choices"][0]["message"]["content"], get(url + "/v1/kv_stats")


# -m slow: the first test runs two ranks through the library and checks both; this one
# the same split through the server.
@pytest.mark.slow
def test_the_server_on_two_ranks(model_dir, tmp_path):
    args = ["-m", "kvarn_mlx.server", "--model", str(model_dir), *PRESET]
    with open(tmp_path / "one.log", "w") as log:
        port = free_port()
        want, one = serve_and_ask([sys.executable, *args, "--port", str(port)], port, log)
    with open(tmp_path / "two.log", "w") as log:
        port = free_port()
        got, two = serve_and_ask(
            [
                LAUNCH,
                "--backend",
                "ring",
                "-n",
                "2",
                "--python",
                sys.executable,
                "--",
                *args,
                "--port",
                str(port),
            ],
            port,
            log,
        )
    assert got == want
    held_one, held_two = one["prompt_cache"], two["prompt_cache"]
    assert held_one["tokens"] == held_two["tokens"] > 64
    assert 2 * held_two["held"] == held_one["held"]  # rank 0 holds its half


@pytest.mark.slow  # the first test launches two ranks the same way; this is the CLI's text
def test_generate_on_two_ranks(model_dir):
    args = [
        "-m",
        "kvarn_mlx.generate",
        "--model",
        str(model_dir),
        "--prompt",
        "tell me " * 40,
        "--max-tokens",
        "50",
        *PRESET,
        "--verbose",
        "false",
    ]
    one = subprocess.run(
        [sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=TIMEOUT
    )
    assert one.returncode == 0, one.stderr
    proc = launch(
        2, *args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        out, err = proc.communicate(timeout=TIMEOUT)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 0, err
    assert out == one.stdout  # rank 0 prints the single process's text, rank 1 nothing


@pytest.mark.slow  # an error path; the launch itself is the first test's
def test_prompt_from_stdin_on_two_ranks_is_an_error(model_dir):
    # mlx.launch does not hand every rank the same stdin: ranks would disagree and hang.
    args = ["-m", "kvarn_mlx.generate", "--model", str(model_dir), "--prompt", "-"]
    proc = launch(
        2,
        *args,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=TIMEOUT)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    # mlx.launch itself exits 0 whatever its ranks do; the ranks' messages tell.
    assert '--prompt "$(cat prompt.txt)"' in out + err
