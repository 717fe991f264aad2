"""Calibration profiles: how much each layer of one model minds KVarN at each
key and value width, measured by `python -m kvarn_mlx.calibrate`, as JSON.

    profile = read(path)              # the file's structure checked: nothing else is needed
    check_model(profile, model, layers)   # made with this model, every KVarN layer measured
    write(path, profile)              # atomically; never over a file that is not a profile

A profile holds, per layer that make_cache turns into a KVarNCache, the mean KL
to the plain cache when only that layer's keys (or only its values) are
quantized at each width ("k": {"2": kl, ...}, "v": {...}; null where the
layer's head dim cannot hold that width). A profile may also measure the
narrow widths with one-byte (e4m3) scales ("fp8_widths", and per layer
"k_fp8", "v_fp8"): a layer stored that way is cheaper, which is what lets a
mix at the narrowest preset's bytes widen some other layer. It may also hold
"growth": two presets' mean KL measured with every layer quantized at several
context lengths, which lets mix.predict scale the layers' sum to a context
(the KL grows with the tokens quantized). Every failure is a
ProfileError whose message names the problem and the fix.
"""

import hashlib
import json
import math
from dataclasses import replace
from pathlib import Path

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten

from .atomic_json import check_target, write_json
from .config import FP8_MAX_BITS, PRESETS, SUPPORTED_BITS, KVarNConfig

FORMAT = "kvarn-mlx-profile"
FORMAT_VERSION = 1
SIDES = ("k", "v")
# The settings a profile's widths were measured with; a mix uses the same.
SETTINGS = ("group_size", "sink", "iters", "scale_dtype", "rotate_keys", "rotate_values")
_SAMPLE = 64  # elements read from each end of every parameter for the fingerprint


class ProfileError(ValueError):
    pass


def fingerprint(model) -> str:
    """A hash of what the model computes: its config, class, and every parameter's
    name, shape, dtype and first and last elements. Computed from the model
    object alone, so make_cache can check a profile without knowing where the
    model was loaded from (a fine-tune of the same architecture gets another)."""
    h = hashlib.sha256()
    args = getattr(model, "args", None)
    fields = vars(args) if args is not None and hasattr(args, "__dict__") else {}
    h.update(json.dumps(fields, sort_keys=True, default=str).encode())
    h.update(f"{type(model).__module__}.{type(model).__name__}".encode())
    params = sorted(tree_flatten(model.parameters()), key=lambda kv: kv[0])
    ends = []
    for name, x in params:
        h.update(f"{name}:{tuple(x.shape)}:{x.dtype}".encode())
        flat = x.reshape(-1)
        ends.append(
            mx.concatenate([flat[:_SAMPLE], flat[-_SAMPLE:]]).astype(mx.float32)
            if mx.issubdtype(x.dtype, mx.floating)
            else mx.concatenate([flat[:_SAMPLE], flat[-_SAMPLE:]]).astype(mx.int64)
        )
    mx.eval(ends)
    for e in ends:
        h.update(np.array(e).tobytes())
    return h.hexdigest()[:32]


def settings_config(settings, k_bits, v_bits, fp8=False) -> KVarNConfig:
    """The KVarNConfig of widths k_bits/v_bits with a profile's settings
    (fp8: with one-byte scales instead of the profile's scale dtype)."""
    c = KVarNConfig(k_bits=k_bits, v_bits=v_bits, **{k: settings[k] for k in SETTINGS})
    return replace(c, scale_dtype="fp8") if fp8 else c


def fp8_widths(p) -> list:
    """The widths profile p measured with one-byte scales too (may be none)."""
    return p.get("fp8_widths") or []


def side_key(side, fp8=False) -> str:
    """The field of a layer entry holding one side's KLs: "k", "v", "k_fp8" or "v_fp8"."""
    return side + "_fp8" if fp8 else side


def measured(entry, side, fp8=False) -> dict:
    """One layer's {width: KL} for keys ("k") or values ("v"), with one-byte scales if fp8."""
    return entry[side_key(side, fp8)]


# -- reading -------------------------------------------------------------------------


