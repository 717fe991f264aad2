"""KVarN settings and the named presets (docs/algorithm.md, "Tiles, sink and tail")."""

import re
from dataclasses import dataclass, replace

SUPPORTED_BITS = (2, 3, 4, 5, 6, 8)
SUPPORTED_GROUP_SIZES = (64, 128)
SCALE_DTYPES = ("float16", "bfloat16", "float32", "fp8")  # fp8: e4m3, one byte per scale
# Wider codes lose more to e4m3's 3-bit mantissa than the byte per scale saves
# (reconstruction error 1.1-2.6x float16 scales' at 6 and 8 bits, within 7% at 2-4).
FP8_MAX_BITS = 4


@dataclass(frozen=True)
class KVarNConfig:
    """One KVarN quantizer setting.

    k_bits, v_bits: code bits for keys and values.
    group_size: G, tokens per tile.
    sink: S, leading tokens kept in the model's dtype (None means G).
    iters: variance-normalization iterations.
    scale_dtype: storage dtype of the absorbed scales; "fp8" stores e4m3 bytes (codes <= 4 bits).
    tail_tokens: the newest tokens kept in the model's dtype beyond the tile being filled;
        a tile is quantized when it leaves this tail (a multiple of group_size; 0: as
        soon as it fills).
    rotate_keys, rotate_values: apply the Hadamard rotation (docs/algorithm.md, "Rotation").
        rotate_keys="auto" decides per kv head, at the first quantized tiles,
        whichever of rotated / unrotated keys gives the smaller score error.
    iters=0 with no rotation is plain per-channel-K / per-token-V RTN (KIVI-style).
    """

    k_bits: int = 4
    v_bits: int = 2
    group_size: int = 128
    sink: int | None = None
    iters: int = 8
    scale_dtype: str = "float16"
    rotate_keys: bool | str = True
    rotate_values: bool = True
    tail_tokens: int = 0

    def __post_init__(self):
        for name in ("k_bits", "v_bits"):
            if getattr(self, name) not in SUPPORTED_BITS:
                raise ValueError(
                    f"{name}={getattr(self, name)} is not supported; use one of {SUPPORTED_BITS}"
                )
        if self.group_size not in SUPPORTED_GROUP_SIZES:
            raise ValueError(
                f"group_size={self.group_size} is not supported; use one of {SUPPORTED_GROUP_SIZES}"
            )
        if self.sink is not None and self.sink < 0:
            raise ValueError(f"sink={self.sink} must be >= 0")
        t = self.tail_tokens
        if not isinstance(t, int) or isinstance(t, bool) or t < 0 or t % self.group_size:
            raise ValueError(
                f"tail_tokens={t!r} must be 0 or a positive multiple of the tile size "
                f"group_size={self.group_size} (e.g. {4 * self.group_size}): whole tiles leave "
                "the tail"
            )
        if self.iters < 0:
            raise ValueError(f"iters={self.iters} must be >= 0")
        if self.rotate_keys not in (True, False, "auto"):
            raise ValueError(f"rotate_keys={self.rotate_keys!r} must be True, False or 'auto'")
        if self.scale_dtype not in SCALE_DTYPES:
            raise ValueError(
                f"scale_dtype={self.scale_dtype!r} is not supported; use one of {SCALE_DTYPES}"
            )
        if self.scale_dtype == "fp8" and max(self.k_bits, self.v_bits) > FP8_MAX_BITS:
            raise ValueError(
                "scale_dtype='fp8' keeps 3 mantissa bits per scale: it suits codes of at most "
                f"{FP8_MAX_BITS} bits, not k_bits={self.k_bits}, v_bits={self.v_bits}; use float16 "
                "scales there"
            )

    @property
    def sink_size(self) -> int:
        return self.group_size if self.sink is None else self.sink

    @property
    def name(self) -> str:
        name = f"k{self.k_bits}v{self.v_bits}_g{self.group_size}"
        return name + "_auto" if self.rotate_keys == "auto" else name


