"""KVarN caches in mlx-lm's batch protocol: BatchKVarNCache (merge, prepare,
finalize, filter, extend, extract, trim, state), batch_generate and
BatchGenerator against each sequence generated alone.

The cache tests feed random keys and values and compare every row with a
single KVarNCache fed only that row's tokens, in the same chunks: the two must
be bit-identical. Model tests use the tiny random-weight models of
tests/models.py; the embedded model's run is marked slow.
"""

import contextlib
import copy

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.generate import BatchGenerator, batch_generate, stream_generate
from mlx_lm.models.cache import make_prompt_cache

import kvarn_mlx
from kvarn_mlx import attention, dispatch
from kvarn_mlx.batch_cache import BatchKVarNCache
from kvarn_mlx.cache import KVarNCache
from kvarn_mlx.config import KVarNConfig, get_preset
from kvarn_mlx.integration import make_cache
from models import tiny_model, tokenizer, tokens

CFG = KVarNConfig(k_bits=4, v_bits=2, group_size=64, sink=16)
H, D, HQ = 2, 64, 4
SCALE = D**-0.5
NEAR_TIE = 1e-3


def randn(*shape, seed):
    return mx.random.normal(shape, key=mx.random.key(seed))


class Run:
    """A BatchKVarNCache and, per row, a single KVarNCache fed the same real tokens."""

    def __init__(self, prefixes, seed=0, configs=None):
        self.singles = []
        for i, n in enumerate(prefixes):
            c = KVarNCache(CFG if configs is None else configs[i])
            if n:
                c.update_and_fetch(
                    randn(1, H, n, D, seed=seed + i), randn(1, H, n, D, seed=seed + 50 + i)
                )
            self.singles.append(c)
        self.batch = BatchKVarNCache.merge(self.singles)  # copies: the singles go on alone
        self.seed = seed + 100

    def step(self, spans):
        """One update of the batch: spans[b] = (start, end) of row b's real tokens
        among this step's columns (the rest is padding, filled with huge values).
        Returns the batch attention output and each single's output."""
        B, L = len(spans), max(e for _, e in spans)
        self.seed += 1
        k, v = randn(B, H, L, D, seed=self.seed) * 3, randn(B, H, L, D, seed=self.seed + 1000)
        q = randn(B, HQ, L, D, seed=self.seed + 2000)
        real = np.zeros((B, 1, L, 1), bool)
        for b, (s, e) in enumerate(spans):
            real[b, :, s:e] = True
        k, v = (mx.where(mx.array(real), x, 1e4) for x in (k, v))
        mask = self.batch.make_mask(L)
        self.batch.update_and_fetch(k, v)
        got = self.batch.attention(q, SCALE, mask)
        want = []
        for b, (s, e) in enumerate(spans):
            if e == s:
                want.append(None)
                continue
            self.singles[b].update_and_fetch(k[b : b + 1, :, s:e], v[b : b + 1, :, s:e])
            want.append(
                attention.packed_attention(
                    q[b : b + 1, :, s:e], self.singles[b], SCALE, "causal" if e - s > 1 else None
                )
            )
        mx.eval(got, [w for w in want if w is not None])
        for b, (s, e) in enumerate(spans):
            row = np.array(got[b])
            assert not row[:, :s].any() and not row[:, e:].any(), (
                f"row {b}: padding positions are not zero"
            )
            if want[b] is not None:  # a decode step attends over all rows at once
                np.testing.assert_allclose(
                    row[:, s:e], np.array(want[b][0]), rtol=1e-5, atol=2e-6, err_msg=f"row {b}"
                )
        return got

    def prompt(self, lengths, chunk=None):
        """A right-padded prompt as PromptProcessingBatch.prompt runs it."""
        L = max(lengths)
        self.batch.prepare(lengths=lengths, right_padding=[L - n for n in lengths])
        chunk = chunk or L
        for c0 in range(0, L, chunk):
            c1 = min(L, c0 + chunk)
            self.step([(0, max(0, min(n, c1) - c0)) for n in lengths])
        self.batch.finalize()

    def decode(self, n=1):
        for _ in range(n):
            self.step([(0, 1)] * len(self.singles))

    def check(self):
        """Every row's extracted cache equals its single cache; the bookkeeping agrees."""
        b = self.batch
        assert b.offset.tolist() == [c.offset for c in self.singles]
        assert b.left_padding.tolist() == [b.size() - c.offset for c in self.singles]
        for i, c in enumerate(self.singles):
            assert_same_cache(b.extract(i), c)
        # The batch holds the rows' sinks and tails, one tile storage for all rows
        # (room up to the longest row's tiles, as mlx-lm's batch caches pad) and,
        # while it decodes, the rows' recent tokens side by side.
        dense = [x for r in b.rows for x in (r.sink_k, r.sink_v, r.tail_k, r.tail_v)]
        dense += list(b._recent or ())
        if b._tiles is None:  # rows of other settings: each its own storage
            tiles = sum(r.tiles.nbytes for r in b.rows if r.tiles is not None)
        else:
            tiles = 0 if b._tiles.storage is None else b._tiles.storage.nbytes
        assert b.nbytes == sum(x.nbytes for x in dense if x is not None) + tiles
        assert b.nbytes >= sum(c.nbytes - c.nbytes_breakdown()["unused"] for c in self.singles)


