"""The single generation worker: one thread owns the model and runs one request at a time, in
arrival order.

MLX work (loading, warm-up, decoding) all happens on that thread, so the event loop only moves
text between the worker and the sockets and stays responsive while a generation runs. Each job
carries a cancel flag: a client that goes away sets it, and the worker stops consuming the
generation's events at the next one, freeing itself for the next request.
"""

from __future__ import annotations

import asyncio
import queue
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from pydantic import ValidationError

from dspark_flow.engine.decode import DoneEvent, TextEvent
from dspark_flow.errors import DsparkFlowError
from dspark_flow.log import get_logger
from dspark_flow.models.backend import release_thread_streams
from dspark_flow.models.context import context_limit
from dspark_flow.pipeline import Pipeline
from dspark_flow.result import GenResult
from dspark_flow.server.common import ApiError, Finished

log = get_logger()

WARMUP_PROMPT = "Hello"


def _closing() -> ApiError:
    return ApiError(503, "the server is shutting down", type="server_error")


def _cancelled() -> ApiError:
    """What a cancelled job's consumer receives (nginx's "client closed request"; it is never
    delivered: the client has gone)."""
    return ApiError(499, "the client closed the request")


@dataclass
class GenRequest:
    prompt_ids: list[int]
    max_tokens: int | None  # None: the recipe's budget
    sampler: dict[str, Any] | None  # None: the recipe's sampler
    stop: list[str] = field(default_factory=list)


class Job:
    """One queued request; the worker thread feeds its items into the event loop."""

    def __init__(self, request: GenRequest, loop: asyncio.AbstractEventLoop):
        self.request = request
        self.enqueued = time.perf_counter()
        self.cancelled = threading.Event()
        self._loop = loop
        self._items: asyncio.Queue[str | Finished | BaseException] = asyncio.Queue()

    def put(self, item: str | Finished | BaseException) -> None:
        """Called from the worker thread (and from the shutdown's signal handler)."""
        try:
            self._loop.call_soon_threadsafe(self._items.put_nowait, item)
        except RuntimeError:  # the loop is closed (server shutting down): nobody is listening
            self.cancelled.set()

    def cancel(self) -> None:
        self.cancelled.set()

    def abort(self, error: ApiError) -> None:
        """End the job with `error` for its consumer now (the server is stopping); the worker
        stops the generation at its next event."""
        self.cancelled.set()
        self.put(error)

    async def items(self) -> AsyncIterator[str | Finished]:
        """Text pieces, then one `Finished`; raises the worker's error. Leaving early (a client
        disconnect cancels the consuming task) cancels the generation."""
        try:
            while True:
                item = await self._items.get()
                if isinstance(item, BaseException):
                    raise item
                yield item
                if isinstance(item, Finished):
                    return
        finally:
            self.cancel()


def find_stop_sequence(tokenizer: Any, result: GenResult, stops: list[str]) -> str | None:
    """Which stop string ended the text. The loop cuts the text at a stop string but keeps the
    tokens, so the stop string is what the full decode has right after the returned text."""
    if not stops or result.finish_reason != "stop":
        return None
    full = tokenizer.decode(result.token_ids)
    if not full.startswith(result.text):
        return None
    matches = [s for s in stops if full.startswith(s, len(result.text))]
    return max(matches, key=len) if matches else None


