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


def test_two_threads_reading_one_checkpoint_each_get_their_own_bytes(example) -> None:
    # The numba path's reader thread reads a checkpoint while the main thread copies from it (read_raw): each
    # thread's read buffer is its own (Checkpoint.scratch). With one shared buffer the bytes below get mixed.
    from rlmerge.io.open import open_all

    base, _ = example
    (ckpt,) = open_all([base])
    names = sorted(ckpt.tensors, key=lambda n: -ckpt.tensors[n].numel)[:2]
    want = {n: bytes(ckpt.read_raw(n, 0, ckpt.tensors[n].numel)) for n in names}
    bad: list[str] = []

    def reader(name: str) -> None:
        for _ in range(300):
            got = ckpt.read_raw(name, 0, ckpt.tensors[name].numel)
            if bytes(got) != want[name]:
                bad.append(name)
                return

    threads = [threading.Thread(target=reader, args=(n,)) for n in names]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    ckpt.close()
    assert bad == []