def assert_same_cache(a, b, held=True):
    assert isinstance(a, KVarNCache) and type(a) is type(b)
    sa, sb = a.state, b.state
    assert sa.keys() == sb.keys()
    for name in sa:
        x, y = sa[name], sb[name]
        if isinstance(x, mx.array):
            np.testing.assert_array_equal(np.array(x), np.array(y), err_msg=name)
        else:
            assert x == y, name
    if held:
        assert a.nbytes == b.nbytes


# -- the cache --------------------------------------------------------------------------


def test_rows_keep_their_own_tokens_sinks_and_tiles():
    # Prefixes of different lengths (prefix reuse), a right-padded prompt in two
    # chunks with tiles quantized in the middle of it, then decode steps across
    # tile boundaries: every row equals a cache built from its tokens alone.
    run = Run([70, 0, 5])
    assert run.batch.left_padding.tolist() == [0, 70, 65] and run.batch.size() == 70
    run.prompt([30, 140, 3], chunk=100)
    run.check()
    assert [c.n_tiles for c in run.singles] == [1, 1, 0]
    run.decode(75)
    run.check()
    assert [c.n_tiles for c in run.singles] == [2, 3, 1]


def test_filter_extend_extract_move_tiles_without_quantizing(monkeypatch):
    run = Run([200, 90, 150])
    other = Run([10, 300], seed=7)

    def no_quantizing(*args, **kwargs):
        raise AssertionError("tiles were quantized again")

    monkeypatch.setattr(dispatch, "_quantize", no_quantizing)
    run.batch.filter([2, 0])
    assert run.batch.left_padding.tolist() == [50, 0] and run.batch.size() == 200
    run.batch.extend(other.batch)
    assert run.batch.left_padding.tolist() == [150, 100, 290, 0] and run.batch.size() == 300
    run.singles = [run.singles[2], run.singles[0], *other.singles]
    run.check()
    run.batch.filter([0, 2])  # the two shortest: their common padding is dropped
    assert run.batch.left_padding.tolist() == [0, 140] and run.batch.size() == 150
    run.singles = [run.singles[0], run.singles[2]]
    run.check()
    monkeypatch.undo()
    run.decode(3)  # goes on exactly
    run.check()


