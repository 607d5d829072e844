"""A method's first merge: what compiling its kernels costs, against the same merge with them cached.

Runs in a fresh process per call with an empty numba cache of its own (``NUMBA_CACHE_DIR``, set before numba is
imported): one warm-up merge (``--warm-up``, default task arithmetic: numba's own set-up is paid there), then each
``--method`` twice on the built-in example (``rlmerge.synthetic.make_example``: 3 agents, bf16), the first merge
compiling its specialisations, the second loading them. The figures include the merge itself (~0.1 s cached).

    PYTHONPATH=src python benchmarks/first_merge.py --method ties --method dare_ties
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--method", action="append", required=True, help="a method to time (repeatable)")
    ap.add_argument("--warm-up", default="task_arithmetic", help="merged first, untimed in the table")
    args = ap.parse_args()
    root = Path(tempfile.mkdtemp(prefix="first-merge-"))
    os.environ["NUMBA_CACHE_DIR"] = str(root / "numba-cache")  # before rlmerge imports numba
    try:
        import rlmerge
        from rlmerge.synthetic import make_example

        base, agents = make_example(root / "in")

        def timed(method: str, out: str) -> float:
            t = time.perf_counter()
            rlmerge.merge(base, agents, root / out, method=method, fsync=False)
            return time.perf_counter() - t

        print(f"warm-up {args.warm_up}: {timed(args.warm_up, 'warm-up'):.2f} s")
        for i, method in enumerate(args.method):
            first = timed(method, f"{i}-first")
            cached = timed(method, f"{i}-cached")
            print(f"{method}: first merge {first:.2f} s, cached {cached:.2f} s")
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
