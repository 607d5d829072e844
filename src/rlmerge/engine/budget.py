"""Peak memory of a merge, estimated from headers alone, and the check that refuses one that will not fit.

Memory is bounded by the block size B (elements) and the number of agents N, never by the model size. The route
(route.py) picks the estimate of the path the merge will take:

- the torch path (``estimate_memory``): reused float32 buffers (base [B], deltas [N, B]) and raw read buffers,
  the per-block work arrays of the statistics pass and the method (|τ| > ε masks, float64 Gram input, signs …:
  ``WORK_PER_AGENT`` bytes per element per agent plus ``WORK_FIXED``), and ``BASELINE`` for the interpreter,
  torch and numpy;
- the numba path (``estimate_fast``): no torch, one mapped block per input, the output slots.

tests/test_route.py checks both against the peak RSS of real merges (within 25 %).

``.bin`` inputs are memory-mapped: the pages they touch count in RSS but are file-backed and reclaimable,
so they are reported separately and not checked (a pre-1.6 non-zip ``.bin`` cannot be mapped and is
loaded whole: it really occupies that memory).
"""

from __future__ import annotations

import contextlib
import math
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import ConfigError
from ..io.checkpoint import Checkpoint

# Measured (Linux, torch 2.13 CPU; tests/test_route.py re-measures it): a torch-path merge of N = 3 bf16 agents
# peaked at 315–325 MiB with blocks of 0.25 M elements and at 671 (ram+), 678 (ties), 688 (ram, task_arithmetic,
# dare_ties) MiB with blocks of 4 M: ~296 MiB fixed and 90–94 bytes per element, where the formula below gives
# 4 (N + 1) + 2 (N + 1) + 16 N + 32 = 104.
BASELINE = 296 * 2**20  # bytes: interpreter + torch + numpy + rich, statistics arrays, I/O buffers
WORK_PER_AGENT = 16  # bytes per element per agent for block temporaries (stats pass: mask, f64 copy, signs)
WORK_FIXED = 32  # bytes per element: counts, merged block, output cast, bincount inputs
# Measured (Linux, numba 0.6x, 2 threads; tests/test_route.py re-measures it): a fused merge of N = 3 bf16 agents
# peaked at 179.6 / 183.7 / 195.5 / 211.5 MiB with blocks of 0.25 / 1 / 2 / 4 M elements (ram+; ties and
# task_arithmetic within 2 MiB of these): ~176 MiB fixed and 8.2 bytes per element, where the formula below
# gives (N + 1) · 2 + 2 = 10.
FAST_BASELINE = 176 * 2**20  # bytes: interpreter + numpy + numba + the loaded kernels and threads, no torch
# Measured the same way with .bin inputs (2026-12-04): 366 MiB fixed with one .bin input (torch loaded to read
# it) and ~23 bytes per element (the blocks copied into two slots, where safetensors are viewed in place).
TORCH_LOADED = 190 * 2**20  # bytes: torch, on the numba path, when an input is read by copy (.bin, verl shards)


@dataclass(frozen=True)
class MemoryEstimate:
    block: int  # elements per block actually used (the block size, capped at the largest tensor)
    buffers: int  # bytes: reused float32 blocks + raw read buffers
    work: int  # bytes: per-block temporaries
    baseline: int  # bytes: the interpreter and libraries
    mapped: int  # bytes of memory-mapped .bin inputs (file-backed, reclaimable; not in ``total``)
    torch: bool = True  # whether ``baseline`` counts torch (False: the numba path over inputs viewed in place)

    @property
    def total(self) -> int:
        return self.buffers + self.work + self.baseline


def estimate_memory(base: Checkpoint, agents: Sequence[Checkpoint], block_size: int, *,
                    n_agents: int | None = None) -> MemoryEstimate:
    """Peak resident memory of a merge with blocks of ``block_size`` elements, from headers only.

    ``n_agents`` counts agents that could not be opened too (a dry run still estimates for all of them).
    """
    n = len(agents) if n_agents is None else n_agents
    largest = max((t.numel for t in base.tensors.values()), default=1)
    b = max(1, min(block_size, largest))
    models = [base, *agents]
    itemsize = max((t.dtype.itemsize for m in models for t in m.tensors.values()), default=4)
    buffers = 4 * b * (n + 1) + itemsize * b * (n + 1)
    work = b * (WORK_PER_AGENT * n + WORK_FIXED)
    return MemoryEstimate(b, buffers, work, BASELINE, _mapped(models))


def _mapped(models: Sequence[Checkpoint]) -> int:
    """Bytes of the memory-mapped ``.bin`` files among ``models`` (file-backed, reclaimable)."""
    return sum(f.stat().st_size for m in models if m.format == "bin" for f in m.files)