def test_decode_attends_over_all_rows_in_one_graph(monkeypatch):
    # Rows of different lengths cross tile boundaries at different steps, commit
    # them at different turns, and join and leave: each decode step is one
    # attention call over all rows, equal to each row's own (Run.step), and the
    # rows hold what their single caches hold (Run.check).
    calls = []
    together = BatchKVarNCache._attend_together
    monkeypatch.setattr(
        BatchKVarNCache,
        "_attend_together",
        lambda self, q, *a: calls.append(q.shape[0]) or together(self, q, *a),
    )
    run = Run([300, 90, 16, 200])
    run.decode(70)
    assert calls == [4] * 70
    run.check()
    assert [c.n_tiles for c in run.singles] == [5, 2, 1, 3]
    run.batch.filter([3, 1])
    run.singles = [run.singles[3], run.singles[1]]
    other = Run([5, 140], seed=9)
    run.batch.extend(other.batch)
    run.singles += other.singles
    calls.clear()
    run.decode(60)
    assert calls == [4] * 60
    run.check()
    run.batch.trim(3)
    for c in run.singles:
        c.trim(3)
    run.decode(5)
    run.check()


@pytest.mark.parametrize("preset,scales", [("auto4v2", "float16"), ("k2v2_g128", "fp8")])
def test_one_graph_decode_with_per_head_rotation_and_fp8_scales(preset, scales):
    # auto4v2: each row chooses its keys' rotation per kv head with its own queries
    # (rows differ: the step attends with [B, H] flags); fp8 scales are e4m3
    # bytes, which the shared storage keeps as they are.
    cfg = get_preset(preset, group_size=64, sink=16, scale_dtype=scales)
    run = Run([70, 150, 10], configs=[cfg] * 3)
    run.decode(80)
    run.check()
    flags = [c.rotate_k for c in run.batch.rows]
    assert all(isinstance(f, mx.array) for f in flags) or preset != "auto4v2"


def test_one_graph_decode_with_a_full_precision_tail():
    # tail_tokens: the newest tokens stay in full precision, tiles leave the tail later.
    cfg = KVarNConfig(k_bits=4, v_bits=2, group_size=64, sink=16, tail_tokens=64)
    run = Run([200, 30, 120], configs=[cfg] * 3)
    run.decode(70)
    run.check()
    assert [c.n_tiles for c in run.singles] == [c.n_tiles for c in run.batch.rows]
    assert run.singles[0].n_tiles >= 2 and run.singles[1].n_tiles == 0


def test_rows_of_other_settings_attend_per_row():
    # Rows whose tiles differ in shape cannot share one storage: each keeps its own.
    run = Run([100, 90], configs=[CFG, KVarNConfig(k_bits=2, v_bits=4, group_size=64, sink=16)])
    assert run.batch._tiles is None
    run.decode(40)
    run.check()


def test_extract_is_independent_of_the_batch():
    run = Run([100, 40])
    got = run.batch.extract(1)
    saved = got.state
    run.decode(30)  # the batch row fills its tail in place
    for name, x in got.state.items():
        if isinstance(x, mx.array):
            np.testing.assert_array_equal(np.array(x), np.array(saved[name]), err_msg=name)
    # and the extracted cache goes on like the row's single cache did before those steps
    assert got.offset == 40


def test_merge_leaves_its_caches_alone():
    c = KVarNCache(CFG)
    c.update_and_fetch(randn(1, H, 20, D, seed=1), randn(1, H, 20, D, seed=2))
    saved = c.state
    b = BatchKVarNCache.merge([c, KVarNCache(CFG)])
    b.update_and_fetch(randn(2, H, 5, D, seed=3), randn(2, H, 5, D, seed=4))
    assert c.offset == 20
    np.testing.assert_array_equal(np.array(c.state["tail_k"]), np.array(saved["tail_k"]))


def test_empty_batches_and_left_padding():
    b = BatchKVarNCache.merge([])
    assert b.empty() and b.size() == 0 and b.nbytes == 0 and b.offset.tolist() == []
    run = Run([0, 0, 0])
    assert run.batch.empty() and run.batch.nbytes == 0
    run.batch.prepare(left_padding=[3, 0, 8])
    assert run.batch.offset.tolist() == [-3, 0, -8]
    run.step([(3, 10), (0, 10), (8, 10)])
    run.check()
    with pytest.raises(ValueError, match="empty"):
        run.batch.prepare(left_padding=[1, 1, 1])
    with pytest.raises(ValueError, match="lengths"):
        run.batch.prepare(right_padding=[1, 0, 0])


