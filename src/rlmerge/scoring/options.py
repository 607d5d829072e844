"""The options every scorer of a sweep shares (the CLI's flags, a recipe's keys, ``TaskScorer``'s fields)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Backend = Literal["hf", "vllm"]


@dataclass(frozen=True)
class Options:
    limit: int = 128  # examples per task
    split: str = "val"  # the lab's split; a packaged benchmark's seeded half (scoring/chat.py)
    seed: int = 0  # which examples (lab splits, benchmark subsets; lm-eval's seeds)
    batch_size: int = 8  # prompts generated (or lm-eval requests run) at once
    kind: Literal["word", "chat"] = "word"  # how the model sees a lab task (rlmerge.lab.views)
    include_path: tuple[str, ...] = ()  # folders of lm-eval task YAMLs
    num_fewshot: int | None = None  # lm-eval's few-shot examples
    lm_eval_backend: Backend = "hf"  # lm-eval's model: in process (hf) or vLLM on the candidate's folder
    cmd_timeout: float = 3600.0  # seconds a command scorer may run on one candidate
    cmd_env: tuple[tuple[str, str], ...] = ()  # added to a command's environment
    cmd_cwd: str | None = None  # a command's working directory (default: the current one)
    disjoint_from_test: int = 0  # > 0: a lab split's examples avoid the prompts of the seed's first that many test ones
