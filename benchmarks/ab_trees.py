"""A/B of two (or more) source trees of rlmerge: fresh processes of each, alternated, each timing a few merges of a
set after one that loads the kernels; medians of the timed merges.

For a change that no environment variable switches (interleave.py's case): check out each side in its own
worktree and give their roots. A process's first merge is not counted (numba's set-up, lazy imports), so the
figures are those of later merges, as interleave.py's.

    python benchmarks/ab_trees.py /work/bench-data/0.5b --tree /work/main --tree /work/wt/branch \\
        --method ties --params '{"density": 0.5}' --rounds 6
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from dataset import print_medians, set_arguments  # noqa: E402

CHILD = """
import json, shutil, sys, tempfile, time
from pathlib import Path
import rlmerge
sys.path.insert(0, {bench!r})
from dataset import NAMES
root, method, params, merges = Path({set!r}), {method!r}, json.loads({params!r}), {merges}
with tempfile.TemporaryDirectory(dir=root.parent) as scratch:
    for i in range(merges + 1):
        out = Path(scratch) / "out"
        t, c = time.perf_counter(), time.process_time()
        rlmerge.merge(root / "base", [root / a for a in NAMES], out, method=method, params=params)
        wall, cpu = time.perf_counter() - t, time.process_time() - c
        shutil.rmtree(out)
        if i:
            print(f"{{wall}} {{cpu}}", flush=True)
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    set_arguments(ap)
    ap.add_argument("--tree", action="append", default=[], type=Path, help="a checkout's root; two or more")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--merges", type=int, default=2, help="timed merges per process")
    args = ap.parse_args()
    if len(args.tree) < 2:
        raise SystemExit("give two or more --tree")
    code = CHILD.format(bench=str(Path(__file__).resolve().parent), set=str(args.set.resolve()),
                        method=args.method, params=args.params, merges=args.merges)
    runs: dict[Path, list[tuple[float, float]]] = {t: [] for t in args.tree}
    for r in range(args.rounds):
        for tree in args.tree if r % 2 == 0 else args.tree[::-1]:
            env = dict(os.environ, PYTHONPATH=str(tree / "src"), HF_HUB_OFFLINE="1")
            done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
            if done.returncode:
                raise SystemExit(f"{tree}: the merge failed:\n{done.stderr[-2000:]}")
            got = [tuple(float(x) for x in line.split()) for line in done.stdout.split("\n") if line.strip()]
            runs[tree].extend(got)  # type: ignore[arg-type]
            print(f"round {r + 1} {tree}: " + ", ".join(f"{w:.2f} s" for w, _ in got), flush=True)
    print_medians(runs)


if __name__ == "__main__":
    main()