def test_decoding_rows_hold_their_tail_once():
    # While the batch decodes, an appending row's tail lives in the batch's recent
    # buffer only; read from outside, the row has it back as its single cache holds it.
    run = Run([100, 40])
    run.decode(5)
    b = run.batch
    assert all(r.tail_k is None and r.tail_v is None for r in b._rows)
    held = sum(x.nbytes for r in b._rows for x in r.held_arrays()) + sum(
        x.nbytes for x in b._recent
    )
    assert b.nbytes == held
    assert [r.tail_k.shape for r in b.rows] == [c.tail_k.shape for c in run.singles]
    run.decode(1)  # the next step drops them again
    assert all(r.tail_k is None for r in b._rows)
    run.check()


def test_decode_step_with_a_row_still_empty():
    # A row merged before any token (mlx-lm's server runs a one-token prompt as a
    # one-token step): its first token starts its cache, the other rows decode on.
    run = Run([150, 0, 20])
    run.decode(3)
    run.check()


def test_mask_is_mlx_lms_causal_mask_with_left_padding():
    from mlx_lm.models.cache import BatchKVCache

    run = Run([30, 12])
    plain = BatchKVCache([0, 18])
    plain.update_and_fetch(mx.zeros((2, H, 30, D)), mx.zeros((2, H, 30, D)))
    for N in (1, 5):
        np.testing.assert_array_equal(
            np.array(run.batch.make_mask(N)), np.array(plain.make_mask(N))
        )
    assert run.batch.offset.tolist() == plain.offset.tolist()


def test_an_array_mask_of_another_origin_is_applied_per_row():
    # A mask the model built itself (here: the causal mask made by hand) is cut per
    # row; the result equals the recognized causal mask's.
    run = Run([40, 7])
    k, v = randn(2, H, 6, D, seed=5), randn(2, H, 6, D, seed=6)
    q = randn(2, HQ, 6, D, seed=7)
    from mlx_lm.models.base import create_causal_mask

    mask = create_causal_mask(6, offset=40, left_padding=run.batch.left_padding)
    run.batch.update_and_fetch(k, v)
    got = run.batch.attention(q, SCALE, mask)
    want = run.batch.attention(q, SCALE, None)  # None: each row causal on its own tokens
    np.testing.assert_allclose(np.array(got), np.array(want), atol=1e-6)


@pytest.mark.parametrize("prefixes,steps", [([50, 20], 1), ([200, 20, 90], 3)])
def test_fallback_keys_and_values_are_in_the_batch_layout(prefixes, steps):
    # Decode steps return every row's keys and values (its tiles dequantized) in
    # the batch layout, gathered from the step's view of all rows.
    run = Run(prefixes)
    run.prompt([10, 3, 40][: len(prefixes)])
    for i in range(steps):
        B = len(prefixes)
        k, v = run.batch.update_and_fetch(
            randn(B, H, 1, D, seed=8 + i), randn(B, H, 1, D, seed=9 + i)
        )
        assert k.shape == (B, H, run.batch.size(), D)
        for b, lp in enumerate(run.batch.left_padding.tolist()):
            row_k, row_v = run.batch.rows[b].dequantized()
            assert not np.array(k[b, :, :lp]).any()
            np.testing.assert_array_equal(np.array(k[b, :, lp:]), np.array(row_k[0]))
            np.testing.assert_array_equal(np.array(v[b, :, lp:]), np.array(row_v[0]))
    assert [r.n_tiles for r in run.batch.rows][:2] == ([0, 0] if steps == 1 else [3, 0])


def test_trim():
    run = Run([100, 30])
    run.decode(5)
    assert run.batch.trim(10) == 10
    for c in run.singles:
        c.trim(10)
    run.check()
    assert run.batch.trim(50) == 50  # the short row is emptied
    for c in run.singles:
        c.trim(50)
    assert run.batch.offset.tolist() == [45, 0] and run.batch.left_padding.tolist() == [0, 45]
    run.decode(2)
    run.check()


