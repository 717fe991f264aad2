"""More than one Mac, on one machine: `python -m kvarn_mlx.generate` and
`python -m kvarn_mlx.server` alone and under `mlx.launch --backend ring -n N`
(tensor parallel through mlx-lm's sharded_load, ranks talking over TCP).

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3 \\
        python benchmarks/distributed.py --ranks 3

Same prompt (an excerpt of CPython's pydoc topics, long enough for tiles to be
quantized), greedy. Reported: whether the N-rank text equals the single
process's, and the KV bytes rank 0 holds against the single process (rank 0
prints for generate; the server's GET /v1/kv_stats reports rank 0's prompt
cache). The kv heads split evenly, so each rank should hold 1/N.
"""

import argparse
import json
import re
import shutil
import subprocess
import sys
import tempfile
import urllib.request
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent), str(HERE)]
from server import get, start, stop  # noqa: E402

from kvarn_mlx.eval.runner import load_text, meta_markdown, metadata  # noqa: E402

ROOT = HERE.parent
LAUNCH = shutil.which("mlx.launch") or str(Path(sys.executable).parent / "mlx.launch")


def prompt_text(chars):
    text = load_text("topics")
    return "Summarize this documentation in one paragraph:\n" + text[:chars]


def launcher(ranks):
    # "--": mlx.launch would otherwise take flags the command shares with it.
    return [LAUNCH, "--backend", "ring", "-n", str(ranks), "--"] if ranks > 1 else []


def run_generate(ranks, model, prompt, max_tokens, preset):
    cmd = [
        *launcher(ranks),
        sys.executable,
        "-m",
        "kvarn_mlx.generate",
        "--prompt",
        prompt,
        "--max-tokens",
        str(max_tokens),
        "--kv-preset",
        preset,
        *(["--model", model] if model else []),
    ]
    out = subprocess.run(
        cmd, cwd=ROOT, capture_output=True, text=True, stdin=subprocess.DEVNULL, timeout=3600
    )
    text, _, stats = out.stdout.partition("==========")
    held = re.search(r"KV bytes held: ([\d.]+) MiB for (\d+) tokens", stats)
    if held is None:
        raise SystemExit(
            f"generate on {ranks} rank(s) printed no statistics:\n{out.stdout}\n{out.stderr}"
        )
    return {"text": text, "kv_mib": float(held[1]), "tokens": int(held[2])}


def run_server(ranks, model, prompt, max_tokens, preset, log_dir):
    flags = ["--kv-preset", preset]
    with open(log_dir / f"server_{ranks}.log", "w") as log:
        proc, url = start(model or "embedded:smollm2-135m-instruct", flags, log, launcher(ranks))
        try:
            body = {
                "messages": [{"role": "user", "content": prompt}],
                "max_tokens": max_tokens,
                "temperature": 0.0,
            }
            req = urllib.request.Request(
                url + "/v1/chat/completions",
                data=json.dumps(body).encode(),
                headers={"Content-Type": "application/json"},
            )
            with urllib.request.urlopen(req, timeout=3600) as r:
                reply = json.loads(r.read())
            held = get(url + "/v1/kv_stats")["prompt_cache"]
        finally:
            stop(proc)
    return {
        "text": reply["choices"][0]["message"]["content"],
        "kv_mib": held["held"] / 2**20,
        "tokens": held["tokens"],
    }


def markdown(meta, args, rows):
    lines = [
        "# More than one Mac: mlx.launch on one machine",
        "",
        meta_markdown(meta),
        "",
        f"`mlx.launch --backend ring -n {args.ranks}` on localhost against one process, same "
        f"prompt, greedy, {args.max_tokens} tokens, `--kv-preset {args.kv_preset}`. KV MiB: bytes "
        "of the arrays rank 0 holds (generate's statistics; the server's prompt cache after the "
        "request, GET /v1/kv_stats).",
        "",
        "| command | ranks | same text as one process | tokens in cache | KV MiB (rank 0) | one "
        "process / rank 0 |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['command']} | {r['ranks']} | {r['same_text']} | {r['tokens']} | "
            f"{r['kv_mib']:.2f} | {r['ratio']:.2f}x |"
        )
    return "\n".join(lines) + "\n"


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, default=3)
    p.add_argument("--model", default=None, help="default: the embedded model (3 kv heads)")
    p.add_argument("--kv-preset", default="auto4v2")
    p.add_argument("--prompt-chars", type=int, default=2600)
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--out", default=str(HERE / "results"))
    args = p.parse_args(argv)
    meta = metadata(
        args.model or "SmolLM2-135M-Instruct (embedded)",
        "python benchmarks/distributed.py " + " ".join(argv if argv is not None else sys.argv[1:]),
    )
    prompt = prompt_text(args.prompt_chars)
    rows = []
    with tempfile.TemporaryDirectory() as logs:
        for command, run in (("generate", run_generate), ("server", run_server)):
            extra = (Path(logs),) if run is run_server else ()
            one = run(1, args.model, prompt, args.max_tokens, args.kv_preset, *extra)
            many = run(args.ranks, args.model, prompt, args.max_tokens, args.kv_preset, *extra)
            for ranks, r in ((1, one), (args.ranks, many)):
                rows.append(
                    {
                        "command": command,
                        "ranks": ranks,
                        "same_text": r["text"] == one["text"],
                        "tokens": r["tokens"],
                        "kv_mib": r["kv_mib"],
                        "ratio": one["kv_mib"] / r["kv_mib"],
                        "text": r["text"],
                    }
                )
                print(json.dumps({k: v for k, v in rows[-1].items() if k != "text"}), flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "distributed.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    (out / "distributed.md").write_text(markdown(meta, args, rows))
    print(markdown(meta, args, rows))


if __name__ == "__main__":
    main()
