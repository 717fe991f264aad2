"""python -m kvarn_mlx.calibrate on tiny models: the replayed measurement equals
whole teacher-forced passes, and the profile it writes reads back."""

import json

import mlx.core as mx
import pytest
from mlx_lm.models.cache import KVCache

from kvarn_mlx import calibrate as C
from kvarn_mlx import profile as P
from kvarn_mlx.config import get_preset
from kvarn_mlx.integration import make_cache
from models import tiny_model, tokenizer

TEXT = "The quick brown fox jumps over the lazy dog; pack my box with five dozen liquor jugs. " * 40


@pytest.fixture(scope="module")
def text_file(tmp_path_factory):
    p = tmp_path_factory.mktemp("text") / "text.txt"
    p.write_text(TEXT)
    return str(p)


@pytest.fixture(scope="module")
def llama():
    return tiny_model("llama64")


@pytest.fixture(scope="module")
def llama_profile(llama, text_file):
    return C.calibrate(
        llama, tokenizer(), source=text_file, start=0, tokens=384, measure=128, chunk=128
    )


@pytest.mark.parametrize("name", ["llama64", "gemma3", "qwen2"])
def test_replay_equals_whole_passes(name, text_file):
    """Layer l's recorded inputs replayed through layers l.. give the KL of whole
    teacher-forced passes with the same cache at layer l (keys: auto rotation)."""
    model = tiny_model(name)
    ids, _ = C.calibration_tokens(tokenizer(), text_file, 0, 512)
    chunks = C._chunks(512, 128)
    layers = [
        i for i, c in enumerate(make_cache(model, "auto4v2")) if type(c).__name__ == "KVarNCache"
    ]
    l = layers[-1] if name == "gemma3" else layers[0]
    rec = C.Recording(model, ids, 128, {2, 3}, {l}, 256)
    base = get_preset("auto4v2")
    assert C.measure_replayed(model, rec, l, [KVCache()], 256) == [0.0]
    for side, w in (("k", 2), ("v", 3)):
        replayed = C.measure_replayed(
            model, rec, l, [C.OneSideCache(C.variant_config(base, side, w), side)], 256
        )
        whole = C.measure_whole(
            model, rec, l, C.OneSideCache(C.variant_config(base, side, w), side)
        )
        assert replayed[0] > 1e-4
        assert replayed[0] == pytest.approx(whole, rel=1e-4)
    assert len(chunks) == 4


def test_batched_rows_equal_single_rows(llama, text_file):
    ids, _ = C.calibration_tokens(tokenizer(), text_file, 0, 512)
    rec = C.Recording(llama, ids, 128, {3}, {0}, 256)
    base = get_preset("auto4v2")
    variants = [("k", 2), ("v", 2), ("k", 5)]
    rows = C.measure_replayed(
        llama, rec, 0, [C.OneSideCache(C.variant_config(base, s, w), s) for s, w in variants], 256
    )
    for (s, w), kl in zip(variants, rows):
        one = C.measure_replayed(
            llama, rec, 0, [C.OneSideCache(C.variant_config(base, s, w), s)], 256
        )[0]
        assert kl == pytest.approx(one, rel=1e-4)


def test_one_side_cache_reads_the_other_side_exactly():
    """Keys-only: attention output equals attention with the quantized keys and exact values."""
    cfg = C.variant_config(get_preset("k2v2_g128"), "k", 2)
    c = C.OneSideCache(cfg, "k")
    k = mx.random.normal((1, 2, 512, 64), key=mx.random.key(1))
    v = mx.random.normal((1, 2, 512, 64), key=mx.random.key(2))
    c.update_and_fetch(k[:, :, :384], v[:, :, :384])
    c.update_and_fetch(k[:, :, 384:], v[:, :, 384:])
    view = c.step_view()
    assert view.tiles is None
    got_v = mx.concatenate([view.sink_v, view.recent_v], axis=2)
    got_k = mx.concatenate([view.sink_k, view.recent_k], axis=2)
    assert mx.array_equal(got_v, v)
    assert not mx.allclose(got_k[:, :, 128:384], k[:, :, 128:384], atol=1e-3)  # quantized tiles
    assert mx.array_equal(got_k[:, :, :128], k[:, :, :128])  # the sink


