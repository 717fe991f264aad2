"""python -m kvarn_mlx.eval tasks: the sandbox, the exact paired statistics,
answer parsing, and the command end to end on a tiny model (2 problems)."""

import json
import time

import pytest

from kvarn_mlx.eval import paired, sandbox, tasks
from kvarn_mlx.eval.__main__ import main
from model_folder import tiny_model_folder


@pytest.fixture(scope="module")
def problems():
    return tasks.load_problems()


# -- exact statistics ------------------------------------------------------------------------------


def test_clopper_pearson_known_values():
    # Closed forms: 0 of n -> upper 1 - (alpha/2)^(1/n); n of n -> lower (alpha/2)^(1/n).
    assert paired.clopper_pearson(0, 10) == pytest.approx((0.0, 1 - 0.025**0.1), abs=1e-9)
    assert paired.clopper_pearson(10, 10) == pytest.approx((0.025**0.1, 1.0), abs=1e-9)
    # Tabulated (R's binom.test): 5 of 10, 1 of 10, 7 of 20.
    assert paired.clopper_pearson(5, 10) == pytest.approx((0.187086, 0.812914), abs=1e-6)
    assert paired.clopper_pearson(1, 10) == pytest.approx((0.002529, 0.445016), abs=1e-6)
    assert paired.clopper_pearson(7, 20) == pytest.approx((0.153909, 0.592189), abs=1e-6)
    assert paired.clopper_pearson(0, 0) == (0.0, 1.0)


def test_mcnemar_exact_p():
    assert paired.mcnemar_p(1, 9) == pytest.approx(
        2 * 11 / 1024
    )  # 2 P(X <= 1), X ~ binomial(10, 1/2)
    assert paired.mcnemar_p(5, 5) == 1.0 and paired.mcnemar_p(0, 0) == 1.0
    assert paired.mcnemar_p(0, 6) == pytest.approx(2 / 64)


def test_paired_difference():
    # 20 problems: 12 both right, 1 lost, 5 gained, 2 both wrong.
    ref = [True] * 12 + [True] + [False] * 5 + [False] * 2
    got = [True] * 12 + [False] + [True] * 5 + [False] * 2
    d = paired.paired_difference(ref, got)
    assert (d["n"], d["lost"], d["gained"], d["difference"]) == (20, 1, 5, pytest.approx(0.2))
    # q = disagreement rate (6 of 20), p = share of disagreements gained (5 of 6)
    q_lo, q_hi = paired.clopper_pearson(6, 20, 0.025)
    p_lo, p_hi = paired.clopper_pearson(5, 6, 0.025)
    assert d["interval"] == pytest.approx((q_hi * (2 * p_lo - 1), q_hi * (2 * p_hi - 1)))
    assert d["interval"][0] < 0 < d["interval"][1]  # 5 against 1 is not significant
    assert d["p_value"] == pytest.approx(2 * 7 / 64)
    # No disagreement still leaves doubt: q's upper bound 1 - 0.0125^(1/20) either way.
    same = paired.paired_difference(ref, ref)
    bound = 1 - 0.0125 ** (1 / 20)
    assert same["difference"] == 0 and same["p_value"] == 1.0
    assert same["interval"] == pytest.approx((-bound, bound))
    with pytest.raises(ValueError, match="different lengths"):
        paired.paired_difference([True], [True, False])


def _coverage(n, q, p):
    """P(the interval holds the true difference q (2p - 1)), summed exactly over the
    disagreements m ~ binomial(n, q) and the gained c ~ binomial(m, p)."""
    from math import comb

    true, total = q * (2 * p - 1), 0.0
    for m in range(n + 1):
        for c in range(m + 1):
            ref = [True] * (n - c) + [False] * c
            got = [True] * (n - m) + [False] * (m - c) + [True] * c
            lo, hi = paired.paired_difference(ref, got)["interval"]
            if lo - 1e-12 <= true <= hi + 1e-12:
                p_m = comb(n, m) * q**m * (1 - q) ** (n - m)
                total += p_m * comb(m, c) * p**c * (1 - p) ** (m - c)
    return total


