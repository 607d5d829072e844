"""Float32 blocks of base and task vectors: the only place that reads weights and moves them to a device.

A block is a contiguous range of a tensor's flat elements (so every block is one contiguous byte range
in every file). Buffers are allocated once, at the block size, and reused for every block of every
tensor: page faults on fresh allocations cost more than the arithmetic here.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch

from .plan import Job, Plan

DEFAULT_BLOCK = 1 << 22  # elements per block: 16 MiB of float32 per buffer


@dataclass
class Block:
    job: Job
    start: int
    stop: int
    base: torch.Tensor  # [n] float32
    deltas: torch.Tensor  # [N, n] float32, τ_t = θ_t − θ₀ (zeros for an agent missing the tensor)

    @property
    def n(self) -> int:
        return self.stop - self.start


class BlockReader:
    """Yields the blocks of a merge job, reading the base and every agent into reused buffers."""

    def __init__(self, plan: Plan, *, block_size: int = DEFAULT_BLOCK, device: str = "cpu") -> None:
        if block_size < 1:
            raise ValueError("block_size must be ≥ 1")
        largest = max((j.numel for j in plan.merge_jobs), default=1)
        self.block_size = min(block_size, largest)
        self.plan = plan
        self.device = torch.device(device)
        n = len(plan.agents)
        self._base = torch.empty(self.block_size, dtype=torch.float32)
        self._agents = torch.empty((n, self.block_size), dtype=torch.float32)

    def spans(self, job: Job) -> Iterator[tuple[int, int]]:
        for start in range(0, job.numel, self.block_size):
            yield start, min(start + self.block_size, job.numel)

    def blocks(self, job: Job) -> Iterator[Block]:
        plan = self.plan
        for start, stop in self.spans(job):
            n = stop - start
            base = plan.base.read_f32(job.name, start, stop, self._base)
            deltas = self._agents[:, :n]
            for t, (agent, present) in enumerate(zip(plan.agents, job.present)):
                if present:
                    agent.read_f32(job.name, start, stop, self._agents[t])
                    deltas[t].sub_(base)
                else:
                    deltas[t].zero_()
            if self.device.type != "cpu":
                base, deltas = base.to(self.device, non_blocking=True), deltas.to(self.device, non_blocking=True)
            yield Block(job, start, stop, base, deltas)
