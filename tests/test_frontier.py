"""benchmarks/frontier.py end to end on a tiny model folder (a fidelity run, then
the frontier from its json), and its frontier test on points with known answers."""

import json

import pytest

from benchmark_scripts import load_benchmark
from kvarn_mlx.calibrate import main as calibrate_main
from kvarn_mlx.eval.__main__ import main as eval_main
from model_folder import tiny_model_folder


def test_status_and_choices():
    f = load_benchmark("frontier")
    pts = [
        {"method": m, "bytes_per_token": b, "kl_mean": kl}
        for m, b, kl in [
            ("mlxq2", 40, 0.5),
            ("mlxq4", 80, 0.1),
            ("k2v2_g128", 30, 0.3),
            ("k3v3_g128", 60, 0.2),
            ("k4v4_g128", 80, 0.05),
            ("k8v8_g128", 150, 0.0005),
            ("k6v6_g128", 120, 0.002),
        ]
    ]
    by = {p["method"]: p for p in f.status(pts)}
    assert (
        by["k2v2_g128"]["on_or_below_mlx"] and by["k2v2_g128"]["best_other"] is None
    )  # below mlx-lm's least bytes
    assert by["k3v3_g128"]["on_or_below_mlx"] and by["k3v3_g128"]["best_other"] == "mlxq2"
    assert by["mlxq4"]["best_other"] == "k4v4_g128" and by["mlxq4"]["on_or_below_mlx"] is None
    by["k3v3_g128"]["kl_mean"] = 0.6
    assert not f.status(pts)[3]["on_or_below_mlx"] and not by["k3v3_g128"]["pareto"]
    assert by["k6v6_g128"]["pareto"] and by["mlxq2"]["pareto"]
    c = f.choose(pts, plain=320, near_lossless_kl=1e-3, usable_kl=1)  # halves: 160, 80
    assert f.choose(pts, plain=240, near_lossless_kl=1e-4)["best_at_half_memory"] == "k6v6_g128"
    assert c["most_context"] == "k2v2_g128" and c["best_at_half_memory"] == "k8v8_g128"
    assert c["best_at_quarter_memory"] == "k4v4_g128" and c["near_lossless"] == "k8v8_g128"
    # The fewest bytes only among usable caches: k2v2_g128's KL 0.3 is over 0.2.
    assert (
        f.choose(pts, plain=320, near_lossless_kl=1e-3, usable_kl=0.2)["most_context"]
        == "k4v4_g128"
    )


# -m slow: test_tail_frontier_end_to_end runs the helpers tail_frontier.py shares with it.
@pytest.mark.slow
@pytest.mark.e2e
def test_frontier_end_to_end(tmp_path):
    folder = tiny_model_folder(tmp_path / "model")
    out = tmp_path / "results"
    eval_main(
        [
            "--model",
            str(folder),
            "--out",
            str(out),
            "--tag",
            "t",
            "fidelity",
            "--contexts",
            "384",
            "--chunk",
            "128",
            "--methods",
            "k2v2_g128,k4v4_g128+fp8,k8v8_g128+fp16:0,mlxq2,mlxq4",
        ]
    )
    # A second run (packed attention) replaces the first one's k2v2_g128 row.
    eval_main(
        [
            "--model",
            str(folder),
            "--out",
            str(out),
            "--tag",
            "p",
            "--attention",
            "packed",
            "fidelity",
            "--contexts",
            "384",
            "--chunk",
            "128",
            "--methods",
            "k2v2_g128",
        ]
    )
    res = load_benchmark("frontier").main(
        [
            str(out / "fidelity_t.json"),
            str(out / "fidelity_p.json"),
            "--name",
            "t",
            "--model",
            str(folder),
            "--out",
            str(out),
            "--long-context",
            "640",
        ]
    )
    pts = {p["method"]: p for p in res["points"]}
    assert set(pts) == {"k2v2_g128", "k4v4_g128+fp8", "k8v8_g128+fp16:0", "mlxq2", "mlxq4"}
    assert pts["k2v2_g128"]["attention"] == "packed" and pts["mlxq2"]["attention"] == "dequant"
    assert [r["attention"] for r in res["fidelity_runs"]] == ["dequant", "packed"]
    # 2 layers, 1 kv head, head dim 64, K and V, float16.
    assert res["plain_fp16_bytes_per_token"] == 2 * 64 * 2 * 2
    assert (
        pts["k2v2_g128"]["bytes_per_token"]
        < pts["k4v4_g128+fp8"]["bytes_per_token"]
        < res["plain_fp16_bytes_per_token"]
    )
    assert pts["mlxq2"]["bytes_per_token"] < pts["mlxq4"]["bytes_per_token"]
    # At 640 tokens the 128-token sink weighs less; mlx-lm's caches hold the same per token.
    assert pts["k2v2_g128"]["long_bytes_per_token"] < pts["k2v2_g128"]["bytes_per_token"]
    assert pts["mlxq4"]["long_bytes_per_token"] == pts["mlxq4"]["bytes_per_token"]
    assert res["plain_fp16_long_bytes_per_token"] == res["plain_fp16_bytes_per_token"]
    # Layer 0 plain: at least half the plain cache's bytes.
    assert pts["k8v8_g128+fp16:0"]["bytes_per_token"] > res["plain_fp16_bytes_per_token"] / 2
    # The float32 run holds more than float16 K/V.
    assert all(p["run_bytes_per_token"] > p["whole_bytes_per_token"] for p in pts.values())
    data = json.loads((out / "frontier_t.json").read_text())
    md = (out / "frontier_t.md").read_text()
    assert (
        data["result"]["choices"]["most_context"] in pts and "python benchmarks/frontier.py" in md
    )
    assert md.count("\n| ") == 1 + len(pts)
    assert (out / "frontier_t.png").stat().st_size > 0


