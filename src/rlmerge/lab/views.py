"""How a model of one kind sees a task family: the text it is given, and how its reply is rewarded and scored.

Two kinds: `word`, the tiny lab's models with their word-level tokenizer, which continue the raw task
prompt; and `chat`, an instruct model (SmolLM2) that gets the prompt as a chat turn after solved examples
and whose reply is parsed before the family's verifier reads it (`rlmerge.lab.smollm2`). Training (GRPO,
SFT) and scoring both go through a view, so a family is rewarded and scored the same way at every size.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from transformers import PreTrainedTokenizerBase

from rlmerge.lab.tasks import Example, make_family

Kind = Literal["word", "chat"]

# Longest gold answer per family in word-level tokens, plus slack; greedy decoding stops at EOS before this.
WORD_MAX_NEW_TOKENS = {"tool_use": 36, "coding": 24, "memory": 3}


@dataclass(frozen=True)
class TaskView:
    family: str
    prompt: Callable[[Example], str]  # the text the model continues
    target: Callable[[Example], str]  # the gold continuation of `prompt`, before EOS (supervised training)
    reward: Callable[[str, Example], float]  # shaped, in [0, 1] (GRPO)
    score: Callable[[str, Example], float]  # strict 0/1 (test)
    max_new_tokens: int
    # a finer reward where the family has one (tool use: credit per argument), else None
    graded: Callable[[str, Example], float] | None = None


def task_view(kind: Kind, family: str, tokenizer: PreTrainedTokenizerBase) -> TaskView:
    if kind == "word":
        fam = make_family(family)
        return TaskView(
            family, lambda ex: ex.prompt, lambda ex: ex.target, fam.reward, fam.score, WORD_MAX_NEW_TOKENS[family],
            getattr(fam, "graded_reward", None),
        )
    if kind == "chat":
        from rlmerge.lab import smollm2

        chat = smollm2.ChatFamily(family)
        return TaskView(
            family,
            lambda ex: smollm2.chat_prompt(tokenizer, ex),
            lambda ex: ex.target.strip(),  # the tokenizer's EOS (<|im_end|>) closes the turn
            chat.reward,
            chat.score,
            smollm2.MAX_NEW_TOKENS[family],
            chat.graded if hasattr(make_family(family), "graded_reward") else None,
        )
    raise ValueError(f"unknown model kind {kind!r}; choose word or chat")
