"""rlmerge._threads: the worker threads an interrupted command never waits on for long."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

import rlmerge
from rlmerge import _threads
from rlmerge._threads import Workers


def test_map_returns_results_in_order_and_raises_the_first_error() -> None:
    w = Workers(3, "t")
    try:
        assert w.map(lambda a, b: a * b, [(i, 2) for i in range(20)]) == [2 * i for i in range(20)]
        with pytest.raises(ZeroDivisionError):
            w.map(lambda x: 1 / x, [(1,), (0,), (2,)])
        assert w.map(lambda x: x + 1, [(1,)]) == [2]  # not chained: a failed call does not stop the others
    finally:
        assert w.close(abort=False)


def test_chained_calls_after_a_failure_fail_with_its_error_without_running() -> None:
    ran: list[int] = []
    w = Workers(1, "t", chained=True)
    first = w.submit(lambda: 1 / 0)
    later = w.submit(ran.append, 1)
    assert w.close(abort=False)
    assert isinstance(first.exception(), ZeroDivisionError)
    assert later.exception() is first.exception() and ran == []


def test_an_aborted_close_waits_a_bounded_time_for_a_stuck_call_and_drops_the_queued(monkeypatch) -> None:
    monkeypatch.setattr(_threads, "ABORT_WAIT", 0.2)
    release = threading.Event()
    w = Workers(1, "t")
    stuck = w.submit(release.wait)
    queued = w.submit(lambda: "ran")
    while not stuck.running():
        time.sleep(0.001)
    t0 = time.monotonic()
    assert w.close(abort=True) is False  # the stuck call still runs …
    assert time.monotonic() - t0 < 4.0  # … and was not waited for (0.2 s here)
    assert all(t.daemon for t in w._threads)  # nor will it keep the process alive
    release.set()
    assert stuck.result(5) is True and queued.cancelled()


def test_a_merge_leaves_no_thread_running(example, tmp_path: Path) -> None:
    base, agents = example
    before = {t.ident for t in threading.enumerate()}
    rlmerge.merge(base, agents, tmp_path / "out", method="ties")
    rlmerge.merge(base, agents, tmp_path / "out2", method="ram+")
    left = [t.name for t in threading.enumerate() if t.ident not in before and t.is_alive()]
    assert left == []
