"""The chat engine: one loaded model and one KV cache kept across turns.

Everything here calls MLX, so an Engine must be used from one thread only
(the server runs it in its worker thread; the CLI in the main thread).

Each turn gets the whole conversation. The engine tokenizes it, keeps the
longest prefix already in the cache (trimming the rest: edits, regenerations,
a different conversation) and prefills only what is new.
"""

import json
import time

import mlx.core as mx
from mlx_lm.generate import stream_generate
from mlx_lm.sample_utils import make_sampler

from kvarn_mlx import memory, prompt_cache
from kvarn_mlx.cache import KVarNCache
from kvarn_mlx.integration import make_cache
from kvarn_mlx.config import DEFAULT_PRESET, FP16, PRESETS
from kvarn_mlx.loader import DEFAULT_NAME, load

from .errors import ChatError
from .validate import check_messages

PRESET_NAMES = (*PRESETS, FP16)
STATS_EVERY = 8  # tokens between live stats events while decoding
HISTORY_MAX = 400  # chart points kept per conversation


def model_id(spec):
    """The public name of a --model value (None = the embedded model)."""
    return DEFAULT_NAME if spec is None else str(spec).rstrip("/")


def check_preset(preset):
    if preset not in PRESET_NAMES:
        raise ChatError(f"unknown KV preset {preset!r}; valid presets: {', '.join(PRESET_NAMES)}",
                        code="invalid_preset", param="kv_preset")
    return preset


def find_stop(text, stops, new_from):
    """Where the earliest stop string starts in text, looking only at matches
    that end in text[new_from:] (the rest was searched before); None if none."""
    hits = []
    for s in stops:
        i = text.find(s, max(0, new_from - len(s) + 1))
        if i >= 0:
            hits.append(i)
    return min(hits, default=None)


def held_back(text, stops):
    """How many trailing characters of text could begin a stop string."""
    return max((k for s in stops for k in range(min(len(s) - 1, len(text)), 0, -1) if text.endswith(s[:k])),
               default=0)


