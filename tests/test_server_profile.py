"""python -m kvarn_mlx.server --kv-profile: per-layer widths from a calibration
profile, shown by /v1/kv_stats; bad profile flags stop it before it loads."""

import json

import pytest
from mlx_lm import load

from kvarn_mlx.integration import profile_mix
from test_mix import synthetic
from test_server_mlx import client, get, model_dir, run_server, server  # noqa: F401 (model_dir: a fixture)


@pytest.mark.e2e
def test_served_caches_take_the_profile_widths(model_dir, tmp_path):
    model = load(str(model_dir))[0]
    path = tmp_path / "profile.json"
    path.write_text(json.dumps(synthetic(model)))
    want = profile_mix(model, str(path), "auto2")[0].summary()
    # server() serves k4v2_g64 with a 64-token tail; the profile's tiles are 128 tokens
    flags = ("--kv-profile", str(path), "--kv-bytes-like", "auto2", "--kv-tail-tokens", "128")
    with server(model_dir, *flags) as (url, _):
        reply = client(url).chat.completions.create(
            model="default_model",
            messages=[{"role": "user", "content": "hello " * 200}],
            max_tokens=4,
        )
        assert reply.usage.completion_tokens >= 1
        stats = get(url + "/v1/kv_stats")
    assert stats["kv_profile"] == str(path)
    assert stats["kv_widths"] == want


@pytest.mark.e2e
def test_bad_profile_flags_stop_the_server(tmp_path):
    r = run_server("--kv-max-kl", "0.01")
    assert r.returncode == 2 and "pass --kv-profile" in r.stderr
    r = run_server("--kv-profile", str(tmp_path / "none.json"))
    assert r.returncode == 2 and "no profile file" in r.stderr
