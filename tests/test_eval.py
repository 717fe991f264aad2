"""Fast checks of kvarn_mlx.eval on a tiny random model: metrics with known
answers, a KIVI tile against numpy, and every subcommand end to end."""

import json
from dataclasses import replace

import mlx.core as mx
import numpy as np
import pytest

from kvarn_mlx.eval import methods as ev
from kvarn_mlx.eval.__main__ import main
from kvarn_mlx.eval.fidelity import fidelity
from kvarn_mlx.cache import KVarNCache

from models import tiny_model


class Bytes:
    def encode(self, text):
        return list(text.encode("utf-8"))


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama64")


def test_fp_against_itself_is_exact(model):
    res = fidelity(model, Bytes(), ["fp"], [384], chunk=128)
    (row,) = res["rows"]
    assert row["kl_mean"] == 0 and row["kl_p99"] == 0
    assert row["top1_agree"] == 1 and row["ppl_delta"] == 0


def test_quantized_methods_differ_and_report_bytes(model):
    res = fidelity(model, Bytes(), ["kivi2", "kvarn4", "mlxq2", "konly2"], [512], chunk=128)
    rows = {r["method"]: r for r in res["rows"]}
    assert rows["kivi2"]["kl_mean"] > rows["kvarn4"]["kl_mean"] > 0
    for m in ("kivi2", "kvarn4", "mlxq2"):
        assert 0 < rows[m]["bytes"] < rows["fp"]["bytes"]
    assert rows["konly2"]["bytes"] > rows["kivi2"]["bytes"]  # V kept in full precision


def _rtn(x, bits, axis):
    lo, hi = x.min(axis=axis, keepdims=True), x.max(axis=axis, keepdims=True)
    scale = np.maximum((hi - lo) / (2**bits - 1), 1e-10)
    return np.clip(np.rint((x - lo) / scale), 0, 2**bits - 1) * scale + lo


def test_kivi_tile_matches_numpy():
    cfg = ev.method_config("kivi2")
    assert cfg.iters == 0 and not cfg.rotate_keys and not cfg.rotate_values
    rng = np.random.default_rng(0)
    k = rng.normal(size=(1, 2, 256, 64)).astype(np.float32) * rng.uniform(0.2, 5, size=(1, 1, 1, 64)).astype(np.float32)
    v = rng.normal(size=(1, 2, 256, 64)).astype(np.float32)
    for c in (KVarNCache(replace(cfg, scale_dtype="float32")),
              ev.TileCache(ev.KVarNSide(True, 2, iters=0, rotate=False), ev.KVarNSide(False, 2, iters=0, rotate=False))):
        c.update_and_fetch(mx.array(k), mx.array(v))
        if isinstance(c, KVarNCache):
            kh, vh = c.update_and_fetch(mx.array(k[..., :0, :]), mx.array(v[..., :0, :]))
        else:
            kh, vh = c.fetch_all()
        kh, vh = np.array(kh), np.array(vh)
        np.testing.assert_array_equal(kh[..., :128, :], k[..., :128, :])  # sink untouched
        # KIVI: keys per channel over the tile's tokens, values per token over channels.
        tol = 2e-3 if isinstance(c, ev.TileCache) else 1e-5  # TileCache keeps float16 scales
        np.testing.assert_allclose(kh[..., 128:, :], _rtn(k[..., 128:, :], 2, axis=2), atol=tol * 20, rtol=tol)
        np.testing.assert_allclose(vh[..., 128:, :], _rtn(v[..., 128:, :], 2, axis=3), atol=tol * 20, rtol=tol)


def test_tilecache_matches_kvarncache():
    """The eval-only cache with KVarN's quantizers sees the same K/V as the real cache."""
    k = mx.random.normal((1, 2, 300, 64), key=mx.random.key(1))
    v = mx.random.normal((1, 2, 300, 64), key=mx.random.key(2))
    a, b = KVarNCache(ev.method_config("kvarn2")), ev.TileCache(ev.KVarNSide(True, 2), ev.KVarNSide(False, 2))
    for s in (0, 100, 260):
        e = {0: 100, 100: 260, 260: 300}[s]
        ka, va = a.update_and_fetch(k[:, :, s:e], v[:, :, s:e])
        kb, vb = b.update_and_fetch(k[:, :, s:e], v[:, :, s:e])
        np.testing.assert_allclose(np.array(ka), np.array(kb), atol=1e-5)
        np.testing.assert_allclose(np.array(va), np.array(vb), atol=1e-5)


@pytest.mark.parametrize("argv", [
    ["fidelity", "--contexts", "256,384", "--methods", "kivi2,oracle2,affine2,mlxq2,vonly2,k4v2_g128", "--chunk", "128"],
    ["accumulation", "--context", "512", "--methods", "kivi2,rot2,kvarn2,mlxq2"],
    ["decode", "--prompt-len", "160", "--steps", "24", "--methods", "kivi2,kvarn2", "--text", "topics", "--prompts", "2"],
])
def test_cli_end_to_end(model, tmp_path, argv):
    main(["--out", str(tmp_path), *argv], model=model, tokenizer=Bytes(), model_name="tiny llama64")
    stem = argv[0]
    data = json.loads((tmp_path / f"{stem}.json").read_text())
    assert data["meta"]["model"] == "tiny llama64" and "mlx" in data["meta"]["versions"]
    assert "openblas_preloaded" in data["meta"] and data["meta"]["command"].endswith(" ".join(argv))
    assert (tmp_path / f"{stem}.md").read_text().startswith("#")
    try:
        import matplotlib  # noqa: F401
        assert data["plots"] and all((tmp_path / p).exists() for p in data["plots"])
    except ImportError:
        pass


def test_unknown_method_fails_early(model, tmp_path):
    with pytest.raises(ValueError, match="unknown method"):
        main(["--out", str(tmp_path), "fidelity", "--methods", "kivi3"], model=model, tokenizer=Bytes())
