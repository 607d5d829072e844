"""What every task family provides: examples with a gold answer and a verifiable scorer."""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True)
class Example:
    """One task instance. `prompt` ends where the model's answer starts; `target` is one gold answer."""

    family: str
    prompt: str
    target: str
    # JSON-serialisable data the scorer needs (expected call, expected stdout, expected value).
    check: dict
    # The kind of instance (coding: the operation), kept when a split avoids another split's prompts
    # (`make_split`'s exclude), so that avoiding them does not change the split's mix; "" for one kind only.
    stratum: str = ""


class TaskFamily(Protocol):
    """A generator of examples plus two scorers: a shaped reward for RL and a strict 0/1 test score."""

    name: str

    def sample(self, rng: random.Random) -> Example: ...

    def reward(self, completion: str, example: Example) -> float:
        """Shaped reward in [0, 1] used by GRPO (partial credit for well-formed answers)."""
        ...

    def score(self, completion: str, example: Example) -> float:
        """Strict test metric: 1.0 when the answer is verified correct, else 0.0."""
        ...

    def words(self) -> list[str]:
        """Every word the generator can emit, so the tokenizer never meets an unknown word."""
        ...


def answer_part(completion: str) -> str:
    """The answer is the first line of the completion; anything after a newline is ignored."""
    return completion.strip().split("\n", 1)[0].strip()
