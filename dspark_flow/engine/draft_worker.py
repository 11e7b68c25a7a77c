"""Evaluate a lazy draft on a second thread while the loop's thread builds the verify graph.

Why: on CUDA MLX launches a graph's kernels from the thread that evaluates it, so the loop's
`mx.async_eval` of the drafter's draft returns only after most of that launch work (3.25 ms a
drafting round on the H200, docs/benchmarks.md §3), and the verify forward's graph, which it
builds next, is host Python (2.1-2.4 ms). MLX releases the GIL while it evaluates, so on a
worker thread the two overlap.

MLX 0.32 binds a stream to the thread that made it: an array built on one thread cannot be
evaluated on another ("There is no Stream(...) in current thread"). So every call to the drafter
runs on the worker (`DrafterOnWorker`), which builds and evaluates all of the drafter's arrays on
its own stream; the loop's thread only puts the draft's ids into the verify graph, and waits for
the worker before it evaluates that graph. Inputs the drafter takes from the target (the taps)
are evaluated on the loop's thread before the drafter takes them (`Drafter.target_features`):
MLX waits for an array on the stream, so the thread, that computed it.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, TypeVar

import mlx.core as mx

from dspark_flow.models.backend import release_thread_streams
from dspark_flow.strategy import Draft, Drafter, Sampler

# True, False, or None for the backend's default (`draft_on_worker`). Benchmarks set it to
# compare.
DRAFT_ON_WORKER: bool | None = None

T = TypeVar("T")


def draft_on_worker(drafter: Drafter) -> bool:
    """Whether this drafter's drafts are evaluated on a worker thread: only drafters that say
    they may run there (`Drafter.runs_on_worker`), and by default nowhere yet (no measured
    gain: benchmarks/draft_worker.py compares). On the CPU and Metal `async_eval` already
    returns before the device work."""
    return bool(DRAFT_ON_WORKER) and drafter.runs_on_worker


class DraftWorker:
    """One thread for one generation. Calls run in order: `call` waits for the result,
    `post` does not (its error raises at the next `call` or `wait`)."""

    def __init__(self) -> None:
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="dspark-flow-draft")
        self._posted: list[Future[Any]] = []

    def call(self, fn: Callable[..., T], *args: Any) -> T:
        future = self._pool.submit(fn, *args)
        self.wait()
        return future.result()

    def post(self, fn: Callable[..., Any], *args: Any) -> None:
        self._posted.append(self._pool.submit(fn, *args))

    def wait(self) -> None:
        """Block until everything posted has run (the first error raises here)."""
        posted, self._posted = self._posted, []
        for future in posted:
            future.result()

    def close(self) -> None:
        """Wait, free the thread's MLX streams (left to interpreter exit they abort the
        process) and end the thread."""
        try:
            self.wait()
        finally:
            self._pool.submit(release_thread_streams).result()
            self._pool.shutdown(wait=True)


class DrafterOnWorker(Drafter):
    """The loop's drafter, every call made on the worker; a lazy draft is evaluated there too
    (`launch`), while the caller builds the verify graph."""

    def __init__(self, drafter: Drafter, worker: DraftWorker):  # no config: a view of one
        self.drafter = drafter
        self.worker = worker

    @property
    def max_draft(self) -> int | None:
        return self.drafter.max_draft

    def begin(self, prompt_ids: list[int], sampler: Sampler) -> None:
        self.worker.call(self.drafter.begin, prompt_ids, sampler)

    def source(self, history: list[int]) -> str:
        return self.worker.call(self.drafter.source, history)

    def propose(self, history: list[int], k: int) -> Draft:
        return self.worker.call(self.drafter.propose, history, k)

    def launch(self, pending: mx.array) -> None:
        self.worker.post(mx.eval, pending)

    def observe(self, proposed: int, accepted: int) -> None:
        self.worker.post(self.drafter.observe, proposed, accepted)

    def after_forward(self, committed: int) -> None:
        mx.eval(self.drafter.target_features())  # computed here: waited for here
        # Waited for: it takes the taps, which the next forward on this thread replaces.
        self.worker.call(self.drafter.after_forward, committed)
