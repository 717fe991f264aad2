"""python -m kvarn_mlx.bench and the tuning file it writes (kvarn_mlx/tuning.py):
the short form runs and writes a file that passes the reader's checks; a file's
choice changes which attention function a step runs, in this process and at the
next start; a malformed or foreign file is ignored with one log line."""

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import pytest

import metal_emulator
from kvarn_mlx import attention, bench, dispatch, kernels, prefill, tuning
from kvarn_mlx.config import get_preset

ROOT = Path(__file__).resolve().parents[1]
DEVICE = mx.default_device().type.name


def run(args, env=None):
    """A command with these environment variables (None: unset)."""
    e = {**os.environ, "PYTHONPATH": str(ROOT), **(env or {})}
    e = {k: v for k, v in e.items() if v is not None}
    return subprocess.run(
        [sys.executable, *args], capture_output=True, text=True, env=e, cwd=ROOT, timeout=300
    )


@pytest.fixture
def constants(monkeypatch):
    """Whatever a test applies is undone after it."""
    monkeypatch.setattr(prefill, "MIN_QUERIES", dict(prefill.MIN_QUERIES))
    monkeypatch.setattr(dispatch, "CPU_STREAMS", dispatch.CPU_STREAMS)
    monkeypatch.setattr(attention, "MIN_STREAM_TILES", attention.MIN_STREAM_TILES)
    monkeypatch.setattr(kernels, "_ATT_TARGET_GROUPS", kernels._ATT_TARGET_GROUPS)


@pytest.mark.e2e
def test_quick_bench_writes_a_tuning_file_it_reads_back(tmp_path):
    out = tmp_path / "tuning.json"
    r = run(["-m", "kvarn_mlx.bench", "--contexts", "2048,8192", "--quick", "--out", str(out)])
    assert r.returncode == 0, r.stderr
    data = tuning.read(out)  # the reader's checks: this machine, this MLX, valid choices
    assert data["device"] == DEVICE and data["mlx"] == mx.__version__
    assert set(data["choices"]) >= {"min_queries"}
    assert {row["context"] for row in data["figures"]["attention_ms"]} == {2048, 8192}
    assert all(
        row[k] > 0
        for row in data["figures"]["attention_ms"]
        for k in ("plain", "dequantized", "ops")
    )
    for line in (
        "| machine |",
        "| MLX | " + mx.__version__,
        "| context | queries |",
        "| min_queries |",
        str(out),
    ):
        assert line in r.stdout
    assert [p.name for p in tmp_path.iterdir()] == ["tuning.json"]  # no temp file left


def test_bench_refuses_to_overwrite_a_file_it_did_not_write(tmp_path, capsys):
    out = tmp_path / "notes.json"
    out.write_text('{"mine": 1}\n')
    with pytest.raises(tuning.TuningError, match="not a kvarn-mlx tuning file"):
        tuning.write(out, DEVICE, {"min_queries": 4}, {})
    assert out.read_text() == '{"mine": 1}\n'
    assert bench.main(["--quick", "--out", str(out)]) == 2  # before measuring anything
    assert "refusing to overwrite" in capsys.readouterr().err
    assert out.read_text() == '{"mine": 1}\n'


def spy(monkeypatch):
    """Which attention function each step runs: 'dequantized' or 'ops'."""
    calls = []
    deq, ops = prefill.attend_dequantized, attention.attend
    monkeypatch.setattr(
        prefill, "attend_dequantized", lambda *a, **k: calls.append("dequantized") or deq(*a, **k)
    )
    monkeypatch.setattr(attention, "attend", lambda *a, **k: calls.append("ops") or ops(*a, **k))
    return calls


