"""Per-layer widths from a calibration profile against the uniform presets:
measured KL and bytes (python -m kvarn_mlx.eval fidelity runs) next to the
KL the profile predicts, and a plot of KL against bytes.

The fidelity runs measure on the start of CPython's pydoc text; calibration
(python -m kvarn_mlx.calibrate, default text) reads its second half, so the
measured text was not used for calibration.

    python -m kvarn_mlx.calibrate --out benchmarks/results/profile_smollm2.json
    P=benchmarks/results/profile_smollm2.json
    python -m kvarn_mlx.eval --tag mixed_smollm2 --attention packed fidelity \\
        --contexts 1024,4096,16384 --methods auto2,auto4v2,$P@auto2,$P@auto4v2
    python benchmarks/mixed_widths.py --profile benchmarks/results/profile_smollm2.json \\
        --fidelity benchmarks/results/fidelity_mixed_smollm2.json --tag smollm2

Fidelity runs may be split (presets in one, mixes in another): every --fidelity
file's rows are read, but a mix only if it is --profile's (the profile predicts its
own mixes only), and a method's row at a context is the first file's that has it
(as in tail_frontier.py); the plain cache's reference is the same in each.
"""

import argparse
import json
from pathlib import Path

from kvarn_mlx import integration
from kvarn_mlx import mix as mixes
from kvarn_mlx import profile as profiles
from kvarn_mlx.config import get_preset
from kvarn_mlx.eval.methods import profile_method
from kvarn_mlx.eval.runner import pyplot


def predicted(model, p, method):
    """(predicted KL, tile bytes per token) of a preset or PROFILE@TARGET method under profile p."""
    layers, shapes = integration.quantizable_layers(model)
    target = profile_method(method)
    if target is None:
        m = mixes.choose(p, shapes, bytes_like=method)
        return m.budget["predicted_kl"], m.budget["tile_bytes"] / m.group_size, None
    _, bytes_like, max_kl = target
    m = mixes.choose(p, shapes, bytes_like=bytes_like, max_kl=max_kl)
    return m.predicted_kl, m.bytes_per_token, m


def is_preset(method):
    """Whether the profile can predict this method: a KVarN preset (not the plain cache or
    an mlx-lm baseline such as mlxq4, which the same fidelity runs may hold)."""
    try:
        get_preset(method)
    except ValueError:
        return False
    return True


