"""benchmarks/decode_speed.py --quick end to end on a tiny model folder: every method
at every context in one run, ratios against that run's plain cache, the tile share."""

import json

import pytest

from benchmark_scripts import load_benchmark
from model_folder import tiny_model_folder

pytestmark = pytest.mark.e2e


def test_decode_speed_quick(tmp_path):
    ds = load_benchmark("decode_speed")
    folder = tiny_model_folder(tmp_path / "model")
    out = tmp_path / "results"
    ds.main(["--quick", "--model", str(folder), "--out", str(out)])
    data = json.loads((out / "decode_speed.json").read_text())
    contexts = [int(c) for c in ds.QUICK["contexts"].split(",")]
    assert [(r["context"], r["method"]) for r in data["rows"]] == [
        (c, m) for c in contexts for m in ds.METHODS
    ]
    for r in data["rows"]:
        base = next(b for b in data["rows"] if b["context"] == r["context"] and b["method"] == "fp")
        assert r["tokens_per_s"] > 0 and r["speed_vs_fp"] == pytest.approx(
            r["tokens_per_s"] / base["tokens_per_s"]
        )
        assert 0 < r["build_s"] < r["s_per_token"]  # the model call is part of the step
        assert r["build_vs_fp"] == pytest.approx(r["build_s"] / base["build_s"])
        assert r["cache_bytes"] > 0
    presets = [m for m in ds.METHODS if m != "fp" and not m.startswith("mlxq")]
    assert [(o["method"], o["context"]) for o in data["overhead"]] == [
        (m, c) for m in presets for c in contexts
    ]
    assert all(
        0 < o["fraction_of_decode"]
        and o["tile_s_all_layers_iters0"] > 0
        and o["tile_s_per_layer_calls"] > 0
        for o in data["overhead"]
    )
    md = (out / "decode_speed.md").read_text()
    assert "python benchmarks/decode_speed.py --quick" in md and "dispatch.quantize" in md
    assert (out / "decode_speed.png").stat().st_size > 0


@pytest.mark.slow  # the script's path is test_decode_speed_quick's, with --rows
def test_decode_speed_quick_batch(tmp_path):
    # --rows: sequences of different lengths joined by mlx-lm's merge, decoding together;
    # tokens/s counts every row's token.
    ds = load_benchmark("decode_speed")
    folder = tiny_model_folder(tmp_path / "model")
    out = tmp_path / "results"
    argv = ["--quick", "--rows", "3", "--methods", "fp,k4v2_g128", "--model", str(folder)]
    ds.main([*argv, "--out", str(out)])
    data = json.loads((out / "decode_speed.json").read_text())
    contexts = [int(c) for c in ds.QUICK["contexts"].split(",")]
    assert data["batch_rows"] == 3 and data["overhead"] == []
    assert [(r["context"], r["method"]) for r in data["rows"]] == [
        (c, m) for c in contexts for m in ("fp", "k4v2_g128")
    ]
    for r in data["rows"]:
        assert r["tokens_per_s"] == pytest.approx(1 / r["s_per_token"])
        assert 0 < r["build_s"] < 3 * r["s_per_token"] and r["cache_bytes"] > 0
    assert ds.row_lengths(300, 3) == [116, 208, 300] and ds.row_lengths(1024, 4) == [
        544,
        704,
        864,
        1024,
    ]
    assert "Batched: 3 sequences" in (out / "decode_speed.md").read_text()
    with pytest.raises(SystemExit):
        ds.main([*argv[:3], "--methods", "fp,mlxq4", "--out", str(out)])
