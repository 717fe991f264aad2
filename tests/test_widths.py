"""The "auto" key rotation at every code width: it decides per kv head and does
as well as the better of rotated and plain keys (2 and 4 bits: test_auto_rotation.py)."""

from dataclasses import replace

import pytest

from kvarn_mlx import get_preset
from models import tokens
from test_auto_rotation import mean_kl, outlier_model, rotated_heads


@pytest.mark.parametrize("bits", [3, 5, 6, 8])
def test_auto_key_rotation_at_every_width(bits):
    auto = get_preset(f"k{bits}v{bits}_g64_auto", sink=64)
    assert auto.rotate_keys == "auto" and auto.k_bits == bits
    model, toks = outlier_model("qwen2_bias"), tokens(640)
    kl = {
        name: mean_kl(model, toks, cfg)
        for name, cfg in {
            "kvarn": replace(auto, rotate_keys=True),
            "plain_keys": replace(auto, rotate_keys=False),
            "auto": auto,
        }.items()
    }
    summary = rotated_heads(kl["auto"][1])
    assert all(s is not None for s in summary), summary  # every layer decided
    print(
        f"\nk{bits}v{bits}: mean KL { ({k: f'{v[0]:.2e}' for k, v in kl.items()}) }, rotated heads "
        f"{summary}"
    )
    assert kl["auto"][0] <= 1.10 * min(kl["kvarn"][0], kl["plain_keys"][0])
