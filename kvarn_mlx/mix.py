"""Per-layer key and value widths from a calibration profile (profile.py).

Given a byte budget (the tile bytes per token of a preset, `bytes_like`) or a
KL target (`max_kl`), choose one key width and one value width per layer (and,
where the profile measured them, one-byte scales for that layer) that minimize
the predicted KL at those bytes. The prediction assumes the layers' and sides'
KLs add up: predicted KL = the sum of the measured KLs of each layer's key
width and value width (each measured with only that side of that layer
quantized, with that layer's scales). Tile bytes per token per layer and side
come from the arrays a real KVarNCache of that layer's shape holds (sink and
tail are the same for every width, so they do not enter the choice).

The choice is exact: a multiple-choice knapsack solved by dynamic programming
over the bytes, so the mix at a preset's bytes never holds more than the
preset and never predicts a higher KL.
"""

import math
from dataclasses import dataclass, field
from functools import lru_cache, reduce

import mlx.core as mx
import numpy as np

from . import profile as profiles
from .cache import KVarNCache
from .config import PRESETS, get_preset
from .profile import ProfileError, settings_config


@lru_cache(maxsize=256)
def tile_bytes(config, heads, head_dim, dtype):
    """(key, value) bytes of one quantized tile of a layer with this config,
    kv heads and head dim: the tile arrays a KVarNCache holds after one tile
    (lazily filled: array bytes depend on shapes only, nothing is computed)."""
    c = KVarNCache(config)
    n = config.sink_size + config.group_size
    x = mx.zeros((1, heads, n, head_dim), dtype)
    c.update_and_fetch(x, x)
    tiles = c.tiles.valid(1)
    return (
        sum(a.nbytes for a in tiles.keys()),
        sum(a.nbytes for a in tiles.arrays()) - sum(a.nbytes for a in tiles.keys()),
    )


@dataclass
class Mix:
    """Per-layer widths chosen from a profile, and what they cost and predict."""

    widths: dict  # layer -> (k_bits, v_bits)
    fp8: frozenset  # layers whose scales are one byte (e4m3)
    tile_bytes: int  # bytes of one tile of every quantized layer
    predicted_kl: float  # sum of the layers' measured KLs at these widths
    group_size: int
    target: str  # what was asked, e.g. "bytes of auto4v2" or "KL <= 0.005"
    budget: dict = field(
        default_factory=dict
    )  # the preset's tile bytes and predicted KL, for bytes_like
    context: int = None  # with max_kl: the tokens its KL is predicted at (predict)
    context_kl: float = None  # predict(profile, predicted_kl, context)

    @property
    def bytes_per_token(self):
        """Tile bytes per token, summed over the quantized layers."""
        return self.tile_bytes / self.group_size

    def label(self, layer) -> str:
        """A layer's widths, e.g. "k3v2", and "/fp8" for one-byte scales."""
        k, v = self.widths[layer]
        return f"k{k}v{v}" + ("/fp8" if layer in self.fp8 else "")

    def summary(self) -> dict:
        return {
            "widths": {str(l): self.label(l) for l in sorted(self.widths)},
            "tile_bytes_per_token": self.bytes_per_token,
            "predicted_kl": self.predicted_kl,
            **(
                {"context": self.context, "predicted_kl_at_context": self.context_kl}
                if self.context
                else {}
            ),
            "target": self.target,
            **({"preset": self.budget} if self.budget else {}),
        }

    def describe(self) -> str:
        counts = {}
        for l in self.widths:
            counts[self.label(l)] = counts.get(self.label(l), 0) + 1
        common = ", ".join(f"{w} x{n}" for w, n in sorted(counts.items(), key=lambda t: -t[1]))
        out = (
            f"KV widths from the profile ({self.target}): {common}; "
            f"{self.bytes_per_token:,.1f} tile bytes/token, predicted KL {self.predicted_kl:.4g}"
            + (f" ({self.context_kl:.4g} at {self.context:,} tokens)" if self.context else "")
        )
        if self.budget:
            out += (
                f" ({self.budget['name']}: {self.budget['tile_bytes'] / self.group_size:,.1f} "
                f"bytes/token, predicted KL {self.budget['predicted_kl']:.4g})"
            )
        per_layer = " ".join(f"{l}:{self.label(l)}" for l in sorted(self.widths))
        return out + "\n  per layer: " + per_layer


