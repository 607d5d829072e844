"""Scorers for ``rlmerge sweep``: the lab's verifiable tasks and lm-eval tasks, on a candidate in memory or on disk.

A task is ``lab:FAMILY`` (tool_use, coding, memory: greedy answers checked by the family's verifier, accuracy in %;
``kind`` is how the model sees a family, ``rlmerge.lab.views``: ``word`` for the tiny lab's models, ``chat`` for an
instruct model such as the lab's SmolLM2 base)
or ``lm-eval:TASK`` (lm-evaluation-harness, the ``eval`` extra; its primary metric, ×100 so that both read as %).
A bare name is a lab family when it is one, else an lm-eval task. Every score is higher-is-better: an lm-eval task
whose primary metric is not an accuracy-like one (perplexity, a loss) is refused.

The model is loaded once per candidate: from its folder (``rlmerge.lab.evaluate.load_checkpoint``), or, for a
candidate built in memory, from the base's config and the merged tensors (``load_model``), in float32 either way,
so a candidate scores the same in memory and on disk.

>>> scorer = TaskScorer(["lab:tool_use", "lab:memory"], limit=64)               # doctest: +SKIP
>>> rlmerge.sweep(base, agents, "sweep/", candidates=["ram+ r=0.05,0.1"], scorer=scorer)  # doctest: +SKIP
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from .engine.sweep import Built
from .errors import ConfigError

# lm-eval metrics (the name before lm-eval's ",filter") a sweep may rank by: fractions, higher is better
ACCURACY_LIKE = ("acc", "acc_norm", "exact_match", "em", "f1", "mcc", "pass@1", "bleu", "rouge1", "rougeL")


def load_model(built: Built) -> tuple[Any, Any]:
    """(float32 causal LM in eval mode, tokenizer) of a built candidate, from disk or from memory."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from .lab.evaluate import load_checkpoint
    from .lab.tokenizer import load_tokenizer

    if built.path is not None:
        return load_checkpoint(built.path)
    assert built.tensors is not None  # built in memory
    config = AutoConfig.from_pretrained(built.side_dir)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    state = {k: v.to(torch.float32) for k, v in built.tensors.items()}
    missing, unexpected = model.load_state_dict(state, strict=False)
    tied = {k for k in missing if getattr(config, "tie_word_embeddings", False) and k.endswith("lm_head.weight")}
    if set(missing) - tied or unexpected:
        raise ConfigError(f"the merged tensors do not fit {type(model).__name__}: missing {sorted(missing)[:3]}, "
                          f"unexpected {sorted(unexpected)[:3]}", file=str(built.side_dir))
    if (Path(built.side_dir) / "generation_config.json").is_file():  # as from_pretrained reads it from a folder
        from transformers import GenerationConfig

        model.generation_config = GenerationConfig.from_pretrained(built.side_dir)
    model.eval()
    return model, load_tokenizer(built.side_dir)


def split_names(tasks: Sequence[str]) -> tuple[list[str], list[str]]:
    """(lab families, lm-eval task names) of ``lab:…`` / ``lm-eval:…`` / bare names, in the order given."""
    from .lab.tasks import FAMILIES

    lab, harness = [], []
    for t in tasks:
        kind, sep, name = t.partition(":")
        if sep and kind == "lab":
            if name not in FAMILIES:
                raise ConfigError(f"--tasks: {t!r}: the lab's tasks are {', '.join(FAMILIES)}")
            lab.append(name)
        elif sep and kind == "lm-eval":
            harness.append(name)
        elif t in FAMILIES:
            lab.append(t)
        else:
            harness.append(t)
    return lab, harness


@dataclass
class TaskScorer:
    """Score a candidate on ``tasks`` (see the module docstring): ``limit`` examples per lab task (the ``split``
    split of seed ``seed``) and per lm-eval task."""

    tasks: list[str]
    limit: int = 128
    split: str = "val"  # the lab's validation split: a sweep chooses hyperparameters, the test split judges
    seed: int = 0
    include_path: list[str] = field(default_factory=list)
    num_fewshot: int | None = None
    batch_size: int = 8
    kind: Literal["word", "chat"] = "word"  # how the model sees a lab task (rlmerge.lab.views)

    def __post_init__(self) -> None:
        self.lab, self.harness = split_names(self.tasks)
        if not self.tasks:
            raise ConfigError("no tasks to score (--tasks)", hint="e.g. --tasks lab:tool_use,lab:coding")
        if self.split not in ("val", "test"):
            raise ConfigError(f"--split {self.split!r}", hint="val (to choose) or test (to report)")
        if self.kind not in ("word", "chat"):
            raise ConfigError(f"the lab tasks' view {self.kind!r}", hint="word (the tiny lab's models) or chat")
        if "coding" in self.lab:  # it runs the candidates' programs: refused before anything is merged
            from .sandbox import ensure_isolation

            ensure_isolation()
        if self.harness:
            from .lab.harness import UnknownTask, split_tasks

            try:
                split_tasks(self.harness, [Path(p) for p in self.include_path])
            except UnknownTask as e:
                raise ConfigError(f"--tasks: {e}") from e

    @property
    def names(self) -> list[str]:
        return [*(f"lab:{f}" for f in self.lab), *(f"lm-eval:{t}" for t in self.harness)]

    def settings(self) -> dict[str, Any]:
        """What decides the scores besides the model (recorded in results.json, checked by --resume)."""
        return {"tasks": self.names, "limit": self.limit, "split": self.split, "seed": self.seed,
                "include_path": list(self.include_path), "num_fewshot": self.num_fewshot,
                **({"kind": self.kind} if self.kind != "word" else {})}  # a word sweep's --resume stays valid

    def __call__(self, built: Built) -> dict[str, float]:
        from .lab.evaluate import score_examples
        from .lab.tasks import make_family, make_split

        model, tokenizer = load_model(built)
        scores = {f"lab:{f}": 100.0 * score_examples(model, tokenizer,
                                                     make_split(make_family(f), self.split, self.limit, self.seed),
                                                     self.kind)
                  for f in self.lab}
        if self.harness:
            from .lab.harness import run_harness

            results = run_harness(model, tokenizer, self.harness, include_path=[Path(p) for p in self.include_path],
                                  limit=self.limit, num_fewshot=self.num_fewshot, batch_size=self.batch_size,
                                  seed=self.seed)
            for t in self.harness:
                scores[f"lm-eval:{t}"] = 100.0 * primary_metric(t, results.get(t))
        return scores


def primary_metric(task: str, metrics: dict[str, float] | None) -> float:
    """The first accuracy-like metric lm-eval reported for ``task`` (a fraction)."""
    for name, value in (metrics or {}).items():
        if "stderr" not in name and name.split(",")[0] in ACCURACY_LIKE:
            return float(value)
    raise ConfigError(f"lm-eval task {task!r} reported no accuracy-like metric ({', '.join(metrics or {}) or 'none'})",
                      hint=f"a sweep ranks by higher-is-better fractions: {', '.join(ACCURACY_LIKE)}")
