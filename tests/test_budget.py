"""--max-kv-bytes: the bound on what one step adds, and generate stopping before the budget."""

import random
import re

import mlx.core as mx
import pytest
from mlx_lm.models.cache import KVCache, QuantizedKVCache, RotatingKVCache

from kvarn_mlx import budget, byte_models, generate
from kvarn_mlx.cache import KVarNCache
from kvarn_mlx.config import KVarNConfig, get_preset
from model_folder import tiny_model_folder

LAYER = byte_models.Layer("kv", heads=2, k_dim=64, v_dim=64, dtype="float16")
KINDS = {
    "plain": (KVCache, "plain"),
    "mlx-lm 4-bit": (lambda: QuantizedKVCache(64, 4), 4),
    "mlx-lm 8-bit": (lambda: QuantizedKVCache(64, 8), 8),
    "k4v2_g128": (lambda: KVarNCache("k4v2_g128"), get_preset("k4v2_g128")),
    "k2v2 g64 sink 0": (
        lambda: KVarNCache(KVarNConfig(2, 2, 64, sink=0)),
        KVarNConfig(2, 2, 64, sink=0),
    ),
    "k8v8 sink 64": (
        lambda: KVarNCache(KVarNConfig(8, 8, 128, sink=64)),
        KVarNConfig(8, 8, 128, sink=64),
    ),
}


def feed(c, n):
    z = mx.zeros((1, LAYER.heads, n, LAYER.k_dim), mx.float16)
    c.update_and_fetch(z, z)
    return c.nbytes


def steps(seed):
    """Prompt chunks, speculative-sized steps and long runs of one-token steps."""
    rng = random.Random(seed)
    out = [rng.choice([1, 5, 100, 300, 2048])]
    while sum(out) < 5000:
        out += rng.choice([[1] * rng.randint(1, 400), [rng.randint(2, 16)], [rng.randint(17, 700)]])
    return out


@pytest.mark.parametrize("name", KINDS)
def test_no_step_adds_more_than_its_bound(name):
    make, kind = KINDS[name]
    m = byte_models.byte_model(LAYER, kind, 2048)
    worst = 0.0
    for seed in range(3):
        c, held, before_two = make(), 0, 0
        seq = steps(seed)
        for i, L in enumerate(seq):
            now = feed(c, L)
            bound = budget.step_allocation(m, L)
            assert now - held <= bound, (
                f"{name}: a {L}-token step added {now - held} > {bound} bytes"
            )
            worst = max(worst, (now - held) / bound)
            if i and L == 1 and seq[i - 1] == 1:  # two one-token steps against the two-token bound
                assert now - before_two <= budget.step_allocation(m, 2)
            before_two, held = held, now
            if i % 64 == 0:
                mx.eval(c.state)  # keeps the lazy graph short
    # Not a vacuous bound: some step comes close to it.
    assert worst > 0.7, f"{name}: steps add at most {worst:.0%} of the bound"


def test_window_cache_bound():
    layer = byte_models.Layer("window", heads=2, k_dim=64, v_dim=64, dtype="float16", window=300)
    m = byte_models.byte_model(layer, "plain", 2048)
    c, held = RotatingKVCache(max_size=300), 0
    for L in steps(5):
        now = feed(c, L)
        assert now - held <= budget.step_allocation(m, L)
        held = now


@pytest.mark.parametrize(
    "text, n", [("2GB", 2 * 2**30), ("512MiB", 512 * 2**20), ("1.5G", 3 * 2**29), ("4096", 4096)]
)
def test_sizes(text, n):
    assert budget.parse_size(text) == n


@pytest.mark.parametrize("text", ["0", "0GB", "lots", "-1GB", "2 GBs"])
def test_bad_sizes_say_what_to_write(text):
    with pytest.raises(ValueError, match="write e.g.|give a positive size"):
        budget.parse_size(text)


# -- generate --------------------------------------------------------------------------

PROMPT = ["--prompt", "hello " * 100, "--ignore-chat-template", "--verbose", "false"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return tiny_model_folder(tmp_path_factory.mktemp("models") / "tiny")


def stop_line(err):
    m = re.search(
        r"stopped after (\d+) generated tokens by --max-kv-bytes: the KV cache holds ([\d,]+) "
        r"bytes "
        r".* could add up to ([\d,]+) bytes .*budget of ([\d,]+) bytes",
        err,
    )
    assert m, err
    return [int(g.replace(",", "")) for g in m.groups()]


@pytest.mark.parametrize(
    "preset, size",
    [
        ("k4v2_g128", "300KiB"),
        ("fp16", "600KiB"),
        pytest.param("k2v2_g128", "400KiB", marks=pytest.mark.slow),  # as k4v2, 5x longer
    ],
)
def test_generate_stops_before_the_budget(tiny, capsys, preset, size):
    generate.main(
        [
            "--model",
            str(tiny),
            *PROMPT,
            "--max-tokens",
            "3000",
            "--kv-preset",
            preset,
            "--max-kv-bytes",
            size,
        ]
    )
    err = capsys.readouterr().err
    n, held, more, limit = stop_line(err)
    assert limit == budget.parse_size(size)
    assert 0 < n < 3000
    assert (
        held <= limit < held + more
    )  # within the budget, stopped at the first step that could cross it


def test_generate_under_the_budget_runs_to_the_end(tiny, capsys):
    generate.main(["--model", str(tiny), *PROMPT, "--max-tokens", "50", "--max-kv-bytes", "1GB"])
    assert "--max-kv-bytes" not in capsys.readouterr().err


def test_a_prompt_that_cannot_fit_is_an_error(tiny):
    with pytest.raises(SystemExit) as e:
        generate.main(["--model", str(tiny), *PROMPT, "--max-kv-bytes", "20KiB"])
    msg = e.value.code
    assert (
        msg.startswith("error: --max-kv-bytes: the 101-token prompt does not fit")
        and "\n" not in msg
    )
    assert "python -m kvarn_mlx.plan" in msg


def test_bad_size_fails_before_loading(monkeypatch):
    monkeypatch.setattr("kvarn_mlx.loader.load", lambda *a, **k: pytest.fail("loaded the model"))
    with pytest.raises(SystemExit, match="--max-kv-bytes: cannot read 'lots' as a size"):
        generate.main(["--max-kv-bytes", "lots"])


def test_speculative_decoding_stops_before_the_budget(tiny, capsys):
    # Verification steps add --num-draft-tokens + 1 tokens; the prompt is checked whole
    # (mlx-lm's speculative decoding reports no prompt progress).
    generate.main(
        [
            "--model",
            str(tiny),
            *PROMPT,
            "--max-tokens",
            "3000",
            "--kv-preset",
            "k4v2_g128",
            "--max-kv-bytes",
            "300KiB",
            "--draft-model",
            str(tiny),
            "--num-draft-tokens",
            "3",
        ]
    )
    n, held, more, limit = stop_line(capsys.readouterr().err)
    assert 0 < n < 3000 and held <= limit < held + more
    with pytest.raises(
        SystemExit, match="the 101-token prompt does not fit; after 0 prompt tokens"
    ):
        generate.main(
            ["--model", str(tiny), *PROMPT, "--max-kv-bytes", "100KiB", "--draft-model", str(tiny)]
        )
