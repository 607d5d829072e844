"""--jobs: a lab seed's independent stages (the agents, each model's test scores, the merge rows) in worker
processes, one torch thread each, within the machine's memory.

With --jobs > 1 each stage (an agent's GRPO run, a model's test scores, a merge row) runs in a worker process
and holds its own model: two of the smollm2 sizes' agents side by side need more than 24 GB (the
system killed a 16.7 GB tool-use run beside a 6.6 GB memory run on 2026-12-06). So the pool admits a stage only
while the peaks of the stages running and its own fit the budget; one stage alone always runs.

A stage's peak is its process's resident high-water mark (``VmHWM``, reset as the stage starts), recorded in
``memory.json`` in the run's --out (`MemoryBook`), so later seeds and reruns plan with what each stage
took here; a stage never measured counts the size's prior (`LabSize.stage_gb`, measured on the lab machine).
"""

from __future__ import annotations

import json
import multiprocessing
import os
import resource
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from concurrent.futures.process import BrokenProcessPool
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rlmerge.engine.budget import available_memory
from rlmerge.errors import RLMergeError
from rlmerge.lab.stages import write_json

GB = 1 << 30
BUDGET_SHARE = 0.9  # of the memory available: the main process, the page cache of the checkpoints, a margin
SIGNAL_POLL = 1.0  # seconds the main process waits on its workers at a time (`each`): see there


def reset_peak() -> bool:
    """Start this process's high-water mark afresh (Linux ≥ 4.0); False where it cannot (the peak then counts
    from the process's start: an over-estimate)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def peak_bytes() -> int:
    """This process's resident high-water mark since `reset_peak` (else since it started)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss if sys.platform == "darwin" else rss * 1024  # bytes on macOS, KiB on Linux


def measured(fn: Callable[..., Any], *args: Any) -> tuple[Any, int]:
    """``fn(*args)`` and the peak resident bytes of this process while it ran."""
    reset_peak()
    result = fn(*args)
    return result, peak_bytes()


def kind(stage: str) -> str:
    """A stage name's kind, its first word: ``agent tool_use`` → ``agent``, ``row RAM+`` → ``row``."""
    return stage.split(" ", 1)[0]


@dataclass
class MemoryBook:
    """The peak each stage took (bytes, the largest seen), kept in ``path``; estimates for stages to come."""

    path: Path | None
    priors_gb: Mapping[str, float]  # stage name, stage kind or "*" -> GB, for stages never measured
    budget: int | None = None  # bytes the stages running together may use; None: no limit
    peaks: dict[str, int] = field(default_factory=dict)

    @classmethod
    def load(cls, path: Path | None, priors_gb: Mapping[str, float], budget: int | None = None) -> MemoryBook:
        peaks: dict[str, int] = {}
        if path is not None and path.is_file():
            try:
                saved = json.loads(path.read_text())
                peaks = {str(k): int(v) for k, v in saved.get("peak_bytes", {}).items()}
            except (ValueError, AttributeError, TypeError):
                peaks = {}  # a damaged record only costs the estimates: measured again as stages run
        return cls(path, priors_gb, budget, peaks)

    def estimate(self, stage: str) -> tuple[int, str]:
        """(bytes, where from): this stage's own peak, else the largest peak of its kind, else the prior for the
        stage (by its name, else its kind, else "*")."""
        if stage in self.peaks:
            return self.peaks[stage], "measured"
        same = [v for k, v in self.peaks.items() if kind(k) == kind(stage)]
        if same:
            return max(same), f"measured for another {kind(stage)}"
        for key in (stage, kind(stage), "*"):
            if key in self.priors_gb:
                return int(self.priors_gb[key] * GB), "prior"
        return 0, "prior"

    def record(self, stage: str, peak: int) -> None:
        if peak <= self.peaks.get(stage, 0):
            return
        self.peaks[stage] = peak
        if self.path is not None:
            write_json(self.path, {"peak_bytes": dict(sorted(self.peaks.items())),
                                   "note": "largest resident set of each lab stage's process (rlmerge.lab.jobs)"})

    def budget_now(self) -> int | None:
        """The budget for a batch of stages starting now: the one given, else a share of what is available."""
        if self.budget is not None:
            return self.budget
        free = available_memory()  # MemAvailable, capped by a cgroup's limit (the merge's own budget reads it)
        return None if free is None else int(free * BUDGET_SHARE)


def admit(running: list[int], wanted: int, budget: int | None) -> bool:
    """Whether a stage estimated at ``wanted`` bytes may start beside stages estimated at ``running``: always
    when nothing runs (a stage larger than the budget runs alone), else while the sum fits."""
    return not running or budget is None or sum(running) + wanted <= budget


def one_thread() -> None:
    """A worker's initializer: one torch thread, as run_lab's own process (see there). Set before the stage's
    modules import torch (which reads it then), so a worker costs no torch import of its own."""
    os.environ["OMP_NUM_THREADS"] = "1"
    if "torch" in sys.modules:
        sys.modules["torch"].set_num_threads(1)


