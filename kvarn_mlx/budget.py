"""A KV-cache memory budget: stop before the next step could take the cache past it.

Between steps, the bytes the cache holds now (memory.cache_bytes, measured
from its arrays) plus the most the next step of L tokens could allocate must
fit the budget. The most a step allocates per layer comes from the byte
models (byte_models.py), the caches' own growth rules measured on real caches:
  KVCache, QuantizedKVCache,  one room step (`step` tokens) per `step` tokens
  RotatingKVCache             of the step, rounded up
  KVarNCache                  one growth of the tile storage (the step's own tiles plus
                              one a short step left waiting, rounded up to step_tiles), and
                              the step's tokens in the sink or the tail plus one tail step
  recurrent caches            nothing (their state has a fixed size)
A step that needs no new room allocates less than this bound, so the budget
stops generation at most one allocation early, never late. The bound is on
bytes held; the copy a growing buffer makes is released at the end of the step.
"""

import logging
import math

from . import byte_models, memory
from .byte_models import human, longest_context
from .cache import KVarNCache


class BudgetExceeded(Exception):
    """The next step could take the KV cache past the budget; the message says by how much."""


def parse_size(text):
    """'2GB', '512MiB', '1.5G', '1e9' -> bytes (K/M/G/T are powers of 1024); ValueError
    naming the fix."""
    try:
        n = byte_models.parse_bytes(text)
    except byte_models.PlanError as e:
        raise ValueError(str(e)) from None
    if n <= 0:
        raise ValueError(f"{text!r} is no room at all; give a positive size, e.g. 2GB or 512MiB")
    return n


def _kind(c):
    """A cache layer's kind in the planner's terms (see byte_models.byte_model)."""
    if isinstance(c, KVarNCache):
        return c.config
    bits = getattr(c, "bits", None)
    return bits if isinstance(bits, int) and hasattr(c, "group_size") else "plain"


def step_allocation(m, L):
    """The most bytes a step of L tokens adds to a layer with byte model m.

    Also bounds two one-token steps by L = 2: they cross at most one room step
    (KVCache, tail buffer) and one tile-storage growth."""
    if isinstance(m, (byte_models.Steps, byte_models.Window)):
        return m.token_bytes * m.step * math.ceil(L / m.step)
    if isinstance(m, byte_models.SinkTilesTail):
        # Capacity is a whole number of step_tiles tiles (tiles.append).
        tiles = -(-(L // m.group + 2) // m.step_tiles) * m.step_tiles
        # Sink and tail hold tokens in the model's dtype; a step puts at most
        # S + T + G of its tokens there (T: tail_tokens; the rest goes into tiles),
        # and a new tail buffer rounds its tokens up to one tail step.
        dense = math.ceil(m.tail_step_bytes * min(L, m.sink + m.tail + m.group) / m.tail_step)
        return m.tile_bytes * tiles + dense + m.tail_step_bytes
    return 0


class KVBudget:
    """The budget of one model's cache (the list make_cache or a prompt-cache file gave)."""

    def __init__(self, model, cache, max_bytes, prefill_step_size=byte_models.PREFILL_STEP_SIZE):
        self.cache, self.max_bytes = cache, max_bytes
        layers = byte_models.model_layers(model)  # lazy: nothing is computed
        flat = [c for c, _ in byte_models.flat_caches(cache)]
        if len(flat) != len(layers):
            raise ValueError(f"the cache has {len(flat)} layers, the model {len(layers)}")
        built = {}
        self.models = []
        for layer, c in zip(layers, flat):
            key = (layer, _kind(c))
            if key not in built:
                built[key] = byte_models.byte_model(*key, prefill_step_size)
            self.models.append(built[key])

    def held(self):
        return memory.cache_bytes(self.cache)["held"]

    def allocation(self, L):
        """The most a step of L tokens could add, all layers."""
        return sum(step_allocation(m, L) for m in self.models)

    def check(self, *steps):
        """Raise BudgetExceeded if the bytes held plus what steps of these token counts
        could add exceed the budget."""
        held, more, L = self.held(), sum(self.allocation(n) for n in steps), sum(steps)
        if held + more > self.max_bytes:
            tokens = max((int(getattr(c, "offset", 0)) for c in self.cache), default=0)
            raise BudgetExceeded(
                f"the KV cache holds {held:,} bytes ({human(held)}) for {tokens} tokens, and the "
                f"next {L} token{'s' if L > 1 else ''} could add up to {more:,} bytes "
                f"({human(more)}): beyond the budget of {self.max_bytes:,} bytes "
                f"({human(self.max_bytes)})"
            )


def fit_tokens(kv, n, max_tokens):
    """The max_tokens that keep one request's cache (n prompt tokens) within kv's budget,
    by the planner's byte models: the most the cache could hold at that many tokens, room
    included, whatever the steps. BudgetExceeded if the prompt itself does not fit."""
    peak = lambda t: sum(m.peak(t) for m in kv.models)  # noqa: E731
    if peak(n + 1) > kv.max_bytes:
        raise BudgetExceeded(
            f"--max-kv-bytes: the {n}-token prompt does not fit: its KV cache could hold up to "
            f"{peak(n + 1):,} bytes ({human(peak(n + 1))}), beyond the budget of {kv.max_bytes:,} "
            f"bytes ({human(kv.max_bytes)}). Shorten the prompt, or start the server with a larger "
            "--max-kv-bytes or a smaller --kv-preset (python -m kvarn_mlx.plan shows what fits)"
        )
    if peak(n + max_tokens) <= kv.max_bytes:
        return max_tokens
    fit = longest_context(peak, 1, kv.max_bytes) - n
    logging.warning(
        f"--max-kv-bytes: a {n}-token prompt may generate {fit} tokens, not {max_tokens}"
    )
    return fit
