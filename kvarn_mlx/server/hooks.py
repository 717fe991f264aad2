"""Every hook into mlx-lm's server (mlx_lm.server), in one place.

mlx-lm's server has no way to pass it a cache factory, a generator, a prompt
cache or a handler, so install() and run() rebind the names it looks up:
mlx_lm.server's make_prompt_cache (and mlx_lm.generate's, for its
BatchGenerator), BatchGenerator, stream_generate and run. integration.py
changes mlx-lm's model-level globals (attention, cache registration,
batching); this module is the only other one that changes mlx-lm's globals.

The private mlx-lm names used here, each "module:qualified name" with what it
is for, are listed in MLX_LM_PRIVATE; tests/test_mlx_lm_private.py looks each
up in the installed mlx-lm and fails, naming it, when one moved. No other
module of the server uses a private mlx-lm name (the test greps for them).
"""

import functools
import logging
import os
import socket
import sys
import threading
from http.server import ThreadingHTTPServer

import mlx.core as mx
import mlx_lm.server as mlx_server
from mlx_lm.models import cache as mlx_cache
from mlx_lm.models.cache import LRUPromptCache

from .. import budget
from ..batch_cache import BatchKVarNCache
from ..config import DEFAULT_PRESET, FP16, user_preset
from ..integration import make_cache
from ..profile import from_settings
from .stats import KVStats

MLX_LM_PRIVATE = {
    "mlx_lm.server:ResponseGenerator._tokenize": (
        "ResponseGenerator: --max-kv-bytes caps max_tokens"
    ),
    "mlx_lm.generate:BatchGenerator._generation_batch": (
        "BatchGenerator: the live sequences' caches"
    ),
    "mlx_lm.generate:BatchGenerator._prompt_batch": "BatchGenerator: the live sequences' caches",
    "mlx_lm.generate:BatchGenerator._unprocessed_sequences": (
        "BatchGenerator: the waiting sequences' caches"
    ),
    "mlx_lm.models.cache:LRUPromptCache._trie": "PromptCache.entries: the stored caches",
    "mlx_lm.models.cache:LRUPromptCache._lru": "PromptCache.entries: the stored caches",
    "mlx_lm.models.cache:LRUPromptCache.CacheOrder._lrus": "PromptCache.entries: the stored caches",
}


# -- caches ---------------------------------------------------------------------------


def cache_factory(
    preset, sink=None, provider=None, profile=(None, None, None, None), tail_tokens=None
):
    """mlx-lm's make_prompt_cache(model, max_kv_size=None), building KVarN
    caches (preset "fp16": mlx-lm's own caches; profile: (--kv-profile,
    --kv-bytes-like, --kv-max-kl, --kv-context), per-layer widths instead of the preset's;
    sink, tail_tokens: --kv-sink, --kv-tail-tokens, None for the defaults: user_preset).
    The draft model of speculative decoding keeps mlx-lm's plain cache: it only
    proposes tokens."""
    if preset == FP16 and profile[0] is None:
        return mlx_cache.make_prompt_cache
    overrides = dict(sink=sink, tail_tokens=tail_tokens)
    config = user_preset(preset, **overrides) if profile[0] is None else None

    def make_prompt_cache(model, max_kv_size=None):
        if max_kv_size is not None:
            raise ValueError("KVarN caches have no maximum size (max_kv_size); leave it unset")
        if provider is not None and model is provider.draft_model:
            return mlx_cache.make_prompt_cache(model)
        if config is None:
            path, bytes_like, max_kl, context = profile
            return make_cache(
                model,
                profile=path,
                bytes_like=bytes_like,
                max_kl=max_kl,
                context=context,
                **overrides,
            )
        return make_cache(model, config)

    return make_prompt_cache


def install_caches(preset, sink, provider=None, profile=(None, None, None, None), tail_tokens=None):
    """Rebind make_prompt_cache where mlx_lm.server and mlx_lm.generate (for its
    BatchGenerator) look it up."""
    make_prompt_cache = cache_factory(preset, sink, provider, profile, tail_tokens)
    mlx_server.make_prompt_cache = make_prompt_cache
    sys.modules["mlx_lm.generate"].make_prompt_cache = make_prompt_cache


class BatchGenerator(mlx_server.BatchGenerator):
    """mlx-lm's BatchGenerator, publishing its live figures to stats."""

    def __init__(self, *args, stats, **kwargs):
        self.stats = stats
        super().__init__(*args, **kwargs)

    def insert_segments(self, segments, *args, **kwargs):
        uids = super().insert_segments(segments, *args, **kwargs)
        self.stats.prompt_tokens += sum(len(s) for seq in segments for s in seq)
        self.stats.publish(self.live_caches(), rows=self.live_rows)
        return uids

    def remove(self, *args, **kwargs):
        out = super().remove(*args, **kwargs)
        self.stats.publish(self.live_caches(), rows=self.live_rows)
        return out

    def next(self):
        decoding = len(self._generation_batch)
        out = super().next()
        self.stats.publish(
            self.live_caches(),
            force=len(self._generation_batch) > decoding,  # prompts done
            rows=self.live_rows,
        )
        return out

    def live_rows(self):
        """(tokens, caches) of each sequence being decoded, when every layer is a
        BatchKVarNCache (its rows are single caches; mlx-lm's batch caches are not split)."""
        batch = self._generation_batch
        caches = batch.prompt_cache or []
        if not caches or not all(isinstance(c, BatchKVarNCache) for c in caches):
            return []
        return [(batch.tokens[i], [c.rows[i] for c in caches]) for i in range(len(batch))]

    def live_caches(self):
        """The cache of every sequence it holds: single caches, or batch caches with their row
        count."""
        out = [(p[3], 1) for p in self._unprocessed_sequences]
        for batch in (self._prompt_batch, self._generation_batch):
            if batch.prompt_cache:
                out.append((batch.prompt_cache, len(batch)))
        return out