def estimate_fast(match: Any, block_size: int, *, n_agents: int | None = None, rows: bool = False,
                  mask_bytes: int = 0) -> MemoryEstimate:
    """Peak resident memory of a merge whose merged tensors all take the numba block stream (stream/fast.py).

    No torch: ``FAST_BASELINE`` (the interpreter, numpy, numba, the loaded kernels, the threads). Per element of
    a block: one block of every input file mapped (the block being computed; a finished one is handed back by
    the readahead thread: at most two wait for it, and the next two are mapped ahead by it, which the measured
    peaks show as up to 50 MB more on the 0.5B and 7B sets, inside this estimate's margin) and the output written
    from its OUT_SLOTS slots. The histograms per part of a hand-off, and ``mask_bytes`` (a tensor's keep
    bits for DARE / DELLA with L1 rescaling) on top. An input that cannot be viewed in place (``.bin``, verl
    shards, a LoRA adapter) has every block copied into two alternating sets of buffers (as float32 τ when an agent
    is an adapter), and its reader loads torch (``TORCH_LOADED``); mapped ``.bin`` files are reported apart, as for the
    torch path.
    """
    from ..kernels import hist_shape
    from ..stream.fast import OUT_SLOTS, PARTS_PER_THREAD, compute_threads, fast_block, reads_tau, row_step

    n = len(match.agents) if n_agents is None else n_agents
    b = fast_block(match, block_size)
    if rows:
        b = max((min(row_step(j.info.shape, j.numel, b), j.numel) for j in match.merge_jobs), default=b)
    models = (match.base, *match.agents)
    itemsize = max((t.dtype.itemsize for m in models for t in m.tensors.values()), default=4)
    out = max((j.out_dtype.itemsize for j in match.merge_jobs), default=4)
    buffers = b * ((n + 1) * itemsize + OUT_SLOTS * out)
    copied = not all(m.viewable for m in models)  # every block is copied (engine/fast.FastPath.blocks) …
    if copied:  # … the agents as float32 τ beside the base in float32 with a LoRA adapter, by readers that load torch
        buffers += 2 * b * (itemsize + (4 * n + 4 if reads_tau(match) else n * itemsize))
    hist = compute_threads() * PARTS_PER_THREAD * 8 * math.prod(hist_shape(min(n, 8)))
    return MemoryEstimate(b, buffers, hist + mask_bytes, FAST_BASELINE + (TORCH_LOADED if copied else 0),
                          _mapped(models), torch=copied)


def available_memory() -> int | None:
    """Bytes this process may still use: MemAvailable, capped by a cgroup limit; None when unknown."""
    limits = []
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                limits.append(int(line.split()[1]) * 1024)
    except (OSError, ValueError, IndexError):
        pass
    try:
        # cgroup v2 (containers): the limit minus anonymous memory in use. Not memory.current, which counts
        # the page cache too: after reading a large checkpoint it sits near the limit, yet that cache is
        # reclaimable and a merge fits.
        text = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        stat = dict(line.split() for line in Path("/sys/fs/cgroup/memory.stat").read_text().splitlines())
        if text != "max":
            limits.append(int(text) - int(stat["anon"]))
    except (OSError, ValueError, KeyError):
        pass
    if not limits and hasattr(os, "sysconf"):
        with contextlib.suppress(ValueError, OSError):
            limits.append(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
    return min(limits) if limits else None


def check_memory(est: MemoryEstimate, n: int, available: int | None = None,
                 fits: Callable[[int], int] | None = None) -> None:
    """Refuse a merge (``est`` for ``n`` agents) whose peak exceeds the memory available; say what block size
    fits (``fits(block)``: the estimate's total for another block size; else the torch path's formula)."""
    avail = available_memory() if available is None else available
    if avail is None or est.total <= avail:
        return
    if fits is None:
        per_element = 4 * (n + 1) + 8 * (n + 1) + WORK_PER_AGENT * n + WORK_FIXED
        block = (avail - BASELINE) // per_element
    else:  # the largest block whose estimate fits, by bisection over [0, est.block)
        lo, hi = 0, est.block
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if fits(mid) <= avail else (lo, mid)
        block = lo
    hint = (f"pass --block-size {block} or less" if block >= 1024
            else "merge fewer agents at once, or free memory")
    raise ConfigError(f"a merge of {n} agents with blocks of {est.block:,} elements needs about "
                      f"{est.total / 2**30:.2f} GiB but only {avail / 2**30:.2f} GiB is available", hint=hint)
