"""A/B of settings that environment variables switch, interleaved merge by merge in one process.

On a machine whose speed moves within minutes (docs/benchmarks.md, 2026-12-07), two runs of ``run.py`` minutes apart
do not resolve a few per cent; merges of the two arms one after the other, in alternating order, in one warm
process, do. Each arm is a set of environment variables, applied before its merge (they must be read when a merge
starts, as RLMERGE_THREADS and RLMERGE_FAST are). ``--fresh N`` instead times N merges of the set in this new
process, one after the other (``--tiny-first``: after a merge of the tiny built-in example): what the first merge
of a process pays (numba's set-up, lazy imports) beside what a later one does.

    PYTHONPATH=src python benchmarks/interleave.py /work/bench-data/0.5b --method ties --params '{"density": 0.5}' \\
        --rounds 10 --arm one=RLMERGE_THREADS=1 --arm two=RLMERGE_THREADS=2
    PYTHONPATH=src python benchmarks/interleave.py /work/bench-data/0.5b --method task_arithmetic --fresh 3
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import rlmerge

sys.path.insert(0, str(Path(__file__).resolve().parent))
from dataset import NAMES, print_medians, set_arguments  # noqa: E402  the agents' folders of a set benchmarks/run.py made


def _arm(text: str) -> tuple[str, dict[str, str]]:
    name, _, pairs = text.partition("=")
    env = dict(p.split("=", 1) for p in pairs.split(",") if p) if pairs else {}
    if not name or any(not k for k in env):
        raise SystemExit(f"--arm {text!r}: NAME=VAR=VALUE[,VAR=VALUE...] (or NAME= for the environment as it is)")
    return name, env


def _timed(base: Path, agents: list[Path], out: Path, method: str, params: dict) -> tuple[float, float]:
    t, c = time.perf_counter(), time.process_time()
    rlmerge.merge(base, agents, out, method=method, params=params)
    wall, cpu = time.perf_counter() - t, time.process_time() - c
    shutil.rmtree(out)
    return wall, cpu


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    set_arguments(ap)
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--arm", action="append", default=[], help="NAME=VAR=VALUE[,VAR=VALUE...]; two or more")
    ap.add_argument("--fresh", type=int, default=0, help="time this many merges of a fresh process instead")
    ap.add_argument("--tiny-first", action="store_true", help="with --fresh: merge the tiny example first")
    args = ap.parse_args()
    params = json.loads(args.params)
    base, agents = args.set / "base", [args.set / a for a in NAMES]
    with tempfile.TemporaryDirectory(dir=args.set.parent) as scratch:
        root = Path(scratch)
        if args.fresh:
            if args.tiny_first:
                from rlmerge.synthetic import make_example

                tiny_base, tiny_agents = make_example(root / "tiny")
                print(f"tiny example: {_timed(tiny_base, tiny_agents, root / 'tiny-out', args.method, params)[0]:.2f} "
                      "s wall", flush=True)
            for i in range(args.fresh):
                wall, cpu = _timed(base, agents, root / "out", args.method, params)
                print(f"merge {i + 1} of the set: {wall:.2f} s wall, {cpu:.2f} CPU-s", flush=True)
            return
        arms = dict(_arm(a) for a in args.arm)
        if len(arms) < 2:
            raise SystemExit("give two or more --arm")
        _timed(base, agents, root / "out", args.method, params)  # the kernels loaded, the page cache warm
        names = list(arms)
        runs: dict[str, list[tuple[float, float]]] = {n: [] for n in names}
        for r in range(args.rounds):
            for name in names if r % 2 == 0 else names[::-1]:
                os.environ.update(arms[name])
                runs[name].append(_timed(base, agents, root / "out", args.method, params))
                print(f"round {r + 1} {name}: {runs[name][-1][0]:.2f} s wall, {runs[name][-1][1]:.2f} CPU-s",
                      flush=True)
    print_medians(runs)


if __name__ == "__main__":
    main()
