"""Where a merge's threads spend it: per thread kind its busy time and CPU, how long 0, 1, 2 … compute threads ran at
once, and where the main thread was while none ran.

Every call the engine's worker threads (rlmerge._threads.Workers) run is timed (wall and thread CPU); a sampler
thread looks at the main thread's stack every millisecond while no compute thread runs a call, and counts the
innermost three rlmerge frames. A sample needs the GIL, so a main thread busy in Python is sampled less often than
one waiting: the counts say where it waits more than where it computes. The first merge loads the kernels and is
not reported unless it is the only one.

    PYTHONPATH=src python benchmarks/merge_threads.py /work/bench-data/0.5b --method ties --params '{"density": 0.5}'
"""

from __future__ import annotations

import argparse
import collections
import json
import shutil
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path
from typing import Any

import rlmerge
from rlmerge import _threads

sys.path.insert(0, str(Path(__file__).resolve().parent))
from dataset import NAMES, set_arguments  # noqa: E402  the agents' folders of a set benchmarks/run.py made

calls: list[tuple[str, float, float, float]] = []  # (thread kind, start, end, thread CPU s)
running = [0]  # compute calls running now


def _timed_loop(self: _threads.Workers) -> None:
    """Workers._loop with every call timed (the abort and chaining rules left out: a benchmark is not interrupted)."""
    kind = threading.current_thread().name.rsplit("-", 1)[0]
    compute = kind == "rlmerge-compute"
    while (item := self._q.get()) is not None:
        fut, fn, args = item
        if not fut.set_running_or_notify_cancel():
            continue
        t, c = time.perf_counter(), time.thread_time()
        running[0] += compute
        try:
            fut.set_result(fn(*args))
        except BaseException as e:  # noqa: BLE001  handed to the waiter, as Workers does
            fut.set_exception(e)
        running[0] -= compute
        calls.append((kind, t, time.perf_counter(), time.thread_time() - c))


def _sampler(main_id: int, on: list[bool], samples: collections.Counter[str]) -> None:
    while True:
        time.sleep(0.001)
        if not on[0] or running[0]:
            continue
        frame = sys._current_frames().get(main_id)
        if frame is None:
            continue
        ours = [f for f in traceback.extract_stack(frame) if "rlmerge" in f.filename]
        samples[" < ".join(f"{Path(f.filename).name}:{f.lineno} {f.name}" for f in ours[::-1][:3])] += 1


def _occupancy(t0: float, t1: float) -> dict[int, float]:
    edges = sorted([(a, 1) for k, a, _, _ in calls if k == "rlmerge-compute"]
                   + [(b, -1) for k, _, b, _ in calls if k == "rlmerge-compute"])
    held: dict[int, float] = collections.defaultdict(float)
    now, last = 0, t0
    for x, d in edges:
        held[now] += x - last
        now, last = now + d, x
    held[now] += t1 - last
    return dict(held)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    set_arguments(ap)
    ap.add_argument("--merges", type=int, default=3, help="merges in this process (the first is not reported)")
    ap.add_argument("--top", type=int, default=15, help="main-thread places to list")
    args = ap.parse_args()
    params: dict[str, Any] = json.loads(args.params)
    _threads.Workers._loop = _timed_loop  # type: ignore[method-assign]
    samples: collections.Counter[str] = collections.Counter()
    on = [False]
    threading.Thread(target=_sampler, args=(threading.main_thread().ident, on, samples), daemon=True).start()
    base, agents = args.set / "base", [args.set / a for a in NAMES]
    with tempfile.TemporaryDirectory(dir=args.set.parent) as scratch:
        for i in range(args.merges):
            out = Path(scratch) / "out"
            calls.clear()
            samples.clear()
            t, c, m = time.perf_counter(), time.process_time(), time.thread_time()
            on[0] = True
            rlmerge.merge(base, agents, out, method=args.method, params=params)
            on[0] = False
            t1 = time.perf_counter()
            shutil.rmtree(out)
            if i == 0 and args.merges > 1:
                continue
            print(f"merge {i + 1}: {t1 - t:.2f} s wall, {time.process_time() - c:.2f} CPU-s "
                  f"(main thread {time.thread_time() - m:.2f})")
            kinds: dict[str, list[float]] = collections.defaultdict(lambda: [0.0, 0.0, 0])
            for kind, a, b, cpu in calls:
                kinds[kind][0] += b - a
                kinds[kind][1] += cpu
                kinds[kind][2] += 1
            for kind, (busy, cpu, n) in sorted(kinds.items()):
                print(f"  {kind:22s} busy {busy:6.2f} s  CPU {cpu:6.2f} s  calls {n}")
            held = _occupancy(t, t1)
            print("  compute threads running at once: "
                  + ", ".join(f"{k}: {v:.2f} s" for k, v in sorted(held.items())))
            print(f"  the main thread while none ran ({sum(samples.values())} samples of ~1 ms):")
            for where, n in samples.most_common(args.top):
                print(f"    {n:5d}  {where}")


if __name__ == "__main__":
    main()