@dataclass
class Workers:
    """Where a seed's independent stages run (--jobs): ``pool``'s processes (None: one at a time in this process),
    at most ``jobs`` at once and, with a pool, only while their memory estimates fit ``book``'s budget."""

    pool: ProcessPoolExecutor | None
    jobs: int
    book: MemoryBook
    log: Callable[[str], None] = print


@contextmanager
def workers_for(jobs: int, book: MemoryBook | None = None, *, fresh: bool = False,
                log: Callable[[str], None] = print) -> Iterator[Workers]:
    """``jobs`` processes that run a seed's independent stages side by side, or none for one at a time in this
    process. Spawned, one torch thread each; with ``fresh`` (Python ≥ 3.11) a new process for every stage, so a
    finished stage's memory goes back to the system before the next starts (the smollm2 sizes: stages of
    minutes holding GB; the tiny sizes' stages last seconds, less than a worker's imports). A stage a worker
    finishes is saved by it, as in this process, so an interrupted run resumes the same way."""
    book = book if book is not None else MemoryBook(None, {})
    if jobs <= 1:
        yield Workers(None, 1, book, log)
        return
    per_stage = {"max_tasks_per_child": 1} if fresh and sys.version_info >= (3, 11) else {}
    pool = ProcessPoolExecutor(max_workers=jobs, mp_context=multiprocessing.get_context("spawn"),
                               initializer=one_thread, **per_stage)
    try:
        yield Workers(pool, jobs, book, log)
    except BaseException:
        # a stop (SIGINT to this process alone, or a stage that failed) ends the workers' stages too: waiting for
        # them would hold the run for up to an hour; a stage stopped midway wrote nothing and runs again on resume
        pool.shutdown(wait=False, cancel_futures=True)
        workers = multiprocessing.active_children()
        for worker in workers:
            worker.terminate()
        deadline = time.time() + 30  # (the executor's own thread may reap them first: poll, do not join)
        while any(w.is_alive() for w in workers) and time.time() < deadline:
            time.sleep(0.05)
        raise
    pool.shutdown(wait=True)


def _gb(n: int | None) -> str:
    return "?" if n is None else f"{n / GB:.1f} GB"


def each(workers: Workers | None, fn: Callable[..., Any], items: Sequence[tuple[Any, ...]], names: Sequence[str],
         ran: Callable[[Any], bool] = lambda result: True) -> list[Any]:
    """``fn(*item)`` for each item (stage ``names[i]``: ``agent tool_use``, ``row RAM+``), results in order.
    In ``workers``' pool: started in order, each as soon as a process is free and its memory estimate fits
    beside the running stages' (`admit`; a later, smaller stage may start before a larger one that
    waits); each stage's measured peak goes to the book where ``ran(result)`` (a stage read back from its saved
    record took next to nothing, which says nothing of what it takes to compute)."""
    workers = workers if workers is not None else Workers(None, 1, MemoryBook(None, {}))
    book = workers.book
    if workers.pool is None:
        results = []
        for item, name in zip(items, names, strict=True):
            result, peak = measured(fn, *item)
            if ran(result):
                book.record(name, peak)
            results.append(result)
        return results
    budget = book.budget_now()
    estimates = [book.estimate(name) for name in names]
    if len(items) > 1:
        told = ", ".join(f"{n} ~{_gb(e)} {how}" for n, (e, how) in zip(names, estimates))
        workers.log(f"memory: {len(items)} stages, at most {workers.jobs} at once within {_gb(budget)} ({told})")
    pending = list(range(len(items)))
    running: dict[Future[Any], int] = {}
    results: list[Any] = [None] * len(items)
    waiting: set[int] = set()  # the stages whose wait was logged
    try:
        while pending or running:
            for i in list(pending):
                if len(running) >= workers.jobs:
                    break
                if admit([estimates[j][0] for j in running.values()], estimates[i][0], budget):
                    running[workers.pool.submit(measured, fn, *items[i])] = i
                    pending.remove(i)
                elif i not in waiting:
                    waiting.add(i)
                    used = sum(estimates[j][0] for j in running.values())
                    workers.log(f"memory: {names[i]} (~{_gb(estimates[i][0])}) waits: the running stages take "
                                f"~{_gb(used)} of {_gb(budget)}")
            done: set[Future[Any]] = set()
            while not done:
                # Woken every SIGNAL_POLL seconds, not only when a stage ends: a SIGTERM that the kernel gave to
                # another of this process's threads (the executor's, a library's) is only run in the main thread
                # once it runs Python again, and a wait without a timeout would hold it for the rest of a stage
                # (minutes; the 120 s of a test's stage, seen once in a CI run).
                done, _ = wait(running, timeout=SIGNAL_POLL, return_when=FIRST_COMPLETED)
            for future in done:
                i = running.pop(future)
                results[i], peak = future.result()
                if ran(results[i]):
                    book.record(names[i], peak)
    except BrokenProcessPool as err:
        raise RLMergeError(
            "a worker process of --jobs died while it ran a stage: the system killed it, most likely for memory "
            f"(running: {', '.join(names[i] for i in running.values())}; the peaks measured so far are in "
            f"{book.path or 'no file'})",
            hint="the stages finished before it are kept: run the same command again, with --jobs 1, a smaller "
            "--memory-gb, or with more memory free (nothing large beside it)") from err
    return results
