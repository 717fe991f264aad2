"""The web server: the chat page, its JSON/SSE API, and an OpenAI-compatible API.

/api/* serves the page (named SSE events); /v1/* follows OpenAI's chat
completions format so other clients work. Both queue jobs on the same Worker.
"""

import asyncio
import json
import re
import time
import uuid
from pathlib import Path

from sse_starlette import EventSourceResponse, ServerSentEvent
from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.responses import FileResponse, JSONResponse
from starlette.routing import Route

from .engine import PRESET_NAMES, ChatError, check_messages, check_preset
from .worker import END, Worker

STATIC = Path(__file__).parent / "static"
MAX_BODY = 4 << 20  # bytes; far beyond any context this app can hold
CHARS_PER_TOKEN_MAX = 32  # a body longer than context * this cannot fit: refuse before tokenizing
POLL = 0.5  # seconds between queue-position updates and disconnect checks
_TIMEOUT = object()
_SAFE_NAME = re.compile(r"[A-Za-z0-9][\w.-]{0,63}")


def error(message, status=400, code="invalid_request_error"):
    kind = "invalid_request_error" if status < 500 else "server_error"
    return JSONResponse({"error": {"message": message, "type": kind, "code": code, "param": None}},
                        status_code=status)


def error_from(e: ChatError):
    return error(str(e), e.status, e.code)


async def read_json(request):
    if int(request.headers.get("content-length") or 0) > MAX_BODY:
        raise ChatError(f"request body too large (limit {MAX_BODY >> 20} MiB)", status=413)
    body = await request.body()
    if len(body) > MAX_BODY:
        raise ChatError(f"request body too large (limit {MAX_BODY >> 20} MiB)", status=413)
    try:
        data = json.loads(body or b"{}")
    except ValueError as e:
        raise ChatError(f"malformed JSON: {e}", code="invalid_json")
    if not isinstance(data, dict):
        raise ChatError("the request body must be a JSON object", code="invalid_json")
    return data


