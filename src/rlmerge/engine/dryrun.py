"""`rlmerge plan`: everything a merge would find wrong, and what it would cost, from headers only.

No weight is read. Every stage that can be checked before the merge runs (method and parameters, dtype
and shard size, the output folder, each input checkpoint, base/agent matching, memory) is checked by the
merge's own ``preflight``, and all problems are returned together rather than stopping at the first.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..errors import RLMergeError
from ..io.tokenizer_plan import TokenizerPlan
from ..io.writer import DEFAULT_SHARD_SIZE, layout_shards
from ..stream.blocks import DEFAULT_BLOCK
from ..stream.match import Match
from .adapter import adapter_write_bytes
from .budget import MemoryEstimate
from .preflight import preflight


@dataclass
class DryRun:
    """What ``rlmerge plan`` reports. ``problems`` empty means the merge can start."""

    method: str
    problems: list[RLMergeError] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    match: Match | None = None
    passes: list[str] = field(default_factory=list)  # "statistics", "merge"
    read_bytes: int = 0  # over all passes
    write_bytes: int = 0
    shards: int = 0
    memory: MemoryEstimate | None = None
    available_memory: int | None = None
    tokenizer: TokenizerPlan | None = None  # the output's tokenizer, and how the agents' differ
    output_format: str = "hf"  # or "peft": a LoRA adapter, whose ``write_bytes`` is a bound (``write_at_most``)
    rank: str | None = None  # --output-format peft: the rank asked

    @property
    def write_at_most(self) -> bool:
        """``write_bytes`` is an upper bound: an adapter saves only the non-linear tensors the merge changes, and
        an energy share keeps a rank known once the matrix is read."""
        return self.output_format == "peft"

    @property
    def ok(self) -> bool:
        return not self.problems

    def to_json(self) -> dict[str, Any]:
        mem = self.memory
        return {
            "ok": self.ok, "method": self.method, "passes": self.passes,
            # no route (a problem stops the merge first): what it would read or write is not known, not 0
            "read_bytes": self.read_bytes if self.passes else None,
            "write_bytes": self.write_bytes if self.passes else None, "shards": self.shards if self.passes else None,
            "merged_dtypes": self.match.merged_dtypes if self.match else None,
            "tensors": len(self.match.jobs) if self.match else None,
            "peak_memory_bytes": mem.total if mem else None, "block": mem.block if mem else None,
            "mapped_bin_bytes": mem.mapped if mem else None, "available_memory_bytes": self.available_memory,
            "problems": [p.render() for p in self.problems], "warnings": self.warnings,
            "tokenizer": self.tokenizer.to_json() if self.tokenizer is not None else None,
            "output_format": self.output_format,
            **({"rank": self.rank, "write_bytes_at_most": True} if self.output_format == "peft" else {}),
        }


def dry_run(base: str | os.PathLike[str], agents: Sequence[str | os.PathLike[str]],
            output: str | os.PathLike[str] | None = None, *, method: str = "ram+",
            params: Mapping[str, Any] | None = None, dtype: str | None = None,
            shard_size: str | int = DEFAULT_SHARD_SIZE, block_size: int = DEFAULT_BLOCK,
            allow_missing: bool = False, count_tied_twice: bool = False, force: bool = False,
            resume: bool = False, available: int | None = None, device: str = "cpu", seed: Any = 0,
            tokenizer_source: str | None = None, chat_template: str | None = None, output_format: str = "hf",
            rank: Any = None, non_linear: str | None = None, push_to_hub: str | None = None,
            revision: str | None = None, recipe: Mapping[str, Any] | None = None, **_ignored: Any) -> DryRun:
    """Check a merge without running it; ``available`` overrides the memory available (bytes).

    The checks are the merge's own (``preflight``): what this reports as a problem, a merge refuses. With
    ``output_format="peft"`` the memory includes the adapter writer's and the bytes written are the adapter's
    (at most: ``DryRun.write_at_most``); with ``push_to_hub``, what would stop the upload is a problem.

    >>> report = dry_run("base/", ["coder/", "tools/"], "merged/", method="ram+")  # doctest: +SKIP
    >>> report.ok, report.read_bytes, report.memory.total  # doctest: +SKIP
    """
    pf = preflight(base, agents, output, method=method, params=params, dtype=dtype, shard_size=shard_size,
                   block_size=block_size, device=device, force=force, resume=resume, allow_missing=allow_missing,
                   count_tied_twice=count_tied_twice, seed=seed, available=available,
                   tokenizer_source=tokenizer_source, chat_template=chat_template, output_format=output_format,
                   rank=rank, non_linear=non_linear, push_to_hub=push_to_hub, revision=revision, recipe=recipe)
    try:
        report = DryRun(method, problems=pf.problems, memory=pf.memory, available_memory=pf.available,
                        tokenizer=pf.tokenizer, output_format=output_format,
                        rank=str(pf.adapter.ranks) if pf.adapter is not None else None)
        if pf.match is None and pf.tokenizer is not None:  # the match refused: the tokenizer's differences still said
            report.warnings = list(pf.tokenizer.warnings)
        if pf.match is not None:
            report.match, report.warnings = pf.match, list(pf.match.warnings)
            report.write_bytes = pf.match.write_bytes
            report.shards = len(layout_shards(pf.match.jobs, pf.shard_bytes or DEFAULT_SHARD_SIZE))
            if pf.adapter is not None and pf.out_dtypes is not None:  # one adapter file
                report.write_bytes = adapter_write_bytes(pf.match, pf.adapter.ranks, pf.out_dtypes)
                report.shards = 1
        if pf.route is not None:  # what the merge will do: the route it will take
            report.passes, report.read_bytes = pf.route.passes, pf.route.read_bytes
    finally:
        pf.close()
    return report
