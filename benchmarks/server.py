"""Many conversations at once: mlx-lm's server on KVarN caches against the
same server with mlx-lm's plain cache and with its --kv-bits cache, in one run.

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3 \\
        python benchmarks/server.py --requests 8 --prompt-tokens 1500 --max-tokens 32

Each server is `python -m kvarn_mlx.server` (mlx_lm.server's own code, with
its stats endpoint): `--kv-preset <KVarN preset>`, `--kv-preset fp16` (mlx-lm's
plain cache) and `--kv-preset fp16 --kv-bits 4 --quantized-kv-start 0`
(mlx-lm's QuantizedKVCache from the first token; by default it starts at
5,000 tokens; it cannot be batched: mlx-lm serves it one request at a time). Against
each: --requests concurrent streaming chat requests from the `openai` client,
each a different ~--prompt-tokens-token excerpt, greedy. Reported: wall time,
total (prompt + generated) tokens/s, generated tokens/s, the live requests
when they held the most tokens and the KV bytes they held (the server's
live_peak in GET /v1/kv_stats; bytes of the arrays held), and the prompt
cache's bytes after the run (the conversations kept for prefix reuse).
"""

import argparse
import concurrent.futures
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from kvarn_mlx.config import DEFAULT_PRESET  # noqa: E402
from kvarn_mlx.eval.runner import load_text, meta_markdown, metadata  # noqa: E402


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def get(url):
    with urllib.request.urlopen(url, timeout=600) as r:
        return json.loads(r.read())


