"""Fidelity on the embedded real model (SmolLM2-135M-Instruct), teacher-forced
over 1,024 tokens of CPython's pydoc text, against the fp cache's logits."""

import pytest

from kvarn_mlx.eval.fidelity import fidelity


@pytest.fixture(scope="module")
def kl_1024(smollm):
    model, tokenizer = smollm
    methods = ["k4v4_g128", "k4v2_g128", "k2v2_g128", "mlxq2", "plaink2", "auto2"]
    # The product's path: packed attention (where "auto" decides with real queries).
    res = fidelity(model, tokenizer, methods, [1024], attention_mode="packed")
    kl = {r["method"]: r["kl_mean"] for r in res["rows"]}
    print("mean KL at 1024 tokens:", {k: round(v, 4) for k, v in kl.items()})
    return kl


def test_more_bits_stay_closer_to_fp16(kl_1024):
    assert kl_1024["fp"] == 0
    assert kl_1024["k4v4_g128"] < kl_1024["k4v2_g128"] < kl_1024["k2v2_g128"]


def test_kvarn_2bit_beats_mlx_lm_quantized_cache_2bit(kl_1024):
    assert kl_1024["k2v2_g128"] < kl_1024["mlxq2"]


def test_auto_key_rotation_within_5_percent_of_the_better_fixed_variant(kl_1024):
    best = min(kl_1024["k2v2_g128"], kl_1024["plaink2"])
    assert kl_1024["auto2"] <= 1.05 * best
