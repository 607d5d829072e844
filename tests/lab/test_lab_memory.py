"""--jobs within the machine's memory: stages start only while their estimated peaks fit (rlmerge.lab.jobs)."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import pytest

from rlmerge.lab import jobs
from rlmerge.lab.jobs import GB, MemoryBook, admit


def test_admit_counts_the_running_stages_and_always_runs_one() -> None:
    assert admit([], 50 * GB, 10 * GB)  # nothing running: even a stage larger than the budget runs (alone)
    assert admit([4 * GB], 6 * GB, 10 * GB)  # 10 of 10
    assert not admit([4 * GB], 6 * GB + 1, 10 * GB)
    assert not admit([3 * GB, 3 * GB], 5 * GB, 10 * GB)
    assert admit([30 * GB], 30 * GB, None)  # no budget known: only --jobs limits


def test_estimates_prefer_the_stage_own_peak_then_its_kind_then_the_prior(tmp_path: Path) -> None:
    book = MemoryBook.load(tmp_path / "jobs.json", {"agent": 17.0, "*": 3.0})
    assert book.estimate("agent coding") == (17 * GB, "prior")
    assert book.estimate("row RAM+") == (3 * GB, "prior")
    book.record("agent tool_use", 16 * GB)
    book.record("agent memory", 7 * GB)
    assert book.estimate("agent memory") == (7 * GB, "measured")
    assert book.estimate("agent coding") == (16 * GB, "measured for another agent")  # the largest of its kind
    book.record("agent memory", 5 * GB)  # a smaller peak later: the largest seen is kept
    assert book.estimate("agent memory")[0] == 7 * GB
    again = MemoryBook.load(tmp_path / "jobs.json", {})  # the next seed, or a rerun, reads what was measured
    assert again.peaks == {"agent memory": 7 * GB, "agent tool_use": 16 * GB}
    (tmp_path / "jobs.json").write_text("{not json")
    assert MemoryBook.load(tmp_path / "jobs.json", {"*": 1.0}).peaks == {}  # damaged: measured again


def test_the_default_budget_is_a_share_of_what_the_system_has_available(monkeypatch: pytest.MonkeyPatch) -> None:
    """What is available: engine.budget.available_memory, the merge's own (MemAvailable, capped by a cgroup's
    limit; tests/test_plan_models.py)."""
    monkeypatch.setattr(jobs, "available_memory", lambda: None)
    assert MemoryBook(None, {}).budget_now() is None  # unknown: only --jobs limits
    monkeypatch.setattr(jobs, "available_memory", lambda: 20 * GB)
    assert MemoryBook(None, {}).budget_now() == int(20 * GB * jobs.BUDGET_SHARE)
    assert MemoryBook(None, {}, budget=5 * GB).budget_now() == 5 * GB  # --memory-gb


def _hold(mb: int) -> int:
    block = bytearray(mb << 20)  # zero-filled: every page touched
    return len(block)


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="resets the peak through Linux's clear_refs")
def test_a_stage_peak_is_its_own_not_the_process_earlier_ones() -> None:
    _, big = jobs.measured(_hold, 300)
    _, small = jobs.measured(_hold, 10)
    assert big >= 300 << 20
    assert small < big - (200 << 20)  # the 300 MB of the stage before are not counted again


def stage(name: str, seconds: float, rendezvous: str) -> tuple[str, float, float, bool]:
    """A stage for the pool: its start and end times; ``rendezvous`` (a folder): it marks its start there and, for
    'A', waits up to 60 s for stage 'C' to start (True when it did: the two ran side by side)."""
    start = time.time()
    folder = Path(rendezvous)
    (folder / f"{name}.started").write_text("")
    met = True
    if name == "A":
        while not (folder / "C.started").exists() and time.time() - start < 60:
            time.sleep(0.05)
        met = (folder / "C.started").exists()
    time.sleep(seconds)
    return name, start, time.time(), met


def test_a_stage_waits_while_it_does_not_fit_and_a_smaller_one_goes_first(tmp_path: Path) -> None:
    """Two 0.8 GB stages do not fit a 1 GB budget together; a 0.1 GB one starts beside the first. The order of
    results is the order of the items, and each stage's measured peak is recorded under its name."""
    book = MemoryBook(tmp_path / "jobs.json", {"big": 0.8, "small": 0.1}, budget=1 * GB)
    items = [("A", 0.2, str(tmp_path)), ("B", 0.2, str(tmp_path)), ("C", 0.2, str(tmp_path))]
    said: list[str] = []
    with jobs.workers_for(2, book, log=said.append) as workers:
        out = jobs.each(workers, stage, items, ["big A", "big B", "small C"])
    assert "big A ~0.8 GB prior" in said[0] and "within 1.0 GB" in said[0]
    assert said[1:] == ["memory: big B (~0.8 GB) waits: the running stages take ~0.8 GB of 1.0 GB"]  # (A alone then)
    assert [o[0] for o in out] == ["A", "B", "C"]
    (_, a0, a1, met), (_, b0, _, _), (_, c0, _, _) = out
    assert met and c0 < a1  # C ran beside A
    assert b0 >= a1  # B waited for A to end: never the two big ones together
    peaks = json.loads((tmp_path / "jobs.json").read_text())["peak_bytes"]
    assert set(peaks) == {"big A", "big B", "small C"} and all(p > 10 << 20 for p in peaks.values())


