"""Fast checks of kvarn_mlx.eval on a tiny random model: metrics with known
answers, the baseline tile caches against numpy, both attention modes, and
every subcommand end to end."""

import json
from dataclasses import replace

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import KVCache

from kvarn_mlx import integration
from kvarn_mlx import reference as ref
from kvarn_mlx.cache import KVarNCache
from kvarn_mlx.eval.__main__ import main
from kvarn_mlx.eval.fidelity import fidelity
from kvarn_mlx.eval.methods import make_caches, method_bits, method_cache
from kvarn_mlx.eval.runner import CheckpointError, Dequantized, append_checkpoint, read_checkpoint
from models import tiny_model


class Bytes:
    def encode(self, text):
        return list(text.encode("utf-8"))


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama64")


class _OneLayer:
    """A model of one plain-cache layer, for make_caches."""

    layers = [None]

    def make_cache(self):
        return [KVCache()]


def kv(L=300, D=64, seed=0):
    rng = np.random.default_rng(seed)
    # Channels of different scales, as keys have.
    k = rng.normal(size=(1, 2, L, D)) * rng.uniform(0.2, 5, size=(1, 1, 1, D))
    return k.astype(np.float32), rng.normal(size=(1, 2, L, D)).astype(np.float32)


def all_tokens(cache, k, v):
    """Every token of k, v [1, H, L, D] as the cache holds them
    (all whole tiles quantized), numpy."""
    cache.update_and_fetch(mx.array(k), mx.array(v))
    kh, vh = cache.update_and_fetch(
        mx.array(k[..., :0, :]), mx.array(v[..., :0, :])
    )  # a 0-token step sees every tile
    return np.array(kh), np.array(vh)


def test_fp_against_itself_is_exact(model):
    res = fidelity(model, Bytes(), ["fp"], [384], chunk=128)
    (row,) = res["rows"]
    assert row["kl_mean"] == 0 and row["kl_p99"] == 0
    assert row["top1_agree"] == 1 and row["ppl_delta"] == 0


def test_a_context_inside_a_chunk_ends_that_chunk(model):
    res = fidelity(model, Bytes(), ["kvarn4"], [300, 512], chunk=128)
    rows = {(r["method"], r["context"]): r for r in res["rows"]}
    assert rows[("fp", 300)]["fp16_bytes"] == 2 * 2 * 2 * 300 * 64 * 2  # bytes held at 300
    assert rows[("kvarn4", 300)]["bytes"] > 0 and rows[("kvarn4", 512)]["bytes"] > 0


def test_quantized_methods_differ_and_report_bytes(model):
    res = fidelity(model, Bytes(), ["kivi2", "kvarn4", "mlxq2", "konly2"], [512], chunk=128)
    rows = {r["method"]: r for r in res["rows"]}
    assert rows["kivi2"]["kl_mean"] > rows["kvarn4"]["kl_mean"] > 0
    for m in ("kivi2", "kvarn4", "mlxq2"):
        assert 0 < rows[m]["bytes"] < rows["fp"]["bytes"]
    assert rows["konly2"]["bytes"] > rows["kivi2"]["bytes"]  # V kept in full precision
    # 2 layers, 2 kv heads, head dim 64, K and V, 2 bytes each.
    assert all(r["fp16_bytes"] == 2 * 2 * 2 * 512 * 64 * 2 for r in res["rows"])
    # kivi2: 2-bit codes, float16 scales a, b per channel (K) / per token (V)
    # and t / c of 128-token tiles.
    assert rows["kivi2"]["bits_per_quantized_element"] == 2 + 8 * 2 * (3 * 64 + 3 * 128) / (
        2 * 128 * 64
    )


def test_method_names():
    assert [method_bits(m) for m in ("fp", "kvarn2", "k4v2_g128", "konly4", "vonly2", "mlxq4")] == [
        "16/16",
        "2/2",
        "4/2",
        "4/fp",
        "fp/2",
        "4/4",
    ]
    cls, cfg = method_cache("kivi2")
    assert cls is KVarNCache and cfg.iters == 0 and not cfg.rotate_keys and not cfg.rotate_values
    assert method_cache("rot4")[1].iters == 0 and method_cache("rot4")[1].rotate_keys
    assert method_cache("norm2")[1].iters == 8 and not method_cache("norm2")[1].rotate_values
    for bad in ("kivi3", "kvarn", "nope2"):
        with pytest.raises(ValueError, match="unknown method"):
            method_cache(bad)


