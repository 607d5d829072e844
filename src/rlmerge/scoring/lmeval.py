"""``lm-eval:TASK``: lm-evaluation-harness (the ``eval`` extra) on a candidate, and the reading of lm-eval's results
(its in-process document, or the ``results_*.json`` a command scorer wrote), which both share.

Backends (``--lm-eval-backend``): ``hf`` (default) hands lm-eval the candidate's model loaded in this process
(lm-eval's HFLM around it, so the lab's word-level tokenizers stay intact); ``vllm`` runs lm-eval's own ``vllm``
model on the candidate's folder (a candidate built in memory is written to a temporary one first), which needs
vLLM installed (``pip install vllm``: a CUDA machine) and makes one vLLM engine per candidate.

A task's score is its first accuracy-like metric (``ACCURACY_LIKE``, in lm-eval's order) × 100; its stderr is
lm-eval's ``METRIC_stderr`` × 100; n is lm-eval's ``n-samples`` (effective; a group's: its tasks'). Per-example
results come from lm-eval's logged samples where each is a number and their mean is the metric (a mean-aggregated
metric such as acc or exact_match; not a corpus metric such as bleu), with lm-eval's ``doc_id`` as the ids.
A task whose metric is not higher-is-better (perplexity, a loss) is refused.
"""

from __future__ import annotations

import gc
import importlib.util
import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import ConfigError, RLMergeError, ScorerError
from ..sweeping.scores import TaskScore, make
from .options import Options
from .subject import Subject

# lm-eval metrics (the name before lm-eval's ",filter") a sweep may rank by: fractions, higher is better
ACCURACY_LIKE = ("acc", "acc_norm", "exact_match", "em", "f1", "mcc", "pass@1", "bleu", "rouge1", "rougeL")
VLLM_HINT = ("pip install vllm (a CUDA machine; lm-eval runs it as its 'vllm' model), or score in process with "
             "--lm-eval-backend hf")


def primary_metric(task: str, metrics: Mapping[str, Any] | None, *,
                   error: type[RLMergeError] = ConfigError) -> tuple[str, float]:
    """(lm-eval's key, value) of the first accuracy-like metric reported for ``task`` (a fraction)."""
    for key, value in (metrics or {}).items():
        if "stderr" not in key and key.split(",")[0] in ACCURACY_LIKE and isinstance(value, (int, float)):
            return key, float(value)
    raise error(f"lm-eval task {task!r} reported no accuracy-like metric ({', '.join(metrics or {}) or 'none'})",
                hint=f"a sweep ranks by higher-is-better fractions: {', '.join(ACCURACY_LIKE)}")


def task_scores(doc: Mapping[str, Any], tasks: Sequence[str] | None = None, *,
                samples: Mapping[str, list[dict[str, Any]]] | None = None,
                error: type[RLMergeError] = ConfigError, where: str = "lm-eval") -> dict[str, TaskScore]:
    """task → TaskScore from lm-eval's results document (see the module docstring); ``tasks`` None: every task
    that is not part of a group in it."""
    results = doc.get("results") or {}
    if tasks is None:
        inner = {t for subs in (doc.get("group_subtasks") or {}).values() for t in subs}
        tasks = [t for t in results if t not in inner]
    logged = samples if samples is not None else (doc.get("samples") or {})
    out = {}
    for task in tasks:
        metrics = results.get(task)
        key, value = primary_metric(task, metrics, error=error)
        name, _, filt = key.partition(",")
        stderr = (metrics or {}).get(f"{name}_stderr,{filt}" if filt else f"{name}_stderr")
        rec: dict[str, Any] = {"score": 100.0 * value}
        if isinstance(stderr, (int, float)) and math.isfinite(stderr):
            rec["stderr"] = 100.0 * float(stderr)
        per = _per_example(logged.get(task), name, filt, value)
        if per is not None:
            rec["samples"], rec["ids"] = per
        else:
            rec["n"] = _count(doc, task)
        out[task] = make(rec, task=task, where=where)
    return out


def _per_example(rows: list[dict[str, Any]] | None, name: str, filt: str,
                 value: float) -> tuple[list[float], list[str]] | None:
    """(samples × 100, doc ids) of one metric, when each logged sample has it as a number averaging ``value``."""
    mine = [r for r in rows or [] if r.get("filter", filt) == filt]
    if not mine or not all(isinstance(r.get(name), (int, float)) and "doc_id" in r for r in mine):
        return None
    mine.sort(key=lambda r: r["doc_id"])
    vals = [float(r[name]) for r in mine]
    ids = [str(r["doc_id"]) for r in mine]
    if len(set(ids)) != len(ids) or not math.isclose(sum(vals) / len(vals), value, rel_tol=1e-6, abs_tol=1e-9):
        return None
    return [100.0 * v for v in vals], ids


