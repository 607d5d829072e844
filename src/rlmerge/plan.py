"""Match base and agents from headers only: one job per stored base tensor, every problem at once."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import torch

from .checkpoint import DTYPE_NAMES, Checkpoint, TensorInfo
from .errors import InputError, RLMergeError, raise_all

EMBEDDING_SUFFIXES = ("embed_tokens.weight", "wte.weight", "word_embeddings.weight")


@dataclass(frozen=True)
class Job:
    """One stored base tensor: merged from float32 deltas, or copied byte for byte from the base."""

    name: str
    kind: Literal["merge", "copy"]
    info: TensorInfo  # the base's copy: shape, dtype, where it lives
    out_dtype: torch.dtype
    present: tuple[bool, ...]  # per agent; False only when the user allowed missing tensors
    weight: int = 1  # how many times the statistics count it (2: the authors' tied double count)

    @property
    def numel(self) -> int:
        return self.info.numel

    @property
    def out_nbytes(self) -> int:
        return self.numel * self.out_dtype.itemsize


@dataclass
class Plan:
    base: Checkpoint
    agents: list[Checkpoint]
    jobs: list[Job]
    dropped: dict[str, list[str]] = field(default_factory=dict)  # tensor → agents that have it, base not
    missing: dict[str, list[str]] = field(default_factory=dict)  # tensor → agents without it (allowed)
    tied: list[str] = field(default_factory=list)  # stored once, used as both embedding and lm_head
    warnings: list[str] = field(default_factory=list)

    @property
    def merge_jobs(self) -> list[Job]:
        return [j for j in self.jobs if j.kind == "merge"]

    @property
    def read_bytes(self) -> int:
        """Bytes of weights one merge pass reads: the base plus each agent's copy of merged tensors."""
        total = 0
        for j in self.jobs:
            total += j.info.nbytes
            if j.kind == "merge":
                total += sum(a.tensors[j.name].nbytes for a, p in zip(self.agents, j.present) if p)
        return total

    @property
    def write_bytes(self) -> int:
        return sum(j.out_nbytes for j in self.jobs)


def tied_tensors(base: Checkpoint) -> list[str]:
    """Embeddings that double as lm_head: tied in config and lm_head not stored."""
    if not base.tie_word_embeddings or any(n.endswith("lm_head.weight") for n in base.tensors):
        return []
    return [n for n in base.tensors if n.endswith(EMBEDDING_SUFFIXES)]


def build_plan(base: Checkpoint, agents: list[Checkpoint], *, dtype: torch.dtype | None = None,
               allow_missing: bool = False, count_tied_twice: bool = False) -> Plan:
    """Check every agent against the base and lay out the jobs; raise all problems together."""
    problems: list[RLMergeError] = []
    plan = Plan(base, agents, jobs=[], tied=tied_tensors(base))
    if not agents:
        problems.append(InputError("no agents given", hint="pass at least one agent after the base"))
    base_arch = base.config.get("architectures")
    for a in agents:
        arch = a.config.get("architectures")
        if base_arch and arch and arch != base_arch:
            problems.append(InputError(f"architecture {arch} differs from the base's {base_arch}",
                                       file=str(a.path / "config.json"),
                                       hint="agents must be fine-tuned from the same base model"))
        if a.path.resolve() == base.path.resolve():
            plan.warnings.append(f"agent {a.label} is the base folder itself: it contributes nothing")

    order = sorted(base.tensors.values(), key=lambda t: (str(t.file), t.offset, t.name))
    for info in order:
        present = []
        for a in agents:
            other = a.tensors.get(info.name)
            if other is None:
                if info.is_float and not allow_missing:
                    problems.append(InputError(
                        "tensor is in the base but missing from the agent", file=str(a.path),
                        tensor=info.name, hint="pass --allow-missing to treat the agent as unchanged there"))
                elif info.is_float:
                    plan.missing.setdefault(info.name, []).append(a.label)
                present.append(False)
                continue
            present.append(True)
            if other.shape != info.shape:
                vocab = info.name.endswith((*EMBEDDING_SUFFIXES, "lm_head.weight"))
                hint = ("the vocabulary was resized: resize the agent's embeddings back to the base's "
                        "vocabulary" if vocab and other.shape[1:] == info.shape[1:]
                        else "the agent is not a fine-tune of this base")
                problems.append(InputError(f"shape {list(other.shape)} differs from the base's "
                                           f"{list(info.shape)}", file=str(other.file),
                                           tensor=info.name, hint=hint))
            elif info.is_float and not other.is_float:
                problems.append(InputError(f"agent stores {DTYPE_NAMES[other.dtype]} where the base stores "
                                           f"{DTYPE_NAMES[info.dtype]}", file=str(other.file),
                                           tensor=info.name, hint="re-save the agent in a float dtype"))
        kind: Literal["merge", "copy"] = "merge" if info.is_float else "copy"
        out_dtype = dtype if (dtype is not None and info.is_float) else info.dtype
        weight = 2 if (count_tied_twice and info.name in plan.tied) else 1
        plan.jobs.append(Job(info.name, kind, info, out_dtype, tuple(present), weight))

    for a in agents:
        for name in a.tensors:
            if name not in base.tensors:
                plan.dropped.setdefault(name, []).append(a.label)
        wider = {(DTYPE_NAMES[a.tensors[j.name].dtype], DTYPE_NAMES[j.info.dtype]) for j in plan.jobs
                 if j.kind == "merge" and j.name in a.tensors
                 and a.tensors[j.name].dtype.itemsize > j.info.dtype.itemsize}
        for theirs, ours in sorted(wider):
            plan.warnings.append(
                f"agent {a.label} stores {theirs} against a {ours} base: rounding differences count as "
                f"changes, so its task vector looks denser than it is; save agents in the base's dtype")
    if plan.dropped:
        plan.warnings.append(f"{len(plan.dropped)} tensor(s) only some agents have are dropped: "
                             + ", ".join(sorted(plan.dropped)[:5]) + (" …" if len(plan.dropped) > 5 else ""))
    raise_all(problems)
    return plan