def test_method_variants():
    # Any width pair by name, FP8 scales, layers kept plain.
    assert (
        method_bits("k5v3_g128") == "5/3" and method_cache("k5v3_g64_auto")[1].rotate_keys == "auto"
    )
    cls, cfg = method_cache("auto4v2+fp8")
    assert (
        cls is KVarNCache
        and cfg.scale_dtype == "fp8"
        and cfg.rotate_keys == "auto"
        and cfg.k_bits == 4
    )
    assert (
        method_cache("kivi2+fp8")[1].iters == 0
        and method_cache("kivi2+fp8")[1].scale_dtype == "fp8"
    )
    assert method_cache("k4v2_g128+fp16:0:-1")[1] == method_cache("k4v2_g128")[1]
    assert [type(c) for c in make_caches(tiny_model("llama64"), "k4v2_g128+fp16:-1")] == [
        KVarNCache,
        KVCache,
    ]
    g = make_caches(tiny_model("gemma3"), "k4v4_g128+fp8+fp16:1")  # layers 0 and 2 slide
    assert [type(c).__name__ for c in g] == [
        "RotatingKVCache",
        "KVCache",
        "RotatingKVCache",
        "KVarNCache",
    ]
    assert g[3].config.scale_dtype == "fp8"
    for bad in ("k4v2_g128+fp4", "mlxq4+fp8", "fp+fp16:0", "k8v8_g128+fp8", "k4v2_g128+fp16"):
        with pytest.raises(ValueError):
            method_cache(bad)
    with pytest.raises(ValueError, match="the model has 2 layers"):
        make_caches(tiny_model("llama64"), "k4v2_g128+fp16:2")


def test_growing_bytes_leave_out_sliding_layers():
    g = tiny_model("gemma3")  # window 32: 2 sliding layers, 2 global
    rows = {
        r["method"]: r
        for r in fidelity(g, Bytes(), ["k4v4_g128", "k4v4_g128+fp16:1"], [384], chunk=128)["rows"]
    }
    fp, q, half = rows["fp"], rows["k4v4_g128"], rows["k4v4_g128+fp16:1"]
    assert (
        fp["growing_bytes"] == 2 * 384 * 256 * 2 * 4
    )  # 2 global layers, 1 kv head, K and V, float32
    assert 0 < q["growing_bytes"] < half["growing_bytes"] < fp["growing_bytes"]
    assert (
        fp["bytes"] - fp["growing_bytes"] == q["bytes"] - q["growing_bytes"] > 0
    )  # the same sliding windows
    assert 0 < half["kl_mean"] < q["kl_mean"]


def _rtn(x, bits, axis):
    lo, hi = x.min(axis=axis, keepdims=True), x.max(axis=axis, keepdims=True)
    scale = np.maximum((hi - lo) / (2**bits - 1), 1e-10)
    return np.clip(np.rint((x - lo) / scale), 0, 2**bits - 1) * scale + lo


def test_kivi_tile_matches_numpy():
    k, v = kv(256)
    kh, vh = all_tokens(KVarNCache(replace(method_cache("kivi2")[1], scale_dtype="float32")), k, v)
    np.testing.assert_array_equal(kh[..., :128, :], k[..., :128, :])  # sink untouched
    # KIVI: keys per channel over the tile's tokens, values per token over channels.
    np.testing.assert_allclose(
        kh[..., 128:, :], _rtn(k[..., 128:, :], 2, axis=2), atol=2e-5, rtol=1e-5
    )
    np.testing.assert_allclose(
        vh[..., 128:, :], _rtn(v[..., 128:, :], 2, axis=3), atol=2e-5, rtol=1e-5
    )


def test_oracle_keys_match_numpy():
    k, v = kv(256)
    cls, cfg = method_cache("oracle2")
    kh, _ = all_tokens(cls(cfg), k, v)
    H = ref.hadamard(64).astype(np.float64)
    rot = k[..., 128:, :].astype(np.float64) @ H.T
    t = np.maximum(rot.std(axis=-1, ddof=1, keepdims=True), 1e-6)  # exact per-token scale
    want = (_rtn(rot / t, 2, axis=2) * t) @ H
    np.testing.assert_allclose(kh[..., 128:, :], want, atol=5e-3 * np.abs(want).max())


def test_affine_tiles_are_mlx_lm_format_per_token():
    k, v = kv(300)
    cls, cfg = method_cache("affine4")
    kh, vh = all_tokens(cls(cfg), k, v)
    for x, xh in ((k, kh), (v, vh)):
        np.testing.assert_array_equal(xh[..., :128, :], x[..., :128, :])  # the sink
        np.testing.assert_array_equal(xh[..., 256:, :], x[..., 256:, :])  # the tail
        rows = mx.array(x[0, :, 128:256, :].reshape(-1, 64))  # one token per row
        want = mx.dequantize(*mx.quantize(rows, group_size=64, bits=4), group_size=64, bits=4)
        np.testing.assert_array_equal(xh[0, :, 128:256, :], np.array(want).reshape(2, 128, 64))
        assert np.abs(xh[..., 128:256, :] - x[..., 128:256, :]).max() > 0