class Engine:
    def __init__(
        self,
        pipeline: Pipeline,
        *,
        warmup: bool = True,
        max_active_bytes: int | None = None,
    ):
        self.pipeline = pipeline
        self.warmup = warmup
        self.max_active_bytes = max_active_bytes
        if max_active_bytes is None:
            # The cache's own setting, else most of what MLX may use: the guard is always on.
            from dspark_flow.strategies.caches.prefix import default_memory_ceiling

            configured = getattr(pipeline.cache.config, "max_active_bytes", None)
            self.max_active_bytes = (
                configured if configured is not None else default_memory_ceiling()
            )
        self.ready = False
        self.load_error: BaseException | None = None
        self._log_failure = True
        self.busy = False
        self.served = 0
        self.cancelled = 0
        self.failed = 0
        self.context_length: int | None = None
        self.tokenizer: Any = None
        self._loaded = threading.Event()
        self._jobs: queue.Queue[Job | None] = queue.Queue()
        self._running: Job | None = None
        self._closing = False  # set by abort_all: the server is stopping
        self._thread = threading.Thread(target=self._work, name="dspark-flow-engine", daemon=True)

    # -- lifecycle ---------------------------------------------------------------------------

    def start(self, log_failure: bool = True) -> Engine:
        """Load (and warm up) on the worker thread. `log_failure` false: a caller that will
        wait_ready() and report the failure itself (the CLI) does not get it logged twice."""
        self._log_failure = log_failure
        if not self._thread.is_alive():
            self._thread.start()
        return self

    def wait_ready(self, timeout: float | None = None) -> None:
        """Block until the model is loaded and warmed up; re-raise a loading failure."""
        if not self._loaded.wait(timeout):
            raise DsparkFlowError("the model did not finish loading in time")
        if self.load_error is not None:
            raise self.load_error

    def abort_all(self) -> int:
        """End every queued and running request with a 503 in its own dialect (a stream gets
        an error event and its end) instead of leaving them to be cut off, and every later one
        at once; returns how many were ended here.

        Runs in a signal handler, on the event loop's thread, which may have been interrupted
        inside the queue's own lock (submit, waiting): it takes no lock. The closing flag covers
        a job between the queue and `_running`, and requests submitted after it."""
        self._closing = True
        jobs = [j for j in list(self._jobs.queue) if j is not None]  # one C call: atomic
        running = self._running
        if running is not None and running not in jobs:
            jobs.append(running)
        for job in jobs:
            job.abort(_closing())
        return len(jobs)

    def _end_if_closing(self, job: Job) -> None:
        """A job abort_all did not reach ends with the same 503 once the server is closing."""
        if self._closing and not job.cancelled.is_set():
            job.abort(_closing())

    def stop(self) -> None:
        self._jobs.put(None)
        if self._thread.is_alive():
            self._thread.join(timeout=30)

    @property
    def waiting(self) -> int:
        return self._jobs.qsize()

    @property
    def drafter_kind(self) -> str:
        return str(self.pipeline.recipe.drafter.kind)

    @property
    def cache(self) -> Any:
        return self.pipeline.cache

    def cache_stats(self) -> dict[str, Any]:
        stats = getattr(self.cache, "stats", None)
        return stats() if callable(stats) else {"kind": str(self.pipeline.recipe.cache.kind)}

    def submit(self, request: GenRequest) -> Job:
        """Queue a request (call from the event loop); consume `job.items()`."""
        job = Job(request, asyncio.get_running_loop())
        if self._closing:
            job.abort(_closing())
        else:
            self._jobs.put(job)
        return job

    # -- the worker thread -------------------------------------------------------------------

    def _load(self) -> None:
        started = time.perf_counter()
        self.pipeline.warm_up()
        components = self.pipeline.components
        assert components is not None
        self.tokenizer = components.tokenizer
        self.context_length = context_limit(components.model)
        if self.warmup:
            # One tiny generation compiles/allocates what the first request would otherwise pay.
            self.pipeline.generate(WARMUP_PROMPT, max_new_tokens=2)
            clear = getattr(self.cache, "clear", None)
            if callable(clear):
                clear()  # the warm-up prompt is of no use to anyone
        log.info("model ready", seconds=round(time.perf_counter() - started, 2))

    def _work(self) -> None:
        try:
            self._serve()
        finally:
            release_thread_streams()  # or the process aborts at exit (serve's Ctrl-C: exit 134)

    def _serve(self) -> None:
        try:
            self._load()
            self.ready = True
        except BaseException as exc:
            self.load_error = exc
            if self._log_failure:
                log.error("loading failed", error=str(exc))
        finally:
            self._loaded.set()
        while True:
            job = self._jobs.get()
            if job is None:
                return
            self._end_if_closing(job)  # taken while abort_all ran
            if job.cancelled.is_set():
                self.cancelled += 1
                job.put(_cancelled())  # a consumer may still be waiting: let it finish
                continue
            if not self.ready:
                job.put(ApiError(503, "the model failed to load", type="server_error"))
                continue
            self.busy = True
            self._running = job
            try:
                self._run(job)
            finally:
                self.busy = False
                self._running = None

    def _run(self, job: Job) -> None:
        req = job.request
        relieve = getattr(self.cache, "relieve_memory", None)
        if callable(relieve):
            relieve(self.max_active_bytes)
        queue_seconds = time.perf_counter() - job.enqueued
        events = self.pipeline.events(
            req.prompt_ids,
            max_new_tokens=req.max_tokens,
            sampler=req.sampler,
            stop=req.stop or None,
            stream_text=True,  # also for non-streaming requests: text events are cancel points
        )
        try:
            for event in events:
                self._end_if_closing(job)  # abort_all may have missed it
                if job.cancelled.is_set():
                    self.cancelled += 1
                    reason = "server shutting down" if self._closing else "client went away"
                    log.info("generation cancelled", reason=reason)
                    job.put(_cancelled())
                    return
                if isinstance(event, TextEvent):
                    job.put(event.text)
                elif isinstance(event, DoneEvent):
                    self.served += 1
                    job.put(
                        Finished(
                            result=event.result,
                            prompt_tokens=len(req.prompt_ids),
                            prefix_cached_tokens=int(getattr(self.cache, "last_reused", 0)),
                            queue_seconds=queue_seconds,
                            stop_sequence=find_stop_sequence(
                                self.tokenizer, event.result, req.stop
                            ),
                            drafter=self.drafter_kind,
                        )
                    )
        except (DsparkFlowError, ValidationError) as exc:
            self.failed += 1
            job.put(ApiError(400, str(exc).splitlines()[0] if str(exc) else type(exc).__name__))
        except Exception as exc:  # a bug: the client gets a clean 500, the log gets the details
            self.failed += 1
            log.exception("generation failed")
            job.put(ApiError(500, f"generation failed: {type(exc).__name__}", type="server_error"))
        finally:
            events.close()  # stop the generator where it stands
