"""python -m kvarn_mlx.eval retrieval on a tiny model: prompts, scoring, intervals,
the first-chunk shortcut against running the model, the command end to end."""

import json
import random

import mlx.core as mx
import pytest

from kvarn_mlx.eval import retrieval
from kvarn_mlx.eval.__main__ import main
from kvarn_mlx.eval.methods import make_caches
from kvarn_mlx.eval.runner import for_model
from model_folder import tiny_model_folder


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from kvarn_mlx.loader import load

    folder = tiny_model_folder(tmp_path_factory.mktemp("models") / "tiny")
    return folder, *load(str(folder))


def test_wilson_known_values():
    assert retrieval.wilson(0, 10) == pytest.approx((0.0, 0.2775), abs=1e-4)
    assert retrieval.wilson(10, 10) == pytest.approx((0.7225, 1.0), abs=1e-4)
    assert retrieval.wilson(5, 10) == pytest.approx((0.2366, 0.7634), abs=1e-4)
    assert retrieval.wilson(0, 0) == (0.0, 1.0)
    # All right or all wrong: the interval holds 1 or 0 exactly (6/6 rounded to
    # 0.9999999999999999 once, and the table said the plain cache was outside its own interval).
    for n in range(1, 200):
        assert retrieval.wilson(n, n)[1] == 1.0 and retrieval.wilson(0, n)[0] == 0.0


def test_chunks_as_mlx_lm_generate_step():
    assert retrieval.chunks(5000, 2048) == [(0, 2048), (2048, 4096), (4096, 4999), (4999, 5000)]
    assert retrieval.chunks(2049, 2048) == [(0, 2048), (2048, 2049)]
    assert retrieval.chunks(1, 2048) == [(0, 1)]


def test_first_number():
    assert retrieval.first_number(" 48213. The") == "48213"
    assert retrieval.first_number(" 482135") == "482135"  # a longer number is not the secret
    assert retrieval.first_number(" the number") is None


@pytest.mark.parametrize("task", retrieval.TASKS)
@pytest.mark.parametrize("depth", [0.0, 0.5, 1.0])
def test_prompts(tiny, task, depth):
    _, _, tok = tiny
    ids, secret, where = retrieval.make_prompt(tok, task, 800, depth, random.Random(3))
    again = retrieval.make_prompt(tok, task, 800, depth, random.Random(3))
    assert (ids, secret, where) == again  # seeded: the same prompt for every method
    assert 760 <= len(ids) <= 800
    text = tok.decode(ids)
    assert len(secret) == 5 and text.count(secret) == (2 if task == "passkey" else 1)
    # The haystack has no digits: only the needles (and "4 colors") have some.
    assert sum(c.isdigit() for c in text) == (10 if task == "passkey" else 4 * 5 + 1)
    # The needle sits at the depth: within a sentence of it, measured in tokens.
    body_start, body_end = retrieval._encode(tok, "", "").__len__(), len(ids) - 30
    frac = (where - body_start) / (body_end - body_start)
    assert abs(frac - depth) < 0.12, frac
    if task == "multikey":
        asked = text.split("What is the secret number for ")[1].split("?")[0]
        assert f"The secret number for {asked} is {secret}." in text
        assert text.endswith(f"The secret number for {asked} is")


@pytest.mark.parametrize("method", ["kvarn2", "k2v2_g128"])
def test_first_chunk_from_plain_kv_equals_running_the_model(tiny, method):
    _, model, tok = tiny
    ids, *_ = retrieval.make_prompt(tok, "passkey", 700, 0.5, random.Random(0))
    fp = make_caches(model, "fp")
    grabbed = []
    retrieval.answer(
        model, ids, fp, 300, 4, on_first_chunk=lambda: grabbed.append(retrieval.first_chunk_kv(fp))
    )
    results = []
    for replay in (None, grabbed[0]):
        caches = make_caches(model, method)
        assert retrieval.replayable(caches)
        out = retrieval.answer(model, ids, for_model(caches, "dequant"), 300, 4, first_kv=replay)
        results.append((out, caches))
    (a, ca), (b, cb) = results
    assert a == b
    for x, y in zip(ca, cb):
        assert x.n_tiles >= 2  # tiles came from the replayed chunk and the ones after it
        for u, v in zip(x.held_arrays(), y.held_arrays()):
            assert u.shape == v.shape and mx.array_equal(u, v).item()


