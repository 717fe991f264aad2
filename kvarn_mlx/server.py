"""python -m kvarn_mlx.server: mlx-lm's OpenAI-compatible server on KVarN caches.

This runs mlx_lm.server itself (its flags, endpoints and behaviour: chat and
text completions, streaming, tools, stop words, logprobs, batching, the LRU
prompt cache), with:
- every KV cache it makes built by kvarn_mlx.make_cache (--kv-preset, --kv-sink);
  KVarN caches merge into batches, so requests are batched;
- the embedded default model when --model is omitted;
- GET /v1/models (and /v1/models/ID): the served model and the Hugging Face
  cache's, whose names a request may give (served_models), never a traceback;
- every field of a completion request checked before it is queued
  (request_fields): a 400 naming the field;
- GET /v1/kv_stats: KV bytes held by live requests and by the prompt cache,
  next to what mlx-lm's plain cache would hold for the same tokens;
  `?request=ID` (a completion's id) adds the figures of the cache that request
  left in the prompt cache: one conversation's memory (apps/chat's panel);
- kvarn_mlx.guard's rules on every request: a Host this server answers to
  (DNS rebinding), JSON bodies only, no POST from other web pages' Origins
  unless --allowed-origins lists them (default: none), and --api-key;
  bodies of up to MAX_BODY bytes that mlx-lm's JSON parsing takes without
  failing (nesting, UTF-8), refused before they are queued.

--prompt-cache-bytes is mlx-lm's flag: it counts `nbytes`, the bytes the
KVarN caches really hold, so the same budget keeps more prefixes.
"""

import argparse
import hashlib
import io
import json
import logging
import os
import sys
import threading
import time
import weakref
from collections import OrderedDict, deque
from urllib.parse import parse_qs, unquote, urlsplit

import mlx.core as mx
import numpy as np
import mlx_lm.server as mlx_server
from mlx_lm.models import cache as mlx_cache
from mlx_lm.models.cache import LRUPromptCache

from . import budget, guard, memory, plan, request_fields, served_models
from .batch_cache import BatchKVarNCache
from .config import DEFAULT_PRESET, FP16, PRESETS, get_preset
from .integration import make_cache

STATS_PATH = "/v1/kv_stats"
MODELS_PATH = "/v1/models"
COMPLETIONS = {"/v1/completions": False, "/v1/chat/completions": True, "/chat/completions": True}  # path: chat?
API_KEY_ENV = "KVARN_API_KEY"

# The generation thread publishes the live requests' figures after its steps, so
# a reading never waits for a step; the prompt cache (LRU) is changed and read
# under _lock.
_lock = threading.Lock()
_prompt_caches = weakref.WeakSet()
# Prompt tokens of requests that the model runs (those the prompt cache held are not).
_counts = {"prompt_tokens": 0}
# "now": the latest live figures, "peak": those with the most tokens held.
# "rows": (tokens, memory.panel figures) of each sequence decoded with KVarN caches.
_live = {"now": None, "peak": None, "at": 0.0, "sequences": 0, "rows": []}
MAX_BODY = 64 << 20  # bytes of a request body; far beyond any prompt text (images come base64-encoded)
PUBLISH_EVERY = 1.0  # seconds between measurements while the number of sequences stays
# Per request (by completion id): its prompt's length and digest; per cache lately
# stored in the prompt cache: its tokens and memory.panel figures, measured when
# stored. Both bounded (a stored entry holds 4 bytes a token).
REMEMBERED, STORED = 256, 32
_prompts = OrderedDict()
_stored = deque(maxlen=STORED)


# -- caches ---------------------------------------------------------------------------


