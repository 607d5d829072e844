"""Float32 blocks of base and task vectors: the only place that reads weights and moves them to a device.

A block is a contiguous range of a tensor's flat elements (so every block is one contiguous byte range
in every file). Buffers are allocated once, at the block size, and reused for every block of every
tensor: page faults on fresh allocations cost more than the arithmetic here.
"""

from __future__ import annotations

import contextlib
import ctypes
import math
import sys
from collections.abc import Iterator
from dataclasses import dataclass

from .._torch import torch
from ..errors import ConfigError
from ..io.checkpoint import Checkpoint
from .match import Job, Match

DEFAULT_BLOCK = 1 << 22  # elements per block: 16 MiB of float32 per buffer


@dataclass
class Block:
    job: Job
    start: int
    stop: int
    base: torch.Tensor  # [n] float32
    deltas: torch.Tensor  # [N, n] float32, τ_t = θ_t − θ₀ (zeros for an agent missing the tensor)
    extra: torch.Tensor | None = None  # [N, n] float32 per-agent side inputs (e.g. Fisher diagonals)

    @property
    def n(self) -> int:
        return self.stop - self.start


def spans(numel: int, step: int) -> Iterator[tuple[int, int]]:
    """Consecutive flat ranges [start, stop) of at most ``step`` elements covering ``numel``."""
    for start in range(0, numel, step):
        yield start, min(start + step, numel)


def device_type(device: str) -> str:
    """'cpu', 'cuda', … for a device string; refuses a device torch does not know or cannot use.

    "cpu" is answered without importing torch (the fast path never needs it).
    """
    if str(device) == "cpu":
        return "cpu"
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise ConfigError(f"unknown device {device!r}", hint="use cpu, cuda or cuda:N") from e
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"device {device!r}: CUDA is not available here", hint="use --device cpu")
    return str(dev.type)


def read_delta(agent: Checkpoint, name: str, start: int, stop: int, base: torch.Tensor,
               out: torch.Tensor) -> torch.Tensor:
    """τ of ``agent`` over flat elements [start, stop) of ``name`` in float32, into ``out``: θ_t − θ₀ from its
    stored values (``base``: θ₀ there, float32), or the τ an agent supplies itself (a LoRA adapter). Both backends
    read τ through this (the numba one when an agent is an adapter: engine/fast.FastPath._read)."""
    if not agent.stored_bytes:
        return agent.read_delta_f32(name, start, stop, base, out)  # type: ignore[attr-defined]
    return agent.read_f32(name, start, stop, out).sub_(base[:stop - start])


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """The bytes of a CPU tensor, as the writer takes them."""
    return memoryview(t.contiguous().view(torch.uint8).numpy())


def pin_malloc_threshold(limit: int = 1 << 20) -> None:
    """Keep glibc from growing the heap with every block-sized temporary.

    After a large free, glibc raises its mmap threshold dynamically; block-sized temporaries of varying
    sizes then come from the heap and fragment it, so RSS grows with the number of tensors instead of
    staying bounded by the block size (measured on the 0.5B set: 1.58 GB → see docs/benchmarks.md).
    A fixed threshold hands such buffers back to the OS on free. No-op off glibc.
    """
    if not sys.platform.startswith("linux"):
        return
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").mallopt(-3, limit)  # -3 = M_MMAP_THRESHOLD


class BlockReader:
    """Yields the blocks of a merge job, reading the base and every agent into reused buffers.

    The buffers (and torch) come with the first block: a merge whose jobs all run on the fast path never
    allocates them.
    """

    def __init__(self, match: Match, *, block_size: int = DEFAULT_BLOCK, device: str = "cpu", rows: bool = False,
                 extras: list[Checkpoint] | None = None) -> None:
        if block_size < 1:
            raise ValueError("block_size must be ≥ 1")
        largest = max((j.numel for j in match.merge_jobs), default=1)
        self.block_size = min(block_size, largest)
        self.match = match
        self.device = device
        self.rows = rows  # blocks hold whole rows: a multiple of shape[1:], at least one row
        self.extras = extras
        self._size = 0  # elements the buffers hold; 0 until the first block
        pin_malloc_threshold()

    def _alloc(self, size: int) -> None:
        n = len(self.match.agents)
        self._base = torch.empty(size, dtype=torch.float32)
        self._agents = torch.empty((n, size), dtype=torch.float32)
        self._extra = torch.empty((n, size), dtype=torch.float32) if self.extras else None
        self._size = size

    def step(self, job: Job) -> int:
        if not self.rows:
            return self.block_size
        row = row_length(job.info.shape)
        return max(row, self.block_size // row * row)

    def bytes_of(self, job: Job, blk: Block) -> int:
        """Stored bytes read for one block: the base's, each present agent's and each side input's."""
        m = self.match
        agents = sum(a.tensors[job.name].dtype.itemsize for a, here in zip(m.agents, job.present) if here)
        extra = sum(x.tensors[job.name].dtype.itemsize for x in self.extras or ())
        return blk.n * (job.info.dtype.itemsize + agents + extra)

    def spans(self, job: Job) -> Iterator[tuple[int, int]]:
        return spans(job.numel, self.step(job))

    def blocks(self, job: Job) -> Iterator[Block]:
        match = self.match
        if self.step(job) > self._size:  # the first block, or one row larger than the block size: grow
            self._alloc(max(self.step(job), self.block_size))
        device = torch.device(self.device)
        for start, stop in self.spans(job):
            n = stop - start
            base = match.base.read_f32(job.name, start, stop, self._base)
            extra = None
            if self.extras and self._extra is not None:
                extra = self._extra[:, :n]
                for t, ckpt in enumerate(self.extras):
                    ckpt.read_f32(job.name, start, stop, self._extra[t])
            deltas = self._agents[:, :n]
            for t, (agent, present) in enumerate(zip(match.agents, job.present)):
                if present:
                    read_delta(agent, job.name, start, stop, base, self._agents[t])
                else:
                    deltas[t].zero_()
            if device.type != "cpu":
                base, deltas = base.to(device, non_blocking=True), deltas.to(device, non_blocking=True)
                extra = None if extra is None else extra.to(device, non_blocking=True)
            yield Block(job, start, stop, base, deltas, extra)


def row_length(shape: tuple[int, ...]) -> int:
    """Elements per row (``shape[1:]``); a 1-D tensor is one row, as mergekit's unsqueeze(0)."""
    return math.prod(shape[1:]) if len(shape) >= 2 else max(math.prod(shape), 1)