def test_plain_cache_is_not_replayed_into_mlx_lm_quantized_or_auto(tiny):
    _, model, _ = tiny
    assert not retrieval.replayable(make_caches(model, "mlxq4"))
    # An auto preset chooses its key rotation with the first chunk's queries, which a replay lacks.
    assert not retrieval.replayable(make_caches(model, "auto4v2"))


def test_summary_counts_and_interval():
    def rec(L, d, fp, m):
        return {
            "task": "passkey",
            "length": L,
            "depth": d,
            "answers": {"fp": {"right": fp}, "m": {"right": m}},
        }

    records = (
        [rec(100, 0.0, True, True)] * 6
        + [rec(100, 1.0, True, False)] * 3
        + [rec(200, 0.0, False, True)]
    )
    s = retrieval.summarize(records, ["fp", "m"], ["passkey"], [100, 200], [0.0, 1.0])["passkey"]
    assert (s["fp"]["right"], s["m"]["right"], s["m"]["trials"]) == (9, 7, 10)
    assert (s["m"]["lost_vs_fp"], s["m"]["gained_vs_fp"]) == (3, 1)
    assert s["m"]["cells"]["1.0|100"] == [0, 3] and s["m"]["per_length"]["200"] == [1, 1]
    lo, hi = retrieval.wilson(9, 10)
    assert s["m"]["within_fp_interval"] == (lo <= 0.7 <= hi)


@pytest.mark.e2e
def test_cli_end_to_end_and_resume(tiny, tmp_path, monkeypatch):
    folder, model, tok = tiny
    ck = tmp_path / "ck.jsonl"
    argv = [
        "--out",
        str(tmp_path),
        "--tag",
        "t",
        "retrieval",
        "--methods",
        "mlxq4,k4v2_g128",
        "--lengths",
        "300,500",
        "--depths",
        "0,1",
        "--trials",
        "1",
        "--prefill-step-size",
        "256",
        "--answer-tokens",
        "3",
        "--checkpoint",
        str(ck),
    ]
    res = main(argv, model=model, tokenizer=tok, model_name="tiny")
    assert len(res["records"]) == 2 * 2 * 2 and len(ck.read_text().splitlines()) == 8
    saved = json.loads((tmp_path / "retrieval_t.json").read_text())
    assert saved["result"]["summary"]["multikey"]["k4v2_g128"]["trials"] == 4
    assert {"retrieval_passkey_t.png", "retrieval_multikey_t.png"} <= {
        p.name for p in tmp_path.iterdir()
    }
    assert "| k4v2_g128 | 4/2 |" in (tmp_path / "retrieval_t.md").read_text()
    # A second run with the same settings takes every prompt from the checkpoint.
    monkeypatch.setattr(
        retrieval, "answer", lambda *a, **k: pytest.fail("ran a finished prompt again")
    )
    again = main(argv, model=model, tokenizer=tok, model_name="tiny")
    assert again["records"] == res["records"]
    # Fewer methods and a subset of the lengths reuse it too,
    # with the other methods' answers dropped.
    fewer = main(
        [*argv[:6], "k4v2_g128", "--lengths", "500", *argv[9:]],
        model=model,
        tokenizer=tok,
        model_name="tiny",
    )
    assert [r["answers"] for r in fewer["records"]] == [
        {m: r["answers"][m] for m in ("fp", "k4v2_g128")}
        for r in res["records"]
        if r["length"] == 500
    ]
    # A method the checkpoint lacks is not taken from it.
    with pytest.raises(pytest.fail.Exception, match="ran a finished prompt again"):
        main([*argv[:6], "k2v2_g128", *argv[7:]], model=model, tokenizer=tok, model_name="tiny")


def test_unknown_task(tiny, tmp_path):
    _, model, tok = tiny
    with pytest.raises(ValueError, match="unknown task 'needle'"):
        main(["--out", str(tmp_path), "retrieval", "--tasks", "needle"], model=model, tokenizer=tok)
