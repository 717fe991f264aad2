"""The server's KV statistics: one KVStats object, made by run() and passed to
the hooks that measure (generation thread, prompt cache) and to the request
handler that answers GET /v1/kv_stats.

The generation thread publishes the live requests' figures after its steps, so
a reading never waits for a step; the prompt cache (LRU) is changed and read
under the lock.
"""

import hashlib
import threading
import time
import weakref
from collections import OrderedDict, deque

import mlx.core as mx
import numpy as np

from .. import memory
from ..batch_cache import BatchKVarNCache

PUBLISH_EVERY = 1.0  # seconds between measurements while the number of sequences stays
# Per request (by completion id): its prompt's length and digest; per cache lately
# stored in the prompt cache: its tokens and memory.sequence_summary figures, measured when
# stored. Both bounded (a stored entry holds 4 bytes a token).
REMEMBERED, STORED = 256, 32


class KVStats:
    """KV bytes held by live requests and by the prompt cache, and the figures
    of single requests (by completion id)."""

    def __init__(self):
        self.lock = threading.Lock()
        self.prompt_caches = weakref.WeakSet()  # the LRUs whose entries count
        self.prompt_tokens = 0  # of requests the model ran (those the prompt cache held are not)
        # "now": the latest live figures, "peak": those with the most tokens held,
        # "rows": (tokens, memory.sequence_summary figures) of each sequence decoded with
        # KVarN caches.
        self.live = {"now": None, "peak": None, "at": 0.0, "sequences": 0, "rows": []}
        self.prompts = OrderedDict()
        self.stored = deque(maxlen=STORED)

    def publish(self, entries, force=False, rows=list):
        """In the generation thread: measure the live (caches, sequences) entries if
        their number changed, if forced, or PUBLISH_EVERY seconds after the last time;
        rows() gives the (tokens, caches) of sequences request_figures can find."""
        n = sum(k for _, k in entries)
        now = time.monotonic()
        live = self.live
        if not force and n == live["sequences"] and now - live["at"] < PUBLISH_EVERY:
            return
        figures = total(entries)
        live_rows = [(np.asarray(t, dtype=np.int32), memory.sequence_summary(c)) for t, c in rows()]
        live.update(now=figures, at=now, sequences=n, rows=live_rows)
        if live["peak"] is None or figures["tokens"] > live["peak"]["tokens"]:
            live["peak"] = figures

    def store(self, tokens, prompt_cache):
        """A cache the prompt cache is about to store (call under the lock),
        measured before the LRU may trim or hand it on: only mlx-lm's kinds of
        cache (each has a state), not any object a caller stores."""
        if all(hasattr(c, "state") for c in prompt_cache):
            self.stored.append(
                (np.asarray(tokens, dtype=np.int32), memory.sequence_summary(prompt_cache))
            )

    def remember(self, request, prompt):
        """The prompt tokens of the request with this completion id (for request_figures)."""
        with self.lock:
            self.prompts[request] = (len(prompt), digest(prompt))
            while len(self.prompts) > REMEMBERED:
                self.prompts.popitem(last=False)

    def report(self, request=None):
        """KV bytes held by live requests and by the prompt cache, and what mlx-lm's
        plain cache would hold for the same tokens (in the model's dtype; fp16: at 2
        bytes an element). Figures from the arrays held (kvarn_mlx.memory); the live
        ones as of the generation's latest step. request: a completion id; adds
        "request", request_figures(request)."""
        with self.lock:
            stored = [(c, 1) for p in self.prompt_caches for c in p.entries()]
            prompt_cache = total(stored)
        out = {
            "live": self.live["now"] or total([]),
            "live_peak": self.live["peak"],
            "prompt_cache": prompt_cache,
            "prompt_tokens_processed": self.prompt_tokens,
        }
        if request is not None:
            out["request"] = self.request_figures(request)
        return out

    def request_figures(self, request):
        """memory.sequence_summary figures of the request with this completion id: once it
        finished, of the cache it left in the prompt cache (its prompt and reply;
        "live": False); while it is decoded in a batch of KVarN caches, of its
        row as of the latest live measurement ("live": True). None before that, for
        an id this server does not remember, or once STORED later caches were stored."""
        with self.lock:
            prompt = self.prompts.get(request)
            if prompt is None:
                return None
            n, want = prompt
            for tokens, figures in reversed(
                self.stored
            ):  # the newest first: the same prompt may come again
                if len(tokens) >= n and digest(tokens[:n]) == want:
                    return {**figures, "live": False}
        for tokens, figures in self.live[
            "rows"
        ]:  # replaced whole by the generation thread, never changed
            if len(tokens) >= n and digest(tokens[:n]) == want:
                return {**figures, "live": True}
        return None


def digest(tokens):
    return hashlib.blake2b(np.asarray(tokens, dtype=np.int32).tobytes(), digest_size=16).digest()


def entry_bytes(caches, n):
    """memory.layer_bytes summed over the layers of one entry: one sequence's
    caches, or a batch of n (its KVarN layers count row by row). sequences:
    those holding tokens (not those still waiting for their prompt)."""
    out = {"sequences": 0, "tokens": 0, "held": 0, "plain": 0, "fp16": 0}
    tokens = [0] * n
    for layer in caches:
        for c in layer.rows if isinstance(layer, BatchKVarNCache) else [layer]:
            b = memory.layer_bytes(c)
            for k in ("held", "plain", "fp16"):
                out[k] += b[k]
        tokens = [max(t, r) for t, r in zip(tokens, row_tokens(layer, n))]
    out["tokens"] = sum(tokens)
    out["sequences"] = sum(t > 0 for t in tokens)
    return out


def row_tokens(layer, n):
    """Tokens of each of the n sequences a cache layer holds."""
    if isinstance(layer, BatchKVarNCache):
        return [r.offset for r in layer.rows]
    offset = getattr(layer, "offset", None)
    if isinstance(offset, mx.array):  # mlx-lm's batch caches: one offset per row
        return [max(0, x) for x in offset.tolist()]
    return [memory.layer_bytes(layer)["tokens"]] if n == 1 else [0] * n


def total(entries):
    """entry_bytes summed over (caches, sequences) entries, with the plain/held ratio."""
    out = {"sequences": 0, "tokens": 0, "held": 0, "plain": 0, "fp16": 0}
    for caches, n in entries:
        for k, v in entry_bytes(caches, n).items():
            out[k] += v
    out["ratio_plain"] = round(out["plain"] / out["held"], 3) if out["held"] else None
    return out
