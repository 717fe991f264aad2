"""Speculative decoding on KVarN caches: a verification step's draft tokens
that the model rejects never enter a quantized tile, and mlx-lm's speculative
generation gives the tokens of plain greedy decoding.

Short steps (decoding, verifying drafts) leave the tile they fill in the tail
until the next update, after mlx-lm has trimmed the rejected drafts.
"""

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.generate import stream_generate

from kvarn_mlx.cache import KVarNCache
from kvarn_mlx.config import KVarNConfig

CFG = KVarNConfig(k_bits=4, v_bits=2, group_size=64, sink=16)
H, D = 2, 64


def kv(n, seed):
    k1, k2 = mx.random.split(mx.random.key(seed))
    return mx.random.normal((1, H, n, D), key=k1), mx.random.normal((1, H, n, D), key=k2)


def assert_same_state(a, b):
    sa, sb = a.state, b.state
    assert sa.keys() == sb.keys()
    for name, x in sa.items():
        if isinstance(x, mx.array):
            np.testing.assert_array_equal(np.array(x), np.array(sb[name]), err_msg=name)
        else:
            assert x == sb[name], name


@pytest.mark.parametrize("accepted", [0, 1, 2, 3])
def test_rejected_drafts_across_a_tile_boundary_never_enter_a_tile(accepted):
    # The tail holds G - 2 tokens; a step verifies [token, 3 drafts], which would
    # fill the tile with draft tokens; mlx-lm then trims the rejected ones.
    prefix = CFG.sink_size + CFG.group_size + CFG.group_size - 2
    k, v = kv(prefix + 4 + 6, seed=accepted)
    spec, alone = KVarNCache(CFG), KVarNCache(CFG)
    for c in (spec, alone):
        c.update_and_fetch(k[:, :, :prefix], v[:, :, :prefix])
    drafts_k = mx.concatenate(
        [k[:, :, prefix : prefix + 1 + accepted], 50 + k[:, :, prefix + 1 + accepted : prefix + 4]],
        2,
    )
    drafts_v = mx.concatenate(
        [v[:, :, prefix : prefix + 1 + accepted], 50 + v[:, :, prefix + 1 + accepted : prefix + 4]],
        2,
    )
    spec.update_and_fetch(drafts_k, drafts_v)
    assert spec.trim(3 - accepted) == 3 - accepted
    alone.update_and_fetch(
        k[:, :, prefix : prefix + 1 + accepted], v[:, :, prefix : prefix + 1 + accepted]
    )
    assert_same_state(spec, alone)
    # and the next steps (one token, then a verification) go on identically
    n = prefix + 1 + accepted
    for c in (spec, alone):
        c.update_and_fetch(k[:, :, n : n + 1], v[:, :, n : n + 1])
        c.update_and_fetch(k[:, :, n + 1 : n + 5], v[:, :, n + 1 : n + 5])
        c.update_and_fetch(k[:, :, n + 5 : n + 6], v[:, :, n + 5 : n + 6])
    assert spec.n_tiles == 2
    assert_same_state(spec, alone)


def test_without_the_deferral_the_drafts_would_be_quantized(monkeypatch):
    # The check above can fail: committing a short step's tile at once puts the
    # rejected drafts into it, and trimming then dequantizes it (approximately).
    monkeypatch.setattr(KVarNCache, "short_step", 0)
    prefix = CFG.sink_size + 2 * CFG.group_size - 2
    k, v = kv(prefix + 4, seed=9)
    spec, alone = KVarNCache(CFG), KVarNCache(CFG)
    for c in (spec, alone):
        c.update_and_fetch(k[:, :, :prefix], v[:, :, :prefix])
    spec.update_and_fetch(k[:, :, prefix:], v[:, :, prefix:] + 50)
    spec.trim(3)
    alone.update_and_fetch(k[:, :, prefix : prefix + 1], v[:, :, prefix : prefix + 1])
    with pytest.raises(AssertionError):
        assert_same_state(spec, alone)


def test_a_decode_step_quantizes_the_tile_it_filled_at_the_next_step():
    c = KVarNCache(CFG)
    k, v = kv(CFG.sink_size + CFG.group_size + 1, seed=3)
    n = CFG.sink_size + CFG.group_size - 1
    c.update_and_fetch(k[:, :, :n], v[:, :, :n])
    c.update_and_fetch(k[:, :, n : n + 1], v[:, :, n : n + 1])  # fills the tile
    assert (c.n_tiles, c.n_tail) == (0, CFG.group_size)
    c.update_and_fetch(k[:, :, n + 1 :], v[:, :, n + 1 :])
    assert (c.n_tiles, c.n_tail) == (1, 1)
    # a prefill step (longer than short_step) quantizes at once
    p = KVarNCache(CFG)
    p.update_and_fetch(k[:, :, : n + 1], v[:, :, : n + 1])
    assert (p.n_tiles, p.n_tail) == (1, 0)