def cache_factory(preset, sink=None, provider=None):
    """mlx-lm's make_prompt_cache(model, max_kv_size=None), building KVarN
    caches (preset "fp16": mlx-lm's own caches). The draft model of speculative
    decoding keeps mlx-lm's plain cache: it only proposes tokens."""
    if preset == FP16:
        return mlx_cache.make_prompt_cache
    config = get_preset(preset, sink=sink)

    def make_prompt_cache(model, max_kv_size=None):
        if max_kv_size is not None:
            raise ValueError("KVarN caches have no maximum size (max_kv_size); leave it unset")
        if provider is not None and model is provider.draft_model:
            return mlx_cache.make_prompt_cache(model)
        return make_cache(model, config)

    return make_prompt_cache


class BatchGenerator(mlx_server.BatchGenerator):
    """mlx-lm's BatchGenerator, publishing its live figures for the stats."""

    def insert_segments(self, segments, *args, **kwargs):
        uids = super().insert_segments(segments, *args, **kwargs)
        _counts["prompt_tokens"] += sum(len(s) for seq in segments for s in seq)
        _publish(self.live_caches(), rows=self.live_rows)
        return uids

    def remove(self, *args, **kwargs):
        out = super().remove(*args, **kwargs)
        _publish(self.live_caches(), rows=self.live_rows)
        return out

    def next(self):
        decoding = len(self._generation_batch)
        out = super().next()
        _publish(self.live_caches(), force=len(self._generation_batch) > decoding,  # prompts done: a jump
                 rows=self.live_rows)
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
        """The cache of every sequence it holds: single caches, or batch caches with their row count."""
        out = [(p[3], 1) for p in self._unprocessed_sequences]
        for batch in (self._prompt_batch, self._generation_batch):
            if batch.prompt_cache:
                out.append((batch.prompt_cache, len(batch)))
        return out


