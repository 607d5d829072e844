"""Task families with verifiable rewards: tool use, coding, memory."""

from __future__ import annotations

import random
from collections.abc import Collection

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


# Draws allowed per example kept when prompts are excluded (coding has only a few hundred distinct prompts).
MAX_DRAWS_PER_EXAMPLE = 100


def make_split(
    family: TaskFamily, split: str, n: int, seed: int = 0, *, exclude: Collection[str] = ()
) -> list[Example]:
    """`n` examples of one split, deterministic in (family, split, seed).

    `exclude`: prompts that must not occur (e.g. the test split's, for a validation split disjoint from it). Each
    example is drawn as without it; one whose prompt is excluded is replaced by the next draw of the same stratum
    (``Example.stratum``: coding's operation) whose prompt is not, so the split keeps the family's mix even where
    one kind has few distinct prompts (coding's string operations: 32). With an empty `exclude` the split is the
    same as ever, and for a family of one stratum the same as skipping the excluded draws.
    """
    rng = random.Random(f"{family.name}/{split}/{seed + SPLIT_OFFSETS[split]}")
    if not exclude:
        return [family.sample(rng) for _ in range(n)]
    out: list[Example] = []
    budget = MAX_DRAWS_PER_EXAMPLE * max(n, 1)
    while len(out) < n:
        want = family.sample(rng)
        budget -= 1
        while want.prompt in exclude and budget > 0:
            draw = family.sample(rng)
            budget -= 1
            if draw.stratum == want.stratum:
                want = draw
        if want.prompt in exclude:
            kind = f" of kind {want.stratum!r}" if want.stratum else ""
            raise ValueError(
                f"{family.name}: could not draw {n} {split} examples{kind} outside the {len(exclude)} excluded "
                "prompts; ask for fewer examples or exclude fewer prompts"
            )
        out.append(want)
    return out


def held_out_split(name: str, split: str, n: int, seed: int, disjoint_from_test: int = 0) -> list[Example]:
    """The examples a validation / test / training split of the lab uses: `n` of family `name`'s `split` for
    `seed`; with `disjoint_from_test` > 0 (not for the test split itself), no prompt of the seed's first
    `disjoint_from_test` test examples occurs (coding has few distinct prompts: a fifth of a 48-example
    validation split repeats the 128-example test split otherwise)."""
    family = make_family(name)
    if disjoint_from_test <= 0 or split == "test":
        return make_split(family, split, n, seed)
    test = {ex.prompt for ex in make_split(family, "test", disjoint_from_test, seed)}
    return make_split(family, split, n, seed, exclude=test)


__all__ = ["FAMILIES", "Example", "TaskFamily", "answer_part", "held_out_split", "make_family", "make_split"]
