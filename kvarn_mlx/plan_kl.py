"""What the planner says about quality: each cache's mean KL to the plain cache.

Without a profile it quotes only what was measured on that very model: for the
embedded models, the committed tables' mean KL (measured_kl.json, written by
benchmarks/measured_kl.py); any other model's caches are "not measured". With a
calibration profile of the model (python -m kvarn_mlx.calibrate), each preset
measured with the profile's settings gets mix.py's prediction (the sum of the
layers' KLs at its widths), and the calibrated mix joins the caches: the fewest
bytes predicting at most --max-kl, or else the least predicted KL within the
default preset's bytes. A profile is checked against the model's weights
(profile.check_model), so --profile loads them.
"""

import json
from dataclasses import dataclass
from importlib import resources

from mlx_lm.models.cache import make_prompt_cache

from .byte_models import PlanError
from .config import DEFAULT_PRESET, PRESETS


@dataclass
class Quality:
    """Per cache name, (KL, where it comes from); what is not known is absent."""

    kl: dict
    source: str  # what the figures are, for the legend
    reference: str = None  # the planner's cache the KLs are against (None: the model's dtype)
    mix: object = None  # mix.Mix of the profile, when one was given
    mix_configs: list = None  # its per-layer KVarNConfigs (None: layer left plain)
    mix_error: str = None  # why no mix could be chosen
    mix_kl: float = None  # the mix's predicted KL (at the plan's context, when given)


def measured(info):
    """Quality from the committed tables for an embedded model, else None."""
    if info.embedded is None:
        return None
    table = json.loads(resources.files("kvarn_mlx").joinpath("measured_kl.json").read_text())
    entry = table.get(info.embedded)
    if entry is None:
        return None
    kl = {name: (value, "measured") for name, value in entry["kl"].items()}
    return Quality(kl, f"measured: {entry['source']}", "plain (float32)")


def with_profile(path, model_arg, max_kl, base=None, context=None):
    """Quality from a calibration profile of the model (predicted), over the
    measured figures `base` (kept for the caches the profile does not predict).
    context: the tokens to predict the KL at (mix.predict), if the profile
    measured how the KL grows; else the KL near the calibration's length."""
    from . import integration, mix, profile
    from .loader import ModelLoadError, load

    try:
        p = profile.read(path)
    except profile.ProfileError as e:
        raise PlanError(f"--profile: {e}") from None
    try:
        model, _ = load(model_arg)  # in the dtype it was calibrated in
    except ModelLoadError as e:
        raise PlanError(f"--profile needs the model's weights to check the profile: {e}") from None
    layers, shapes = integration.quantizable_layers(model)
    try:
        profile.check_model(p, model, layers, str(path))
    except profile.ProfileError as e:
        raise PlanError(f"--profile: {e}") from None
    kl = dict(base.kl) if base else {}
    for name, config in PRESETS.items():
        predicted = mix.preset_kl(p, config)
        if predicted is not None:
            kl[name] = (mix.predict(p, predicted, context), "predicted")
    q = Quality(kl, _source(path, p, context) + (f"; {base.source}" if base else ""))
    target = {"bytes_like": DEFAULT_PRESET} if max_kl is None else {"max_kl": max_kl}
    try:
        q.mix, configs = mix.from_profile(
            model, p, layers, shapes, context=context, where=str(path), **target
        )
    except profile.ProfileError as e:
        q.mix, q.mix_error = None, str(e)
        return q
    q.mix_kl = mix.predict(p, q.mix.predicted_kl, context)
    q.mix_configs = [configs.get(i) for i in range(len(make_prompt_cache(model)))]
    return q


def _source(path, p, context):
    """What the predicted figures are, for the legend."""
    text = p.get("text") if isinstance(p.get("text"), dict) else {}
    where = ""
    if isinstance(text.get("measured_positions"), list) and isinstance(text.get("tokens"), int):
        a, b = text["measured_positions"]
        where = f", measured at positions {a:,}..{b:,} of a {text['tokens']:,}-token text"
    if "growth" not in p:
        # The committed mixed_widths tables (docs/results.md): without a growth measurement,
        # predictions hold near the calibration's length and fall behind as the context grows.
        return (
            f"predicted from {path} (the sum of its layers' KLs{where}; the profile has no "
            "growth measurement, so at longer contexts the measured KL is higher: "
            "python -m kvarn_mlx.calibrate --add-growth)"
        )
    if context is None:
        return (
            f"predicted from {path} (the sum of its layers' KLs{where}; give --context to "
            "scale it by the growth the profile measured)"
        )
    longest = max(int(c) for kls in p["growth"]["presets"].values() for c in kls)
    beyond = "" if context <= longest else ", extrapolated beyond"
    return (
        f"predicted from {path} at {context:,} tokens (the sum of its layers' KLs{where}, "
        f"scaled by how the KL grew with every layer quantized on the profile's text, measured "
        f"to {longest:,} tokens{beyond})"
    )