class PromptCache(LRUPromptCache):
    """mlx-lm's LRU of prompt caches, changed and read under _lock."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        _prompt_caches.add(self)

    def fetch_nearest_cache(self, *args, **kwargs):
        with _lock:
            return super().fetch_nearest_cache(*args, **kwargs)

    def insert_cache(self, model, tokens, prompt_cache, *args, **kwargs):
        # measured before the LRU may trim or hand it on; only mlx-lm's kinds of cache
        # (each has a state), not any object a caller stores
        measurable = all(hasattr(c, "state") for c in prompt_cache)
        figures = memory.panel(prompt_cache) if measurable else None
        with _lock:
            if figures is not None:
                _stored.append((np.asarray(tokens, dtype=np.int32), figures))
            return super().insert_cache(model, tokens, prompt_cache, *args, **kwargs)

    def trim_to(self, *args, **kwargs):
        with _lock:
            return super().trim_to(*args, **kwargs)

    def entries(self):
        return [self._trie.get(model, tokens).prompt_cache
                for lru in self._lru._lrus.values() for model, tokens in lru]


def stream_generate(*args, prompt_cache=None, **kwargs):
    """mlx-lm's stream_generate (the server's path for a request served alone),
    publishing the live figures of its cache."""
    try:
        for i, response in enumerate(_stream_generate(*args, prompt_cache=prompt_cache, **kwargs)):
            if i == 0:
                _counts["prompt_tokens"] += response.prompt_tokens
            _publish([(prompt_cache, 1)])
            yield response
    finally:
        _publish([])


_stream_generate = mlx_server.stream_generate


# -- stats ----------------------------------------------------------------------------


def _bytes(caches, n):
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
        tokens = [max(t, r) for t, r in zip(tokens, _row_tokens(layer, n))]
    out["tokens"] = sum(tokens)
    out["sequences"] = sum(t > 0 for t in tokens)
    return out


def _row_tokens(layer, n):
    """Tokens of each of the n sequences a cache layer holds."""
    if isinstance(layer, BatchKVarNCache):
        return [r.offset for r in layer.rows]
    offset = getattr(layer, "offset", None)
    if isinstance(offset, mx.array):  # mlx-lm's batch caches: one offset per row
        return [max(0, x) for x in offset.tolist()]
    return [memory.layer_bytes(layer)["tokens"]] if n == 1 else [0] * n


def _total(entries):
    out = {"sequences": 0, "tokens": 0, "held": 0, "plain": 0, "fp16": 0}
    for caches, n in entries:
        for k, v in _bytes(caches, n).items():
            out[k] += v
    out["ratio_plain"] = round(out["plain"] / out["held"], 3) if out["held"] else None
    return out


def kv_stats(request=None):
    """KV bytes held by live requests and by the prompt cache, and what mlx-lm's
    plain cache would hold for the same tokens (in the model's dtype; fp16: at 2
    bytes an element). Figures from the arrays held (kvarn_mlx.memory); the live
    ones as of the generation's latest step. request: a completion id; adds
    "request", request_figures(request)."""
    with _lock:
        stored = [(c, 1) for p in _prompt_caches for c in p.entries()]
        prompt_cache = _total(stored)
    out = {
        "live": _live["now"] or _total([]),
        "live_peak": _live["peak"],
        "prompt_cache": prompt_cache,
        "prompt_tokens_processed": _counts["prompt_tokens"],
    }
    if request is not None:
        out["request"] = request_figures(request)
    return out


def request_figures(request):
    """memory.panel figures of the request with this completion id: once it
    finished, of the cache it left in the prompt cache (its prompt and reply;
    "live": False); while it is decoded in a batch of KVarN caches, of its
    row as of the latest live measurement ("live": True). None before that, for
    an id this server does not remember, or once STORED later caches were stored."""
    with _lock:
        prompt = _prompts.get(request)
        if prompt is None:
            return None
        n, digest = prompt
        for tokens, figures in reversed(_stored):  # the newest first: the same prompt may come again
            if len(tokens) >= n and _digest(tokens[:n]) == digest:
                return {**figures, "live": False}
    for tokens, figures in _live["rows"]:  # replaced whole by the generation thread, never changed
        if len(tokens) >= n and _digest(tokens[:n]) == digest:
            return {**figures, "live": True}
    return None


def _digest(tokens):
    return hashlib.blake2b(np.asarray(tokens, dtype=np.int32).tobytes(), digest_size=16).digest()


def _remember(request, prompt):
    with _lock:
        _prompts[request] = (len(prompt), _digest(prompt))
        while len(_prompts) > REMEMBERED:
            _prompts.popitem(last=False)


class _Recorder:
    """The response generator as one request's handler sees it: remembers the
    request's prompt tokens under its completion id (for request_figures)."""

    def __init__(self, generator, request):
        self._generator, self._request = generator, request

    def __getattr__(self, name):
        return getattr(self._generator, name)

    def generate(self, *args, **kwargs):
        ctx, response = self._generator.generate(*args, **kwargs)
        _remember(self._request, ctx.prompt)
        return ctx, response


def _publish(entries, force=False, rows=list):
    """In the generation thread: measure the live (caches, sequences) entries if
    their number changed, if forced, or PUBLISH_EVERY seconds after the last time;
    rows() gives the (tokens, caches) of sequences request_figures can find."""
    n = sum(k for _, k in entries)
    now = time.monotonic()
    if not force and n == _live["sequences"] and now - _live["at"] < PUBLISH_EVERY:
        return
    figures = _total(entries)
    live_rows = [(np.asarray(t, dtype=np.int32), memory.panel(c)) for t, c in rows()]
    _live.update(now=figures, at=now, sequences=n, rows=live_rows)
    if _live["peak"] is None or figures["tokens"] > _live["peak"]["tokens"]:
        _live["peak"] = figures


# -- requests -------------------------------------------------------------------------


