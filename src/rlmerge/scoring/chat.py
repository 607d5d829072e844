"""What the packaged benchmarks (BFCL, HumanEval) share: the seeded subset a sweep scores, and greedy replies to chat
conversations through the model's own chat template.

The subset: a benchmark's examples are shuffled once by ``(benchmark, seed)``; ``val`` is the first half of that
order and ``test`` the second (disjoint: a sweep chooses on one, and the other can judge its pick), and ``limit``
takes the first examples of the half. The chosen examples are scored in the benchmark's own order. The same seed
gives the same examples for every candidate and every run, and a smaller limit a subset of a larger one.
"""

from __future__ import annotations

import importlib.util
import random
from collections.abc import Sequence
from typing import Any

from ..errors import ConfigError


def subset(total: int, *, limit: int, seed: int, split: str, name: str) -> list[int]:
    """Indices (ascending) of the examples of ``name`` that ``split`` scores; see the module docstring."""
    order = list(range(total))
    random.Random(f"{name}/{seed}").shuffle(order)
    half = (total + 1) // 2
    part = order[:half] if split == "val" else order[half:]
    return sorted(part[:limit])


def require(package: str, install: str, what: str) -> None:
    """A ConfigError saying how to install ``package`` when it is not installed (checked before any merge)."""
    if importlib.util.find_spec(package) is None:
        raise ConfigError(f"{what} needs the {package!r} package, which is not installed", hint=install)


def chat_replies(model: Any, tokenizer: Any, conversations: Sequence[list[dict[str, str]]], *, max_new_tokens: int,
                 batch_size: int) -> list[str]:
    """The greedy reply to each conversation (a list of {role, content}), prompted through the tokenizer's chat
    template with the assistant's turn opened."""
    from ..lab.evaluate import generate

    if not getattr(tokenizer, "chat_template", None):
        raise ConfigError("the candidate's tokenizer has no chat template, and this benchmark prompts through it",
                          hint="score an instruct model (its tokenizer_config.json or chat_template.jinja has one)")
    prompts = [tokenizer.apply_chat_template(c, tokenize=False, add_generation_prompt=True) for c in conversations]
    return generate(model, tokenizer, prompts, max_new_tokens, batch_size)