def read(path) -> dict:
    """The profile in the file `path`, once its structure is known to be sound:
    format and version, the settings, the widths (each one KVarN supports) and,
    for every layer, a KL (a finite number >= 0, or null) at every width."""
    path = Path(path).expanduser()
    if not path.is_file():
        raise ProfileError(
            f"no profile file at {path}; make one with python -m kvarn_mlx.calibrate --out {path}"
        )
    try:
        p = json.loads(path.read_text())
    except (ValueError, UnicodeDecodeError) as e:
        raise ProfileError(
            f"{path} is not JSON ({e}); pass a file written by python -m kvarn_mlx.calibrate"
        ) from None
    if not isinstance(p, dict) or p.get("format") != FORMAT:
        raise ProfileError(
            f'{path} is not a kvarn-mlx profile (no "format": "{FORMAT}"); '
            "pass a file written by python -m kvarn_mlx.calibrate"
        )
    if p.get("format_version") != FORMAT_VERSION:
        raise ProfileError(
            f"{path} has profile format version {p.get('format_version')!r}; this version reads "
            f"{FORMAT_VERSION}. Calibrate again"
        )
    validate(p, str(path))
    return p


def validate(p, where="the profile"):
    """Raise ProfileError unless p has every field a mix needs, each well formed."""

    def bad(msg):
        raise ProfileError(f"{where}: {msg}; calibrate again (python -m kvarn_mlx.calibrate)")

    model = p.get("model")
    if not isinstance(model, dict) or not isinstance(model.get("fingerprint"), str):
        bad("no model fingerprint")
    widths = p.get("widths")
    if not isinstance(widths, list) or not widths:
        bad("no widths")
    for w in widths:
        if w not in SUPPORTED_BITS or isinstance(w, bool):
            bad(f"width {w!r} is not one KVarN supports ({', '.join(map(str, SUPPORTED_BITS))})")
    settings = p.get("settings")
    if not isinstance(settings, dict) or any(k not in settings for k in SETTINGS):
        bad(f"settings must name {', '.join(SETTINGS)}")
    try:
        settings_config(settings, widths[0], widths[0])
    except (TypeError, ValueError) as e:
        bad(f"settings are not a KVarN setting ({e})")
    fp8 = p.get("fp8_widths", [])
    if not isinstance(fp8, list):
        bad("fp8_widths must be a list of widths")
    for w in fp8:
        if w not in SUPPORTED_BITS or isinstance(w, bool) or w > FP8_MAX_BITS:
            bad(f"fp8 width {w!r}: one-byte scales take widths of 2 to {FP8_MAX_BITS} bits")
    if fp8 and settings["scale_dtype"] == "fp8":
        bad("fp8_widths in a profile whose settings already store one-byte scales")
    layers = p.get("layers")
    if not isinstance(layers, list) or not layers:
        bad("no layers")
    seen = set()
    for entry in layers:
        i = entry.get("layer") if isinstance(entry, dict) else None
        if not isinstance(i, int) or isinstance(i, bool) or i < 0 or i in seen:
            bad(f"layer entry {entry!r} has no index, or a repeated one")
        seen.add(i)
        for side in SIDES:
            _check_kls(bad, f"layer {i} {side!r}", entry.get(side), widths)
            if fp8:
                key = side_key(side, True)
                _check_kls(bad, f"layer {i} {key!r}", entry.get(key), fp8)
    if "growth" in p:
        _check_growth(bad, p["growth"])


def _check_growth(bad, g):
    """The optional "growth" field: {"presets": {name: {"L": measured mean KL}}}."""
    presets = g.get("presets") if isinstance(g, dict) else None
    if not isinstance(presets, dict) or not presets:
        bad('"growth" must hold "presets": {preset: {context: KL}}')
    for name, kls in presets.items():
        if name not in PRESETS:
            bad(f"growth: {name!r} is not a preset")
        if not isinstance(kls, dict) or not kls:
            bad(f"growth {name!r}: no measurements")
        for key, kl in kls.items():
            if not key.isdigit() or int(key) < 1:
                bad(f"growth {name!r}: context {key!r} is not a number of tokens")
            if not _is_kl(kl):
                bad(f"growth {name!r} at {key}: KL {kl!r} is not a number >= 0")


def _is_kl(x) -> bool:
    """Whether x is a measured KL: a finite number >= 0 (not a bool)."""
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) and x >= 0


def _check_kls(bad, what, kls, widths):
    if not isinstance(kls, dict):
        bad(f"{what}: no measurements")
    for key in kls:
        if not key.isdigit() or int(key) not in SUPPORTED_BITS:
            bad(
                f"{what}: width {key!r} is not one KVarN supports "
                f"({', '.join(map(str, SUPPORTED_BITS))})"
            )
    for w in widths:
        kl = kls.get(str(w), "missing")
        if kl == "missing":
            bad(f"{what} has no measurement at width {w}")
        if kl is not None and not _is_kl(kl):
            bad(f"{what} width {w}: KL {kl!r} is not a number >= 0")
    if all(kls[str(w)] is None for w in widths):
        bad(f"{what} has no width it can hold")