class APIHandler(mlx_server.APIHandler):
    """mlx-lm's request handler behind kvarn_mlx.guard's checks, plus the stats endpoint."""

    settings = argparse.Namespace(allowed_hosts=[], allowed_origins=[], api_key=None, kv_preset=None, kv_sink=None,
                                  max_kv_bytes=None)

    def _refused(self, post, public=False):
        """Answer and return True if the request breaks a rule. public: no API
        key needed (a page that holds nothing, and asks for the key)."""
        s = self.settings
        try:
            guard.check_host(self.headers.get("Host"), self.connection.getsockname()[0], s.allowed_hosts)
            if post:
                if "*" not in s.allowed_origins:
                    guard.check_origin(self.headers.get("Origin"), self.headers.get("Host"),
                                       allowed=s.allowed_origins)
                guard.check_json_type(self.headers.get("Content-Type"))
            if not public:
                guard.check_api_key(self.headers.get("Authorization"), s.api_key)
        except guard.Refused as e:
            self.send_error_json(e)
            return True
        return False

    def send_error_json(self, e):
        """Answer with guard.Refused e, in OpenAI's error format."""
        body = json.dumps({"error": {"message": str(e), "type": "invalid_request_error" if e.status < 500
                                     else "server_error", "code": e.code, "param": e.param}}).encode()
        self.send_response(e.status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        if e.status == 401:
            self.send_header("WWW-Authenticate", "Bearer")
        self.end_headers()
        self.wfile.write(body)

    def handle_completion(self, request, stop_words):
        self.response_generator = _Recorder(self.response_generator, self.request_id)
        try:
            super().handle_completion(request, stop_words)
        except (BrokenPipeError, ConnectionResetError):  # mlx-lm stops the generation; no traceback
            logging.info(f"{self.request_id}: the client left before the reply was sent")
            self.close_connection = True

    def do_POST(self):
        if self._refused(post=True):
            return
        try:
            body = self.read_body()
            if self.path in COMPLETIONS:
                body = self.check_completion(body, chat=COMPLETIONS[self.path])
        except guard.Refused as e:
            return self.send_error_json(e)
        rfile, self.rfile = self.rfile, io.BytesIO(body)  # mlx-lm reads the body again
        self.headers.replace_header("Content-Length", str(len(body)))  # check_completion rewrote it
        try:
            super().do_POST()
        finally:
            self.rfile = rfile

    def check_completion(self, body, chat):
        """The completion request's body, its fields checked (request_fields)
        and its "model" the name mlx-lm loads: "default_model" for the served
        model (served_models.model_for)."""
        try:
            data = json.loads(body)
        except ValueError as e:
            raise guard.Refused(f"Invalid JSON in request body: {e}", code="invalid_json") from None
        if not isinstance(data, dict):
            raise guard.Refused("the request body should be a JSON dictionary (object)", code="invalid_json")
        request_fields.check(data, chat=chat)
        self.reply_model = data.get("model") or self.served_model()  # what the replies name
        data["model"] = served_models.model_for(data.get("model"), self.served_model(), self.model_names())
        return json.dumps(data).encode()

    reply_model = None

    def generate_response(self, *args, **kwargs):
        return self._named(super().generate_response(*args, **kwargs))

    def completion_usage_response(self, *args, **kwargs):
        return self._named(super().completion_usage_response(*args, **kwargs))

    def _named(self, response):
        """A reply naming the model as the request did (mlx-lm's: "default_model")."""
        if self.reply_model is not None:
            response["model"] = self.reply_model
        return response

    def served_model(self):
        """The id /v1/models lists for the model this server serves."""
        return served_models.served_id(getattr(self.settings, "model", self.response_generator.cli_args.model))

    def model_names(self):
        """Every name a request may give the served model."""
        spec = getattr(self.settings, "model", self.response_generator.cli_args.model)
        return served_models.names(spec, self.response_generator.cli_args.model)

    def read_body(self, limit=None):
        """The body, once known to be at most `limit` bytes (MAX_BODY; refused by its
        declared length, unread) and JSON that mlx-lm's parser takes without
        failing: not nested past Python's recursion limit, valid UTF-8."""
        limit = MAX_BODY if limit is None else limit
        try:
            n = int(self.headers.get("Content-Length"))
        except (TypeError, ValueError):
            raise guard.Refused("send the body with a Content-Length header", code="length_required", status=411)
        if not 0 <= n <= limit:
            self.close_connection = True
            raise guard.Refused(f"request body too large (limit {limit} bytes)", code="request_too_large",
                                status=413)
        body = self.rfile.read(n)
        try:
            json.loads(body.decode())
        except RecursionError:
            raise guard.Refused("the JSON body is nested too deeply", code="invalid_json") from None
        except UnicodeDecodeError as e:
            raise guard.Refused(f"the body is not valid UTF-8 ({e.reason} at byte {e.start})",
                                code="invalid_json") from None
        except ValueError:
            pass  # mlx-lm answers malformed JSON itself
        return body

    def do_OPTIONS(self):
        if not self._refused(post=False):
            super().do_OPTIONS()

    def do_GET(self):
        if self._refused(post=False):
            return
        url = urlsplit(self.path)
        if url.path == MODELS_PATH or url.path.startswith(MODELS_PATH + "/"):
            return self.send_models(unquote(url.path[len(MODELS_PATH) + 1:]))
        if url.path != STATS_PATH:
            return super().do_GET()
        request = parse_qs(url.query).get("request", [None])[-1]
        stats = kv_stats(request)
        stats.update(kv_preset=self.settings.kv_preset, kv_sink=self.settings.kv_sink,
                     model=self.response_generator.cli_args.model)
        self.send_json(stats)

    def send_models(self, model_id):
        """/v1/models (model_id ""), or /v1/models/{model_id}."""
        started = getattr(self.settings, "started", self.created)
        try:
            if not model_id:
                return self.send_json(served_models.model_list(self.served_model(), started))
            self.send_json(served_models.find_model(model_id, self.served_model(), started))
        except guard.Refused as e:
            self.send_error_json(e)

    def send_json(self, data, status=200):
        body = json.dumps(data).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.send_cors_headers()
        self.end_headers()
        self.wfile.write(body)

    def send_cors_headers(self):
        """Access-Control-Allow-Origin for the origins --allowed-origins lists."""
        allowed, origin = self.settings.allowed_origins, self.headers.get("Origin")
        if "*" in allowed:
            self.send_header("Access-Control-Allow-Origin", "*")
        elif origin and origin.lower().rstrip("/") in allowed:
            self.send_header("Access-Control-Allow-Origin", origin)
            self.send_header("Vary", "Origin")


def run(host, port, model_provider, server_class=mlx_server.ThreadingHTTPServer, handler_class=APIHandler):
    """mlx_lm.server.run with this module's prompt cache (bounded by
    --prompt-cache-bytes as well as --prompt-cache-size) and request handler."""
    args = model_provider.cli_args
    install_caches(handler_class.settings.kv_preset, handler_class.settings.kv_sink, model_provider)
    group = mx.distributed.init()
    prompt_cache = PromptCache(args.prompt_cache_size, **({"max_bytes": args.prompt_cache_bytes}
                                                          if args.prompt_cache_bytes is not None else {}))
    response_generator = ResponseGenerator(model_provider, prompt_cache)
    response_generator.max_kv_bytes = getattr(handler_class.settings, "max_kv_bytes", None)
    threading.Thread(target=_exit_if_generation_dies, args=(response_generator,), daemon=True).start()
    if group.rank() == 0:
        mlx_server._run_http_server(host, port, response_generator, server_class, handler_class)
    else:
        response_generator.join()


class ResponseGenerator(mlx_server.ResponseGenerator):
    """mlx-lm's, with --max-kv-bytes: the most KV bytes one request's cache may hold."""

    max_kv_bytes = None
    _kv_budget = None  # (model, budget.KVBudget of the caches the server makes for it)

    def _tokenize(self, tokenizer, request, args):
        out = super()._tokenize(tokenizer, request, args)
        if self.max_kv_bytes is not None:
            model = self.model_provider.model
            if self._kv_budget is None or self._kv_budget[0] is not model:
                kv = budget.KVBudget(model, mlx_server.make_prompt_cache(model), self.max_kv_bytes,
                                     self.cli_args.prefill_step_size)
                self._kv_budget = (model, kv)
            args.max_tokens = fit_tokens(self._kv_budget[1], len(out[0]), args.max_tokens)
        return out


def fit_tokens(kv, n, max_tokens):
    """The max_tokens that keep one request's cache (n prompt tokens) within kv's budget,
    by the planner's byte models: the most the cache could hold at that many tokens, room
    included, whatever the steps. BudgetExceeded if the prompt itself does not fit."""
    peak = lambda t: sum(m.peak(t) for m in kv.models)  # noqa: E731
    if peak(n + 1) > kv.max_bytes:
        raise budget.BudgetExceeded(
            f"--max-kv-bytes: the {n}-token prompt does not fit: its KV cache could hold up to {peak(n + 1):,} "
            f"bytes ({plan.human(peak(n + 1))}), beyond the budget of {kv.max_bytes:,} bytes "
            f"({plan.human(kv.max_bytes)}). Shorten the prompt, or start the server with a larger "
            "--max-kv-bytes or a smaller --kv-preset (python -m kvarn_mlx.plan shows what fits)")
    if peak(n + max_tokens) <= kv.max_bytes:
        return max_tokens
    fit = plan.longest_context(peak, 1, kv.max_bytes) - n
    logging.warning(f"--max-kv-bytes: a {n}-token prompt may generate {fit} tokens, not {max_tokens}")
    return fit


def _exit_if_generation_dies(generator):
    # mlx-lm logs the error (e.g. a model that cannot be loaded) and would then
    # answer 503 for ever: stop instead, so the user sees why at once.
    generator.join()
    if generator._generation_failed:
        print("error: the server's generation thread stopped (its error is logged above: a --model that cannot "
              "be loaded, for instance); the server exits", file=sys.stderr, flush=True)
        os._exit(1)


# -- command line ---------------------------------------------------------------------


def arg_parser():
    p = argparse.ArgumentParser(
        prog="python -m kvarn_mlx.server", add_help=False,
        description="mlx-lm's server (all of mlx_lm.server's flags work) on KVarN KV caches.")
    g = p.add_argument_group("KVarN")
    g.add_argument("--kv-preset", default=DEFAULT_PRESET,
                   help=f"KVarN preset (default {DEFAULT_PRESET}): {', '.join(PRESETS)}, any kXvY_gG[_auto]; "
                        f"or {FP16}: "
                        "mlx-lm's own cache (then mlx-lm's --kv-bits applies)")
    g.add_argument("--kv-sink", type=int, default=None,
                   help="leading tokens kept unquantized (default: the preset's, one tile)")
    g.add_argument("--max-kv-bytes", type=_size_flag, default=None, metavar="SIZE",
                   help="the most KV bytes one request's cache may hold (e.g. 2GB): a longer prompt is refused, "
                        "and a request stops (finish_reason length) before its cache could grow past it")
    g.add_argument("--allowed-hosts", type=lambda x: [h.strip().lower() for h in x.split(",") if h.strip()],
                   default=[], help="Host names this server answers to besides localhost and its own "
                                    "address, comma-separated ('*': any)")
    g.add_argument("--allowed-origins", type=lambda x: [o.strip().lower().rstrip("/") for o in x.split(",")],
                   default=[], help="web page origins allowed to send requests, comma-separated "
                                    "('*': any; default: none besides this server's own)")
    g.add_argument("--api-key", default=os.environ.get(API_KEY_ENV) or None,
                   help=f"require `Authorization: Bearer KEY` (default: ${API_KEY_ENV})")
    return p


def _size_flag(text):
    try:
        return budget.parse_size(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _preset_error(name):
    """get_preset's message for a name it does not know (None if it knows it)."""
    try:
        get_preset(name)
    except ValueError as e:
        return str(e).replace(" (or a KVarNConfig)", "")
    return None


def main(argv=None, handler=None, parser=None):
    """handler: an APIHandler subclass to serve with (apps/chat's adds its page);
    parser: arg_parser() with more flags, read back from handler.settings."""
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = parser or arg_parser()
    ours, rest = parser.parse_known_args(argv)
    if "-h" in rest or "--help" in rest:
        parser.print_help()
        print("\nmlx_lm.server's flags:\n")
    elif ours.kv_preset != FP16 and _preset_error(ours.kv_preset):
        parser.error(f"--kv-preset: {_preset_error(ours.kv_preset)}; or {FP16}: mlx-lm's own cache")
    elif ours.kv_sink is not None and ours.kv_sink < 0:
        parser.error(f"--kv-sink {ours.kv_sink}: must be >= 0")
    elif ours.kv_preset != FP16 and any(a == "--kv-bits" or a.startswith("--kv-bits=") for a in rest):
        parser.error("--kv-bits is mlx-lm's own quantized cache (one request at a time); this server "
                     f"quantizes with KVarN: use --kv-preset (or --kv-preset {FP16} --kv-bits N for mlx-lm's)")
    if "-h" not in rest and "--help" not in rest:
        ours.model = flag(rest, "--model")  # as given: what /v1/models lists
        rest = _resolve_model(rest)
    # mlx-lm's --allowed-origins sets its CORS headers: the same list as ours.
    rest += ["--allowed-origins", ",".join(ours.allowed_origins)]
    install(ours, handler or APIHandler)
    sys.argv = [parser.prog, *rest]
    mlx_server.main()


def flag(argv, name, default=None):
    """The value of flag `name` in argv (the last one given), else default."""
    value = default
    for i, a in enumerate(argv):
        if a == name and i + 1 < len(argv):
            value = argv[i + 1]
        elif a.startswith(name + "="):
            value = a.split("=", 1)[1]
    return value


def _resolve_model(rest):
    """mlx-lm's argv with --model as a folder when it names an embedded model
    (embedded:<key>, or the key alone) or is missing (the default one)."""
    from . import loader

    for i, a in enumerate(rest):
        if a == "--model" and i + 1 < len(rest) or a.startswith("--model="):
            spec = rest[i + 1] if a == "--model" else a.split("=", 1)[1]
            try:
                path = loader.embedded_path(spec)
            except loader.ModelLoadError as e:
                sys.exit(f"error: --model: {e}")
            if path is None:
                return rest
            return [*rest[:i], "--model", str(path), *rest[i + (2 if a == "--model" else 1):]]
    return [*rest, "--model", str(loader.embedded_path(None))]


def install_caches(preset, sink, provider=None):
    """Rebind make_prompt_cache where mlx_lm.server and mlx_lm.generate (for its
    BatchGenerator) look it up."""
    make_prompt_cache = cache_factory(preset, sink, provider)
    mlx_server.make_prompt_cache = make_prompt_cache
    sys.modules["mlx_lm.generate"].make_prompt_cache = make_prompt_cache


def install(settings, handler=APIHandler):
    """Rebind the names mlx_lm.server looks up, so its own code runs on KVarN
    caches, this module's run() and the request handler."""
    install_caches(settings.kv_preset, settings.kv_sink)
    mlx_server.BatchGenerator = BatchGenerator
    mlx_server.stream_generate = stream_generate
    mlx_server.run = lambda host, port, provider: run(host, port, provider, handler_class=handler)
    settings.started = int(time.time())
    handler.settings = settings


if __name__ == "__main__":
    main()
