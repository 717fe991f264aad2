"""benchmarks/ttft.py --quick end to end on a tiny model folder: every method at
every context, in one run, with ratios against the plain cache of that run."""

import json

import pytest

from benchmark_scripts import load_benchmark
from model_folder import tiny_model_folder

pytestmark = pytest.mark.e2e


@pytest.mark.slow  # the prefill it times is checked in tests/test_prefill.py
def test_ttft_quick(tmp_path):
    ttft = load_benchmark("ttft")
    folder = tiny_model_folder(tmp_path / "model")
    out = tmp_path / "results"
    assert ttft.main(["--quick", "--model", str(folder), "--out", str(out)]) == 0
    data = json.loads((out / "ttft.json").read_text())
    contexts = [int(c) for c in ttft.QUICK["contexts"].split(",")]
    methods = ttft.methods_default()
    assert [(r["context"], r["method"]) for r in data["rows"]] == [
        (c, m) for c in contexts for m in methods
    ]
    assert data["chunk"] == ttft.QUICK["chunk"] < max(contexts)  # the prefill really is chunked
    for r in data["rows"]:
        assert (
            r["ttft_s"] > 0
            and len(r["first_steps_s"]) == 3
            and all(s > 0 for s in r["decode_step_s"])
        )
        assert len(r["tokens"]) == ttft.QUICK["steps"] + 1
        assert r["cache_bytes"] > 0 and r["peak_memory"] > 0
        base = next(
            b for b in data["rows"] if b["context"] == r["context"] and b["method"] == ttft.PLAIN
        )
        assert r["ttft_vs_plain"] == pytest.approx(r["ttft_s"] / base["ttft_s"])
        assert r["first_step_vs_plain"] == pytest.approx(
            r["first_steps_s"][0] / base["first_steps_s"][0]
        )
    md = (out / "ttft.md").read_text()
    assert "python benchmarks/ttft.py --quick" in md and "OpenBLAS preloaded" in md
    assert md.count("\n| ") == 1 + len(contexts) * len(methods)  # header + one row each
    assert (out / "ttft.png").stat().st_size > 0


def test_ttft_rejects_unknown_method(tmp_path):
    with pytest.raises(SystemExit):
        load_benchmark("ttft").main(["--quick", "--methods", "nope", "--out", str(tmp_path)])


@pytest.mark.slow  # test_ttft_quick runs the same script; this adds its --separate processes
def test_ttft_quick_separate_processes(tmp_path):
    # --separate: every method in a process of its own, each with its process peak.
    ttft = load_benchmark("ttft")
    folder = tiny_model_folder(tmp_path / "model")
    out = tmp_path / "results"
    argv = [
        "--quick",
        "--separate",
        "--methods",
        "plain,k2v2_g128",
        "--model",
        str(folder),
        "--out",
        str(out),
    ]
    assert ttft.main(argv) == 0
    data = json.loads((out / "ttft.json").read_text())
    assert data["separate"] and [r["method"] for r in data["rows"]] == ["plain", "k2v2_g128"] * 2
    for r in data["rows"]:
        assert r["process_peak"] >= r["process_peak_before_run"] > 0
        assert len(r["tokens"]) == ttft.QUICK["steps"] + 1 and r["cache_bytes"] > 0
        base = next(
            b for b in data["rows"] if b["context"] == r["context"] and b["method"] == ttft.PLAIN
        )
        assert r["process_peak_vs_plain"] == pytest.approx(r["process_peak"] / base["process_peak"])
    assert "process peak MiB" in (out / "ttft.md").read_text()