@pytest.mark.parametrize("q", [0.02, 0.1, 0.3, 0.7])
@pytest.mark.parametrize("p", [0.1, 0.5, 0.8])
def test_paired_interval_covers_the_difference(q, p):
    # Unconditional coverage, exactly: an interval conditional on the disagreements
    # alone covers 0.22 of the time at q = 0.02, p = 0.1 on 12 problems.
    assert _coverage(12, q, p) >= 0.95


# -- the sandbox -----------------------------------------------------------------------------------


def test_canonical_solution_passes_and_a_wrong_one_fails(problems):
    p = problems[0]
    assert len(problems) == 164
    assert sandbox.run(tasks.program(p, p["canonical_solution"])).passed
    wrong = sandbox.run(tasks.program(p, "    return False\n"))
    assert wrong.status == "failed" and "AssertionError" in wrong.output


def test_sandbox_kills_an_infinite_loop():
    t = time.perf_counter()
    out = sandbox.run("while True:\n    pass\n", timeout=1.0)
    assert out.status == "timeout" and time.perf_counter() - t < 5


def test_sandbox_limits_memory():
    out = sandbox.run("x = bytearray(3 << 30)\nprint('allocated')\n", memory_bytes=1 << 30)
    assert out.status == "failed" and "MemoryError" in out.output


def test_sandbox_blocks_the_network():
    out = sandbox.run("import socket\ns = socket.socket()\nprint('connected')\n")
    assert (
        out.status == "failed"
        and "network is disabled" in out.output
        and "connected" not in out.output
    )
    out = sandbox.run("import socket\nsocket.create_connection(('pypi.org', 443), timeout=2)\n")
    assert out.status == "failed" and "network is disabled" in out.output


def test_sandbox_blocks_files_outside_its_folder(tmp_path):
    outside = tmp_path / "outside.txt"
    out = sandbox.run(f"open({str(outside)!r}, 'w').write('x')\n")
    assert out.status == "failed" and "only files in the sandbox folder" in out.output
    assert not outside.exists()
    keep = tmp_path / "keep.txt"
    keep.write_text("mine")
    for code in [
        f"import os\nos.remove({str(keep)!r})",
        f"import shutil\nshutil.rmtree({str(tmp_path)!r})",
        f"import os\nos.system('rm {keep}')",
        "import subprocess\nsubprocess.run(['true'])",
    ]:
        assert sandbox.run(code).status == "failed", code
    assert keep.read_text() == "mine"
    # Inside its own folder a program may write and read back.
    assert sandbox.run(
        "open('scratch.txt', 'w').write('ok')\nassert open('scratch.txt').read() == 'ok'\n"
    ).passed


# -- prompts and answers ---------------------------------------------------------------------------


def test_program_takes_a_whole_function_or_a_body(problems):
    p = problems[2]  # truncate_number
    whole = (
        "Here it is:\n```python\ndef truncate_number(number: float) -> float:\n"
        "    return number % 1.0\n```\nDone."
    )
    assert sandbox.run(tasks.program(p, whole)).passed
    assert sandbox.run(tasks.program(p, "    return number % 1.0\n")).passed
    assert (
        sandbox.run(
            tasks.program(p, "```python\ndef truncate_number(number):\n    return 0.0\n```")
        ).status
        == "failed"
    )
    assert tasks.extract_code("```py\nx = 1\n") == "x = 1\n"  # an answer cut off inside its block


def test_code_closed():
    assert not tasks.code_closed("Sure:\n```python\ndef f():\n    return 1\n")
    assert tasks.code_closed("Sure:\n```python\ndef f():\n    return 1\n```")
    assert not tasks.code_closed("def f():\n    return 1\n")  # a bare body runs to the end