class PromptCache(LRUPromptCache):
    """mlx-lm's LRU of prompt caches, changed and read under stats.lock; stats
    measures what it stores."""

    def __init__(self, stats, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.stats = stats
        stats.prompt_caches.add(self)

    def fetch_nearest_cache(self, *args, **kwargs):
        with self.stats.lock:
            return super().fetch_nearest_cache(*args, **kwargs)

    def insert_cache(self, model, tokens, prompt_cache, *args, **kwargs):
        with self.stats.lock:
            self.stats.store(tokens, prompt_cache)
            return super().insert_cache(model, tokens, prompt_cache, *args, **kwargs)

    def trim_to(self, *args, **kwargs):
        with self.stats.lock:
            return super().trim_to(*args, **kwargs)

    def entries(self):
        return [
            self._trie.get(model, tokens).prompt_cache
            for lru in self._lru._lrus.values()
            for model, tokens in lru
        ]


def stream_generate(*args, stats, prompt_cache=None, **kwargs):
    """mlx-lm's stream_generate (the server's path for a request served alone),
    publishing the live figures of its cache to stats."""
    try:
        for i, response in enumerate(_stream_generate(*args, prompt_cache=prompt_cache, **kwargs)):
            if i == 0:
                stats.prompt_tokens += response.prompt_tokens
            stats.publish([(prompt_cache, 1)])
            yield response
    finally:
        stats.publish([])


_stream_generate = mlx_server.stream_generate


class ResponseGenerator(mlx_server.ResponseGenerator):
    """mlx-lm's, with --max-kv-bytes: the most KV bytes one request's cache may hold."""

    def __init__(self, model_provider, prompt_cache, max_kv_bytes=None):
        self.max_kv_bytes = max_kv_bytes
        self.kv_budget = None  # (model, budget.KVBudget of the caches the server makes for it)
        self.stopping = False
        super().__init__(model_provider, prompt_cache)  # starts the generation thread

    def _tokenize(self, tokenizer, request, args):
        out = super()._tokenize(tokenizer, request, args)
        if self.max_kv_bytes is not None:
            model = self.model_provider.model
            if self.kv_budget is None or self.kv_budget[0] is not model:
                kv = budget.KVBudget(
                    model,
                    mlx_server.make_prompt_cache(model),
                    self.max_kv_bytes,
                    self.cli_args.prefill_step_size,
                )
                self.kv_budget = (model, kv)
            args.max_tokens = budget.fit_tokens(self.kv_budget[1], len(out[0]), args.max_tokens)
        return out

    def stop_and_join(self):
        self.stopping = True
        super().stop_and_join()


# -- running --------------------------------------------------------------------------


def install(settings, handler_class):
    """Rebind the names mlx_lm.server looks up, so its own main() runs on KVarN
    caches, with run() below serving handler_class (handler.APIHandler or a
    subclass) with these settings."""
    install_caches(
        settings.kv_preset,
        settings.kv_sink,
        profile=from_settings(settings, DEFAULT_PRESET),
        tail_tokens=settings.kv_tail_tokens,
    )
    mlx_server.run = lambda host, port, provider: run(host, port, provider, settings, handler_class)


def run(host, port, model_provider, settings, handler_class):
    """mlx_lm.server.run with this module's prompt cache (bounded by
    --prompt-cache-bytes as well as --prompt-cache-size), generator and handler,
    and one KVStats they share."""
    stats = KVStats()
    install_caches(
        settings.kv_preset,
        settings.kv_sink,
        model_provider,
        from_settings(settings, DEFAULT_PRESET),
        settings.kv_tail_tokens,
    )
    mlx_server.BatchGenerator = functools.partial(BatchGenerator, stats=stats)
    mlx_server.stream_generate = functools.partial(stream_generate, stats=stats)
    args = model_provider.cli_args
    prompt_cache = PromptCache(
        stats,
        args.prompt_cache_size,
        **({"max_bytes": args.prompt_cache_bytes} if args.prompt_cache_bytes is not None else {}),
    )
    generator = ResponseGenerator(
        model_provider, prompt_cache, getattr(settings, "max_kv_bytes", None)
    )
    threading.Thread(target=_exit_if_generation_dies, args=(generator,), daemon=True).start()
    if mx.distributed.init().rank() == 0:
        serve_http(
            host,
            port,
            lambda *a, **k: handler_class(generator, stats, settings, *a, **k),
            generator,
        )
    else:
        generator.join()


def serve_http(host, port, make_handler, generator):
    """Answer HTTP on host:port (IPv4 or IPv6, as the name resolves) until Ctrl-C."""
    family, _, _, _, address = socket.getaddrinfo(
        host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
    )[0]
    server_class = type("HTTPServer", (ThreadingHTTPServer,), {"address_family": family})
    httpd = server_class(address, make_handler)
    logging.info(f"Starting httpd at {host} on port {port}...")
    try:
        httpd.serve_forever()
    except KeyboardInterrupt:
        httpd.server_close()
        generator.stop_and_join()


def _exit_if_generation_dies(generator):
    # mlx-lm logs the error (e.g. a model that cannot be loaded) and would then
    # answer 503 for ever: stop instead, so the user sees why at once.
    generator.join()
    if not generator.stopping:
        print(
            "error: the server's generation thread stopped (its error is logged above: a --model "
            "that cannot be loaded, for instance); the server exits",
            file=sys.stderr,
            flush=True,
        )
        os._exit(1)
