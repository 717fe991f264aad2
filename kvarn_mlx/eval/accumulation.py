"""Error accumulation, the KVarN paper's pseudo-decode: in decoding, later tokens
attend to a cache that already holds quantization error, and that error feeds
into their own K/V. Per layer, the mean absolute error of the attention output
against full precision, by position: "accumulated" (prefill in blocks, each
quantized before the next attends to it) next to "static" (the full-precision
run's K/V quantized once)."""

import math

import mlx.core as mx
import numpy as np
from mlx_lm.models import cache as mlx_cache
from mlx_lm.models.cache import QuantizedKVCache

from .. import integration
from ..cache import KVarNCache
from .methods import SINK, G, make_caches
from .runner import Progress, for_model, pyplot, tokens

NAME = "accumulation"
HELP = "attention-output error vs position: accumulated and static"


def add_arguments(p):
    p.add_argument("--methods", default="kivi2,rot2,kvarn2")
    p.add_argument("--context", type=int, default=2048)
    p.add_argument("--block", type=int, default=G)
    p.add_argument("--text", default="topics")


def run(args, model, tokenizer, methods, meta_md):
    """(result for the json, markdown, plot drawer) of one CLI run."""
    res = accumulation(
        model, tokenizer, methods, args.context, args.block, args.text, args.attention
    )
    md = markdown(res, meta_md)
    summary = summarize(res)[0]
    return dict(compact(res), summary=summary), md, lambda folder: plots(res, folder)


def accumulation(
    model, tokenizer, methods, context=2048, block=G, source="topics", attention_mode="dequant"
):
    ids = tokens(tokenizer, source, context)
    ref, q, kv = _capture_run(model, ids, mlx_cache.make_prompt_cache(model), block, "fp", True)
    scale = model.layers[0].self_attn.scale
    res = {"context": context, "block": block, "source": source, "methods": {}}
    for name in methods:
        out = _capture_run(
            model, ids, for_model(make_caches(model, name), attention_mode), block, name
        )
        acc = np.stack([np.abs(o - r).mean(axis=1) for o, r in zip(out, ref)])  # [layers, L]
        fresh = make_caches(model, name)
        sta = np.stack(
            [
                np.abs(_static_outputs(fresh[i], q[i], *kv[i], scale, block) - ref[i]).mean(axis=1)
                for i in range(len(ref))
            ]
        )
        res["methods"][name] = {"accumulated": acc, "static": sta}
    return res


def _capture_run(model, ids, caches, block, label, want_qkv=False):
    """Chunked prefill capturing every layer's attention output [L, Hq*D] (numpy),
    and (want_qkv) the queries and the final keys/values per layer."""
    integration.patch()  # observers see calls through the patched entry point
    outs, qs, kv = [], [], None
    bar = Progress(math.ceil(len(ids) / block), label)
    x = mx.array(ids)[None]
    for s in range(0, len(ids), block):
        seen = []
        with integration.observe(lambda q, k, v, cache, out: seen.append((q, k, v, out))):
            mx.eval(model(x[:, s : s + block], cache=caches))
        outs.append([np.array(o[0].swapaxes(0, 1).reshape(o.shape[2], -1)) for *_, o in seen])
        if want_qkv:
            qs.append([q for q, *_ in seen])
            kv = [(k, v) for _, k, v, _ in seen]
            mx.eval(qs[-1])
        bar.step()
    per_layer = [np.concatenate([o[i] for o in outs]) for i in range(len(outs[0]))]
    if want_qkv:
        q = [mx.concatenate([c[i] for c in qs], axis=2) for i in range(len(qs[0]))]
        return per_layer, q, kv
    return per_layer


def _static_outputs(c, q, k, v, scale, block):
    """One-shot: quantize the full-precision run's K/V once into the empty cache c
    (every whole tile after the sink) and attend with its queries, with the same
    visibility as the chunked run (a block's queries see tiles before the block
    quantized and the block itself exact), so accumulated / static isolates
    error propagation."""
    exact_block = True
    if isinstance(c, KVarNCache):
        c.update_and_fetch(k, v)
        kh, vh = c.update_and_fetch(
            k[..., :0, :], v[..., :0, :]
        )  # a 0-token step: every tile now counts as seen
    elif isinstance(c, QuantizedKVCache):
        kq, vq = c.update_and_fetch(k, v)
        kh = mx.dequantize(*kq, group_size=c.group_size, bits=c.bits)
        vh = mx.dequantize(*vq, group_size=c.group_size, bits=c.bits)
        exact_block = False  # it quantizes every token on arrival, its own block too
    else:
        kh, vh = k, v
    kh, vh = kh.astype(q.dtype), vh.astype(q.dtype)
    L = q.shape[2]
    out = []
    for s in range(0, L, block):
        e = min(L, s + block)
        km = mx.concatenate([kh[:, :, :s], k[:, :, s:e]], axis=2) if exact_block else kh[:, :, :e]
        vm = mx.concatenate([vh[:, :, :s], v[:, :, s:e]], axis=2) if exact_block else vh[:, :, :e]
        o = mx.fast.scaled_dot_product_attention(q[:, :, s:e], km, vm, scale=scale, mask="causal")
        out.append(np.array(o[0].swapaxes(0, 1).reshape(e - s, -1)))
    return np.concatenate(out)


def _window(x, a, b):
    return float(x[..., a:b].mean())