def create_app(worker: Worker, save_dir: Path):
    save_dir = Path(save_dir)
    last_stats = {}

    def engine():
        if not worker.ready.is_set():
            raise ChatError("the model is still loading; try again in a moment", code="loading", status=503)
        if worker.engine is None:
            raise ChatError(f"the model failed to load: {worker.error}", code="server_error", status=503)
        return worker.engine

    async def check_request(data):
        """Validate a chat request before queueing it; returns the engine arguments."""
        eng = engine()
        messages = check_messages(data.get("messages"))
        model = data.get("model") or eng.name
        if model not in eng.specs:
            raise ChatError(f"unknown model {model!r}; this server has: {', '.join(eng.specs)}",
                            code="model_not_found", status=404)
        preset = check_preset(data.get("kv_preset") or data.get("preset") or eng.preset)
        if data.get("n", 1) != 1:
            raise ChatError("only n=1 is supported")
        max_tokens = data.get("max_completion_tokens", data.get("max_tokens"))
        for key, value in (("max_tokens", max_tokens), ("temperature", data.get("temperature")),
                           ("top_p", data.get("top_p"))):
            if value is not None and (not isinstance(value, (int, float)) or isinstance(value, bool) or value < 0):
                raise ChatError(f"{key} must be a non-negative number")
        if max_tokens is not None and max_tokens < 1:
            raise ChatError("max_tokens must be at least 1")
        chars = sum(len(m["content"]) for m in messages)
        if chars > eng.context * CHARS_PER_TOKEN_MAX:
            raise ChatError(f"the conversation is {chars} characters, far beyond {model}'s "
                            f"{eng.context}-token context; shorten the message or start a new chat",
                            code="context_length_exceeded")
        if model == eng.name:
            # The tokenizer is plain Python/Rust (no MLX): counting here gives a
            # proper HTTP 400 instead of an error in the middle of a stream.
            n = await run_in_threadpool(eng.count_tokens, messages)
            if n >= eng.context:
                raise ChatError(f"the conversation is {n} tokens but {model} has a {eng.context}-token "
                                "context; shorten the message or start a new chat",
                                code="context_length_exceeded")
        return dict(messages=messages, model=model, preset=preset, max_tokens=max_tokens,
                    temp=data.get("temperature"), top_p=data.get("top_p") if data.get("top_p") is not None else 1.0)

    def submit_chat(args):
        def fn(job):
            eng = worker.engine
            eng.use(args["model"], args["preset"])
            return eng.chat(args["messages"], args["max_tokens"], args["temp"], args["top_p"], stop=job.cancel)
        return worker.submit(fn)

    async def events(job, request=None):
        """A job's events; `queued` events while it waits. Leaving (done, or the
        client went away: sse-starlette cancels us) cancels the job."""
        loop = asyncio.get_running_loop()
        next_check = loop.time() + POLL
        try:
            if worker.position(job):
                yield {"type": "queued", "position": worker.position(job)}
            while True:
                try:
                    ev = await asyncio.wait_for(job.events.get(), POLL)
                except asyncio.TimeoutError:
                    ev = _TIMEOUT
                # Checked by the clock: while tokens flow the queue never times out.
                if loop.time() >= next_check:
                    next_check = loop.time() + POLL
                    if request is not None and await request.is_disconnected():
                        return
                    if not job.started:
                        yield {"type": "queued", "position": worker.position(job)}
                if ev is _TIMEOUT:
                    continue
                if ev is END:
                    return
                if ev["type"] == "stats":
                    last_stats.update(ev)
                elif ev["type"] == "done":
                    last_stats.update(ev["stats"])
                yield ev
        finally:
            job.cancel.set()

    async def run_simple(fn):
        """Run fn(engine) on the worker and return its result (or raise ChatError)."""
        engine()
        job = worker.submit(lambda job: fn(worker.engine))
        result = None
        async for ev in events(job):
            if ev["type"] == "error":
                raise ChatError(ev["message"], ev["code"], ev["status"])
            if ev["type"] == "result":
                result = ev["value"]
        return result

    # -- the page -------------------------------------------------------------

    async def index(request):
        return FileResponse(STATIC / "index.html", headers={"Cache-Control": "no-store"})

    async def health(request):
        return JSONResponse({"ready": worker.ready.is_set() and worker.engine is not None,
                             "loading": not worker.ready.is_set(), "error": worker.error,
                             "queued": worker.busy(), "last_reply": worker.last_reply})

    async def info(request):
        try:
            eng = engine()
        except ChatError as e:
            return error_from(e)
        return JSONResponse({"models": list(eng.specs), "presets": list(PRESET_NAMES), "model": eng.name,
                             "preset": eng.preset, "max_tokens": eng.default_max_tokens,
                             "messages": eng.messages, "stats": last_stats or worker.initial_stats})

    async def stats(request):
        return JSONResponse(last_stats or worker.initial_stats)

    async def api_chat(request):
        try:
            args = await check_request(await read_json(request))
        except ChatError as e:
            return error_from(e)
        job = submit_chat(args)

        async def stream():
            async for ev in events(job):
                yield ServerSentEvent(json.dumps(ev), event=ev["type"])

        return EventSourceResponse(stream(), ping=10)

    async def api_new(request):
        try:
            data = await read_json(request)
            model, preset = data.get("model"), data.get("preset")
            if preset is not None:
                check_preset(preset)

            def fn(eng):
                eng.use(model, preset)
                eng.new_chat()
                return eng.stats(point=True)

            s = await run_simple(fn)
        except ChatError as e:
            return error_from(e)
        last_stats.clear()
        last_stats.update(s)
        return JSONResponse(s)

    def chat_file(name):
        if not isinstance(name, str) or not _SAFE_NAME.fullmatch(name.removesuffix(".safetensors")):
            raise ChatError("a chat name is 1-64 letters, digits, '.', '_' or '-'")
        return save_dir / (name.removesuffix(".safetensors") + ".safetensors")

    async def api_save(request):
        try:
            path = chat_file((await read_json(request)).get("name"))
            await run_simple(lambda eng: str(eng.save(path)))
        except ChatError as e:
            return error_from(e)
        return JSONResponse({"name": path.stem, "file": str(path)})

    async def api_load(request):
        try:
            path = chat_file((await read_json(request)).get("name"))

            def fn(eng):
                messages = eng.load(path)
                return {"messages": messages, "stats": eng.stats(point=True)}

            out = await run_simple(fn)
        except ChatError as e:
            return error_from(e)
        last_stats.clear()
        last_stats.update(out["stats"])
        return JSONResponse(out)

    async def api_chats(request):
        names = sorted(p.stem for p in save_dir.glob("*.safetensors")) if save_dir.is_dir() else []
        return JSONResponse({"chats": names, "dir": str(save_dir)})

    # -- OpenAI-compatible ----------------------------------------------------

    async def v1_models(request):
        try:
            eng = engine()
        except ChatError as e:
            return error_from(e)
        return JSONResponse({"object": "list", "data": [
            {"id": name, "object": "model", "created": 0, "owned_by": "local"} for name in eng.specs]})

    async def v1_chat(request):
        try:
            data = await read_json(request)
            args = await check_request(data)
        except ChatError as e:
            return error_from(e)
        cid, created, model = f"chatcmpl-{uuid.uuid4().hex[:24]}", int(time.time()), args["model"]
        job = submit_chat(args)

        def chunk(delta, finish=None):
            return json.dumps({"id": cid, "object": "chat.completion.chunk", "created": created, "model": model,
                               "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]})

        if not data.get("stream"):
            text, done = "", None
            async for ev in events(job, request):
                if ev["type"] == "error":
                    return error(ev["message"], ev["status"], ev["code"])
                if ev["type"] == "done":
                    text, done = ev["text"], ev
            if done is None:  # the client left
                return error("cancelled", 499, "cancelled")
            return JSONResponse({
                "id": cid, "object": "chat.completion", "created": created, "model": model,
                "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                             "finish_reason": _finish(done["finish_reason"])}],
                "usage": done["usage"], "kvarn": _public(done["stats"])})

        include_usage = bool((data.get("stream_options") or {}).get("include_usage"))

        async def stream():
            async for ev in events(job):
                kind = ev["type"]
                if kind == "queued":
                    yield ServerSentEvent(comment=f"queued: {ev['position']} request(s) ahead of you")
                elif kind == "started":
                    yield ServerSentEvent(chunk({"role": "assistant", "content": ""}))
                elif kind == "token":
                    yield ServerSentEvent(chunk({"content": ev["text"]}))
                elif kind == "error":
                    yield ServerSentEvent(json.dumps({"error": {"message": ev["message"], "type": "server_error"
                                                                if ev["status"] >= 500 else "invalid_request_error",
                                                                "code": ev["code"], "param": None}}))
                    return
                elif kind == "done":
                    yield ServerSentEvent(chunk({}, _finish(ev["finish_reason"])))
                    if include_usage:
                        yield ServerSentEvent(json.dumps({"id": cid, "object": "chat.completion.chunk",
                                                          "created": created, "model": model, "choices": [],
                                                          "usage": ev["usage"]}))
            yield ServerSentEvent("[DONE]")

        return EventSourceResponse(stream(), ping=10)

    routes = [
        Route("/", index),
        Route("/api/health", health),
        Route("/api/info", info),
        Route("/api/stats", stats),
        Route("/api/chat", api_chat, methods=["POST"]),
        Route("/api/new", api_new, methods=["POST"]),
        Route("/api/save", api_save, methods=["POST"]),
        Route("/api/load", api_load, methods=["POST"]),
        Route("/api/chats", api_chats),
        Route("/v1/models", v1_models),
        Route("/v1/chat/completions", v1_chat, methods=["POST"]),
    ]
    return Starlette(routes=routes)


def _finish(reason):
    return "stop" if reason == "cancelled" else reason


def _public(stats):
    return {k: v for k, v in stats.items() if k != "history"}
