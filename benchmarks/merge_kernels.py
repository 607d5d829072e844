"""Where a fast-path merge spends its compute: each numba kernel's time summed over its calls, in a whole merge.

Every entry point of the engine's fused kernel and of the sparsify family's kernels is wrapped by a timer (wall time
of each call on its compute thread, summed over threads: with two compute threads, up to twice the merge's wall
time), the merge is run ``--repeat`` times in this process (the first also loads or compiles the kernels), and the
sums of each run are printed beside its wall time. Main-thread work between kernels (sampling, page releases,
Python) is what the wall time has beyond them: ``in hand-offs`` is the wall time the main thread spent handing
blocks to the compute threads and waiting for them (``Workers.map``), ``outside`` the rest, while the compute
threads wait; how many hand-offs of several parts had all of them run by one thread (the other thread started too
late), and how late a hand-off's last part began. ``CPU s`` is the CPU time of the whole process, of the main thread
and of each pool of worker threads (compute, write, read, readahead; each thread's ``time.thread_time`` as it ends):
on two CPUs a merge cannot take less wall time than half its process CPU. docs/benchmarks.md quotes it.

    PYTHONPATH=src python benchmarks/merge_kernels.py /work/bench-data/redesign/0.5b --method ties \\
        --params '{"density": 0.5}'
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
from pathlib import Path
from typing import Any

import numpy as np

import rlmerge
import rlmerge.kernels as engine_kernels
from rlmerge._threads import Workers
from rlmerge.methods.sparsify import kernels as family_kernels

sys.path.insert(0, str(Path(__file__).resolve().parent))
from dataset import NAMES, set_arguments  # noqa: E402  the agents' folders of a set benchmarks/run.py made


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    set_arguments(ap)
    ap.add_argument("--repeat", type=int, default=2)
    args = ap.parse_args()
    spent: dict[str, float] = collections.defaultdict(float)
    calls: collections.Counter[str] = collections.Counter()
    lock = threading.Lock()

    def timed(module: object, name: str) -> None:
        kernel = getattr(module, name)

        def run(*a: object) -> object:
            t = time.perf_counter()
            try:
                return kernel(*a)
            finally:
                with lock:
                    spent[name] += time.perf_counter() - t
                    calls[name] += 1

        setattr(module, name, run)

    handing = [0.0, 0]  # seconds in the compute threads' Workers.map, calls
    plain_map = Workers.map

    lags: list[float] = []  # per hand-off of several parts: when its last part started, after the hand-off
    alone = [0]  # hand-offs of several parts that one thread ran all of (the others started too late)

    def timed_map(self: Workers, fn: Any, calls: Any) -> Any:
        if not self._threads[0].name.startswith("rlmerge-compute"):
            return plain_map(self, fn, calls)
        calls = list(calls)
        began: list[tuple[float, int]] = []

        def part(*a: Any) -> Any:
            began.append((time.perf_counter(), threading.get_ident()))
            return fn(*a)

        t = time.perf_counter()
        try:
            return plain_map(self, part, calls)
        finally:
            handing[0] += time.perf_counter() - t
            handing[1] += 1
            if len(calls) > 1:
                lags.append(max(s for s, _ in began) - t)
                alone[0] += len({who for _, who in began}) == 1

    Workers.map = timed_map  # type: ignore[method-assign]
    pools: dict[str, float] = collections.defaultdict(float)  # CPU seconds of each pool's threads, as they end
    plain_loop = Workers._loop

    def counted_loop(self: Workers) -> None:
        try:
            plain_loop(self)
        finally:
            with lock:
                pools[threading.current_thread().name.rsplit("-", 1)[0].removeprefix("rlmerge-")] += time.thread_time()

    Workers._loop = counted_loop  # type: ignore[method-assign]
    timed(engine_kernels, "fused_range")
    for name in family_kernels._ENTRIES:
        timed(family_kernels, name)
    agents = [args.set / a for a in NAMES]
    with tempfile.TemporaryDirectory(dir=args.set.parent) as scratch:
        for run in range(args.repeat):
            spent.clear()
            calls.clear()
            handing[:] = [0.0, 0]
            pools.clear()
            lags.clear()
            alone[0] = 0
            out = Path(scratch) / "out"
            t, cpu, main_cpu = time.perf_counter(), time.process_time(), time.thread_time()
            rlmerge.merge(args.set / "base", agents, out, method=args.method, params=json.loads(args.params))
            wall = time.perf_counter() - t
            cpu, main_cpu = time.process_time() - cpu, time.thread_time() - main_cpu
            shutil.rmtree(out)
            parts = ", ".join(f"{k} {v:.2f} s / {calls[k]}" for k, v in sorted(spent.items(), key=lambda kv: -kv[1]))
            print(f"run {run + 1}: {args.method} {wall:.2f} s wall; kernels (s / calls): {parts}; "
                  f"sum {sum(spent.values()):.2f} s; in hand-offs {handing[0]:.2f} s / {handing[1]}, outside them "
                  f"{wall - handing[0]:.2f} s", flush=True)
            if lags:
                p50, p90 = (float(v) * 1e3 for v in np.percentile(lags, [50, 90]))
                print(f"       hand-offs of several parts: {len(lags)}, all run by one thread: {alone[0]}; the last "
                      f"part began {p50:.2f} ms (median), {p90:.2f} ms (90th percentile) after the hand-off")
            threads = ", ".join(f"{k} {v:.2f}" for k, v in sorted(pools.items()))
            print(f"       CPU s: process {cpu:.2f} (main thread {main_cpu:.2f}; {threads}) in {wall:.2f} s wall",
                  flush=True)


if __name__ == "__main__":
    main()
