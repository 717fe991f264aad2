"""The terminal chat's engine (--cli): one loaded model and one KV cache kept
across turns, in this process. (The web page talks to kvarn_mlx.server.)

Everything here calls MLX, so an Engine must be used from one thread only.

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
from kvarn_mlx.cli_support import model_context
from kvarn_mlx.config import DEFAULT_PRESET, preset_error
from kvarn_mlx.guard import Refused
from kvarn_mlx.integration import make_cache
from kvarn_mlx.loader import DEFAULT_NAME, load

from .validate import check_messages


def model_id(spec):
    """The public name of a --model value (None = the embedded model)."""
    return DEFAULT_NAME if spec is None else str(spec).rstrip("/")


def check_preset(preset):
    """A preset name make_cache takes (kvarn_mlx.config.preset_error's rule)."""
    if preset_error(preset):
        raise Refused(preset_error(preset), code="invalid_preset", param="kv_preset")
    return preset


class Engine:
    def __init__(
        self,
        models=(None,),
        preset=DEFAULT_PRESET,
        max_tokens=512,
        temp=0.0,
        loaded=None,
        profile=(None, None, None, None),
        tail_tokens=None,
    ):
        """models: --model values (None = embedded); the first is loaded.
        loaded: an already loaded (model, tokenizer) for models[0] (tests).
        profile: (--kv-profile, --kv-bytes-like, --kv-max-kl, --kv-context), per-layer widths
        instead of the preset's. tail_tokens: --kv-tail-tokens (None: make_cache's default)."""
        self.specs = {model_id(s): s for s in models}
        self.profile = profile
        self.tail_tokens = tail_tokens
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
            raise Refused(
                f"unknown model {name!r}; this server has: {', '.join(self.specs)}",
                code="model_not_found",
                status=404,
            )
        if name != self.name:
            self.model = self.tokenizer = None  # free the old weights before loading
            self.model, self.tokenizer = loaded or load(self.specs[name])
            self.name, self._identity = name, None
            self.context = model_context(self.model)  # None: the model does not say
            self.preset = None
        if preset != self.preset:
            self.preset = preset
            self.new_chat()

    def new_chat(self):
        if self.profile[0] is not None:
            path, bytes_like, max_kl, context = self.profile
            self.cache = make_cache(
                self.model,
                profile=path,
                bytes_like=bytes_like,
                max_kl=max_kl,
                context=context,
                tail_tokens=self.tail_tokens,
            )
        else:
            self.cache = make_cache(self.model, self.preset, tail_tokens=self.tail_tokens)
        self.tokens = []  # token ids held by the cache, in order
        self.messages = []  # the conversation the cache holds (for saving)
        self.last = {"tps": 0.0, "prompt_tps": 0.0, "prefilled": 0, "reused": 0}

    def prompt_ids(self, messages):
        if self.tokenizer.has_chat_template:
            return list(self.tokenizer.apply_chat_template(messages, add_generation_prompt=True))
        # No template: a plain transcript.
        text = "".join(f"{m['role']}: {m['content']}\n" for m in messages) + "assistant: "
        return self.tokenizer.encode(text)

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

    def chat(self, messages, max_tokens=None, temp=None, cancel=None):
        """Answer the conversation; yields events (dicts with a "type"):
        start {reused, prefill}, token {text}, done {text, finish_reason, usage, stats}.
        cancel: a threading.Event; when set, generation ends after the current token."""
        messages = check_messages(messages)
        ids = self.prompt_ids(messages)
        if self.context is not None and len(ids) >= self.context:
            raise Refused(
                f"the conversation is {len(ids)} tokens but {self.name} has a "
                f"{self.context}-token context; shorten the message or start a new chat",
                code="context_length_exceeded",
            )
        max_tokens = self.default_max_tokens if max_tokens is None else int(max_tokens)
        if max_tokens < 1:
            raise Refused("max_tokens must be at least 1", param="max_tokens")
        if self.context is not None:
            max_tokens = min(max_tokens, self.context - len(ids))
        temp = self.default_temp if temp is None else float(temp)

        reused = self._reuse(ids)
        yield {
            "type": "start",
            "reused": reused,
            "prefill": len(ids) - reused,
            "prompt_tokens": len(ids),
        }
        gen, text, finish, eos, last = [], "", "stop", False, None
        stream = stream_generate(
            self.model,
            self.tokenizer,
            ids[reused:],
            max_tokens=max_tokens,
            sampler=make_sampler(temp),
            prompt_cache=self.cache,
        )
        start = time.perf_counter()
        try:
            for r in stream:
                last = r
                gen.append(r.token)
                text += r.text
                if r.text:
                    yield {"type": "token", "text": r.text}
                if r.finish_reason:
                    finish, eos = r.finish_reason, r.finish_reason == "stop"
                if cancel is not None and cancel.is_set():
                    finish = "cancelled"
                    break
        finally:
            stream.close()
            self._settle(ids + gen)
        if last is not None:
            self.last.update(tps=last.generation_tps, prompt_tps=last.prompt_tps)
        self.last.update(
            prefilled=len(ids) - reused, reused=reused, seconds=time.perf_counter() - start
        )
        self.messages = messages + [{"role": "assistant", "content": text}]
        n_gen = len(gen) - eos  # the end-of-turn token is not content
        yield {
            "type": "done",
            "text": text,
            "finish_reason": finish,
            "usage": {
                "prompt_tokens": len(ids),
                "completion_tokens": n_gen,
                "total_tokens": len(ids) + n_gen,
            },
            "stats": self.stats(),
        }

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

    def stats(self):
        """The CLI's stats line: KV bytes held against mlx-lm's plain cache in the
        model's dtype and the 2-byte (fp16) equivalent (memory.sequence_summary)."""
        m = memory.sequence_summary(self.cache)
        return {
            "model": self.name,
            "preset": self.preset,
            "context_tokens": self.cache[0].offset,
            "context_limit": self.context,
            "dtype": m["dtype"],
            "held": m["held"],
            "unused": m["unused"],
            "plain": m["plain"],
            "fp16": m["fp16"],
            "ratio_plain": m["ratio_plain"],
            "ratio_fp16": m["ratio_fp16"],
            "tiles_per_layer": m["tiles"],
            "kvarn_layers": m["kvarn_layers"],
            "layers": m["layers"],
            "saving_from": m["saving_from"],
            **self.last,
        }

    # -- files -----------------------------------------------------------------

    def identity(self):
        """The loaded model's identity as prompt-cache files record it."""
        if self._identity is None:
            self._identity = prompt_cache.model_identity(
                self.specs[self.name], self.model, self.tokenizer
            )
        return self._identity

    def save(self, path, overwrite=False):
        """Save the cache, its tokens and the conversation to a prompt-cache file
        (mlx-lm's naming: ".safetensors" added when missing). A file already
        there that is not a prompt cache is never replaced unless overwrite."""
        meta = {
            "app": "kvarn-chat",
            "chat_model": self.name,
            "preset": self.preset,
            "messages": json.dumps(self.messages),
            "tokens": json.dumps(self.tokens),
        }
        mx.eval([c.state for c in self.cache if not c.empty()])
        try:
            return prompt_cache.save(path, self.cache, self.identity(), meta, overwrite=overwrite)
        except prompt_cache.PromptCacheError as e:
            raise Refused(str(e), code="cannot_save", status=409) from None

    def load(self, path):
        """Resume a conversation saved by save(); returns its messages. The
        current conversation is kept if the file cannot be used."""
        path = prompt_cache.cache_path(path)
        if not path.is_file():
            raise Refused(f"no saved conversation at {path}", status=404)
        try:
            name = prompt_cache.read_metadata(path).get("chat_model")
        except prompt_cache.PromptCacheError as e:
            raise Refused(f"cannot load {path}: {e}") from None
        if name not in self.specs:
            raise Refused(
                f"cannot load {path}: it was saved with model {name!r}, which this server does not "
                f"have (it has {', '.join(self.specs)}); start it with --model for that model"
            )
        self.use(name)  # a file from another model of this server: switch to it first
        try:
            cache, meta = prompt_cache.load(path, self.identity())
            messages, tokens = json.loads(meta["messages"]), json.loads(meta["tokens"])
        except (prompt_cache.PromptCacheError, KeyError, ValueError) as e:
            raise Refused(f"cannot load {path}: {e}") from None
        if cache[0].offset != len(tokens):
            raise Refused(
                f"cannot load {path}: its cache holds {cache[0].offset} tokens but it lists "
                f"{len(tokens)}; the file is damaged"
            )
        self.use(name, meta.get("preset", self.preset))
        self.cache, self.tokens, self.messages = cache, tokens, messages
        return messages
