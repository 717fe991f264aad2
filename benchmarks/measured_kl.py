"""Write kvarn_mlx/measured_kl.json: the mean KL of every cache on the embedded
models, from the committed frontier tables, for python -m kvarn_mlx.plan.

The planner ships no benchmark results; this file is the part of them it quotes
(each cache's mean KL to the plain cache, teacher-forced on pydoc text), keyed by
the embedded model's catalogue key, with where the figures come from.

    python benchmarks/measured_kl.py
"""

import json
from pathlib import Path

from kvarn_mlx.atomic_json import write_json

ROOT = Path(__file__).resolve().parent.parent
TABLES = {
    "smollm2-135m-instruct": "frontier_smollm2",
    "gemma-3-270m": "frontier_gemma3",
    "qwen2.5-coder-1.5b": "frontier_qwen1.5b",
}
# The frontier tables' method names for mlx-lm's caches -> the planner's cache names.
MLX_NAMES = {"mlxq8": "mlx-lm 8-bit", "mlxq4": "mlx-lm 4-bit"}


def table(stem):
    d = json.loads((ROOT / "benchmarks" / "results" / f"{stem}.json").read_text())
    r = d["result"]
    kl = {}
    for p in r["points"]:
        name = MLX_NAMES.get(p["method"], p["method"])
        if "+" not in name and not name.startswith("mlxq"):  # presets and mlx-lm's caches only
            kl[name] = p["kl_mean"]
    return {
        "source": (
            f"benchmarks/results/{stem}.md: mean KL to the plain float32 cache, "
            f"teacher-forced, {r['context']} tokens of pydoc text (kvarn_mlx "
            f"{d['meta']['versions']['kvarn_mlx_git']}, {d['meta']['date'][:10]})"
        ),
        "kl": dict(sorted(kl.items())),
    }


def main():
    what = (
        "mean KL of each cache on the embedded models (python -m kvarn_mlx.plan quotes it); "
        "written by benchmarks/measured_kl.py"
    )
    out = {"what": what, **{key: table(stem) for key, stem in TABLES.items()}}
    write_json(ROOT / "kvarn_mlx" / "measured_kl.json", out)


if __name__ == "__main__":
    main()
