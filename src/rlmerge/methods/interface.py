"""What the engine and a method tell each other, besides the declaration itself (spec.py): typed seams.

- ``BlockContext``: where a block sits, and what the method prepared (handed to its hooks, never read by the engine).
- ``Observer``: fed every block of the statistics pass; what it learns stays its own. Subclass it explicitly to take
  the defaults of its optional hooks (how often it streams a tensor, what a statistics cache may keep of it).
- ``Prepared``: what ``prepare`` made of the whole-model statistics (any object: the engine only hands it back).
- ``Rows``: what a method reports about the merge it did, per agent (λ, ρ, kept fractions): the report prints these
  and never recomputes them.
- ``Entries``: a statistics cache's arrays, as an observer or a family's backend keeps and finds them.

A family with a backend of its own declares it with the protocols in spec.py (``Capability``, ``Runner``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal, Protocol

import numpy as np

from .._torch import torch
from ..stats import TensorStats

Scope = Literal["elementwise", "global", "tensor-local"]


@dataclass(frozen=True)
class BlockContext:
    """Where a block sits, and what the statistics pass learned about its tensor."""

    name: str  # tensor name
    start: int  # flat element range [start, stop) of the tensor
    stop: int
    shape: tuple[int, ...]
    present: tuple[bool, ...]  # per agent; a missing agent's deltas are zero
    prepared: Any  # what the method's prepare() returned (its Prepared)
    tensor_stats: TensorStats | None  # None when the method ran without a statistics pass
    seed: int = 0
    extra: torch.Tensor | None = None  # [N, n] float32 side inputs of the block (e.g. Fisher), if any
    params: Any = None  # the tensor's own parameters when they vary per tensor (a recipe's gradient), else None


@dataclass(frozen=True)
class Rows:
    """A method's own numbers about a merge, one per agent (``MethodSpec.report``). The merge's agent table, its
    ``rlmerge.json`` and its model card show ``lambdas`` (column λ) and ``kept``; ``rho`` is what λ came from
    (``MergeResult.rho``); ``warnings`` join the merge's."""

    lambdas: Sequence[float] | None = None  # the rescale of each agent's unique elements (RAM+'s λ_t)
    rho: Sequence[float] | None = None  # the ratio each λ_t came from (RAM+'s ρ_t)
    kept: Sequence[float] | None = None  # the share of the elements merged that a trim kept (TIES' k)
    warnings: tuple[str, ...] = ()


class Entries(Protocol):
    """A statistics cache's arrays for one merge's inputs (engine/cached.StatisticsView), under (kind, key,
    tensor): what an observer or a family's backend found that another merge of the same inputs may reuse. ``key``
    says what the arrays depend on besides the inputs ("" for nothing); ``get`` sees what the cache held when the
    merge started."""

    def get(self, kind: str, key: str, name: str) -> np.ndarray | None: ...

    def put(self, kind: str, key: str, name: str, value: np.ndarray) -> None: ...

    def used(self, kind: str) -> None:
        """Count an entry used instead of reading the weights (the sweep reports these)."""


class Observer(Protocol):
    """Fed every block of the statistics pass (``observe``); after each tensor and after the whole model,
    ``again(name | None)`` may ask for that range to be streamed once more (exact order statistics need a second
    look). ``prepare`` finds it as ``stats.observed``. Subclass it explicitly for the defaults below."""

    def observe(self, ctx: BlockContext, base: torch.Tensor, deltas: torch.Tensor) -> None: ...

    def again(self, name: str | None) -> bool: ...

    def streams(self, name: str, numel: int, numba: bool) -> int:
        """How many times the statistics pass streams tensor ``name`` at most (``numba``: its counts are the numba
        backend's); the route's read count. One unless ``again`` asks for more."""
        return 1

    def reusable(self, cache: Entries, names: Sequence[str]) -> bool:
        """Whether ``cache`` holds all this observer would find over tensors ``names`` (a later merge of the same
        inputs then skips the statistics pass). None by default: it is fed again."""
        return False

    def reuse(self, cache: Entries, names: Sequence[str]) -> None:
        """Take what ``cache`` holds for ``names`` instead of being fed (after ``reusable`` said it does)."""

    def keep(self, cache: Entries) -> None:
        """Put what it found into ``cache`` for later merges of the same inputs."""

    def absorb(self, other: Observer) -> None:
        """Take what ``other``, a copy of it that merged other tensors (a Ray task's), found while merging."""


class Prepared(Protocol):
    """What a method's ``prepare`` made of the whole-model statistics before the merge pass (RAM+'s λ, a family's
    thresholds), or None. The engine keeps it between the passes and hands it back to the method's own hooks
    (``values``, ``merge_block`` through ``BlockContext.prepared``, ``report``); it never reads it, so any object
    is one."""
