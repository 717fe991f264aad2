"""python -m kvarn_mlx.eval longgen on a tiny model: end-of-sequence masked alike,
the plain cache against itself, the command end to end."""

import json

import mlx.core as mx
import numpy as np
import pytest

from kvarn_mlx.eval import longgen
from kvarn_mlx.eval.__main__ import main
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
    lp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    assert float((mx.exp(lp) * (lp - lp)).sum()) == 0.0  # KL of a distribution to itself stays defined


def test_plain_cache_against_itself_is_exact(tiny):
    model, tok = tiny
    res = longgen.longgen(model, tok, ["fp"], steps=40, prompts=1)
    r = res["methods"]["fp"]
    assert r["first_divergence"] == [None] and r["agreement"] == [1.0]
    assert np.all(np.asarray(r["kl"]) == 0)


def test_cli_end_to_end_and_resume(tiny, tmp_path, monkeypatch):
    model, tok = tiny
    argv = ["--out", str(tmp_path), "--tag", "t", "longgen", "--methods", "k2v2_g128,mlxq4", "--steps", "300",
            "--prompts", "2", "--chunk", "64", "--checkpoint", str(tmp_path / "ck.jsonl")]
    first = main(argv, model=model, tokenizer=tok, model_name="tiny")
    saved = json.loads((tmp_path / "longgen_t.json").read_text())["result"]
    assert len(saved["prompts"]) == 2
    for name in ("k2v2_g128", "mlxq4"):
        r = saved["methods"][name]
        assert len(r["kl"]) == 300 and len(r["first_divergence"]) == 2 and 0 <= r["agreement"][0] <= 1
    # A prompt of ~40 tokens and 300 generated: tiles of generated tokens were read, so KVarN is not exact.
    assert np.mean(saved["methods"]["k2v2_g128"]["kl"][200:]) > 0
    md = (tmp_path / "longgen_t.md").read_text()
    assert "| k2v2_g128 | 2/2 |" in md and "KL steps 256-300" in md
    assert (tmp_path / "longgen_kl_t.png").exists()
    # A second run with the same settings takes both prompts from the checkpoint.
    monkeypatch.setattr(longgen, "_one_prompt", lambda *a, **k: pytest.fail("ran a finished prompt again"))
    again = main(argv, model=model, tokenizer=tok, model_name="tiny")
    assert np.array_equal(again["methods"]["k2v2_g128"]["kl"], first["methods"]["k2v2_g128"]["kl"])


def test_prompt_count_checked(tiny, tmp_path):
    model, tok = tiny
    with pytest.raises(ValueError, match="--prompts 99: use 1 to"):
        main(["--out", str(tmp_path), "longgen", "--prompts", "99"], model=model, tokenizer=tok)