def test_a_tuning_file_changes_which_path_a_chunk_takes(tmp_path, monkeypatch, constants):
    monkeypatch.setattr(dispatch, "use_metal", lambda: False)  # the ops path below the threshold
    c = bench.Context(128 + 2 * 128 + 3, get_preset("k4v2_g128"), (1, 4, 2, 64), mx.float32)
    q, view, _, _ = c.step(4)
    calls = spy(monkeypatch)
    attention.attend_view(q, view, 0.125, "causal")
    assert calls == ["ops"]  # 4 queries: below the shipped threshold (16 on CPU, 9 on a GPU)

    path = tuning.write(tmp_path / "tuning.json", DEVICE, {"min_queries": 4}, {})
    assert tuning.apply(path) == {"min_queries": 4}
    attention.attend_view(q, view, 0.125, "causal")
    q3, view3, _, _ = c.step(3)
    attention.attend_view(q3, view3, 0.125, "causal")
    assert calls == ["ops", "dequantized", "ops"]


@pytest.mark.e2e
def test_the_next_start_reads_the_file(tmp_path, monkeypatch):
    path = tuning.write(tmp_path / "tuning.json", DEVICE, {"min_queries": 5}, {})
    show = ["-c", "import kvarn_mlx; from kvarn_mlx import prefill; print(prefill.MIN_QUERIES)"]
    home = {
        "KVARN_MLX_HOME": str(tmp_path),
        "KVARN_MLX_TUNING": None,
    }  # the default: $KVARN_MLX_HOME/tuning.json
    r = run(show, home)
    assert r.returncode == 0 and f"'{DEVICE}': 5" in r.stdout, r.stderr
    path.write_text("{not json")
    r = run(show, home)
    assert r.returncode == 0 and f"'{DEVICE}': {tuning.DEFAULTS[DEVICE]['min_queries']}" in r.stdout
    assert r.stderr.count("ignoring the tuning file") == 1
    monkeypatch.setenv("KVARN_MLX_TUNING", str(path))
    assert tuning.default_path() == path
    monkeypatch.setenv("KVARN_MLX_TUNING", "")  # none (what conftest sets for every test)
    assert tuning.default_path() is None


def good():
    return {
        "kind": tuning.KIND,
        "format": tuning.FORMAT,
        **tuning.machine(),
        "device": "cpu",
        "choices": {"min_queries": 3, "cpu_streams": 1, "min_stream_tiles": 8},
        "figures": {},
    }