def allocate(groups, budget):
    """groups: per group a list of (cost, kl) options (costs integers >= 0); one
    option per group with total cost <= budget and the least total kl.
    Returns (option index per group, least kl per budget 0..budget), or None
    for the indices when no choice fits."""
    best = np.zeros(budget + 1)  # least kl of the groups so far at cost <= b
    picks = []
    for options in groups:
        new = np.full(budget + 1, np.inf)
        pick = np.full(budget + 1, -1, np.int16)
        for i, (cost, kl) in enumerate(options):
            if cost > budget:
                continue
            cand = np.full(budget + 1, np.inf)
            cand[cost:] = best[: budget + 1 - cost] + kl
            better = cand < new  # ties keep the earlier (cheaper) option
            new[better], pick[better] = cand[better], i
        best = new
        picks.append(pick)
    if not np.isfinite(best[budget]):
        return None, best
    b, chosen = budget, []
    for g in reversed(range(len(groups))):
        i = int(picks[g][b])
        chosen.append(i)
        b -= groups[g][i][0]
    return chosen[::-1], best


def _options(p, shapes):
    """Per layer, the ((k_bits, v_bits, fp8), tile bytes, kl) it can take: every
    key width with every value width, with the profile's scales and, at the
    widths measured with them, one-byte scales (one scale dtype per layer)."""
    settings = p["settings"]
    groups = []
    for e in sorted(p["layers"], key=lambda e: e["layer"]):
        heads, k_dim, v_dim, dtype = shapes[e["layer"]]
        opts = []
        for fp8, widths in ((False, p["widths"]), (True, profiles.fp8_widths(p))):
            if not widths:
                continue
            side_opts = {}  # per side, (width, tile bytes, kl) at the widths the layer holds
            for i, (side, dim) in enumerate(zip(profiles.SIDES, (k_dim, v_dim))):
                kls = profiles.measured(e, side, fp8)
                side_opts[side] = [
                    (w, tile_bytes(settings_config(settings, w, w, fp8), heads, dim, dtype)[i], kl)
                    for w in widths
                    if (kl := kls[str(w)]) is not None
                ]
            opts += [
                ((kw, vw, fp8), kb + vb, k_kl + v_kl)
                for kw, kb, k_kl in side_opts["k"]
                for vw, vb, v_kl in side_opts["v"]
            ]
        groups.append((e["layer"], opts))
    return groups


