"""kvarn-server, python -m kvarn_mlx.server: mlx-lm's OpenAI-compatible server on KVarN caches.

This runs mlx_lm.server itself (its flags, endpoints and behaviour: chat and
text completions, streaming, tools, stop words, logprobs, batching, the LRU
prompt cache), with:
- every KV cache it makes built by kvarn_mlx.make_cache (--kv-preset, --kv-sink, --kv-tail-tokens;
  --kv-profile with --kv-bytes-like or --kv-max-kl (held at --kv-context, by
  default the model's context length): per-layer widths, which /v1/kv_stats
  shows as kv_widths);
  KVarN caches merge into batches, so requests are batched;
- the embedded default model when --model is omitted;
- GET /v1/models (and /v1/models/ID): the served model and the Hugging Face
  cache's, whose names a request may give (served_models), never a traceback;
- every field of a completion request checked before it is queued
  (request_fields): a 400 naming the field;
- GET /v1/kv_stats: KV bytes held by live requests and by the prompt cache,
  next to what mlx-lm's plain cache would hold for the same tokens;
  `?request=ID` (a completion's id) adds the figures of the cache that request
  left in the prompt cache: one conversation's memory (the chat app's panel);
- kvarn_mlx.guard's rules on every request (http_io): a Host this server
  answers to (DNS rebinding), JSON bodies only, no POST from other web pages'
  Origins unless --allowed-origins lists them (default: none), and --api-key;
  bodies of up to MAX_BODY bytes of well-formed JSON, refused before they are queued.

--prompt-cache-bytes is mlx-lm's flag: it counts `nbytes`, the bytes the
KVarN caches really hold, so the same budget keeps more prefixes.

The modules: cli (the command), handler (the request handler), http_io (the
guard, bodies and responses, shared with the chat app), hooks (every hook
into mlx-lm's server, and the only private mlx-lm names), stats (the KV
statistics object), request_fields, served_models.
"""

from .cli import API_KEY_ENV, arg_parser, main
from .handler import APIHandler

__all__ = ["API_KEY_ENV", "APIHandler", "arg_parser", "main"]