@pytest.mark.parametrize("name, exact", [("konly2", 1), ("vonly2", 0)])
def test_one_side_caches(name, exact):
    """The quantized side is KVarN's, bit for bit; the other side stays exact."""
    k, v = kv(300)
    cls, cfg = method_cache(name)
    one = all_tokens(cls(cfg), k, v)
    both = all_tokens(KVarNCache(method_cache("kvarn2")[1]), k, v)
    np.testing.assert_array_equal(one[exact], (k, v)[exact])
    np.testing.assert_array_equal(one[1 - exact], both[1 - exact])


@pytest.mark.parametrize("name", ["kvarn2", "oracle2", "affine2", "konly2", "mlxq2"])
def test_packed_and_dequant_attention_agree(name):
    """What the patched entry point computes over each cache equals mlx-lm's
    attention over the keys and values the Dequantized view returns."""
    k, v = kv(300)
    q = np.random.default_rng(1).normal(size=(1, 6, 44, 64)).astype(np.float32)
    integration.patch()
    packed_cache, plain_cache = (
        make_caches(_OneLayer(), name)[0],
        Dequantized(make_caches(_OneLayer(), name)[0]),
    )
    outs = []
    for c in (packed_cache, plain_cache):
        c.update_and_fetch(mx.array(k[..., :256, :]), mx.array(v[..., :256, :]))
        kk, vv = c.update_and_fetch(mx.array(k[..., 256:, :]), mx.array(v[..., 256:, :]))
        # A fresh query array per call: mlx-lm's quantized attention scales its queries in place.
        outs.append(
            integration.scaled_dot_product_attention(mx.array(q), kk, vv, c, 0.125, "causal")
        )
    np.testing.assert_allclose(np.array(outs[0]), np.array(outs[1]), atol=2e-4, rtol=2e-4)


def test_auto_presets_attend_packed_in_either_mode(model):
    # Their key-rotation choice reads the step's queries, which only the packed path hands the
    # cache: "dequant" mode leaves them unwrapped (the keys standing in chose otherwise on Gemma).
    from kvarn_mlx.eval.runner import for_model

    for name in ("auto2", "auto4v2", "k2v2_g128"):
        cache = make_caches(model, name)
        wrapped = [isinstance(c, Dequantized) for c in for_model(cache, "dequant")]
        assert wrapped == [not name.startswith("auto")] * len(cache), name
    a, b = (
        fidelity(model, Bytes(), ["auto2"], [384], chunk=128, attention_mode=m)["rows"]
        for m in ("dequant", "packed")
    )
    assert [r["kl_mean"] for r in a] == [r["kl_mean"] for r in b]


def test_attention_modes_give_the_same_numbers(model):
    methods = ["kvarn2", "affine2", "mlxq4"]
    a, b = (
        fidelity(model, Bytes(), methods, [384], chunk=128, attention_mode=m)["rows"]
        for m in ("dequant", "packed")
    )
    for x, y in zip(a, b):
        assert x["method"] == y["method"] and x["bytes"] == y["bytes"]
        assert x["kl_mean"] == pytest.approx(y["kl_mean"], rel=1e-3, abs=1e-7)


@pytest.mark.parametrize(
    "argv",
    [
        [
            "fidelity",
            "--contexts",
            "256,384",
            "--methods",
            "kivi2,oracle2,affine2,mlxq2,vonly2,k4v2_g128",
            "--chunk",
            "128",
        ],
        [
            "fidelity",
            "--contexts",
            "384",
            "--methods",
            "k3v2_g128+fp8,k6v5_g128+fp16:0",
            "--chunk",
            "128",
        ],
        ["accumulation", "--context", "512", "--methods", "kivi2,rot2,kvarn2,mlxq2"],
        [
            "--attention",
            "packed",
            "accumulation",
            "--context",
            "384",
            "--methods",
            "auto2,konly2,mlxq2",
        ],
        [
            "decode",
            "--prompt-len",
            "160",
            "--steps",
            "24",
            "--methods",
            "kivi2,kvarn2",
            "--text",
            "topics",
            "--prompts",
            "2",
        ],
    ],
)
@pytest.mark.e2e
def test_cli_end_to_end(model, tmp_path, argv):
    main(
        ["--out", str(tmp_path), "--tag", "t", *argv],
        model=model,
        tokenizer=Bytes(),
        model_name="tiny llama64",
    )
    stem = next(a for a in argv if a in ("fidelity", "accumulation", "decode")) + "_t"
    data = json.loads((tmp_path / f"{stem}.json").read_text())
    assert data["meta"]["model"] == "tiny llama64" and "mlx" in data["meta"]["versions"]
    assert "openblas_preloaded" in data["meta"] and data["meta"]["command"].endswith(" ".join(argv))
    assert (tmp_path / f"{stem}.md").read_text().startswith("#")
    if "accumulation" in argv:
        for r in data["result"]["summary"]:
            assert r["acc_mean"] > 0 and r["static_mean"] > 0
    try:
        import matplotlib  # noqa: F401

        assert data["plots"] and all((tmp_path / p).exists() for p in data["plots"])
        assert all(p.endswith("_t.png") for p in data["plots"])
    except ImportError:
        pass
    assert not list(tmp_path.glob(".plots.*"))  # the scratch folder is gone


