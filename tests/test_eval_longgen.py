"""python -m kvarn_mlx.eval longgen on a tiny model: end-of-sequence masked alike,
the plain cache against itself, the command end to end."""

import json

import mlx.core as mx
import numpy as np
import pytest

from kvarn_mlx.eval import longgen
from kvarn_mlx.eval.__main__ import main
from kvarn_mlx.eval.runner import kl, log_softmax
from model_folder import tiny_model_folder


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from kvarn_mlx.loader import load

    return load(str(tiny_model_folder(tmp_path_factory.mktemp("models") / "tiny")))


def test_end_of_sequence_never_wins(tiny):
    model, tok = tiny
    eos = sorted(tok.eos_token_ids)

    class EOSLover:  # a model whose favourite token is the end of sequence
        def __call__(self, x, cache=None):
            logits = model(x, cache=cache)
            return logits + mx.zeros((logits.shape[-1],)).at[mx.array(eos)].add(100.0)

    logits = longgen.NoEOS(EOSLover(), eos)(mx.array([[1, 2, 3]]))
    assert logits.dtype == mx.float32 and bool(mx.isfinite(logits).all())
    assert int(mx.argmax(logits[0, -1])) not in eos
    lp = log_softmax(logits)
    assert float(kl(lp, lp).sum()) == 0.0  # KL of a distribution to itself stays defined


def test_plain_cache_against_itself_differs_by_rounding_only(tiny):
    model, tok = tiny
    # Steps of many tokens against one at a time: float rounding, nothing else.
    res = longgen.longgen(model, tok, ["fp"], steps=300, prompts=1)
    r = res["methods"]["fp"]
    assert r["first_divergence"] == [None] and r["agreement"] == [1.0]
    assert np.max(r["kl"]) < 1e-5 and r["kl"][0] == 0


@pytest.mark.e2e
def test_cli_end_to_end_and_resume(tiny, tmp_path, monkeypatch):
    model, tok = tiny
    argv = [
        "--out",
        str(tmp_path),
        "--tag",
        "t",
        "longgen",
        "--methods",
        "k2v2_g128,mlxq4",
        "--steps",
        "300",
        "--prompts",
        "2",
        "--chunk",
        "64",
        "--checkpoint",
        str(tmp_path / "ck.jsonl"),
    ]
    first = main(argv, model=model, tokenizer=tok, model_name="tiny")
    saved = json.loads((tmp_path / "longgen_t.json").read_text())["result"]
    assert len(saved["prompts"]) == 2
    for name in ("k2v2_g128", "mlxq4"):
        r = saved["methods"][name]
        assert (
            len(r["kl"]) == 300 and len(r["first_divergence"]) == 2 and 0 <= r["agreement"][0] <= 1
        )
    # A prompt of ~40 tokens and 300 generated: tiles of generated tokens were read,
    # so KVarN is not exact.
    assert np.mean(saved["methods"]["k2v2_g128"]["kl"][200:]) > 0
    md = (tmp_path / "longgen_t.md").read_text()
    assert "| k2v2_g128 | 2/2 |" in md and "KL steps 256-300" in md
    assert (tmp_path / "longgen_kl_t.png").exists()
    # A second run with the same settings takes both prompts from the checkpoint.
    monkeypatch.setattr(
        longgen, "_one_prompt", lambda *a, **k: pytest.fail("ran a finished prompt again")
    )
    again = main(argv, model=model, tokenizer=tok, model_name="tiny")
    assert np.array_equal(again["methods"]["k2v2_g128"]["kl"], first["methods"]["k2v2_g128"]["kl"])
    # Fewer methods reuse the prompts too; a method the checkpoint lacks, or other settings, do not.
    fewer = main([*argv[:6], "mlxq4", *argv[7:]], model=model, tokenizer=tok, model_name="tiny")
    assert np.array_equal(fewer["methods"]["mlxq4"]["kl"], first["methods"]["mlxq4"]["kl"])
    for changed in ([*argv[:6], "mlxq4,k4v2_g128", *argv[7:]], [*argv[:8], "299", *argv[9:]]):
        with pytest.raises(pytest.fail.Exception, match="ran a finished prompt again"):
            main(changed, model=model, tokenizer=tok, model_name="tiny")


def test_prompt_count_checked(tiny, tmp_path):
    model, tok = tiny
    with pytest.raises(ValueError, match="--prompts 99: use 1 to"):
        main(["--out", str(tmp_path), "longgen", "--prompts", "99"], model=model, tokenizer=tok)


# On a model with more layers than waiting_tiles.PER_STEP, whose decoding quantizes a
# completed tile over a few steps. k2v2_g128 (steps of many tokens over tiles) by
# default. With -m slow: auto4v2 (one-token steps until every layer chose its key
# rotation), and mlxq4, an mlx-lm cache (its step ends: test_step_ends; its longgen
# run: test_cli_end_to_end_and_resume).
@pytest.mark.parametrize(
    "method",
    [
        "k2v2_g128",
        pytest.param("auto4v2", marks=pytest.mark.slow),
        pytest.param("mlxq4", marks=pytest.mark.slow),
    ],
)
def test_steps_ending_at_tiles_read_what_one_token_decoding_reads(tmp_path, method):
    from mlx_lm.models import cache as mlx_cache

    from kvarn_mlx import waiting_tiles
    from kvarn_mlx.eval.decode import _forced, _greedy
    from kvarn_mlx.eval.methods import make_caches
    from kvarn_mlx.eval.runner import for_model
    from kvarn_mlx.loader import load

    layers = waiting_tiles.PER_STEP + 2
    model, tok = load(str(tiny_model_folder(tmp_path / "m", num_hidden_layers=layers)))
    ids = longgen.prompt_ids(tok, longgen.QUESTIONS[0])
    traj, ref_lp = _greedy(model, ids, mlx_cache.make_prompt_cache(model), 420, 2048, "fp")
    one_caches = make_caches(model, method)
    one = _forced(model, ids, for_model(one_caches, "dequant"), traj, ref_lp, 2048, "one")
    caches = make_caches(model, method)
    ends = longgen.step_ends(caches, len(ids), len(traj) - 1)
    many = longgen.forced_steps(
        model, ids, for_model(caches, "dequant"), ends, traj, ref_lp, 2048, "many"
    )
    assert len(many[0]) == len(one[0]) == 420
    assert max(b - a for a, b in zip([len(ids), *ends], ends)) > 100  # steps of many tokens
    if method.startswith("auto"):  # each head's choice is one-token decoding's
        assert all(isinstance(c.rotate_k, mx.array) for c in caches)
        for a, b in zip(caches, one_caches):
            assert np.array_equal(np.array(a.rotate_k), np.array(b.rotate_k))
    np.testing.assert_allclose(many[0], one[0], rtol=1e-3, atol=1e-5)  # float rounding
    assert many[1:] == one[1:]
    assert np.mean(one[0][300:]) > 1e-6  # quantized tiles were read: a real comparison


def test_step_ends():
    from kvarn_mlx.cache import KVarNCache

    # the token before a tile ends: the tile completes in a decoding step
    assert longgen.step_ends([KVarNCache("k4v2_g128")], 100, 500) == [
        *(255, 256, 383, 384, 511, 512, 600)
    ]
    assert longgen.step_ends([KVarNCache("k4v2_g128")], 256, 128) == [383, 384]
    assert longgen.step_ends([object()], 100, 300) == [228, 356, 400]
    assert longgen.step_ends([object()], 100, 0) == []
    assert longgen.step_ends([KVarNCache("auto4v2")], 255, 2) == [256, 257]