def test_stages_that_fit_run_side_by_side_and_one_over_the_budget_runs_alone(tmp_path: Path) -> None:
    book = MemoryBook(None, {"*": 5.0}, budget=1 * GB)  # each estimated above the whole budget
    items = [("A", 0.0, str(tmp_path)), ("C", 0.5, str(tmp_path))]
    (tmp_path / "C.started").write_text("")  # A does not wait for C here
    with jobs.workers_for(2, book) as workers:
        (_, a0, a1, _), (_, c0, c1, _) = jobs.each(workers, stage, items, ["x A", "x C"])
    assert c0 >= a1  # one at a time: never two stages each larger than the budget
    roomy = MemoryBook(None, {"*": 0.1}, budget=1 * GB)
    for f in tmp_path.glob("*.started"):
        f.unlink()
    with jobs.workers_for(2, roomy) as workers:
        (_, a0, a1, met), (_, c0, _, _) = jobs.each(workers, stage, [("A", 0.0, str(tmp_path)),
                                                                           ("C", 0.0, str(tmp_path))], ["x A", "x C"])
    assert met and c0 < a1


def test_one_process_records_each_stage_peak(tmp_path: Path) -> None:
    book = MemoryBook(tmp_path / "jobs.json", {})
    with jobs.workers_for(1, book) as workers:
        assert workers.pool is None
        assert jobs.each(workers, _hold, [(50,), (1,)], ["row a", "row b"]) == [50 << 20, 1 << 20]
    assert book.peaks["row a"] >= 50 << 20 and set(book.peaks) == {"row a", "row b"}


def test_the_cli_passes_the_memory_budget(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from rlmerge.cli import main

    seen: dict = {}

    def run_lab(size: str, out: Path, **kwargs: object) -> dict:
        seen.update(kwargs)
        return {"table": "", "seeds": [], "total_seconds": 0.0}

    from rlmerge.lab import pipeline

    monkeypatch.setattr(pipeline, "run_lab", run_lab)
    assert main(["lab", "--size", "smoke", "--jobs", "2", "--memory-gb", "12.5", "--out", str(tmp_path / "o")]) == 0
    assert seen["jobs"] == 2 and seen["memory_gb"] == 12.5


@pytest.mark.skipif(sys.version_info < (3, 11), reason="ProcessPoolExecutor's max_tasks_per_child is Python 3.11's")
def test_fresh_workers_give_each_stage_a_process_of_its_own() -> None:
    """The smollm2 sizes (`fresh_process_per_stage`): a stage's memory goes back to the system when it ends, so
    the next stage's process starts from nothing; the tiny sizes keep their two workers."""
    with jobs.workers_for(2, MemoryBook(None, {"*": 0.0}), fresh=True) as workers:
        fresh = jobs.each(workers, os.getpid, [()] * 4, [f"row {i}" for i in range(4)])
    with jobs.workers_for(2, MemoryBook(None, {"*": 0.0})) as workers:
        kept = jobs.each(workers, os.getpid, [()] * 4, [f"row {i}" for i in range(4)])
    assert len(set(fresh)) == 4 and len(set(kept)) <= 2
    from rlmerge.lab.sizes import SIZES  # (not at the top: the workers import this module, and sizes imports torch)

    assert SIZES["smollm2-uneven"].fresh_process_per_stage and not SIZES["smoke"].fresh_process_per_stage


def _stage_record(reused: bool) -> dict:
    return {"result": len(bytearray(40 << 20)), "reused": reused}


def test_a_stage_read_back_from_its_record_is_not_taken_for_its_peak(tmp_path: Path) -> None:
    """A reused stage (its saved record read back) takes next to nothing: recording that as its peak would let a
    later run start it beside others when it must be computed again."""
    from rlmerge.lab.pipeline import _ran

    book = MemoryBook(tmp_path / "memory.json", {})
    with jobs.workers_for(1, book) as workers:
        jobs.each(workers, _stage_record, [(True,), (False,)], ["row reused", "row computed"], _ran)
    assert set(book.peaks) == {"row computed"} and book.peaks["row computed"] >= 40 << 20