def label(method):
    target = profile_method(method)
    if target is None:
        return method
    return f"mix at {target[1]}'s bytes" if target[1] else f"mix, KL <= {target[2]:g}"


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None)
    p.add_argument("--profile", required=True)
    p.add_argument(
        "--fidelity",
        nargs="+",
        required=True,
        help="fidelity JSON files (python -m kvarn_mlx.eval)",
    )
    p.add_argument("--tag", required=True)
    p.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    args = p.parse_args(argv)
    from kvarn_mlx.loader import load

    model, _ = load(args.model)
    prof = profiles.read(args.profile)
    rows, commands = {}, []
    for f in args.fidelity:
        d = json.loads(Path(f).read_text())
        commands.append(d["meta"]["command"])
        for r in d["result"]["rows"]:
            target = profile_method(r["method"])
            if target[0] == args.profile if target else is_preset(r["method"]):
                rows.setdefault(r["method"], {}).setdefault(r["context"], r)
    contexts = sorted({c for v in rows.values() for c in v})
    out = []
    for method, by_ctx in rows.items():
        kl_pred, tile_bpt, m = predicted(model, prof, method)
        entry = {
            "method": method,
            "label": label(method),
            "predicted_kl": kl_pred,
            "predicted_at": {c: mixes.predict(prof, kl_pred, c) for c in by_ctx},
            "tile_bytes_per_token": tile_bpt,
            "widths": m.summary()["widths"] if m else None,
            "contexts": {
                c: {
                    "kl_mean": r["kl_mean"],
                    "kl_p99": r["kl_p99"],
                    "top1_agree": r["top1_agree"],
                    "bytes": r["bytes"],
                    "growing_bytes": r.get("growing_bytes") or r["bytes"],
                    "fp16_bytes": r["fp16_bytes"],
                }
                for c, r in by_ctx.items()
            },
        }
        out.append(entry)
    t = prof["text"]
    md = [
        f"# Per-layer widths from a calibration profile ({args.tag})\n",
        f"Model: {prof['model'].get('model')}. Profile: `{args.profile}`, calibrated on "
        f"{t['tokens']} tokens of `{t['source']}` from character {t['start_char']} (KL over "
        f"positions {t['measured_positions'][0]}..{t['measured_positions'][1]}), in "
        f"{prof['seconds']:.0f} s on this machine ({prof['mode']}).\n",
        "Measured: teacher-forced mean KL to the plain cache over positions 128..L-2 of the "
        "*start* of the same text (not used for calibration), 256-token chunks, packed "
        "attention; bytes held at L tokens (measured arrays). Predicted KL: the sum over layers "
        "of the profile's KL at each layer's key width and value width (the mix's own choice; "
        "for a preset, its widths everywhere). "
        + (
            "Predicted at L: that sum times how much the KL of whole caches grew from the "
            "calibration's length to L on the profile's own text (every layer quantized, "
            + ", ".join(
                f"{n} at {', '.join(sorted(k, key=int))} tokens"
                for n, k in prof["growth"]["presets"].items()
            )
            + "; mix.predict), which is what the planner quotes for a context.\n"
            if "growth" in prof
            else "The profile has no growth measurement: predicted at L is the sum.\n"
        ),
        "Commands:\n",
        "```sh",
        f"python -m kvarn_mlx.calibrate {prof.get('command', '').split('calibrate ', 1)[-1]}",
        *commands,
        f"python benchmarks/mixed_widths.py{' --model ' + args.model if args.model else ''} "
        f"--profile {args.profile} --fidelity {' '.join(args.fidelity)} --tag {args.tag}",
        "```\n",
    ]
    head = (
        "| cache | tile bytes/token | predicted KL | "
        + " | ".join(
            f"KL at {c} | predicted at {c} | measured / predicted at {c} | bytes at {c}"
            for c in contexts
        )
        + " |"
    )
    md += [head, "|" + "---|" * (3 + 4 * len(contexts))]
    for e in out:
        cells = []
        for c in contexts:
            r = e["contexts"].get(c)
            cells += (
                [
                    f"{r['kl_mean']:.4f}",
                    f"{e['predicted_at'][c]:.4f}",
                    f"{r['kl_mean'] / e['predicted_at'][c]:.2f}",
                    f"{r['bytes']:,}",
                ]
                if r
                else ["", "", "", ""]
            )
        md.append(
            f"| {e['label']} | {e['tile_bytes_per_token']:,.1f} | {e['predicted_kl']:.4f} | "
            + " | ".join(cells)
            + " |"
        )
    for e in out:
        if e["widths"]:
            md.append(f"\n{e['label']}: " + " ".join(f"{l}:{w}" for l, w in e["widths"].items()))
        else:  # a preset: is the mix at its bytes the preset itself?
            m = predicted(model, prof, f"{args.profile}@{e['method']}")[2]
            cfg = get_preset(e["method"])
            if not m.fp8 and all(kv == (cfg.k_bits, cfg.v_bits) for kv in m.widths.values()):
                md.append(
                    f"\nThe mix at {e['method']}'s bytes is {e['method']} itself: no other widths "
                    "fit those bytes with a lower predicted KL."
                )
    plot = draw(out, contexts, args.out / f"mixed_widths_{args.tag}.png")
    if plot:
        md.append(f"\n![KL against bytes]({plot.name})")
    (args.out / f"mixed_widths_{args.tag}.md").write_text("\n".join(md) + "\n")
    (args.out / f"mixed_widths_{args.tag}.json").write_text(
        json.dumps({"profile": args.profile, "rows": out, "commands": commands}, indent=1)
    )
    print("\n".join(md))


def draw(out, contexts, path):
    plt = pyplot()
    if plt is None:
        return None
    fig, axes = plt.subplots(1, len(contexts), figsize=(5.5 * len(contexts), 4.2), squeeze=False)
    for ax, c in zip(axes[0], contexts):
        for e in out:
            r = e["contexts"].get(c)
            if not r:
                continue
            mixed = e["widths"] is not None
            mib = r["growing_bytes"] / 2**20
            ax.plot(
                mib,
                r["kl_mean"],
                "o" if mixed else "s",
                ms=8,
                color="tab:orange" if mixed else "tab:blue",
            )
            ax.annotate(
                e["label"],
                (mib, r["kl_mean"]),
                fontsize=7,
                xytext=(4, 4),
                textcoords="offset points",
            )
        ax.set(
            yscale="log",
            xlabel=f"KV MiB held at {c} tokens by the layers that grow (measured)",
            ylabel="mean KL to the plain cache",
            title=f"{c} tokens: presets (squares), profile mixes (circles)",
        )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close("all")
    return path


if __name__ == "__main__":
    main()