def check_model(p, model, layers, where="the profile"):
    """Refuse a profile made with another model, or one that leaves out (or adds)
    a layer make_cache quantizes. layers: the indices of those layers."""
    fp = fingerprint(model)
    if p["model"]["fingerprint"] != fp:
        raise ProfileError(
            f"{where} was calibrated on {p['model'].get('model', 'another model')} "
            f"({p['model'].get('model_layers', '?')} layers), not on the model loaded now; "
            "calibrate this model (python -m kvarn_mlx.calibrate --model ...) or pass its profile"
        )
    have = {e["layer"] for e in p["layers"]}
    missing, extra = sorted(set(layers) - have), sorted(have - set(layers))
    if missing or extra:
        what = (
            f"has no measurements for layer(s) {missing}"
            if missing
            else f"measures layer(s) {extra}, which this model's cache does not quantize"
        )
        raise ProfileError(f"{where} {what}; calibrate again (python -m kvarn_mlx.calibrate)")


def flags(profile, bytes_like, max_kl, default_bytes_like, tail_tokens=None, context=None):
    """(profile, bytes_like, max_kl, context) for make_cache from the CLIs'
    --kv-profile, --kv-bytes-like, --kv-max-kl and --kv-context, the profile file's
    structure checked (no model needed); (None, None, None, None) without a
    profile. Without either target, the widths match default_bytes_like's bytes.
    tail_tokens (--kv-tail-tokens) is checked against the profile's tile size,
    which replaces the preset's.
    Raises ValueError naming the flag."""
    if profile is None:
        if bytes_like is not None or max_kl is not None:
            raise ValueError(
                "--kv-bytes-like and --kv-max-kl choose widths from a calibration profile: "
                "pass --kv-profile PROFILE.json too"
            )
        if context is not None:
            raise ValueError(
                "--kv-context is the context --kv-max-kl holds at: pass --kv-profile "
                "PROFILE.json and --kv-max-kl too"
            )
        return None, None, None, None
    if bytes_like is not None and max_kl is not None:
        raise ValueError(
            "--kv-bytes-like and --kv-max-kl: give one (a preset's bytes, or a KL target)"
        )
    if max_kl is not None and not (math.isfinite(max_kl) and max_kl > 0):
        raise ValueError(f"--kv-max-kl {max_kl}: give a KL in nats > 0, e.g. 0.005")
    if context is not None and max_kl is None:
        raise ValueError(
            "--kv-context is the context --kv-max-kl holds at; --kv-bytes-like does not "
            "depend on it: give --kv-max-kl, or leave --kv-context out"
        )
    if context is not None and context <= 0:
        raise ValueError(f"--kv-context {context}: give the context length in tokens, e.g. 32768")
    if max_kl is None and bytes_like is None:
        bytes_like = default_bytes_like
    if bytes_like is not None:
        from .config import get_preset

        try:
            get_preset(bytes_like)
        except ValueError as e:
            raise ValueError(f"--kv-bytes-like: {e}") from None
    try:
        settings = read(profile)["settings"]
    except ProfileError as e:
        raise ValueError(f"--kv-profile: {e}") from None
    if tail_tokens is not None:
        try:
            replace(settings_config(settings, 2, 2), tail_tokens=tail_tokens)
        except ValueError as e:
            raise ValueError(f"--kv-tail-tokens with --kv-profile {profile}: {e}") from None
    return profile, bytes_like, max_kl, context


def from_settings(settings, default_bytes_like):
    """flags() of parsed CLI settings
    (kv_profile, kv_bytes_like, kv_max_kl, kv_context; absent ones are None)."""
    return flags(
        getattr(settings, "kv_profile", None),
        getattr(settings, "kv_bytes_like", None),
        getattr(settings, "kv_max_kl", None),
        default_bytes_like,
        getattr(settings, "kv_tail_tokens", None),
        getattr(settings, "kv_context", None),
    )


# -- writing -------------------------------------------------------------------------


def is_profile(path) -> bool:
    try:
        return json.loads(Path(path).read_text()).get("format") == FORMAT
    except (OSError, ValueError, AttributeError, UnicodeDecodeError):
        return False


def check_writable(path) -> Path:
    """The path, once a profile can be written there (call it before the long measurement)."""
    return check_target(path, is_profile, "profile", ProfileError)


def write(path, p) -> Path:
    """Write profile p to `path` atomically (a temp file in the same folder, then a rename)."""
    validate(p)
    path = check_writable(path)
    return write_json(path, p)
