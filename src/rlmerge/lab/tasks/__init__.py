"""Task families with verifiable rewards: tool use, coding, memory."""

from __future__ import annotations

import random

from rlmerge.lab.tasks.base import Example, TaskFamily, answer_part
from rlmerge.lab.tasks.coding import Coding
from rlmerge.lab.tasks.memory import Memory
from rlmerge.lab.tasks.tool_use import ToolUse

FAMILIES: tuple[str, ...] = ("tool_use", "coding", "memory")


def make_family(name: str) -> TaskFamily:
    factories = {"tool_use": ToolUse, "coding": Coding, "memory": Memory}
    if name not in factories:
        raise ValueError(f"unknown task family {name!r}; choose from {', '.join(FAMILIES)}")
    return factories[name]()


# Split seeds are far apart so train / validation / test never share a generator stream.
SPLIT_OFFSETS = {"train": 0, "warmup": 1_000_003, "val": 2_000_003, "test": 3_000_017}


def make_split(family: TaskFamily, split: str, n: int, seed: int = 0) -> list[Example]:
    """`n` examples of one split, deterministic in (family, split, seed)."""
    rng = random.Random(f"{family.name}/{split}/{seed + SPLIT_OFFSETS[split]}")
    return [family.sample(rng) for _ in range(n)]


__all__ = ["FAMILIES", "Example", "TaskFamily", "answer_part", "make_family", "make_split"]
