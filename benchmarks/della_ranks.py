"""What DELLA's row ranks cost, per agent, on one tensor of a benchmark set: ``kernels.della.rank_span`` (the rank
of |τ| in its row, methods/sparsify/kernels/della.py) against the decode of the keys alone (its first loop: read
agent and base, τ, |τ|'s bits), in CPU ns per element on one thread; the ranks checked against a stable sort.

    PYTHONPATH=src python benchmarks/della_ranks.py /work/bench-data/0.5b [--tensor NAME] [--repeat 5]

The set is the one ``benchmarks/run.py`` makes (``base/`` and one folder per agent, bf16 safetensors).
"""

from __future__ import annotations

import argparse
import json
import sys
from functools import partial
from pathlib import Path

import numpy as np
import torch
from numba import njit

from rlmerge.kernels.codec import _dec, _f32_as_u32, _tau
from rlmerge.methods.sparsify.kernels import della
from rlmerge.methods.sparsify.kernels.della import _ABS

sys.path.insert(0, str(Path(__file__).resolve().parent))
from select_kernels import best, bf16_bits, bf16_tensor, bits  # noqa: E402  (benchmarks/ is not a package)


@njit(nogil=True)
def _keys_only(a, b, n, row, keys, tau):  # type: ignore[no-untyped-def]
    """rank_row's first loop over every row of the tensor (the keys it then sorts)."""
    acc = np.uint32(0)
    for lo in range(0, n, row):
        for i in range(row):
            keys[i] = _f32_as_u32(_tau(a, np.uint64(lo + i), _dec(b[lo + i]), tau)) & _ABS
        acc ^= keys[0]
    return acc


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("set", type=Path, help="a benchmark set folder (manifest.json, base/, one folder per agent)")
    ap.add_argument("--tensor", default="model.layers.3.mlp.down_proj.weight")
    ap.add_argument("--repeat", type=int, default=5, help="timings per kernel; the fastest is printed")
    args = ap.parse_args()
    agents = sorted(p.name for p in args.set.iterdir() if p.is_dir() and p.name != "base")
    t = bf16_tensor(args.set / "base", args.tensor)
    shape, base = list(t.shape), bits(t)
    row, n = shape[-1], base.shape[0]
    manifest = json.loads((args.set / "manifest.json").read_text()) if (args.set / "manifest.json").exists() else {}
    print(f"{args.set} ({manifest.get('shape', {}).get('arch', '?')}), {args.tensor} {shape}: rows of {row}, "
          f"one thread, CPU time, best of {args.repeat}")
    print("| agent | changed elements | rank_span ns / element | keys alone ns / element | ranks = stable sort |")
    print("|---|---:|---:|---:|---|")
    work, hist = della.scratch(row)
    keys = np.empty(row, dtype=np.uint32)
    for name in agents:
        a = bf16_bits(args.set / name, args.tensor)
        ranks = np.empty((1, n), dtype=np.uint32)
        della.rank_span(base, a[None], 0, n, row, ranks, work, hist, None)  # compile / warm
        _keys_only(a, base, n, row, keys, None)
        t_rank = best(partial(della.rank_span, base, a[None], 0, n, row, ranks, work, hist, None), args.repeat)
        t_keys = best(partial(_keys_only, a, base, n, row, keys, None), args.repeat)
        tau = torch.from_numpy(a.view(np.int16)).view(torch.bfloat16).float() - \
            torch.from_numpy(base.view(np.int16)).view(torch.bfloat16).float()
        ref = torch.argsort(tau.abs().view(-1, row), dim=1, stable=True).argsort(dim=1).view(-1).numpy()
        print(f"| {name} | {(a != base).mean() * 100:.1f} % | {t_rank / n * 1e9:.2f} | {t_keys / n * 1e9:.2f} "
              f"| {np.array_equal(ranks[0], ref.astype(np.uint32))} |")


if __name__ == "__main__":
    main()
