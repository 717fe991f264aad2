"""The web server: the chat page, its JSON/SSE API, and an OpenAI-compatible API.

/api/* serves the page (named SSE events); /v1/* follows OpenAI's chat
completions format so other clients work. Both queue jobs on the same Worker.

Every request first passes guard.py's checks (Host, Origin, API key); a JSON
body is read up to a size limit and checked completely (validate.py) before
any job is queued. With an API key, the page itself (static, no conversation
in it) is served without one: it asks the user for the key, keeps it in the
tab's sessionStorage and sends it as a Bearer token like any other client.
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
from starlette.datastructures import Headers
from starlette.middleware import Middleware
from starlette.requests import ClientDisconnect
from starlette.responses import FileResponse, JSONResponse
from starlette.routing import Route

from .engine import PRESET_NAMES
from .errors import ChatError
from .guard import check_api_key, check_host, check_json_type, check_origin
from .validate import check_chat_request, check_name, only_fields, parse_json
from .worker import END, Worker

STATIC = Path(__file__).parent / "static"
MAX_BODY = 4 << 20  # bytes; far beyond any context this app can hold
CHARS_PER_TOKEN_MAX = 32  # a body longer than context * this cannot fit: refuse before tokenizing
POLL = 0.5  # seconds between queue-position updates and disconnect checks
PUBLIC = ("/",)  # served without the API key: the static page
_TIMEOUT = object()
_SAFE_NAME = re.compile(r"[A-Za-z0-9][\w.-]{0,63}")


def error(message, status=400, code="invalid_request_error", param=None):
    kind = "invalid_request_error" if status < 500 else "server_error"
    headers = {"WWW-Authenticate": "Bearer"} if status == 401 else None
    return JSONResponse({"error": {"message": message, "type": kind, "code": code, "param": param}},
                        status_code=status, headers=headers)


def error_from(e: ChatError):
    return error(str(e), e.status, e.code, e.param)


class Guard:
    """ASGI middleware: refuse requests naming another Host, coming from
    another web page's Origin, or without the API key. No CORS headers are
    ever sent, so browsers keep other pages from reading any answer."""

    def __init__(self, app, allowed_hosts=(), allowed_origins=(), api_key=None):
        self.app, self.api_key = app, api_key
        self.allowed_hosts = {h.strip().lower() for h in allowed_hosts}
        self.allowed_origins = {o.strip().lower().rstrip("/") for o in allowed_origins}

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http":
            headers = Headers(scope=scope)
            try:
                local = (scope.get("server") or (None,))[0]
                check_host(headers.get("host"), local, self.allowed_hosts)
                check_origin(headers.get("origin"), headers.get("host"), scope.get("scheme", "http"),
                             self.allowed_origins)
                if scope["path"] not in PUBLIC:
                    check_api_key(headers.get("authorization"), self.api_key)
            except ChatError as e:
                await error_from(e)(scope, receive, send)
                return
        await self.app(scope, receive, send)


async def read_json(request, limit=MAX_BODY):
    """The JSON body, refused (413) as soon as it passes `limit` bytes: by its
    declared length, or while it streams in (chunked bodies have none)."""
    check_json_type(request.headers.get("content-type"))
    too_large = ChatError(f"request body too large (limit {limit} bytes)", code="request_too_large", status=413)
    try:
        declared = int(request.headers.get("content-length") or 0)
    except ValueError:
        raise ChatError("bad Content-Length header")
    if declared > limit:
        raise too_large
    body = bytearray()
    try:
        async for chunk in request.stream():
            body += chunk
            if len(body) > limit:
                raise too_large
    except ClientDisconnect:  # nobody is left to answer; just do no work
        raise ChatError("the client left before sending the whole body", code="client_disconnected")
    return parse_json(bytes(body))


def create_app(worker: Worker, save_dir: Path, allowed_hosts=(), allowed_origins=(), api_key=None,
               max_body=MAX_BODY):
    """The app. allowed_hosts: Host names accepted besides localhost names and
    the address a connection arrived on; allowed_origins: web origins besides
    the page's own; api_key: the Bearer token every endpoint but the page needs."""
    save_dir = Path(save_dir)
    last_stats = {}

    def engine():
        if not worker.ready.is_set():
            raise ChatError("the model is still loading; try again in a moment", code="loading", status=503)
        if worker.engine is None:
            raise ChatError(f"the model failed to load: {worker.error}", code="server_error", status=503)
        return worker.engine

    async def body(request):
        return await read_json(request, max_body)

    async def check_request(data):
        """Validate a chat request before queueing it; returns the engine arguments."""
        eng = engine()
        args = check_chat_request(data, list(eng.specs), PRESET_NAMES, eng.context)
        args["model"] = model = args["model"] or eng.name
        args["preset"] = args["preset"] or eng.preset
        chars = sum(len(m["content"]) for m in args["messages"])
        if chars > eng.context * CHARS_PER_TOKEN_MAX:
            raise ChatError(f"the conversation is {chars} characters, far beyond {model}'s "
                            f"{eng.context}-token context; shorten the message or start a new chat",
                            code="context_length_exceeded", param="messages")
        if model == eng.name:
            # The tokenizer is plain Python/Rust (no MLX): counting here gives a
            # proper HTTP 400 instead of an error in the middle of a stream.
            n = await run_in_threadpool(eng.count_tokens, args["messages"])
            if n >= eng.context:
                raise ChatError(f"the conversation is {n} tokens but {model} has a {eng.context}-token "
                                "context; shorten the message or start a new chat",
                                code="context_length_exceeded", param="messages")
        return args

    def submit_chat(args):
        def fn(job):
            eng = worker.engine
            eng.use(args["model"], args["preset"])
            return eng.chat(args["messages"], args["max_tokens"], args["temp"],
                            1.0 if args["top_p"] is None else args["top_p"], stop=args["stop"], seed=args["seed"],
                            cancel=job.cancel)
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
                raise ChatError(ev["message"], ev["code"], ev["status"], ev.get("param"))
            if ev["type"] == "result":
                result = ev["value"]
        return result

    # -- the page -------------------------------------------------------------

    async def index(request):
        return FileResponse(STATIC / "index.html", headers={"Cache-Control": "no-store"})

    async def health(request):
        return JSONResponse({"ready": worker.ready.is_set() and worker.engine is not None,
                             "loading": not worker.ready.is_set(), "error": worker.error,
                             "queued": worker.busy()})

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
            args = await check_request(await body(request))
        except ChatError as e:
            return error_from(e)
        job = submit_chat(args)

        async def stream():
            async for ev in events(job):
                yield ServerSentEvent(json.dumps(ev), event=ev["type"])

        return EventSourceResponse(stream(), ping=10)

    async def api_new(request):
        try:
            data = only_fields(await body(request), ("model", "preset"))
            model = check_name(data, "model", list(engine().specs))
            preset = check_name(data, "preset", PRESET_NAMES)

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

    def chat_file(data):
        name = only_fields(data, ("name",)).get("name")
        if not isinstance(name, str) or not _SAFE_NAME.fullmatch(name.removesuffix(".safetensors")):
            raise ChatError("a chat name is 1-64 letters, digits, '.', '_' or '-'", param="name")
        return save_dir / (name.removesuffix(".safetensors") + ".safetensors")

    async def api_save(request):
        try:
            path = chat_file(await body(request))

            def fn(eng):
                try:
                    save_dir.mkdir(parents=True, exist_ok=True)
                except OSError as e:
                    raise ChatError(f"cannot create the chats folder {save_dir}: {e}", "cannot_save", 500)
                return str(eng.save(path))

            await run_simple(fn)
        except ChatError as e:
            return error_from(e)
        return JSONResponse({"name": path.stem, "file": str(path)})

    async def api_load(request):
        try:
            path = chat_file(await body(request))

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
            args = await check_request(await body(request))
        except ChatError as e:
            return error_from(e)
        cid, created, model = f"chatcmpl-{uuid.uuid4().hex[:24]}", int(time.time()), args["model"]
        job = submit_chat(args)

        def chunk(delta, finish=None):
            return json.dumps({"id": cid, "object": "chat.completion.chunk", "created": created, "model": model,
                               "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]})

        if not args["stream"]:
            text, done = "", None
            async for ev in events(job, request):
                if ev["type"] == "error":
                    return error(ev["message"], ev["status"], ev["code"], ev.get("param"))
                if ev["type"] == "done":
                    text, done = ev["text"], ev
            if done is None:  # the client left
                return error("cancelled", 499, "cancelled")
            return JSONResponse({
                "id": cid, "object": "chat.completion", "created": created, "model": model,
                "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                             "finish_reason": _finish(done["finish_reason"])}],
                "usage": done["usage"], "kvarn": _public(done["stats"])})

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
                                                                "code": ev["code"], "param": ev.get("param")}}))
                    return
                elif kind == "done":
                    yield ServerSentEvent(chunk({}, _finish(ev["finish_reason"])))
                    if args["include_usage"]:
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
    guard = Middleware(Guard, allowed_hosts=allowed_hosts, allowed_origins=allowed_origins, api_key=api_key)
    app = Starlette(routes=routes, middleware=[guard])
    app.router.redirect_slashes = False  # a stray slash is a 404, not a redirect built from the Host header
    return app


def _finish(reason):
    return "stop" if reason == "cancelled" else reason


def _public(stats):
    return {k: v for k, v in stats.items() if k != "history"}