def start(model, flags, log, launcher=()):
    """`python -m kvarn_mlx.server` (after `launcher`, e.g. mlx.launch's argv) in a
    process group of its own: stop() ends every process it started."""
    port = free_port()
    cmd = [
        *launcher,
        sys.executable,
        "-m",
        "kvarn_mlx.server",
        "--model",
        str(model),
        "--port",
        str(port),
        *flags,
    ]
    proc = subprocess.Popen(
        cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            if get(url + "/health")["status"] == "ok":
                return proc, url
        except OSError:
            time.sleep(0.5)
    stop(proc)
    raise SystemExit(f"server {' '.join(flags)} did not start; see {log.name}")


def stop(proc):
    # The whole group: mlx.launch leaves its ranks running when it is stopped alone.
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def stream(client, prompt, max_tokens):
    text, usage = [], None
    for chunk in client.chat.completions.create(
        model="default_model",
        messages=[{"role": "user", "content": prompt}],
        max_tokens=max_tokens,
        temperature=0.0,
        stream=True,
        stream_options={"include_usage": True},
    ):
        if chunk.choices:
            text.append(chunk.choices[0].delta.content or "")
        if chunk.usage:
            usage = chunk.usage
    return "".join(text), usage


def run_one(name, model, flags, prompts, max_tokens, log_dir, one_at_a_time=False):
    import openai

    with open(log_dir / f"server_{name.replace(' ', '_')}.log", "w") as log:
        proc, url = start(model, flags, log)
        try:
            client = openai.OpenAI(
                base_url=url + "/v1", api_key="none", timeout=3600, max_retries=0
            )
            stream(client, "Hello", 4)  # warm-up: model loaded, kernels built
            base = get(url + "/v1/kv_stats")
            t0 = time.perf_counter()
            with concurrent.futures.ThreadPoolExecutor(
                1 if one_at_a_time else len(prompts)
            ) as pool:
                results = list(pool.map(lambda p: stream(client, p, max_tokens), prompts))
            wall = time.perf_counter() - t0
            after = get(url + "/v1/kv_stats")
        finally:
            stop(proc)
    prompt_tokens = sum(u.prompt_tokens for _, u in results)
    generated = sum(u.completion_tokens for _, u in results)
    peak = after["live_peak"]
    return {
        "name": name,
        "flags": flags,
        "wall_s": wall,
        "prompt_tokens": prompt_tokens,
        "generated_tokens": generated,
        "total_tok_s": (prompt_tokens + generated) / wall,
        "generated_tok_s": generated / wall,
        "peak_live": peak,
        "prompt_cache": after["prompt_cache"],
        "prompt_tokens_processed": after["prompt_tokens_processed"]
        - base["prompt_tokens_processed"],
        "texts": [t for t, _ in results],
    }


def markdown(meta, args, rows):
    mib = lambda b: f"{b / 2**20:.1f}"
    plain = next(r for r in rows if r["name"] == "plain")
    out = [
        "# Many conversations at once: mlx-lm's server on KVarN caches\n",
        meta_markdown(meta),
        "",
        f"{args.requests} concurrent streaming chat requests (openai client), each a different "
        f"excerpt of ~{args.prompt_tokens} tokens, greedy, {args.max_tokens} tokens each. Every "
        "server is mlx-lm's own server code started through `python -m kvarn_mlx.server` (for "
        "its stats endpoint). 'live' is the server's live_peak (GET /v1/kv_stats): the live "
        "requests' caches when they held the most tokens (measured after a batch step at most "
        "once a second): bytes of the arrays held. 'plain' is what mlx-lm's KVCache holds for "
        "those tokens in the model's dtype (float32 here), unpadded. 'prompt cache' is the LRU "
        "after the run (the conversations kept for prefix reuse). 'same as plain' counts replies "
        "equal to the plain cache's, and gives the mean length of their common beginning in "
        "characters; 'same as one at a time' compares the KVarN server's batched replies with a "
        "fresh KVarN server answering the same requests one after another (the 'one at a time' "
        "row). The servers run one after another. **CPU caveat**: 2 shared cores with other jobs "
        "running (the load changes between rows), MLX's CPU quantized matmul is slow and KVarN "
        "runs its MLX ops path here, so speeds say little about Apple silicon.",
        "",
        "| server | batched | wall s | total tok/s | generated tok/s | live seqs | live tokens | "
        "live KV MiB | plain MiB for them | prompt cache MiB (seqs) | same as plain (common "
        "chars) | same as one at a time |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    alone = next((r for r in rows if r["name"].endswith("one at a time")), None)
    for r in rows:
        p = r["peak_live"]
        vs_alone = "-"
        if alone is not None and r["name"] == "kvarn":
            vs_alone = (
                f"{sum(a == b for a, b in zip(r['texts'], alone['texts']))}/{len(r['texts'])}"
            )
        same = sum(a == b for a, b in zip(r["texts"], plain["texts"]))
        common = sum(
            len(os.path.commonprefix([a, b])) for a, b in zip(r["texts"], plain["texts"])
        ) / len(r["texts"])
        out.append(
            f"| {r['name']} (`{' '.join(r['flags'])}`) | {'yes' if p['sequences'] > 1 else 'no'} | "
            f"{r['wall_s']:.1f} | {r['total_tok_s']:.1f} | {r['generated_tok_s']:.2f} | "
            f"{p['sequences']} | {p['tokens']} | {mib(p['held'])} | {mib(p['plain'])} | "
            f"{mib(r['prompt_cache']['held'])} ({r['prompt_cache']['sequences']}) | "
            f"{same}/{len(r['texts'])} ({common:.0f}) | {vs_alone} |"
        )
    return "\n".join(out) + "\n"


def main():
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--model", default=None, help="model folder (default: the embedded model)")
    ap.add_argument("--kv-preset", default=DEFAULT_PRESET)
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--prompt-tokens", type=int, default=1500)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    args = ap.parse_args()

    from mlx_lm.tokenizer_utils import load as load_tokenizer

    from kvarn_mlx.loader import default_model_path

    model = Path(args.model) if args.model else default_model_path()
    tok = load_tokenizer(model)
    ids = tok.encode(load_text("topics"))
    prompts = [
        tok.decode(ids[i * 2 * args.prompt_tokens :][: args.prompt_tokens])
        for i in range(args.requests)
    ]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    common = ["--max-tokens", str(args.max_tokens), "--prompt-cache-size", str(2 * args.requests)]
    servers = [
        ("kvarn", ["--kv-preset", args.kv_preset]),
        ("kvarn one at a time", ["--kv-preset", args.kv_preset]),
        ("plain", ["--kv-preset", "fp16"]),
        ("kv-bits 4", ["--kv-preset", "fp16", "--kv-bits", "4", "--quantized-kv-start", "0"]),
    ]
    logs = Path(tempfile.mkdtemp(prefix="kvarn_server_bench."))
    print(f"server logs in {logs}")
    rows = []
    for name, flags in servers:
        print(f"{name}: {' '.join(flags)}", flush=True)
        rows.append(
            run_one(
                name,
                model,
                flags + common,
                prompts,
                args.max_tokens,
                logs,
                name.endswith("at a time"),
            )
        )
        r = rows[-1]
        print(
            f"  {r['wall_s']:.1f}s, {r['total_tok_s']:.1f} tok/s, live {r['peak_live']}", flush=True
        )
    meta = metadata(model.name, "python benchmarks/server.py " + " ".join(sys.argv[1:]))
    (out / "server.md").write_text(markdown(meta, args, rows))
    (out / "server.json").write_text(
        json.dumps({"meta": meta, "args": vars(args), "result": rows}, indent=1)
    )
    print((out / "server.md").read_text())


if __name__ == "__main__":
    main()