def test_state_round_trip():
    run = Run([100, 30])
    run.prompt([5, 20])
    again = BatchKVarNCache.from_state(run.batch.state)
    assert (
        again.left_padding.tolist() == run.batch.left_padding.tolist()
        and again.size() == run.batch.size()
    )
    for a, b in zip(again.rows, run.batch.rows):
        assert_same_cache(a, b, held=False)  # a state holds no preallocated room
    mx.eval(run.batch.state)  # mlx-lm evaluates the state of batch caches
    bad = run.batch.state
    bad["idx"] += 1
    with pytest.raises(ValueError, match="corrupt"):
        BatchKVarNCache.from_state(bad)


def test_bad_input():
    with pytest.raises(TypeError, match="KVarNCache"):
        BatchKVarNCache.merge([KVarNCache(CFG), object()])
    run = Run([10, 10])
    with pytest.raises(ValueError, match="2 sequences"):
        run.batch.update_and_fetch(randn(3, H, 1, D, seed=1), randn(3, H, 1, D, seed=2))


# -- with mlx-lm ----------------------------------------------------------------------


def alone(model, tok, prompt, n, cache, **kwargs):
    """Greedy tokens of the prompt generated alone into cache, the top-two
    logit gap at each step, and every token the cache took (the prompt, the
    tokens and a stop token)."""
    out, gaps = [], []
    for g in stream_generate(model, tok, prompt, max_tokens=n, prompt_cache=cache, **kwargs):
        if g.finish_reason == "stop":  # batch_generate leaves the stop token out
            return out, gaps, list(prompt) + out + [g.token]
        top = mx.topk(g.logprobs, 2)
        out.append(g.token)
        gaps.append(float(top.max() - top.min()))
    return out, gaps, list(prompt) + out


def near_ties(single, gaps, batched):
    """1 if the sequences part at a near tie of the single run (tokens after
    that are not comparable), 0 if they are equal; anything else fails."""
    for i, (a, b) in enumerate(zip(single, batched)):
        if a != b:
            assert gaps[i] < NEAR_TIE, (
                f"token {i}: {a} alone, {b} batched, top-two gap {gaps[i]:.2e}"
            )
            return 1
    assert len(single) == len(batched)
    return 0


def assert_like_alone(caches, single, tie, model, ids):
    """The batch's returned caches are KVarNCaches like the single run's: same
    bytes and tiles, and (unless the tokens parted) the same contents up to the
    float noise of batched matmuls. That noise can flip a code at a rounding tie,
    and the flip travels on through later layers and tokens, so where a layer
    holds tiles the bound is a tenth of what quantizing changed: the distance to
    a plain cache fed the same tokens ids (wrong rows, padding in a tile's
    statistics or a misplaced tile move the contents by the quantization error
    or more)."""
    assert [type(c) for c in caches] == [type(c) for c in single]
    plain = make_prompt_cache(model)
    kv = [(a, b, p) for a, b, p in zip(caches, single, plain) if isinstance(a, KVarNCache)]
    assert kv
    if tie:
        return
    model(mx.array(ids)[None], cache=plain)
    for a, b, p in kv:  # (mlx-lm's own batch caches may extract with other preallocated room)
        assert a.nbytes == b.nbytes
        assert (a.offset, a.n_tiles, a.n_tail) == (
            b.offset,
            b.n_tiles,
            b.n_tail,
        ) and p.offset == b.offset
        for x, y, z in zip(
            a.dequantized(),
            b.dequantized(),
            (p.keys[..., : p.offset, :], p.values[..., : p.offset, :]),
        ):
            x, y, z = (np.array(t.astype(mx.float32)) for t in (x, y, z))
            bound = max(1e-2 * np.linalg.norm(y), 0.1 * np.linalg.norm(y - z) if b.n_tiles else 0)
            assert np.linalg.norm(x - y) <= bound


