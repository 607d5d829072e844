"""Worker threads that an interrupted command never waits on for long.

The engine's compute and read threads and the writer's thread are daemon threads fed by one queue. On an
interrupt (Ctrl-C, SIGTERM) ``close(abort=True)`` drops the calls not yet started and waits for the running ones at
most ``ABORT_WAIT`` seconds: a call stuck for good (a write to a hung disk, a kernel that does not return) then
neither keeps the cleanup waiting nor, being a daemon thread, the process alive at exit. The stdlib's
ThreadPoolExecutor cannot do this: the interpreter joins its threads at exit, however long they take.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import Future
from typing import Any

ABORT_WAIT = 5.0  # seconds an aborted close waits for the calls still running


class Workers:
    """``threads`` daemon threads running submitted calls, each as a Future.

    ``chained``: after a call fails, every later call fails with the same error without running (the writer's
    order: nothing is written after a failed write).
    """

    def __init__(self, threads: int, name: str, *, chained: bool = False) -> None:
        self._q: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._abort = False
        self._chained = chained
        self._failed: BaseException | None = None
        self._threads = [threading.Thread(target=self._loop, name=f"{name}-{i}", daemon=True) for i in range(threads)]
        for t in self._threads:
            t.start()

    def submit(self, fn: Callable[..., Any], *args: Any) -> Future[Any]:
        fut: Future[Any] = Future()
        self._q.put((fut, fn, args))
        return fut

    def map(self, fn: Callable[..., Any], calls: Iterable[tuple[Any, ...]]) -> list[Any]:
        """``fn(*args)`` for each ``args`` of ``calls``, run in parallel; the results in order."""
        futures = [self.submit(fn, *args) for args in calls]
        return [f.result() for f in futures]

    def _loop(self) -> None:
        while (item := self._q.get()) is not None:
            fut, fn, args = item
            if self._abort:
                fut.cancel()
            if not fut.set_running_or_notify_cancel():
                continue
            if self._failed is not None:
                fut.set_exception(self._failed)
                continue
            try:
                fut.set_result(fn(*args))
            except BaseException as e:  # handed to whoever waits on the future
                if self._chained:
                    self._failed = e
                fut.set_exception(e)

    def close(self, *, abort: bool) -> bool:
        """Stop the threads once the calls submitted so far ran (``abort``: once the running ones end, the others
        dropped, waiting at most ABORT_WAIT seconds). True when every thread ended."""
        self._abort = abort
        for _ in self._threads:
            self._q.put(None)
        end = time.monotonic() + ABORT_WAIT
        for t in self._threads:
            t.join(timeout=max(0.0, end - time.monotonic()) if abort else None)
        return not any(t.is_alive() for t in self._threads)