def test_batched_answers_stop_where_the_code_block_closes(monkeypatch):
    # A scripted model: each row writes its tokens, then repeats its last one. Row 0 closes a code
    # block at its 5th token and must end there (its cache returned); row 1 never does.
    import mlx.core as mx

    from kvarn_mlx.integration import make_cache
    from models import tiny_model, tokenizer

    model, tok = tiny_model("llama64"), tokenizer()
    script = [list(b"```\n```") + [ord("x")] * 20, list(b"abcdefgh") + [ord("y")] * 20]
    steps = {"n": 0}

    def fake(x, cache=None, **kw):
        logits = model(x, cache=cache, **kw)
        step = steps["n"]
        if x.shape[1] == 1:  # a decode step (prefill chunks come as longer inputs)
            steps["n"] += 1
        want = [s[min(step, len(s) - 1)] for s in script[: logits.shape[0]]]
        return (
            mx.where(mx.arange(logits.shape[-1]) == mx.array(want)[:, None, None], 100.0, -100.0)
            + 0 * logits
        )

    class Scripted:
        layers = model.layers

        def __call__(self, *a, **k):
            return fake(*a, **k)

    prompts = [[1, 2, 3], [4, 5, 6]]
    got = {
        i: (out, cache)
        for i, out, cache in tasks.answers(
            Scripted(), tok, "k4v2_g128", prompts, lambda: make_cache(model, "k4v2_g128"), 12, 64, 2
        )
    }
    outs, finals = [got[i][0] for i in (0, 1)], [got[i][1] for i in (0, 1)]
    assert bytes(outs[0]) == b"```\n```"
    assert len(outs[1]) == 12
    # Both rows hand back their own caches, the stopped one included, holding what they read.
    for final, n in zip(finals, (3 + 7, 3 + 12)):
        assert [type(c).__name__ for c in final] == ["KVarNCache"] * 2 and n - 1 <= final[
            0
        ].offset <= n


def test_a_finished_row_goes_to_the_next_prompt():
    # Continuous batching: three prompts through two rows. Each prompt gets its own cache when it
    # starts, is answered once, and its cache holds its prompt and answer.
    from kvarn_mlx.integration import make_cache
    from models import tiny_model, tokenizer

    model, tok = tiny_model("llama64"), tokenizer()
    prompts = [[1, 2, 3], [4, 5, 6, 7, 8], [9, 10]]
    made = []

    def new_cache():
        made.append(make_cache(model, "k4v2_g128"))
        return made[-1]

    got = list(tasks.answers(model, tok, "k4v2_g128", prompts, new_cache, 5, 64, 2))
    assert sorted(i for i, _, _ in got) == [0, 1, 2] and len(made) == 3
    for i, out, cache in got:
        assert 1 <= len(out) <= 5
        assert len(prompts[i]) + len(out) - 1 <= cache[0].offset <= len(prompts[i]) + len(out)


def test_select():
    probs = [{"task_id": f"HumanEval/{i}"} for i in range(164)]
    assert [p["task_id"] for p in tasks.select(probs, "2")] == ["HumanEval/0", "HumanEval/1"]
    assert [p["task_id"] for p in tasks.select(probs, "10:12")] == ["HumanEval/10", "HumanEval/11"]
    for bad in ("0", "5:5", "160:170", "x"):
        with pytest.raises(ValueError, match="--problems"):
            tasks.select(probs, bad)


# -- end to end ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from kvarn_mlx.loader import load

    folder = tiny_model_folder(tmp_path_factory.mktemp("models") / "tiny")
    return load(str(folder))


def test_prompt_parts_share_the_context(tiny, problems):
    _, tok = tiny
    context = tasks.context_ids(tok, 300)
    shared0, own0 = tasks.prompt_parts(tok, problems[0], None)
    shared1, own1 = tasks.prompt_parts(tok, problems[1], context)
    shared2, _ = tasks.prompt_parts(tok, problems[2], context)
    assert len(context) == 300 and shared0 == [] and shared1 == shared2
    assert tok.decode(own0).startswith("<|im_start|>") and "has_close_elements" in tok.decode(own0)
    assert tok.decode(own1).startswith("Complete the following") and tok.decode(own1).endswith(
        "assistant\n"
    )
    text = tok.decode(shared1)
    assert "for context" in text and text.endswith("\n```\n\n") and "argparse" in text