def check_against_alone(model, tok, prompts, make, n, report=None, **kwargs):
    """batch_generate over the prompts against each prompt alone; the number of
    near ties. report: a list to get (prompt tokens, tokens, smallest top-two gap) per prompt."""
    r = batch_generate(
        model,
        tok,
        prompts,
        prompt_caches=[make() for _ in prompts],
        max_tokens=n,
        return_prompt_caches=True,
        return_token_ids=True,
        **kwargs,
    )
    ties = 0
    for p, got, caches in zip(prompts, r.token_ids, r.caches):
        single = make()
        want, gaps, ids = alone(model, tok, p, n, single)
        tie = near_ties(want, gaps, got)
        assert_like_alone(caches, single, tie, model, ids)
        ties += tie
        if report is not None:
            report.append((len(p), len(want), min(gaps)))
    return ties


@pytest.mark.parametrize("name,preset", [("llama64", CFG), ("qwen2", "auto4v2"), ("gemma3", CFG)])
def test_batch_generate_equals_each_prompt_alone(name, preset):
    model, tok = tiny_model(name), tokenizer()
    prompts = [[t % 255 for t in tokens(n, seed=i)] for i, n in enumerate([20, 100, 170, 300])]
    sink = dict(sink=16) if isinstance(preset, str) else {}
    ties = check_against_alone(model, tok, prompts, lambda: make_cache(model, preset, **sink), 40)
    assert ties <= 1


def test_batch_generator_with_sequences_joining_and_leaving():
    # Continuous batching: sequences join a running batch (extend), finish at
    # different lengths (filter), one starts from a cache holding its prefix.
    model, tok = tiny_model("llama64"), tokenizer()
    make = lambda: make_cache(model, CFG)
    prompts = [[t % 255 for t in tokens(n, seed=10 + i)] for i, n in enumerate([150, 30, 90, 250])]
    lengths = [30, 12, 45, 20]
    prefix = make()
    model(mx.array(prompts[3][:140])[None], cache=prefix)
    inputs = prompts[:3] + [prompts[3][140:]]
    starts = [make(), make(), make(), prefix]
    singles = [make(), make(), make(), copy.deepcopy(prefix)]

    gen = BatchGenerator(model, stop_tokens=[[tok.eos_token_id]], prefill_step_size=64)
    uids = gen.insert(inputs[:2], max_tokens=lengths[:2], caches=starts[:2])
    out = {u: [] for u in uids}
    for _ in range(8):
        for r in gen.next_generated():
            out[r.uid].append(r.token)
    uids += gen.insert(inputs[2:], max_tokens=lengths[2:], caches=starts[2:])
    out.update({u: [] for u in uids[2:]})
    caches = {}
    while responses := gen.next_generated():
        for r in responses:
            out[r.uid].append(r.token)
            if r.finish_reason is not None:
                caches[r.uid] = r.prompt_cache
    gen.close()
    for p, n, u, single in zip(inputs, lengths, uids, singles):
        want, gaps, ids = alone(model, tok, p, n, single, prefill_step_size=64)
        ids = prompts[3][:140] + ids if u == uids[3] else ids
        assert_like_alone(caches[u], single, near_ties(want, gaps, out[u]), model, ids)


def test_without_the_patch_the_dequantized_keys_serve():
    # Models that call mx.fast.scaled_dot_product_attention directly get the
    # batch layout of dequantized keys and values with the batch mask.
    model, tok = tiny_model("llama64"), tokenizer()
    prompts = [[t % 255 for t in tokens(n, seed=20 + i)] for i, n in enumerate([40, 130])]
    make = lambda: make_cache(model, CFG)
    kvarn_mlx.unpatch()
    try:
        ties = check_against_alone(model, tok, prompts, make, 20)
    finally:
        kvarn_mlx.patch()
    assert ties == 0


@pytest.mark.slow
def test_batch_generate_on_the_embedded_model(smollm):
    from kvarn_mlx.eval.runner import load_text

    model, tok = smollm
    ids = tok.encode(load_text("topics"))
    prompts = [ids[s : s + n] for s, n in ((0, 20), (3000, 300), (6000, 700), (9000, 1500))]
    report = []
    ties = check_against_alone(model, tok, prompts, lambda: make_cache(model), 64, report)
    for n, m, gap in report:
        print(
            f"prompt {n} tokens: {m} greedy tokens compared, smallest top-two logit gap {gap:.2e}"
        )
    print(f"near ties: {ties} of {len(prompts)} prompts")


