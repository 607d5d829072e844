"""Peak memory of a merge, estimated from the match alone, and the check that refuses one that will not fit.

Memory is bounded by the block size B (elements) and the number of agents N, never by the model size:

- reused buffers: float32 base [B] + deltas [N, B], and each checkpoint's raw read buffer [B × itemsize];
- per-block work arrays of the statistics pass and the method (|τ| > ε masks, float64 Gram input,
  signs, RAM's active deltas …): measured at about ``WORK_PER_AGENT`` bytes per element per agent plus
  ``WORK_FIXED`` per element (``tests/test_plan_dry_run.py`` checks the estimate against the peak RSS
  of a real merge);
- a fixed ``BASELINE`` for the interpreter, torch and numpy.

``.bin`` inputs are memory-mapped: the pages they touch count in RSS but are file-backed and reclaimable,
so they are reported separately and not checked (a pre-1.6 non-zip ``.bin`` cannot be mapped and is
loaded whole: it really occupies that memory).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from ..errors import ConfigError
from ..io.checkpoint import Checkpoint

# Measured (Linux, torch 2.13 CPU; tests/test_plan_dry_run.py re-measures it): RSS after importing rlmerge and
# opening 4 checkpoints 239 MiB; peak − that = 47 / 149 / 281 MiB for blocks of 0.25 / 1 / 2 M elements,
# N = 3, bf16 inputs, i.e. ~132 bytes per element (the formula below gives 136) plus ~15 MiB fixed.
BASELINE = 288 * 2**20  # bytes: interpreter + torch + numpy + rich, statistics arrays, I/O buffers
WORK_PER_AGENT = 24  # bytes per element per agent for block temporaries (stats pass: mask, f64 copy, signs)
WORK_FIXED = 40  # bytes per element: counts, merged block, output cast, bincount inputs


@dataclass(frozen=True)
class MemoryEstimate:
    block: int  # elements per block actually used (the block size, capped at the largest tensor)
    buffers: int  # bytes: reused float32 blocks + raw read buffers
    work: int  # bytes: per-block temporaries
    baseline: int  # bytes: the interpreter and libraries
    mapped: int  # bytes of memory-mapped .bin inputs (file-backed, reclaimable; not in ``total``)

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
    mapped = sum(f.stat().st_size for m in models if m.format == "bin" for f in m.files)
    return MemoryEstimate(b, buffers, work, BASELINE, mapped)


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


def check_memory(est: MemoryEstimate, n: int, available: int | None = None) -> None:
    """Refuse a merge (``est`` for ``n`` agents) whose peak exceeds the memory available; say what fits."""
    avail = available_memory() if available is None else available
    if avail is None or est.total <= avail:
        return
    per_element = 4 * (n + 1) + 8 * (n + 1) + WORK_PER_AGENT * n + WORK_FIXED
    fits = (avail - BASELINE) // per_element
    hint = (f"pass --block-size {fits} or less" if fits >= 1024
            else "merge fewer agents at once, or free memory")
    raise ConfigError(f"a merge of {n} agents with blocks of {est.block:,} elements needs about "
                      f"{est.total / 2**30:.2f} GiB but only {avail / 2**30:.2f} GiB is available", hint=hint)