@pytest.mark.e2e
def test_tail_frontier_end_to_end(tmp_path):
    # benchmarks/tail_frontier.py from a fidelity run of PRESET+tailN methods: the tail's
    # full-precision tokens add bytes, measured from held arrays, and a tail as long as
    # the run leaves nothing quantized (KL 0 against the plain cache).
    folder = tiny_model_folder(tmp_path / "model")
    out = tmp_path / "results"
    eval_main(
        [
            *("--model", str(folder), "--out", str(out), "--tag", "t", "fidelity"),
            *("--contexts", "384", "--chunk", "128"),
            *("--methods", "k2v2_g128+tail0,k2v2_g128+tail128,k2v2_g128+tail256"),
        ]
    )
    res = load_benchmark("tail_frontier").main(
        [str(out / "fidelity_t.json"), "--name", "t", "--model", str(folder), "--out", str(out)]
        + ["--long", "1024"]
    )
    by = {(p["tail"], p["context"]): p for p in res["points"]}
    assert by[256, 384]["kl_mean"] == 0 and by[0, 384]["kl_mean"] > 0
    assert by[0, 384]["bytes_per_token"] < by[128, 384]["bytes_per_token"]
    assert by[128, 384]["bytes_per_token"] < by[256, 384]["bytes_per_token"]
    assert by[0, 384]["long"][1024] < by[128, 384]["long"][1024]
    assert (out / "tail_t.md").exists() and (out / "tail_frontier_t.png").exists()


def test_tail_frontier_reads_method_names():
    split = load_benchmark("tail_frontier").split
    assert split("fp") is None
    assert split("auto4v2") == ("auto4v2", 0)
    assert split("auto4v2+tail128") == ("auto4v2", 128)
    assert split("benchmarks/results/profile_smollm2.json@auto2") == ("mix@auto2", 0)


# -m slow: the script's parts are checked on their own (the allocation in test_mix.py,
# calibration in test_calibrate.py, its method names above).
@pytest.mark.slow
def test_mixed_widths_end_to_end(tmp_path):
    # benchmarks/mixed_widths.py from a real (short) calibration of a tiny model and a
    # fidelity run of a preset, the mix at its bytes and an mlx-lm baseline the script
    # has no prediction for (left out of the table).
    folder = tiny_model_folder(tmp_path / "model")
    out = tmp_path / "results"
    text = tmp_path / "text.txt"
    text.write_text("The quick brown fox jumps over the lazy dog; pack my box. " * 60)
    profile = tmp_path / "profile.json"
    calibrate_main(
        [*("--model", str(folder), "--out", str(profile), "--text", str(text)), "--text-start"]
        + ["0", *("--tokens", "384", "--measure", "128", "--chunk", "128", "--widths", "2,4")]
        + ["--growth-tokens", "768"]
    )
    mix = f"{profile}@auto2"
    eval_main(
        [
            *("--model", str(folder), "--out", str(out), "--tag", "t", "fidelity"),
            *("--contexts", "384", "--chunk", "128", "--methods", f"auto2,mlxq4,{mix}"),
        ]
    )
    load_benchmark("mixed_widths").main(
        [*("--model", str(folder), "--profile", str(profile), "--tag", "t", "--out", str(out))]
        + ["--fidelity", str(out / "fidelity_t.json")]
    )
    rows = {r["method"]: r for r in json.loads((out / "mixed_widths_t.json").read_text())["rows"]}
    assert set(rows) == {"auto2", mix}
    assert rows[mix]["tile_bytes_per_token"] <= rows["auto2"]["tile_bytes_per_token"]
    assert rows[mix]["predicted_kl"] <= rows["auto2"]["predicted_kl"]
    assert rows["auto2"]["contexts"]["384"]["kl_mean"] > 0
    # predicted at 384 tokens, the calibration's length: the sum (the growth is from there)
    assert rows["auto2"]["predicted_at"]["384"] == pytest.approx(rows["auto2"]["predicted_kl"])
    assert json.loads(profile.read_text())["growth"]["presets"]["auto2"]["768"] > 0
    md = (out / "mixed_widths_t.md").read_text()
    assert "| auto2 |" in md and "mlxq4" not in md.split("Commands:")[0]