BAD = {
    "not JSON": ("{", "cannot read it"),
    "another kind": ({"kind": "other"}, "not a kvarn-mlx tuning file"),
    "another format": ({"format": 99}, "format 99"),
    "another MLX": ({"mlx": "0.0.1"}, "measured with mlx '0.0.1'"),
    "another chip": ({"chip": "Apple M9"}, "measured with chip 'Apple M9'"),
    "another device type": ({"device": "tpu"}, "device 'tpu'"),
    "unknown choice": ({"choices": {"min_queries": 3, "turbo": 1}}, "unknown choice 'turbo'"),
    "zero": ({"choices": {"min_queries": 0}}, "min_queries=0"),
    "a string": ({"choices": {"min_queries": "9"}}, "min_queries='9'"),
    "a bool": ({"choices": {"cpu_streams": True}}, "cpu_streams=True"),
    "a GPU choice in a CPU file": ({"choices": {"target_groups": 128}}, "is for the gpu"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_a_malformed_or_foreign_file_is_ignored_with_one_log_line(
    tmp_path, caplog, constants, case
):
    change, reason = BAD[case]
    path = tmp_path / "tuning.json"
    path.write_text(change if isinstance(change, str) else json.dumps({**good(), **change}))
    before = {d: tuning.current(d) for d in ("cpu", "gpu")}
    with caplog.at_level(logging.WARNING, logger="kvarn_mlx.tuning"):
        assert tuning.apply(path) is None
    assert {d: tuning.current(d) for d in ("cpu", "gpu")} == before
    assert len(caplog.records) == 1 and reason in caplog.records[0].getMessage()


def test_a_good_file_sets_every_choice_for_its_device_type(tmp_path, constants):
    path = tmp_path / "tuning.json"
    path.write_text(json.dumps(good()))
    assert tuning.apply(path) == {"min_queries": 3, "cpu_streams": 1, "min_stream_tiles": 8}
    assert tuning.current("cpu") == {
        **tuning.DEFAULTS["cpu"],
        "min_queries": 3,
        "cpu_streams": 1,
        "min_stream_tiles": 8,
    }
    assert tuning.current("gpu")["min_queries"] == tuning.DEFAULTS["gpu"]["min_queries"]
    assert tuning.apply(tmp_path / "missing.json") is None


def row(L, deq, ops, kernel=None, ctx=2048):
    return {
        "context": ctx,
        "queries": L,
        "plain": 1.0,
        "dequantized": deq,
        "ops": ops,
        "kernel": kernel,
    }


def test_min_queries_is_where_the_dequantized_path_wins_from_on():
    rows = [row(1, 5, 1), row(4, 5, 4), row(8, 5, 6), row(16, 5, 9)]
    assert bench.choose_min_queries(rows, 16) == 8
    # summed over contexts: at 8 queries the packed path wins overall
    assert (
        bench.choose_min_queries(rows + [row(8, 9, 1, ctx=8192), row(16, 1, 2, ctx=8192)], 16) == 16
    )
    # the kernel, where it serves, is what the dequantized path competes with
    assert (
        bench.choose_min_queries([row(1, 5, 9, kernel=1), row(8, 5, 9, kernel=2), row(9, 5, 9)], 16)
        == 9
    )
    assert bench.choose_min_queries([row(1, 5, 1), row(16, 5, 2)], 16) == 16  # never: the default
    assert bench.choose_min_queries([row(1, 1, 5), row(16, 5, 9)], 16) == 1


def test_streams_split_from_where_two_are_faster_at_every_larger_count():
    d = {"min_stream_tiles": 4}
    rows = lambda *pairs: [{"tiles": n, "one": o, "split": s} for n, o, s in pairs]
    assert bench.choose_streams(rows((2, 1, 2), (4, 2, 1), (8, 3, 2), (63, 9, 5)), d) == (2, 2)
    assert bench.choose_streams(rows((2, 1, 0.5), (4, 2, 3), (8, 3, 2), (63, 9, 5)), d) == (2, 4)
    assert bench.choose_streams(rows((2, 1, 0.5), (63, 5, 9)), d) == (1, 4)


def test_reference_check_holds_the_attention_kernel_to_numpy(monkeypatch):
    """The comparison itself, without a device: the ops path in the kernel's place
    passes, an output off by 0.01 fails."""
    monkeypatch.setattr(kernels, "_self_test", lambda: True)
    ops = lambda q, view, scale, causal: attention.attend(
        q, view, scale, "causal" if causal else None
    )
    monkeypatch.setattr(kernels, "packed_attention_metal", ops)
    assert bench.reference_check() is None
    monkeypatch.setattr(kernels, "packed_attention_metal", lambda *a: ops(*a) + 0.01)
    assert "differs from the numpy reference" in bench.reference_check()
    monkeypatch.setattr(kernels, "_self_test", lambda: False)
    assert "self-test failed" in bench.reference_check()


mslemu = None if metal_emulator.NATIVE else metal_emulator.load()


@pytest.mark.slow  # 5 s in the emulator; test_kernels.py holds the kernels to the reference
@pytest.mark.emulator
@pytest.mark.skipif(not metal_emulator.NATIVE and mslemu is None, reason=metal_emulator.SKIP_REASON)
def test_reference_check_passes_on_the_kernels(monkeypatch):
    monkeypatch.setattr(kernels, "_self_test_result", None)
    if metal_emulator.NATIVE:
        assert bench.reference_check() is None
        return
    with mslemu.patch_mlx():
        assert bench.reference_check() is None