def _count(doc: Mapping[str, Any], task: str) -> int | None:
    """lm-eval's effective example count of a task, or of a group (its tasks', recursively)."""
    counts = doc.get("n-samples") or {}
    if task in counts and isinstance(counts[task], Mapping):
        n = counts[task].get("effective")
        return int(n) if isinstance(n, int) and n > 0 else None
    subs = (doc.get("group_subtasks") or {}).get(task)
    if not subs:
        return None
    total = 0
    for t in subs:
        n = _count(doc, t)
        if n is None:
            return None
        total += n
    return total


def read_folder(folder: Path, *, where: str) -> dict[str, TaskScore]:
    """Every task of the lm-eval results a program wrote under ``folder`` (``results_*.json``, with the
    ``samples_TASK_*.jsonl`` beside each when it logged samples). Raises ScorerError."""
    found = sorted(folder.rglob("results_*.json"))
    if not found:
        raise ScorerError(f"{where} wrote no lm-eval results (results_*.json) under its {{output}} folder",
                          hint="give lm-eval `--output_path {output}` (a folder), e.g. "
                               "'cmd:lm_eval --model hf --model_args pretrained={model} --tasks T --output_path "
                               "{output}'")
    out: dict[str, TaskScore] = {}
    for path in found:
        try:
            doc = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as e:
            raise ScorerError(f"{where}: its lm-eval results are not JSON ({e})", file=str(path)) from e
        if not isinstance(doc, dict):
            raise ScorerError(f"{where}: its lm-eval results are not a JSON object", file=str(path))
        samples = {}
        for task in doc.get("results") or {}:
            rows = [json.loads(line) for f in sorted(path.parent.glob(f"samples_{task}_*.jsonl"))
                    for line in f.read_text(encoding="utf-8").splitlines() if line.strip()]
            if rows:
                samples[task] = rows
        for task, score in task_scores(doc, samples=samples, error=ScorerError, where=f"{where} ({path.name})").items():
            if task in out:
                raise ScorerError(f"{where}: task {task!r} is in two lm-eval results files", file=str(path))
            out[task] = score
    return out


@dataclass
class LmEval:
    """``lm-eval:TASK`` for each of ``tasks``, in one lm-eval run per candidate."""

    tasks: list[str]
    options: Options

    def __post_init__(self) -> None:
        from ..lab.harness import UnknownTask, split_tasks

        if self.options.lm_eval_backend not in ("hf", "vllm"):
            raise ConfigError(f"--lm-eval-backend {self.options.lm_eval_backend!r}", hint="hf or vllm")
        if self.options.lm_eval_backend == "vllm" and importlib.util.find_spec("vllm") is None:
            raise ConfigError("--lm-eval-backend vllm: vLLM is not installed", hint=VLLM_HINT)
        try:
            split_tasks(self.tasks, [Path(p) for p in self.options.include_path])
        except UnknownTask as e:
            raise ConfigError(f"--tasks: {e}") from e

    @property
    def names(self) -> list[str]:
        return [f"lm-eval:{t}" for t in self.tasks]

    @property
    def needs(self) -> str:
        return "folder" if self.options.lm_eval_backend == "vllm" else "model"

    def score(self, subject: Subject) -> dict[str, TaskScore]:
        from ..lab.harness import evaluate

        o = self.options
        if o.lm_eval_backend == "vllm":
            folder = subject.folder()
            try:
                from lm_eval.models.vllm_causallms import VLLM  # imports vllm
            except ImportError as e:
                raise ConfigError(f"--lm-eval-backend vllm: {e}", hint=VLLM_HINT) from e
            lm = VLLM(pretrained=str(folder), seed=o.seed, batch_size="auto")
        else:
            from lm_eval.models.huggingface import HFLM

            model, tokenizer = subject.model()
            lm = HFLM(pretrained=model, tokenizer=tokenizer, batch_size=o.batch_size)
        try:
            doc = evaluate(lm, self.tasks, include_path=[Path(p) for p in o.include_path], limit=o.limit,
                           num_fewshot=o.num_fewshot, seed=o.seed, log_samples=True)
        finally:
            del lm  # a vLLM engine holds its GPU memory until it is collected
            gc.collect()
        return {f"lm-eval:{t}": s for t, s in task_scores(doc, self.tasks).items()}