def test_unknown_method_fails_early(tmp_path):
    with pytest.raises(ValueError, match="unknown method"):
        main(
            ["--out", str(tmp_path), "fidelity", "--methods", "kivi3"],
            model=object(),
            tokenizer=Bytes(),
        )


def test_checkpoint_survives_a_run_stopped_mid_line(tmp_path):
    # A run killed while writing a row leaves it cut short: reading leaves it out, and the
    # next row starts a line of its own instead of gluing onto it.
    ck = tmp_path / "ck.jsonl"
    rows = [{"settings": {"n": i}, "record": {"x": "y" * i}} for i in range(3)]
    for r in rows[:2]:
        append_checkpoint(ck, r)
    whole = ck.read_text()
    ck.write_text(whole + json.dumps(rows[2])[:17])
    assert read_checkpoint(ck) == rows[:2]
    append_checkpoint(ck, rows[2])
    assert read_checkpoint(ck) == rows
    assert ck.read_text().startswith(whole) and ck.read_text().endswith("\n")
    assert read_checkpoint(tmp_path / "missing.jsonl") == [] and read_checkpoint(None) == []


@pytest.mark.parametrize(
    "text", ["my notes\n", '{"settings": {"n": 1}}\n[1, 2]\n', b"\xff\xfe binary"]
)
def test_a_file_no_eval_wrote_is_refused_untouched(tmp_path, text):
    notes = tmp_path / "notes.txt"
    (notes.write_bytes if isinstance(text, bytes) else notes.write_text)(text)
    before = notes.read_bytes()
    with pytest.raises(CheckpointError, match="is not a row of a python -m kvarn_mlx.eval"):
        read_checkpoint(notes)
    # The CLI refuses it before loading a model (none is given here) and leaves it as it was.
    with pytest.raises(SystemExit, match="pass a new file"):
        main(["--out", str(tmp_path), "tasks", "--checkpoint", str(notes)])
    assert notes.read_bytes() == before


class _StopsAfter:
    """The model, raising KeyboardInterrupt at its n-th call (a run stopped by hand)."""

    def __init__(self, model, n):
        self.model, self.n = model, n

    def __getattr__(self, name):
        return getattr(self.model, name)

    def __call__(self, *args, **kwargs):
        self.n -= 1
        if self.n < 0:
            raise KeyboardInterrupt
        return self.model(*args, **kwargs)


def test_a_stopped_fidelity_run_resumes_from_its_state(model, tmp_path, monkeypatch):
    from kvarn_mlx.eval import fidelity as fidelity_module
    from kvarn_mlx.eval.fidelity import RunState

    methods, contexts = ["auto4v2", "k2v2_g128+tail128", "mlxq4"], [384, 640]
    folder = tmp_path / "state"

    def run(model, methods=methods, state=None):
        return fidelity(
            model, Bytes(), methods, contexts, chunk=64, attention_mode="packed", state=state
        )

    want = run(model)
    monkeypatch.setattr(fidelity_module, "STATE_EVERY", -1)  # save before every chunk
    with pytest.raises(KeyboardInterrupt):  # in chunk 6 of 10, the third method's call
        run(_StopsAfter(model, 5 * 4 + 2), state=RunState(folder))
    assert json.loads((folder / "state.json").read_text())["chunks"] == 5
    assert len(list(folder.iterdir())) == 1 + 2 * 4  # state.json, caches and metrics per method
    with pytest.raises(ValueError, match="holds the state of another run"):
        run(model, methods[:2], state=RunState(folder))
    with pytest.raises(ValueError, match="another run .other model"):
        run(model, state=RunState(folder, {"model": "x"}))
    with pytest.raises(ValueError, match="is a file; pass a folder"):
        RunState(folder / "state.json")
    got = run(_StopsAfter(model, 5 * 4), state=RunState(folder))  # the 5 chunks left, no more
    assert not folder.exists()  # the finished run removes its state
    for a, b in zip(want["rows"], got["rows"]):
        assert a.keys() == b.keys()
        for key in a:
            close = pytest.approx(b[key], rel=1e-6) if isinstance(b[key], float) else b[key]
            assert a[key] == close, (a["method"], key)
