"""One worker thread that owns the Engine; asyncio handlers queue jobs to it.

MLX state (model, cache, streams) is used from this thread only, and jobs run
one at a time in arrival order, so requests never interleave on the cache.
Each job reports back through an asyncio.Queue of events ending with END.
"""

import asyncio
import logging
import threading
import traceback
from collections import deque

from .engine import ChatError, Engine

log = logging.getLogger("apps.chat")
END = None  # last event of every job


class Job:
    def __init__(self, fn, loop):
        self.fn = fn  # fn(job) -> an iterator of events, or a single result
        self.loop = loop
        self.events = asyncio.Queue()
        self.cancel = threading.Event()  # set by the client side: stop or skip this job
        self.started = False

    def emit(self, ev):
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, ev)
        except RuntimeError:  # the event loop is gone (server shutting down)
            pass


class Worker:
    def __init__(self, engine_kwargs):
        self.engine = None
        self.error = None  # why the engine failed to start, if it did
        self.initial_stats = {}
        self.ready = threading.Event()
        self._jobs = deque()
        self._cv = threading.Condition()
        self._thread = threading.Thread(target=self._run, args=(engine_kwargs,), name="mlx-worker",
                                        daemon=True)
        self._thread.start()

    def submit(self, fn):
        """Queue fn(job) from the event loop; returns the Job."""
        job = Job(fn, asyncio.get_running_loop())
        with self._cv:
            self._jobs.append(job)
            self._cv.notify()
        return job

    def position(self, job):
        """How many jobs run before this one (0 = it is next or running)."""
        with self._cv:
            try:
                return self._jobs.index(job)
            except ValueError:
                return 0

    def busy(self):
        with self._cv:
            return len(self._jobs)

    def stop(self):
        with self._cv:
            self._jobs.append(END)
            self._cv.notify()
        self._thread.join(timeout=10)

    def _run(self, engine_kwargs):
        try:
            self.engine = Engine(**engine_kwargs)
            self.initial_stats = self.engine.stats()
        except Exception as e:
            self.error = f"{type(e).__name__}: {e}"
            log.error("could not start the engine: %s", self.error)
        self.ready.set()
        while True:
            with self._cv:
                while not self._jobs:
                    self._cv.wait()
                job = self._jobs[0]
            if job is END:
                return
            self._do(job)
            with self._cv:
                self._jobs.popleft()

    def _do(self, job):
        if job.cancel.is_set():  # the client left while waiting
            job.emit(END)
            return
        job.started = True
        job.emit({"type": "started"})
        try:
            if self.engine is None:
                raise ChatError(f"the model failed to load: {self.error}", code="server_error", status=503)
            out = job.fn(job)
            if hasattr(out, "__next__"):
                for ev in out:
                    job.emit(ev)
            else:
                job.emit({"type": "result", "value": out})
        except ChatError as e:
            job.emit({"type": "error", "message": str(e), "code": e.code, "status": e.status, "param": e.param})
        except Exception as e:  # keep serving: report, log, carry on
            log.error("job failed:\n%s", traceback.format_exc())
            job.emit({"type": "error", "message": f"internal error: {type(e).__name__}: {e}",
                      "code": "server_error", "status": 500})
        finally:
            job.emit(END)