def test_profile_holds_every_layer_side_and_width(llama, llama_profile):
    p = llama_profile
    assert p["format"] == P.FORMAT and p["format_version"] == P.FORMAT_VERSION
    assert p["mode"] == "replay"
    assert p["widths"] == [2, 3, 4, 5, 6, 8] and p["fp8_widths"] == [2, 3, 4]
    assert [e["layer"] for e in p["layers"]] == [0, 1]
    assert p["model"]["fingerprint"] == P.fingerprint(llama)
    assert p["text"]["tokens"] == 384 and p["text"]["measured_positions"] == [256, 383]
    for e in p["layers"]:
        for side in "kv":
            kl = e[side]
            assert set(kl) == {"2", "3", "4", "5", "6", "8"}
            assert kl["2"] > kl["4"] > kl["8"] >= 0
            one_byte = e[side + "_fp8"]  # the same widths with e4m3 scales: close, not equal
            assert set(one_byte) == {"2", "3", "4"}
            assert one_byte["2"] > one_byte["4"] > 0
            assert one_byte["2"] != kl["2"] and one_byte["2"] == pytest.approx(kl["2"], rel=0.5)


def test_profile_round_trip(tmp_path, llama_profile):
    path = tmp_path / "p.json"
    P.write(path, llama_profile)
    assert P.read(path) == json.loads(json.dumps(llama_profile))
    assert not list(tmp_path.glob(".*tmp"))  # the temp file was renamed


def test_profile_is_not_written_over_other_files(tmp_path, llama_profile):
    other = tmp_path / "notes.json"
    other.write_text('{"mine": 1}')
    with pytest.raises(P.ProfileError, match="not a kvarn-mlx profile; refusing"):
        P.write(other, llama_profile)
    assert other.read_text() == '{"mine": 1}'
    with pytest.raises(P.ProfileError, match="does not exist; create the folder"):
        P.check_writable(tmp_path / "missing" / "p.json")


def test_calibrate_cli_refuses_bad_arguments_before_loading(tmp_path):
    other = tmp_path / "notes.json"
    other.write_text("keep")
    with pytest.raises(SystemExit, match="refusing to overwrite"):
        C.main(["--out", str(other)])
    with pytest.raises(SystemExit, match="--widths 2,7"):
        C.main(["--out", str(tmp_path / "p.json"), "--widths", "2,7"])
    with pytest.raises(SystemExit, match="--fp8-widths 2,5: use some of 2, 3, 4"):
        C.main(["--out", str(tmp_path / "p.json"), "--fp8-widths", "2,5"])
    assert not (tmp_path / "p.json").exists()


def test_checkpoint_resumes_an_interrupted_run(llama, text_file, tmp_path, monkeypatch):
    """Each measurement is appended as it is made; a run given the checkpoint of an
    interrupted one (cut in the middle of a line) measures only the rest, and a
    checkpoint of other settings gives it nothing."""
    run = dict(source=text_file, start=0, tokens=384, measure=128, chunk=128, fp8_widths=[])
    run["widths"] = [2, 4]
    ck = tmp_path / "full.jsonl"
    full = C.calibrate(llama, tokenizer(), checkpoint=str(ck), **run)
    lines = ck.read_text().splitlines()
    assert len(lines) == 2 * 2 * 2  # layers x sides x widths
    cut = tmp_path / "cut.jsonl"
    cut.write_text("\n".join(lines[:5]) + "\n" + lines[5][:40])
    rows = []
    measure = C.measure_replayed
    monkeypatch.setattr(
        C,
        "measure_replayed",
        lambda m, rec, l, caches, f: rows.extend(caches) or measure(m, rec, l, caches, f),
    )
    resumed = C.calibrate(llama, tokenizer(), checkpoint=str(cut), **run)
    assert resumed["resumed_measurements"] == 5
    assert len(rows) == 3 + 1  # the three missing, and the replay check's plain row
    # The same measurements up to float rounding: a resumed run batches fewer widths
    # together, which changes the matmuls' summation order (KLs near 1e-4 moved by 1e-4).
    for a, b in zip(full["layers"], resumed["layers"]):
        for side in "kv":
            assert b[side] == pytest.approx(a[side], rel=1e-3)
    assert len(cut.read_text().splitlines()) == 6 + 3  # appended after the torn line
    again = C.calibrate(llama, tokenizer(), checkpoint=str(cut), **run)
    assert again["resumed_measurements"] == 8 and again["layers"] == resumed["layers"]
    other = C.calibrate(llama, tokenizer(), checkpoint=str(ck), **{**run, "chunk": 64})
    assert "resumed_measurements" not in other
    assert len(ck.read_text().splitlines()) == 2 * 8  # both runs' lines, no blank line
    other = C.calibrate(llama, tokenizer(), checkpoint=str(ck), **{**run, "chunk": 64})
    assert other["resumed_measurements"] == 8


