"""The route a merge takes, chosen once: which backend runs each tensor, the passes, the reads, the memory.

``route`` is the only place that decides. ``merge`` runs what it says (backends.py, passes.py), ``rlmerge plan``
reports it (its passes, bytes read and peak memory are the route's), and ``inspect`` asks it too.

- A method whose tensors can all take the numba block stream runs there when numba is installed, the device
  is the CPU and RLMERGE_FAST is not 0: an elementwise rule on the fused kernel (tensors the kernels cannot read
  stay on torch in the same run), the sparsify presets that select a window of |τ| or draw a random mask on
  their own kernels (all tensors or none: their thresholds and L1 sums are made there). Anything else, and
  ``inspect``'s extra counters, run on torch.
- A statistics pass runs when the method needs whole-model statistics before merging (RAM+'s ρ, a whole-model
  threshold, Model Stock's Gram matrices), when its torch path gathers per-tensor ones first (TIES thresholds,
  L1 sums), and when a resumed run must recount the shards it kept.
- Reads: a selecting tensor larger than a block is read once per selection round and once to merge on the numba
  path; an L1-rescaled one twice; every other tensor once per pass. The bytes are exact, but for a per-tensor
  selection on the torch path: its rounds stop as soon as a tensor's thresholds are found, so the figure is the
  most it reads.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from ..io.checkpoint import Checkpoint
from ..methods import Capability, MethodSpec, Observer
from ..stream.fast import eligible, enabled, fast_block, row_step
from ..stream.match import Job, Match
from .budget import MemoryEstimate, estimate_fast, estimate_memory
from .cached import StatisticsView

Kind = str  # "fused", "torch", or the kind of a family's own backend (Capability.kind: "select", "random")


@dataclass(frozen=True)
class Route:
    kind: Kind  # the numba backend of the merged tensors it covers ("torch": none)
    fast: frozenset[str]  # merged tensors it merges; the others run on torch
    stats_fast: frozenset[str]  # merged tensors whose statistics it counts (an observer's run on torch)
    statistics: bool  # a statistics pass runs before the merge pass
    method_statistics: bool  # the method's prepare() reads the statistics pass (not only a resumed recount)
    stats_reads: dict[str, int]  # reads of each merged tensor in the statistics pass (0: no pass)
    merge_reads: dict[str, int]  # reads of each merged tensor in the merge pass
    memory: MemoryEstimate
    read_bytes: int  # every byte of weights read, over both passes (copied tensors included)
    write_bytes: int
    observed: bool = False  # the method's observer is fed in the statistics pass
    backend: Capability | None = None  # the family's own backend, when ``kind`` is its

    @property
    def passes(self) -> list[str]:
        return ["statistics", "merge"] if self.statistics else ["merge"]


def route(match: Match, spec: MethodSpec | None, p: Any, *, device: str = "cpu", block_size: int,
          extras: Sequence[Checkpoint] = (), resumed: bool = False, agents: int | None = None,
          cached: StatisticsView | None = None, at: Callable[[str], Any] | None = None) -> Route:
    """The route of a merge of ``match`` with ``spec`` and ``p`` (``spec`` None: ``inspect``, the statistics
    pass alone). ``agents``: the number of agents to budget memory for (a plan whose agents could not all be
    opened still estimates for every one). ``cached``: statistics an earlier merge of the same inputs gathered
    (cached.py); what they cover is not read again. ``at``: each tensor's parameters where a recipe gave
    them per tensor (its thresholds, hence its reads, may differ); the cache is keyed by one set of parameters,
    so it is not used for such a merge."""
    if at is not None:
        cached = None
    n = len(match.agents)
    jobs = match.merge_jobs
    if spec is None:  # inspect: the statistics pass alone, on torch (its extra counters are torch's)
        memory = estimate_memory(match.base, match.agents, block_size, n_agents=agents)
        return Route("torch", frozenset(), frozenset(), True, False, {j.name: 1 for j in jobs},
                     {j.name: 0 for j in jobs}, memory, sum(_bytes(match, j, ()) for j in jobs), 0, observed=True)
    observer = spec.observer(p, n, at)
    kind, family = _kind(match, spec, p, device=device, extras=extras)
    fast = frozenset(j.name for j in jobs if kind != "torch" and eligible(match, j))
    # an observer (thresholds made in the statistics pass) runs on torch, whatever merges afterwards, unless the
    # family's backend feeds it itself
    stats_fast = fast if (observer is None or family is not None) else frozenset()
    block = fast_block(match, block_size)
    observed = observer is not None and (family is None or family.observed(observer))  # fed in the statistics pass
    needs = spec.needs_stats(p) or observed
    statistics = (needs or resumed) and not (
        cached is not None and cached.covers(spec, p, observer, jobs, stats_fast, observed=observed))
    stats_reads = {j.name: (_stats_reads(observer, j, j.name in stats_fast) if statistics else 0) for j in jobs}
    step = (lambda j: row_step(j.info.shape, j.numel, block)) if spec.row_blocks(p) else (lambda j: block)
    merge_reads = {j.name: (family.merge_reads(observer, j, block, step(j), cached)
                            if family is not None and j.name in fast else 1) for j in jobs}
    read_bytes = sum((stats_reads[j.name] + merge_reads[j.name]) * _bytes(match, j, extras) for j in jobs)
    read_bytes += sum(j.info.nbytes for j in match.jobs if j.kind == "copy")
    n_mem = (agents if agents is not None else n) + len(extras)
    if kind == "torch" or len(fast) < len(jobs):
        memory = estimate_memory(match.base, [*match.agents, *extras], block_size, n_agents=n_mem)
    else:
        memory = estimate_fast(match, block_size, n_agents=n_mem, rows=spec.row_blocks(p),
                               mask_bytes=family.memory(jobs, n) if family is not None else 0)
    return Route(kind, fast, stats_fast, statistics, needs, stats_reads, merge_reads, memory, read_bytes,
                 match.write_bytes, observed, family)


def _kind(match: Match, spec: MethodSpec, p: Any, *, device: str,
          extras: Sequence[Checkpoint]) -> tuple[Kind, Capability | None]:
    """The backend of the numba path, first found: the family's own (every tensor or none), the rule compiled
    into the fused kernel, else torch."""
    if extras or not enabled(device) or not match.merge_jobs:
        return "torch", None
    family = spec.backend(p)
    if family is not None:
        every = all(eligible(match, j) for j in match.merge_jobs)  # a LoRA adapter's τ too: every kernel takes τ
        return (family.kind, family) if every else ("torch", None)
    if (spec.program(p, len(match.agents)) is not None and not spec.row_blocks(p)
            and any(eligible(match, j) for j in match.merge_jobs)):
        return "fused", None
    return "torch", None


def _stats_reads(observer: Observer | None, job: Job, numba: bool) -> int:
    """Streams of ``job`` in the statistics pass: one, and (on torch) as many more as the method's observer asks
    for at most (``streams``: a selection's later rounds)."""
    return observer.streams(job.name, job.numel, numba) if observer is not None else 1


def _bytes(match: Match, job: Job, extras: Sequence[Checkpoint]) -> int:
    """Bytes one read of a merged tensor takes: the base's copy, each agent's that has it, each side input's."""
    agents = sum(a.tensors[job.name].nbytes for a, here in zip(match.agents, job.present) if here)
    return job.info.nbytes + agents + sum(x.tensors[job.name].nbytes for x in extras if job.name in x.tensors)