class Engine:
    def __init__(self, models=(None,), preset=DEFAULT_PRESET, max_tokens=512, temp=0.0,
                 loaded=None):
        """models: --model values (None = embedded); the first is loaded.
        loaded: an already loaded (model, tokenizer) for models[0] (tests)."""
        self.specs = {model_id(s): s for s in models}
        self.default_max_tokens, self.default_temp = max_tokens, temp
        self.model = self.tokenizer = self.name = self._identity = None
        self.preset = check_preset(preset)
        self.use(next(iter(self.specs)), preset, loaded=loaded)

    # -- model and cache -----------------------------------------------------

    def use(self, name=None, preset=None, loaded=None):
        """Switch model and/or preset (a new, empty cache when either changes)."""
        name = name or self.name
        preset = check_preset(preset or self.preset)
        if name not in self.specs:
            raise ChatError(f"unknown model {name!r}; this server has: {', '.join(self.specs)}",
                            code="model_not_found", status=404)
        if name != self.name:
            self.model = self.tokenizer = None  # free the old weights before loading
            self.model, self.tokenizer = loaded or load(self.specs[name])
            self.name, self._identity = name, None
            self.context = getattr(getattr(self.model, "args", None), "max_position_embeddings", None) or 8192
            self.preset = None
        if preset != self.preset:
            self.preset = preset
            self.new_chat()

    def new_chat(self):
        self.cache = make_cache(self.model, self.preset)
        self.tokens = []  # token ids held by the cache, in order
        self.messages = []  # the conversation the cache holds (for saving)
        self.history = []  # chart points [context, held bytes, plain-cache bytes, 2-byte bytes]
        self.last = {"tps": 0.0, "prompt_tps": 0.0, "prefilled": 0, "reused": 0}
        self._point()

    def prompt_ids(self, messages):
        if self.tokenizer.has_chat_template:
            return list(self.tokenizer.apply_chat_template(messages, add_generation_prompt=True))
        # No template: a plain transcript.
        text = "".join(f"{m['role']}: {m['content']}\n" for m in messages) + "assistant: "
        return self.tokenizer.encode(text)

    def count_tokens(self, messages):
        return len(self.prompt_ids(check_messages(messages)))

    def _reuse(self, ids):
        """Trim the cache to the longest common prefix with ids; return its length.
        At least one token is always left to prefill (it yields the first logits)."""
        p = 0
        for a, b in zip(self.tokens, ids):
            if a != b:
                break
            p += 1
        p = min(p, len(ids) - 1)
        offset = self.cache[0].offset if self.cache else 0
        if offset > p:
            for c in self.cache:
                c.trim(offset - p)
        self.tokens = self.tokens[:p]
        return p

    # -- a turn ----------------------------------------------------------------

    def chat(self, messages, max_tokens=None, temp=None, top_p=1.0, stop=(), seed=None, cancel=None):
        """Answer the conversation; yields events (dicts with a "type"):
        start {reused, prefill}, token {text}, stats {...}, done {text, finish_reason, usage, stats}.
        stop: strings that end the reply, as OpenAI's `stop` (not part of the text).
        cancel: a threading.Event; when set, generation ends after the current token."""
        messages = check_messages(messages)
        ids = self.prompt_ids(messages)
        if len(ids) >= self.context:
            raise ChatError(
                f"the conversation is {len(ids)} tokens but {self.name} has a {self.context}-token "
                "context; shorten the message or start a new chat", code="context_length_exceeded")
        max_tokens = self.default_max_tokens if max_tokens is None else int(max_tokens)
        if max_tokens < 1:
            raise ChatError("max_tokens must be at least 1", param="max_tokens")
        max_tokens = min(max_tokens, self.context - len(ids))
        temp = self.default_temp if temp is None else float(temp)
        if seed is not None:
            mx.random.seed(seed)

        reused = self._reuse(ids)
        yield {"type": "start", "reused": reused, "prefill": len(ids) - reused, "prompt_tokens": len(ids)}
        gen, text, shown, finish, eos, last = [], "", 0, "stop", False, None
        stream = stream_generate(self.model, self.tokenizer, ids[reused:], max_tokens=max_tokens,
                                 sampler=make_sampler(temp, top_p), prompt_cache=self.cache)
        start = time.perf_counter()
        try:
            for r in stream:
                last = r
                gen.append(r.token)
                text += r.text
                cut = find_stop(text, stop, len(text) - len(r.text))
                if cut is not None:
                    text, finish = text[:cut], "stop"
                    break
                # Text that may be the start of a stop string waits for the next token.
                safe = len(text) - held_back(text, stop)
                if safe > shown:
                    yield {"type": "token", "text": text[shown:safe]}
                    shown = safe
                if r.finish_reason:
                    finish, eos = r.finish_reason, r.finish_reason == "stop"
                if cancel is not None and cancel.is_set():
                    finish = "cancelled"
                    break
                if len(gen) % STATS_EVERY == 0:
                    self.last.update(tps=r.generation_tps, prompt_tps=r.prompt_tps)
                    yield {"type": "stats", **self.stats(point=True)}
        finally:
            stream.close()
            self._settle(ids + gen)
        if len(text) > shown:
            yield {"type": "token", "text": text[shown:]}
        if last is not None:
            self.last.update(tps=last.generation_tps, prompt_tps=last.prompt_tps)
        self.last.update(prefilled=len(ids) - reused, reused=reused, seconds=time.perf_counter() - start)
        self.messages = messages + [{"role": "assistant", "content": text}]
        n_gen = len(gen) - eos  # the end-of-turn token is not content
        yield {"type": "done", "text": text, "finish_reason": finish,
               "usage": {"prompt_tokens": len(ids), "completion_tokens": n_gen,
                         "total_tokens": len(ids) + n_gen},
               "stats": self.stats(point=True)}

    def _settle(self, fed):
        """Record which tokens the cache now holds. mlx-lm feeds each sampled
        token before yielding it, so the cache holds a prefix of `fed`."""
        offset = self.cache[0].offset
        if offset > len(fed):  # should not happen; keep cache and tokens in step anyway
            for c in self.cache:
                c.trim(offset - len(fed))
            offset = len(fed)
        self.tokens = fed[:offset]

    # -- stats -----------------------------------------------------------------

    def _point(self):
        m = memory.cache_bytes(self.cache)
        point = [self.cache[0].offset, m["held"], m["plain"], m["fp16"]]
        if not self.history or self.history[-1] != point:
            self.history.append(point)
            del self.history[:-HISTORY_MAX]
        return m

    def stats(self, point=False):
        """The memory panel: KV bytes held against mlx-lm's plain cache in the
        model's dtype and, separately, the 2-byte (fp16) equivalent. Before the
        first tile is quantized, saving_from says from which token KVarN saves."""
        m = self._point() if point else memory.cache_bytes(self.cache)
        kvarn = [c for c in self.cache if isinstance(c, KVarNCache) and not c.empty()]
        dtype = memory.kv_dtype(self.cache)
        saving_from = None
        if kvarn and dtype is not None:
            c = kvarn[0]
            saving_from = memory.saving_starts_at(c.config, c.sink_k.shape[-1], dtype.size)
        return {"model": self.name, "preset": self.preset, "context_tokens": self.cache[0].offset,
                "context_limit": self.context, "dtype": None if dtype is None else str(dtype).removeprefix("mlx.core."),
                "held": m["held"], "unused": m["unused"], "plain": m["plain"], "fp16": m["fp16"],
                "ratio_plain": m["ratio_plain"], "ratio_fp16": m["ratio_fp16"], "tiles_per_layer": m["tiles"],
                "kvarn_layers": m["kvarn_layers"], "layers": m["layers"], "saving_from": saving_from, **self.last,
                "history": list(self.history)}

    # -- files -----------------------------------------------------------------

    def identity(self):
        """The loaded model's identity as prompt-cache files record it."""
        if self._identity is None:
            self._identity = prompt_cache.model_identity(self.specs[self.name], self.model, self.tokenizer)
        return self._identity

    def save(self, path, overwrite=False):
        """Save the cache, its tokens and the conversation to a prompt-cache file
        (mlx-lm's naming: ".safetensors" added when missing). A file already
        there that is not a prompt cache is never replaced unless overwrite."""
        meta = {"app": "kvarn-chat", "chat_model": self.name, "preset": self.preset,
                "messages": json.dumps(self.messages), "tokens": json.dumps(self.tokens)}
        mx.eval([c.state for c in self.cache if not c.empty()])
        try:
            return prompt_cache.save(path, self.cache, self.identity(), meta, overwrite=overwrite)
        except prompt_cache.PromptCacheError as e:
            raise ChatError(str(e), code="cannot_save", status=409)

    def load(self, path):
        """Resume a conversation saved by save(); returns its messages. The
        current conversation is kept if the file cannot be used."""
        path = prompt_cache.cache_path(path)
        if not path.is_file():
            raise ChatError(f"no saved conversation at {path}", status=404)
        try:
            name = prompt_cache.read_metadata(path).get("chat_model")
        except prompt_cache.PromptCacheError as e:
            raise ChatError(f"cannot load {path}: {e}")
        if name not in self.specs:
            raise ChatError(f"cannot load {path}: it was saved with model {name!r}, which this server does not have "
                            f"(it has {', '.join(self.specs)}); start it with --model for that model")
        self.use(name)  # a file from another model of this server: switch to it first
        try:
            cache, meta = prompt_cache.load(path, self.identity())
            messages, tokens = json.loads(meta["messages"]), json.loads(meta["tokens"])
        except (prompt_cache.PromptCacheError, KeyError, ValueError) as e:
            raise ChatError(f"cannot load {path}: {e}")
        if cache[0].offset != len(tokens):
            raise ChatError(f"cannot load {path}: its cache holds {cache[0].offset} tokens but it lists "
                            f"{len(tokens)}; the file is damaged")
        self.use(name, meta.get("preset", self.preset))
        self.cache, self.tokens, self.messages = cache, tokens, messages
        self.history = []
        self._point()
        return messages