def summarize(res, sink=SINK):
    L = res["context"]
    first = (sink + G, min(L, sink + G + 512))  # first quantized positions
    last = (max(sink + G, L - 512), L)  # may overlap "first" on short contexts
    rows = []
    for name, r in res["methods"].items():
        acc, sta = r["accumulated"].mean(axis=0), r["static"].mean(axis=0)
        pos = np.arange(L)
        sel = pos >= sink + G
        slope = np.polyfit(pos[sel] / 1000, acc[sel], 1)[0]
        slope_s = np.polyfit(pos[sel] / 1000, sta[sel], 1)[0]
        rows.append(
            {
                "method": name,
                "acc_first": _window(acc, *first),
                "acc_last": _window(acc, *last),
                "static_first": _window(sta, *first),
                "static_last": _window(sta, *last),
                "acc_growth": _window(acc, *last) / max(_window(acc, *first), 1e-12),
                "acc_over_static_last": _window(acc, *last) / max(_window(sta, *last), 1e-12),
                "acc_slope_per_1k": float(slope),
                "static_slope_per_1k": float(slope_s),
                "acc_mean": float(acc[sel].mean()),
                "static_mean": float(sta[sel].mean()),
            }
        )
    return rows, first, last


def markdown(res, meta_md):
    rows, first, last = summarize(res)
    out = [
        f"# Error accumulation (pseudo-decode, text: {res['source']})\n",
        meta_md,
        f"\nContext {res['context']} tokens, prefilled in blocks of {res['block']} (each block "
        "is quantized before the next attends to it; a block's own tokens are seen in full "
        "precision, as in real decoding). Error = mean |attention output - full-precision "
        "output| (before o_proj), averaged over heads, channels and layers. Accumulated: the "
        "chunked run, where every layer's input already carries the error of earlier layers and "
        "tokens. Static: the full-precision run's K/V quantized once, attended by the "
        "full-precision queries with the same visibility (tiles before the query's block "
        "quantized, the block itself exact), so acc/static > 1 is error carried forward through "
        f"layers and tokens. Windows: first = positions [{first[0]}, {first[1]}), last = "
        f"[{last[0]}, {last[1]}).\n",
        "| method | acc first | acc last | acc growth (last/first) | acc slope /1K tok | static "
        "first | static last | static slope /1K | acc/static (last) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        out.append(
            f"| {r['method']} | {r['acc_first']:.5f} | {r['acc_last']:.5f} | "
            f"{r['acc_growth']:.2f} | {r['acc_slope_per_1k']:+.5f} | {r['static_first']:.5f} | "
            f"{r['static_last']:.5f} | {r['static_slope_per_1k']:+.5f} | "
            f"{r['acc_over_static_last']:.2f} |"
        )
    out.append("\nPer-layer mean error over quantized positions (accumulated / static):\n")
    names = list(res["methods"])
    out.append("| layer | " + " | ".join(names) + " |")
    out.append("|---|" + "---|" * len(names))
    n_layers = next(iter(res["methods"].values()))["accumulated"].shape[0]
    for i in range(n_layers):
        cells = []
        for n in names:
            r = res["methods"][n]
            cells.append(
                f"{r['accumulated'][i, SINK + G :].mean():.4f} / "
                f"{r['static'][i, SINK + G :].mean():.4f}"
            )
        out.append(f"| {i} | " + " | ".join(cells) + " |")
    return "\n".join(out) + "\n"


def compact(res, bin=16):
    """For the json: per-position curves averaged over layers at full resolution,
    per-layer curves as means over bins of `bin` tokens (keeps files small)."""
    out = dict(res, methods={}, layer_bin=bin)
    for name, r in res["methods"].items():
        m = {}
        for key in ("accumulated", "static"):
            x = np.asarray(r[key], dtype=np.float64)
            n = x.shape[1] // bin * bin
            m[f"{key}_mean_over_layers"] = np.round(x.mean(axis=0), 6)
            m[f"{key}_per_layer_binned"] = np.round(
                x[:, :n].reshape(x.shape[0], -1, bin).mean(axis=2), 6
            )
        out["methods"][name] = m
    return out


def plots(res, outdir, smooth=64):
    plt = pyplot()
    if plt is None:
        return []
    k = np.ones(smooth) / smooth
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.8))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for j, (name, r) in enumerate(res["methods"].items()):
        c = colors[j % len(colors)]
        for ax, key, ls in ((axes[0], "accumulated", "-"), (axes[0], "static", "--")):
            y = np.convolve(
                r[key].mean(axis=0)[SINK + G :], k, mode="valid"
            )  # smooth quantized positions only
            ax.plot(
                SINK + G + smooth // 2 + np.arange(len(y)), y, ls, color=c, label=f"{name} {key}"
            )
        n_layers = r["accumulated"].shape[0]
        for i in (n_layers // 2, n_layers - 1):
            y = np.convolve(r["accumulated"][i][SINK + G :], k, mode="valid")
            axes[1].plot(
                SINK + G + smooth // 2 + np.arange(len(y)),
                y,
                "-" if i == n_layers - 1 else ":",
                color=c,
                label=f"{name} layer {i}",
            )
    axes[0].set(
        xlabel="position (tokens)",
        ylabel="mean |attn out - fp|",
        yscale="log",
        title=f"mean of all layers, block {res['block']} (solid: accumulated, dashed: static)",
    )
    axes[1].set(
        xlabel="position (tokens)",
        ylabel="mean |attn out - fp|",
        yscale="log",
        title="accumulated, single layers",
    )
    for ax in axes:
        ax.legend(fontsize=7)
    fig.tight_layout()
    f = outdir / "accumulation.png"
    fig.savefig(f, dpi=110)
    plt.close("all")
    return [f]
