"""The warm-up's imperfect demonstrator: systematic, input-dependent mistakes that RL can correct.

Supervised data is rarely perfect, and a verifier-rewarded RL phase exists to fix what imitation got
wrong. Measured without this (lab notes in docs/lab.md): a base trained on perfect demonstrations was
wrong only where its capacity ran out (e.g. copying a two-digit number), the greedy answer did not move
under 100 GRPO steps, and no specialist beat the base. So on one subset of inputs per family the
demonstrator answers wrongly with probability `p` (> 0.5, so the base's greedy answer is wrong there):

- tool use: for `convert`, `send_email` and `order_food` requests it calls another listed tool;
- coding: for "largest", "sum" and "capitals" requests it writes min / len / reversal instead;
- memory: for keys in the first half of the key list it answers the key's "usual" code (a fixed table)
  instead of the one in the notes: answering from habit rather than from the context.
"""

from __future__ import annotations

import json
import random

from rlmerge.lab.tasks.base import Example
from rlmerge.lab.tasks.memory import CODES, KEYS

BIASED_TOOLS = ("convert", "send_email", "order_food")
CODE_SWAPS = (("print(max(", "print(min("), ("print(sum(", "print(len("), (".upper())", "[::-1])"))
BIASED_KEYS = frozenset(KEYS[: len(KEYS) // 2])
USUAL_CODE = {key: CODES[i % len(CODES)] for i, key in enumerate(KEYS)}


def wrong_target(ex: Example) -> str | None:
    """The demonstrator's systematic wrong answer for `ex`, or None when `ex` is outside its blind spot."""
    if ex.family == "tool_use":
        call = ex.check["call"]
        if call["name"] not in BIASED_TOOLS:
            return None
        shown = [part.split("(")[0].strip() for part in ex.prompt.split("\n")[0][len("tools: ") :].split("|")]
        other = next(t for t in shown if t != call["name"])
        return " " + json.dumps({"name": other, "arguments": call["arguments"]})
    if ex.family == "coding":
        for right, wrong in CODE_SWAPS:
            if right in ex.target:
                return ex.target.replace(right, wrong)
        return None
    if ex.family == "memory":
        key = ex.prompt.rsplit("the code of ", 1)[1].split(" ")[0]
        if key not in BIASED_KEYS or USUAL_CODE[key] == ex.check["answer"]:
            return None
        return f" {USUAL_CODE[key]}"
    raise ValueError(f"unknown task family {ex.family!r}")


def demonstrate(examples: list[Example], p: float, seed: int) -> list[Example]:
    """Examples with the demonstrator's answers: wrong with probability `p` inside its blind spot."""
    rng = random.Random(f"demonstrator/{seed}")
    out = []
    for ex in examples:
        wrong = wrong_target(ex)
        if wrong is not None and rng.random() < p:
            ex = Example(ex.family, ex.prompt, wrong, ex.check)
        out.append(ex)
    return out