def metal_or_skip():
    """The MSL emulator module (None on a Metal device); skips the test with neither."""
    import metal_emulator

    mslemu = None if metal_emulator.NATIVE else metal_emulator.load()
    if not metal_emulator.NATIVE and mslemu is None:
        pytest.skip(metal_emulator.SKIP_REASON)
    return mslemu


@contextlib.contextmanager
def metal_attention(monkeypatch, mslemu):
    """Attention through the Metal kernel, natively or in the emulator (metal_or_skip());
    yields the list of the kernel's calls, each as its batch size."""
    from kvarn_mlx import kernels

    calls = []
    kernel = kernels.packed_attention_metal
    monkeypatch.setattr(
        kernels, "packed_attention_metal", lambda q, *a: calls.append(q.shape[0]) or kernel(q, *a)
    )
    monkeypatch.setattr(dispatch, "_backend", "auto")
    with contextlib.ExitStack() as stack:
        if mslemu is not None:
            stack.enter_context(mslemu.patch_mlx())
            stack.enter_context(mslemu.options_scope(lint="0"))
        yield calls


@pytest.mark.emulator
def test_metal_kernel_decodes_all_rows_in_one_call(monkeypatch):
    # The batch's decode steps reach the Metal attention kernel (a device, or the MSL
    # emulator on Linux) once for all rows, each row read to its own lengths, and
    # give the ops path's tokens.
    mslemu = metal_or_skip()
    model, tok = tiny_model("llama64"), tokenizer()
    # rows of 0 and 2 tiles, and sinks and tails of their own lengths
    prompts = [[t % 255 for t in tokens(n, seed=31 + i)] for i, n in enumerate([60, 150])]

    def generate():
        caches = [make_cache(model, CFG) for _ in prompts]
        return batch_generate(
            model, tok, prompts, prompt_caches=caches, max_tokens=12, return_token_ids=True
        ).token_ids

    monkeypatch.setattr(dispatch, "_backend", "ops")
    want = generate()
    with metal_attention(monkeypatch, mslemu) as calls:
        got = generate()
    assert [len(g) for g in got] == [12, 12]
    assert set(calls) == {2} and len(calls) >= 2 * 11  # two layers, the decode steps
    assert got == want


@pytest.mark.emulator
@pytest.mark.parametrize("cfg", [CFG, get_preset("auto4v2", group_size=64, sink=16)])
def test_metal_kernel_reads_each_row_to_its_own_lengths(monkeypatch, cfg):
    # Rows of 0, 1 and 3 tiles, sinks of 10 and 16 tokens, tails of their own
    # lengths: the kernel's one call equals each row's own attention (ops path).
    mslemu = metal_or_skip()
    run = Run([230, 9, 100], configs=[cfg] * 3)
    if cfg.rotate_keys == "auto":  # each row's own per-head choice: [B, H] flags
        run.decode(2)
    B = len(run.singles)
    k, v = randn(B, H, 1, D, seed=70), randn(B, H, 1, D, seed=71)
    q = randn(B, HQ, 1, D, seed=72)
    run.batch.update_and_fetch(k, v)
    with metal_attention(monkeypatch, mslemu) as calls:
        got = run.batch.attention(q, SCALE, run.batch.make_mask(1))
        mx.eval(got)
    assert calls == [B]
    monkeypatch.setattr(dispatch, "_backend", "ops")
    for b, c in enumerate(run.singles):
        c.update_and_fetch(k[b : b + 1], v[b : b + 1])
        want = attention.packed_attention(q[b : b + 1], c, SCALE)
        np.testing.assert_allclose(np.array(got[b]), np.array(want[0]), rtol=1e-4, atol=1e-5)
    assert [c.n_tiles for c in run.singles] == [3, 0, 1]
    assert run.singles[1].n_sink == run.singles[1].offset < 16 == run.singles[0].n_sink