def test_calibrate_refuses_a_file_that_is_not_a_checkpoint(tmp_path):
    notes = tmp_path / "notes.txt"
    notes.write_text("my notes\nmore notes\n")
    with pytest.raises(SystemExit, match="line 1 is not a calibration checkpoint"):
        C.main(["--out", str(tmp_path / "p.json"), "--checkpoint", str(notes)])
    assert notes.read_text() == "my notes\nmore notes\n"


def test_calibrate_refuses_a_measure_window_without_quantized_tiles(llama, text_file):
    with pytest.raises(ValueError, match="--measure"):
        C.calibrate(
            llama, tokenizer(), source=text_file, start=0, tokens=300, measure=256, chunk=128
        )


@pytest.mark.slow
def test_embedded_model_profile_drives_make_cache(tmp_path):
    """The CLI on the embedded SmolLM2 (two widths, with one-byte scales too; a short
    text): replayed, and its profile gives make_cache per-layer widths for that model only."""
    from kvarn_mlx.loader import load

    out = tmp_path / "smollm2.json"
    C.main(
        [
            "--out",
            str(out),
            "--tokens",
            "512",
            "--measure",
            "256",
            "--widths",
            "2,4",
            "--fp8-widths",
            "2,4",
            "--growth-tokens",
            "1024",
        ]
    )
    p = P.read(out)
    assert p["mode"] == "replay" and len(p["layers"]) == 30
    assert set(p["growth"]["presets"]) == {"auto4v2", "auto2"}
    model, _ = load(None)
    caches = make_cache(model, profile=str(out), bytes_like="k4v4_g128")
    assert {(c.config.k_bits, c.config.v_bits) for c in caches} <= {(2, 2), (2, 4), (4, 2), (4, 4)}
    assert p["fp8_widths"] == [2, 4] and all(set(e["k_fp8"]) == {"2", "4"} for e in p["layers"])
    with pytest.raises(P.ProfileError, match="not on the model loaded now"):
        make_cache(tiny_model("llama64"), profile=str(out), bytes_like="auto4v2")


def test_growth_measures_whole_caches_at_several_lengths(llama, llama_profile, text_file):
    p = dict(llama_profile)
    g = C.measure_growth(llama, tokenizer(), p, "auto4v2", tokens=1024, chunk=128)
    assert list(g["presets"]) == ["auto4v2", "auto2"]  # the base and the narrowest preset
    for kls in g["presets"].values():
        assert list(kls) == ["384", "768", "1024"]  # the calibration's length, doubled, all
    for c in ("384", "768", "1024"):
        assert g["presets"]["auto2"][c] > g["presets"]["auto4v2"][c] > 0
    assert g["tokens"] == 1024 and g["start_char"] == 0
    p["growth"] = g
    P.validate(p)
    from kvarn_mlx import mix as M

    s, kl = M.preset_kl(p, get_preset("auto4v2")), g["presets"]["auto4v2"]
    # calibrated on 384 tokens: the growth starts there
    assert M.predict(p, s, 1024) == pytest.approx(s * kl["1024"] / kl["384"])
    assert M.predict(p, s, 768) == pytest.approx(s * kl["768"] / kl["384"])
    assert M.predict(p, s, 384) == pytest.approx(s)
    with pytest.raises(
        ValueError, match="--growth-tokens 384: use more than the calibration's 384"
    ):
        C.measure_growth(llama, tokenizer(), p, "auto4v2", tokens=384)


def test_add_growth_refuses_before_loading(tmp_path):
    with pytest.raises(SystemExit, match="no profile file"):
        C.main(["--out", str(tmp_path / "p.json"), "--add-growth"])
    with pytest.raises(SystemExit, match="--add-growth measures --growth-tokens"):
        C.main(["--out", str(tmp_path / "p.json"), "--add-growth", "--growth-tokens", "0"])
    with pytest.raises(SystemExit, match="--growth-tokens -1"):
        C.main(["--out", str(tmp_path / "p.json"), "--growth-tokens", "-1"])
    # the growth starts at the calibration's length: it must run past it, checked before
    # the model loads (and before a fresh calibration's hour of work)
    with pytest.raises(SystemExit, match="--growth-tokens 1024: use more than the calibration's"):
        C.main(["--out", str(tmp_path / "p.json"), "--growth-tokens", "1024"])