# Every width pair at G = 128 with keys at least as wide as values (score
# errors pass through the softmax's exponential; value errors are averaged by
# it), then the other shipped settings. Any kXvY_gG[_auto] name is accepted by
# get_preset, listed here or not.
PRESETS = {
    **{
        f"k{kb}v{vb}_g128": KVarNConfig(k_bits=kb, v_bits=vb, group_size=128)
        for kb in SUPPORTED_BITS
        for vb in SUPPORTED_BITS
        if vb <= kb
    },
    "k4v2_g64": KVarNConfig(k_bits=4, v_bits=2, group_size=64),
    # Beyond the paper: key rotation chosen per kv head (values always rotated).
    "auto2": KVarNConfig(k_bits=2, v_bits=2, group_size=128, rotate_keys="auto"),
    "auto4v2": KVarNConfig(k_bits=4, v_bits=2, group_size=128, rotate_keys="auto"),
}
# k4v2_g128 with key rotation chosen per kv head: lower mean KL than k4v2_g128 at
# every context measured (benchmarks/results/fidelity_auto.md).
DEFAULT_PRESET = "auto4v2"
# Not a KVarN setting: the name the CLIs use for mlx-lm's plain float cache.
FP16 = "fp16"
# The newest tokens a cache keeps in full precision when the user sets none (make_cache,
# --kv-tail-tokens), by tile size: a 128-token tail is on the KL-bytes frontier of every
# model measured, at 4K and 16K (docs/results.md, "The precision tail"); 64-token tiles
# (k4v2_g64) were not measured with one. Presets as get_preset returns them, and the
# eval's methods, keep tail_tokens=0.
DEFAULT_TAIL_TOKENS = {128: 128}


def default_tail_words() -> str:
    """DEFAULT_TAIL_TOKENS in words, for help texts: "128 with 128-token tiles"."""
    return ", ".join(f"{n} with {g}-token tiles" for g, n in DEFAULT_TAIL_TOKENS.items())


_NAME = re.compile(r"k(\d+)v(\d+)_g(\d+)(_auto)?")


def get_preset(preset: "str | KVarNConfig", **overrides) -> KVarNConfig:
    """The named preset (or the given config), with any field overridden (e.g. sink=0, iters=16).
    Names are PRESETS' keys or kXvY_gG, with "_auto" for key rotation chosen per kv head
    (KVarNConfig.name). Overrides of None are ignored (a CLI option left unset)."""
    overrides = {k: v for k, v in overrides.items() if v is not None}
    if isinstance(preset, KVarNConfig):
        return replace(preset, **overrides)
    if preset in PRESETS:
        return replace(PRESETS[preset], **overrides)
    m = _NAME.fullmatch(preset) if isinstance(preset, str) else None
    named = None
    if m:
        kb, vb, g, auto = m.groups()
        try:
            named = KVarNConfig(
                k_bits=int(kb),
                v_bits=int(vb),
                group_size=int(g),
                rotate_keys="auto" if auto else True,
            )
        except ValueError:  # widths or G not supported: the message below lists what is
            pass
    if named is None:
        valid = ", ".join(PRESETS)
        raise ValueError(
            f"unknown KVarN preset {preset!r}; valid presets: {valid}, or any kXvY_gG or "
            f"kXvY_gG_auto with X, Y in {SUPPORTED_BITS} and G in {SUPPORTED_GROUP_SIZES} (or a "
            "KVarNConfig)"
        )
    return replace(named, **overrides)


def user_preset(preset, **overrides) -> KVarNConfig:
    """get_preset for a cache a user asks for by name (make_cache, the commands): without
    a tail_tokens of its own it keeps its tile size's DEFAULT_TAIL_TOKENS in full
    precision. A KVarNConfig is taken as it is."""
    config = get_preset(preset, **overrides)
    if isinstance(preset, str) and overrides.get("tail_tokens") is None:
        config = replace(config, tail_tokens=DEFAULT_TAIL_TOKENS.get(config.group_size, 0))
    return config


def tail_error(preset, tail_tokens):
    """None if the preset (the default one for fp16) takes this tail_tokens (None: the
    default, user_preset's); else KVarNConfig's message. The one check of --kv-tail-tokens."""
    if tail_tokens is None:
        return None
    try:
        get_preset(DEFAULT_PRESET if preset == FP16 else preset, tail_tokens=tail_tokens)
    except ValueError as e:
        return str(e)
    return None


def preset_error(name):
    """None if `name` names a KV cache the commands take: fp16 (mlx-lm's plain
    cache) or a preset get_preset knows; else the message saying what is valid.
    The one check of a preset name, for the CLI, the server and the chat app."""
    if name == FP16:
        return None
    try:
        get_preset(name)
    except ValueError as e:
        return f"{str(e).replace(' (or a KVarNConfig)', '')}; or {FP16} (mlx-lm's plain cache)"
    return None
