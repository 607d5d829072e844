"""What DARE / DELLA's random draws cost alone: mt19937 seeded per chunk and ``torch.rand``'s float32 values made
by the numba streams (methods/sparsify/kernels/mt.py), per number, on one thread; checked against torch.

    PYTHONPATH=src python benchmarks/mt_draws.py [--chunks 2000]
"""

from __future__ import annotations

import argparse
import time

import numpy as np
from numba import njit

from rlmerge.methods.sparsify.kernels import mt
from rlmerge.methods.sparsify.rng import RNG_CHUNK


@njit(nogil=True)
def _draw_chunks(state, out, chunks):  # type: ignore[no-untyped-def]
    acc = 0.0
    for c in range(chunks):
        mt.uniform(state, mt.seed(state, c), out, len(out))
        acc += out[0]
    return acc


@njit(nogil=True)
def _seed_only(state, chunks):  # type: ignore[no-untyped-def]
    for c in range(chunks):
        mt.seed(state, c)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--chunks", type=int, default=2000, help=f"chunks of {RNG_CHUNK} numbers per timing")
    args = ap.parse_args()
    import torch

    state, out = np.empty(mt.STATE, dtype=np.uint32), np.empty(RNG_CHUNK, dtype=np.float32)
    _draw_chunks(state, out, 1), _seed_only(state, 1)  # compile
    for _ in range(3):
        t = time.perf_counter()
        _draw_chunks(state, out, args.chunks)
        draw = time.perf_counter() - t
        t = time.perf_counter()
        _seed_only(state, args.chunks)
        seed = time.perf_counter() - t
        n = args.chunks * RNG_CHUNK
        print(f"seed + draw {draw / n * 1e9:.3f} ns per number; the seeding alone {seed / n * 1e9:.3f} ns")
    mt.uniform(state, mt.seed(state, 5), out, len(out))
    same = bool((torch.rand(len(out), generator=torch.Generator().manual_seed(5)).numpy() == out).all())
    print(f"the same numbers as torch.rand: {same}")


if __name__ == "__main__":
    main()