def test_a_rejected_token_that_chose_the_key_rotation_does_not_keep_its_choice():
    # "auto" key rotation is chosen by the query of the token after the first tile.
    # A verification step completes that tile at its row 2; when rows 2 and 3 are
    # rejected, the choice goes with them and the next step's query makes it, as
    # when decoding the accepted tokens one at a time.
    from kvarn_mlx.attention import packed_attention

    cfg = KVarNConfig(k_bits=4, v_bits=2, group_size=64, sink=16, rotate_keys="auto")
    n = cfg.sink_size + cfg.group_size - 2
    k, v = kv(n + 5, seed=4)
    k = k * mx.array([1.0] * 60 + [40.0] * 4)  # outlier channels: the heads may keep keys plain
    q = kv(5, seed=5)[0] * 3
    spec, alone = KVarNCache(cfg), KVarNCache(cfg)
    for c in (spec, alone):
        c.update_and_fetch(k[:, :, :n], v[:, :, :n])
    spec.update_and_fetch(k[:, :, n : n + 4], v[:, :, n : n + 4])
    packed_attention(q[:, :, :4], spec, 0.125, mask="causal")
    assert spec.room_tile == "chose_rotation" and not isinstance(spec.rotate_k, bool)
    spec.trim(2)
    assert spec.room_tile is None and spec.rotate_k is True
    alone.update_and_fetch(k[:, :, n : n + 2], v[:, :, n : n + 2])
    packed_attention(q[:, :, :2], alone, 0.125, mask="causal")
    for c in (spec, alone):
        c.update_and_fetch(k[:, :, n + 4 : n + 5], v[:, :, n + 4 : n + 5])
        packed_attention(q[:, :, 4:5], c, 0.125)
    assert_same_state(spec, alone)
    assert spec.n_tiles == 1


def greedy(model, tok, prompt, n, cache, **kwargs):
    """Greedy tokens and the top-two logit gap at each (without a draft)."""
    out, gaps = [], []
    for g in stream_generate(model, tok, prompt, max_tokens=n, prompt_cache=cache, **kwargs):
        out.append(g.token)
        top = mx.topk(g.logprobs, 2)
        gaps.append(float(top.max() - top.min()))
    return out, gaps


@pytest.mark.parametrize(
    "preset,prompt_len,draft_seed",
    [
        (CFG, 40, 0),
        (CFG, 100, 1),  # tiles at 80, 144, 208 while decoding
        ("auto4v2", 40, 0),
        ("auto4v2", 90, 1),  # sink 16: the first tile (and its key rotation) at 144
    ],
)
def test_speculative_decoding_gives_the_greedy_tokens(preset, prompt_len, draft_seed, monkeypatch):
    # mlx-lm's speculative decoding with a draft model (seed 0: the same weights,
    # most drafts accepted; seed 1: another model, most rejected) over a KVarN cache
    # on the main model gives plain greedy decoding's tokens. A verification step
    # that completes a tile lets its later rows read that tile quantized, as
    # one-token decoding does (counted below).
    from mlx_lm.models.cache import make_prompt_cache

    from kvarn_mlx import attention
    from kvarn_mlx.integration import make_cache
    from models import tiny_model, tokenizer, tokens

    model, draft, tok = tiny_model("llama64"), tiny_model("llama64", seed=draft_seed), tokenizer()
    prompt = [t % 255 for t in tokens(prompt_len, seed=prompt_len)]
    make = lambda: make_cache(model, preset, **({"sink": 16} if isinstance(preset, str) else {}))
    want, gaps = greedy(model, tok, prompt, 120, make())
    splits = []
    split_step = attention._split_step
    monkeypatch.setattr(attention, "_split_step", lambda *a: splits.append(1) or split_step(*a))
    got = [
        g.token
        for g in stream_generate(
            model,
            tok,
            prompt,
            max_tokens=120,
            draft_model=draft,
            num_draft_tokens=3,
            prompt_cache=make() + make_prompt_cache(draft),
        )
    ]
    assert splits, "no verification step completed a tile"
    for i, (a, b) in enumerate(zip(want, got)):
        if a != b:
            assert gaps[i] < 1e-3, (
                f"token {i}: {a} greedy, {b} speculative, top-two gap {gaps[i]:.2e}"
            )
            return  # a near tie: the tokens after it are not comparable
    assert got == want


@pytest.mark.slow  # the decoding itself: test_speculative_decoding_gives_the_greedy_tokens
def test_generate_with_a_draft_model(tmp_path, capsys, monkeypatch):
    # python -m kvarn_mlx.generate --draft-model: the same text as without it.
    from kvarn_mlx import attention, generate
    from model_folder import tiny_model_folder

    main, draft = (
        tiny_model_folder(tmp_path / "main"),
        tiny_model_folder(tmp_path / "draft", seed=1),
    )
    args = [
        "--model",
        str(main),
        "--prompt",
        "the quick brown fox " * 12,
        "--max-tokens",
        "90",
        "--kv-preset",
        "k4v2_g64",
        "--kv-sink",
        "16",
        "--verbose",
        "false",
    ]
    generate.main(args)
    want = capsys.readouterr().out
    splits = []
    split_step = attention._split_step
    monkeypatch.setattr(attention, "_split_step", lambda *a: splits.append(1) or split_step(*a))
    generate.main(args + ["--draft-model", str(draft), "--num-draft-tokens", "3"])
    assert capsys.readouterr().out == want
    assert splits  # verification steps completed tiles
    with pytest.raises(SystemExit, match="--num-draft-tokens 0"):
        generate.main(args + ["--draft-model", str(draft), "--num-draft-tokens", "0"])