def choose(p, shapes, bytes_like=None, max_kl=None, context=None) -> Mix:
    """The mix for profile p on layers of these shapes ({layer: (kv heads, key dim,
    value dim, dtype)}): the least predicted KL within the tile bytes of the
    preset bytes_like, or the fewest bytes whose predicted KL is at most max_kl;
    with `context` (and a profile that measured growth), the KL predicted at that
    many tokens (predict) is at most max_kl."""
    if (bytes_like is None) == (max_kl is None):
        raise ValueError(
            "a profile needs exactly one of bytes_like (a preset whose bytes to match) or max_kl"
        )
    groups = _options(p, shapes)
    costs = [c for _, opts in groups for _, c, _ in opts]
    unit = reduce(math.gcd, costs)
    G = p["settings"]["group_size"]
    preset = None
    if bytes_like is not None:
        cfg = get_preset(bytes_like)
        if cfg.group_size != G:
            raise ValueError(
                f"bytes_like={bytes_like!r} has {cfg.group_size}-token tiles; the profile's have "
                f"{G}"
            )
        total, kl = 0, 0.0
        for layer, opts in groups:
            match = [o for o in opts if o[0] == (cfg.k_bits, cfg.v_bits, False)]
            if not match:
                raise ValueError(
                    f"bytes_like={bytes_like!r}: layer {layer} cannot hold {cfg.k_bits}-bit keys "
                    f"and {cfg.v_bits}-bit values; pick another preset"
                )
            total, kl = total + match[0][1], kl + match[0][2]
        preset = {"name": bytes_like, "tile_bytes": total, "predicted_kl": kl}
        budget = total // unit
        target = f"the bytes of {bytes_like}"
    else:
        if not (isinstance(max_kl, (int, float)) and max_kl > 0 and math.isfinite(max_kl)):
            raise ValueError(f"max_kl={max_kl!r}: give a KL in nats > 0, e.g. 0.005")
        budget = sum(max(c for _, c, _ in opts) for _, opts in groups) // unit
        if context is not None and not (isinstance(context, int) and context > 0):
            raise ValueError(f"context={context!r}: give the context length in tokens, e.g. 32768")
        if not p.get("growth"):
            context = None  # nothing to scale the sum by
        at = f" at {context:,} tokens" if context else ""
        target = f"predicted KL <= {max_kl:g}{at}"
    scaled = [[(c // unit, kl) for _, c, kl in opts] for _, opts in groups]
    chosen, best = allocate(scaled, budget)
    if chosen is None:
        raise ValueError("no widths fit that many bytes")
    if max_kl is not None:
        # best[b]: the least summed KL in b units of bytes; each predicted at the context
        kl_at = predict(p, best, context)
        if kl_at[budget] > max_kl:
            raise ValueError(
                f"the profile predicts KL {kl_at[budget]:.4g}{at} at best (8-bit keys and values "
                f"everywhere), above max_kl={max_kl:g}; ask for more, or use the plain cache (fp16)"
            )
        budget = int(np.argmax(kl_at <= max_kl))
        chosen, _ = allocate(scaled, budget)
    widths, fp8, total, kl = {}, set(), 0, 0.0
    for (layer, opts), i in zip(groups, chosen):
        (kw, vw, one_byte), c, k = opts[i]
        widths[layer] = (kw, vw)
        if one_byte:
            fp8.add(layer)
        total, kl = total + c, kl + k
    mix = Mix(widths, frozenset(fp8), total, kl, G, target, preset or {})
    if max_kl is not None and context:
        mix.context, mix.context_kl = context, float(predict(p, kl, context))
    return mix


def preset_kl(p, config):
    """The KL profile p predicts for one preset on every layer (the sum of each
    layer's key and value KLs at its widths), or None when the profile was measured
    with other settings (tile size, sink, rotation, ...) or a layer cannot hold
    those widths."""
    if settings_config(p["settings"], config.k_bits, config.v_bits) != config:
        return None
    widths = {"k": str(config.k_bits), "v": str(config.v_bits)}
    kls = [e[side].get(widths[side]) for e in p["layers"] for side in profiles.SIDES]
    return None if any(kl is None for kl in kls) else sum(kls)


def from_profile(
    model, p, kvarn_layers, shapes, bytes_like=None, max_kl=None, context=None, where="the profile"
):
    """(Mix, {layer: KVarNConfig}) for this model from profile p (profile.read's),
    after refusing one of another model or with missing layers.
    kvarn_layers: the layers make_cache quantizes; shapes: their kv_shapes."""
    profiles.check_model(p, model, kvarn_layers, where)
    try:
        mix = choose(p, shapes, bytes_like=bytes_like, max_kl=max_kl, context=context)
    except ValueError as e:
        raise ProfileError(f"{where}: {e}") from None
    configs = {
        l: settings_config(p["settings"], k, v, l in mix.fp8) for l, (k, v) in mix.widths.items()
    }
    return mix, configs


def _kl_at(curve, context):
    """A preset's measured mean KL, {tokens: KL}, at `context`: log-log interpolation
    between the measured lengths, the shortest one's below them, and the power law
    of the last two beyond them (never falling)."""
    pts = sorted((c, kl) for c, kl in curve.items() if kl > 0)
    if not pts:
        return None
    x, y = np.log([c for c, _ in pts]), np.log([kl for _, kl in pts])
    at = math.log(context)
    if len(pts) == 1 or at <= x[-1]:
        return math.exp(np.interp(at, x, y))
    slope = max(0.0, (y[-1] - y[-2]) / (x[-1] - x[-2]))
    return math.exp(y[-1] + slope * (at - x[-1]))


def predict(p, kl_sum, context=None):
    """The mean KL over a `context`-token text that profile p predicts for a cache
    whose layers' KLs sum to kl_sum (a number, or a numpy array of them). The sum
    is the KL near the calibration's length; with a "growth" measurement, it is
    scaled by how much the growth presets' measured KL grew from that length to
    `context`, interpolated between the presets by log KL sum. Without a context or
    a growth measurement: the sum."""
    growth = p.get("growth")
    if context is None or not growth:
        return kl_sum
    base = p["text"]["tokens"]  # the calibration's length
    curves = []  # (log of the preset's sum, log of its growth from base to context)
    for name, kls in growth["presets"].items():
        s = preset_kl(p, PRESETS[name])
        curve = {int(c): kl for c, kl in kls.items()}
        a, b = _kl_at(curve, base), _kl_at(curve, context)
        if s and a and b:
            curves.append((math.log(s), math.log(b / a)))
    if not curves:
        return kl_sum
    xs, ys = zip(*sorted(curves))
    with np.errstate(divide="ignore", invalid="ignore"):  # sums of 0 and inf stay as they are
        factor = np.exp(np.interp(np.log(kl_sum), xs, ys))
    out = np.where(np.asarray(kl_sum) > 0, kl_sum * factor, kl_sum)
    return float(out) if np.ndim(out) == 0 else out