@pytest.mark.e2e
def test_cli_end_to_end_and_resume(tiny, tmp_path, monkeypatch):
    model, tok = tiny
    ck = tmp_path / "ck.jsonl"
    argv = [
        "--out",
        str(tmp_path),
        "--tag",
        "t",
        "tasks",
        "--methods",
        "k4v2_g128,mlxq4",
        "--problems",
        "2",
        "--prefix",
        "0,300",
        "--max-tokens",
        "6",
        "--batch",
        "2",
        "--checkpoint",
        str(ck),
    ]
    res = main(argv, model=model, tokenizer=tok, model_name="tiny")
    assert (
        res["methods"] == ["fp", "k4v2_g128", "mlxq4"]
        and len(ck.read_text().splitlines()) == 2 * 3 * 2
    )
    for prefix in ("0", "300"):
        for recs in res["results"][prefix].values():
            assert [r["task_id"] for r in recs] == ["HumanEval/0", "HumanEval/1"]
            assert all(
                r["answer_tokens"] <= 6 and r["status"] in ("passed", "failed") for r in recs
            )
    # Alone, the KVarN cache quantizes a tile of the ~200-token prompt at most; after 300 more, at
    # least two (the copied context's); mlx-lm's cache quantizes every token.
    alone, after = res["results"]["0"], res["results"]["300"]
    assert all(r["quantized_tokens"] == 0 for r in alone["fp"] + after["fp"])
    assert all(r["quantized_tokens"] >= 256 for r in after["k4v2_g128"])
    assert all(
        r["quantized_tokens"] >= r["prompt_tokens"] + r["answer_tokens"] - 1 for r in alone["mlxq4"]
    )
    assert after["k4v2_g128"][0]["prompt_tokens"] > alone["k4v2_g128"][0]["prompt_tokens"] + 300
    s = res["summary"]["0"]["k4v2_g128"]
    assert s["problems"] == 2 and 0 <= s["pass_at_1"] <= 1
    md = (tmp_path / "tasks_t.md").read_text()
    assert "## the problem alone" in md and "## after 300 tokens of unrelated Python source" in md
    assert "| k4v2_g128 | 4/2 |" in md and (tmp_path / "tasks_humaneval_t.png").exists()
    saved = json.loads((tmp_path / "tasks_t.json").read_text())
    assert (
        saved["meta"]["command"].startswith("python -m kvarn_mlx.eval")
        and saved["result"]["summary"]
    )
    assert saved["meta"]["attention"] == "packed"
    # A second run takes every problem from the checkpoint; more problems run only the new one.
    monkeypatch.setattr(
        tasks, "answers", lambda *a, **k: pytest.fail("generated a finished problem again")
    )
    again = main(argv, model=model, tokenizer=tok, model_name="tiny")
    assert again["results"] == res["results"]
    with pytest.raises(pytest.fail.Exception, match="generated a finished problem again"):
        main([*argv[:8], "3", *argv[9:]], model=model, tokenizer=tok, model_name="tiny")


@pytest.mark.slow
@pytest.mark.e2e
def test_embedded_model_answers_in_code(smollm, tmp_path):
    # SmolLM2-135M rarely passes HumanEval; what this checks is the real path: chat-template
    # prompts, batched KVarN and plain caches, answers that are Python functions, a context of
    # 1,024 tokens prefilled once.
    import ast

    model, tok = smollm
    res = main(
        [
            "--out",
            str(tmp_path),
            "tasks",
            "--methods",
            "auto4v2",
            "--problems",
            "3",
            "--prefix",
            "0,1024",
            "--max-tokens",
            "160",
            "--batch",
            "3",
        ],
        model=model,
        tokenizer=tok,
        model_name="SmolLM2-135M",
    )
    for prefix in ("0", "1024"):
        for m in ("fp", "auto4v2"):
            recs = res["results"][prefix][m]
            codes = [tasks.extract_code(r["answer"]) for r in recs]
            assert sum("def " in c for c in codes) >= 2, [r["answer"] for r in recs]
            parsed = 0
            for c in codes:
                try:
                    ast.parse(c)
                    parsed += 1
                except SyntaxError:
                    pass
            assert parsed >= 1
    after = res["results"]["1024"]["auto4v2"]
    assert all(r["quantized_tokens"] >= 1024 - 128 - 127 for r in after)
    print((tmp_path / "tasks.md").read_text())
