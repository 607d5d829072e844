"""A task's score with its uncertainty: how many examples it came from, its standard error, and, where the scorer
has them, the result of every example (what a paired comparison of two candidates on the same examples needs).

A scorer returns ``{task: value}``; a value is a plain number (the Python API's first contract: n and stderr then
stay unknown), a ``TaskScore``, or a mapping with the same fields (what a command scorer prints):

    {"score": 62.5, "stderr": 6.05, "n": 64}                       # what the scorer knows
    {"score": 50.0, "samples": [100, 0], "ids": ["q1", "q2"]}     # per example: n and stderr follow

``samples`` are in the score's own units, so that ``score`` is their mean (an accuracy in % has samples 0 or 100;
checked, so that 0/1 samples beside a % score are refused, not averaged wrongly). ``ids`` name the examples (stable
across candidates: the same subset in the same order); without them the examples are numbered 0, 1, …. With
samples and no stderr, the stderr is the standard error of their mean, sqrt(Σ(x − x̄)² / n) / √n, which for 0/100
samples is the binomial standard error 100 · sqrt(p(1 − p) / n).

In results.json (``details_json``): per candidate and task ``{"n", "stderr"}`` and, with samples,
``"samples": "100,0,100,…"`` (one string: compact, exact) and ``"examples": KEY``, where ``KEY`` indexes the sweep's
``"examples": {KEY: [ids…]}`` (12 hex digits of the ids' SHA-256), so that candidates scored on the same examples
share one list, and two candidates are paired exactly when their keys are equal.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ..errors import ScorerError

FIELDS = ("score", "stderr", "n", "samples", "ids")
MEAN_TOLERANCE = 1e-3  # relative: a score printed to 4 significant digits still matches its samples' mean


@dataclass(frozen=True)
class TaskScore:
    """One task's score (higher is better) and what is known about its noise; see the module docstring."""

    score: float
    n: int | None = None  # examples the score came from
    stderr: float | None = None  # standard error of ``score``, in its units
    samples: tuple[float, ...] | None = None  # each example's result, in the score's units, in ``ids`` order
    ids: tuple[str, ...] | None = None  # the examples' names (with ``samples``)

    @classmethod
    def from_samples(cls, samples: Sequence[float], ids: Sequence[str] | None = None, *,
                     stderr: float | None = None) -> TaskScore:
        """The mean of per-example results (in the score's units) with the standard error of that mean."""
        return make(
            {"samples": list(samples), **({"ids": list(ids)} if ids is not None else {}),
             **({"stderr": stderr} if stderr is not None else {})}, task="this task")

    @classmethod
    def accuracy(cls, correct: Sequence[float], ids: Sequence[str] | None = None) -> TaskScore:
        """Accuracy in % of 0/1 (or partial-credit 0..1) results: samples 0..100, the binomial standard error. The
        score is ``100 * (sum / n)``, the lab's own arithmetic (so its numbers stay bit for bit what they were)."""
        if not correct:
            raise ScorerError("no examples were scored")
        return make({"score": 100.0 * (sum(correct) / len(correct)), "samples": [100.0 * float(c) for c in correct],
                     **({"ids": list(ids)} if ids is not None else {})}, task="this task")


def make(value: Any, *, task: str, where: str = "the scorer") -> TaskScore:
    """A scorer's value for ``task`` as a checked ``TaskScore`` (raises ScorerError saying what is wrong)."""
    if isinstance(value, TaskScore):
        value = {k: getattr(value, k) for k in FIELDS}
    elif not isinstance(value, Mapping):
        value = {"score": value}
    unknown = sorted(set(map(str, value)) - set(FIELDS))
    if unknown:
        raise ScorerError(f"{where} gave {task!r} unknown field(s) {', '.join(unknown)}",
                          hint=f"a task's value is a number or an object with {', '.join(FIELDS)}")
    samples = _samples(value.get("samples"), task, where)
    score = _number(value["score"], f"{where}: {task!r} score") if value.get("score") is not None else None
    if score is None and samples is None:
        raise ScorerError(f"{where} gave {task!r} no score", hint='e.g. {"score": 61.5} or {"samples": [100, 0]}')
    n = value.get("n")
    if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 1):
        raise ScorerError(f"{where} gave {task!r} n = {n!r}", hint="n is the number of examples: a whole number ≥ 1")
    stderr = _number(value["stderr"], f"{where}: {task!r} stderr") if value.get("stderr") is not None else None
    if stderr is not None and stderr < 0:
        raise ScorerError(f"{where} gave {task!r} stderr = {stderr!r}", hint="a standard error is ≥ 0")
    ids = value.get("ids")
    if samples is None:
        if ids is not None:
            raise ScorerError(f"{where} gave {task!r} ids without samples", hint="ids name the samples, in order")
        assert score is not None
        return TaskScore(score, n, stderr)
    mean = math.fsum(samples) / len(samples)
    if score is not None and not math.isclose(mean, score, rel_tol=MEAN_TOLERANCE, abs_tol=1e-9):
        raise ScorerError(f"{where} gave {task!r} the score {score!r}, but its samples average {mean!r}",
                          hint="samples are in the score's units (0 or 100 per example for an accuracy in %)")
    if n is not None and n != len(samples):
        raise ScorerError(f"{where} gave {task!r} n = {n} and {len(samples)} samples")
    names = _ids(ids, len(samples), task, where)
    if stderr is None:
        stderr = math.sqrt(math.fsum((x - mean) ** 2 for x in samples) / len(samples)) / math.sqrt(len(samples))
    return TaskScore(score if score is not None else mean, len(samples), stderr, samples, names)


def _number(v: Any, what: str) -> float:
    """A finite number from a number or a numeric string (JSON from a command)."""
    if isinstance(v, str):
        try:
            v = float(v.strip())
        except ValueError:
            raise ScorerError(f"{what} is {v!r}, not a number") from None
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise ScorerError(f"{what} is {v!r}, not a number")
    try:
        f = float(v)
    except OverflowError:  # an int too large for a float
        f = math.inf
    if not math.isfinite(f):
        raise ScorerError(f"{what} is {v!r}", hint="a score is a finite number, higher is better")
    return f


def _samples(raw: Any, task: str, where: str) -> tuple[float, ...] | None:
    if raw is None:
        return None
    if isinstance(raw, (str, bytes, Mapping)) or not isinstance(raw, Sequence) or not raw:
        raise ScorerError(f"{where} gave {task!r} samples that are not a non-empty list of numbers")
    return tuple(_number(x, f"{where}: {task!r} sample {i}") for i, x in enumerate(raw))


def _ids(raw: Any, n: int, task: str, where: str) -> tuple[str, ...]:
    if raw is None:
        return tuple(str(i) for i in range(n))
    if isinstance(raw, (str, bytes)) or not isinstance(raw, Sequence) or len(raw) != n:
        raise ScorerError(f"{where} gave {task!r} ids that are not a list of {n} names (one per sample)")
    names = tuple(str(x) for x in raw)
    if len(set(names)) != n:
        raise ScorerError(f"{where} gave {task!r} the same example id twice")
    return names


# -- results.json ---------------------------------------------------------------------------------------------
def examples_key(ids: Sequence[str]) -> str:
    """12 hex digits naming a list of example ids (results.json's ``examples``)."""
    return hashlib.sha256("\n".join(ids).encode()).hexdigest()[:12]


def _text(x: float) -> str:
    return str(int(x)) if x.is_integer() and abs(x) < 2**53 else repr(x)


def details_json(details: Mapping[str, TaskScore], examples: dict[str, list[str]]) -> dict[str, Any]:
    """Per task ``{"n", "stderr"[, "samples", "examples"]}``; the id lists go into ``examples`` (the sweep's)."""
    out: dict[str, Any] = {}
    for task, s in details.items():
        rec: dict[str, Any] = {"n": s.n, "stderr": s.stderr}
        if s.samples is not None and s.ids is not None:
            key = examples_key(s.ids)
            examples.setdefault(key, list(s.ids))
            rec["samples"] = ",".join(_text(x) for x in s.samples)
            rec["examples"] = key
        out[task] = rec
    return out


def details_from_json(scores: Mapping[str, float], details: Mapping[str, Any] | None,
                      examples: Mapping[str, list[str]]) -> dict[str, TaskScore]:
    """What ``details_json`` wrote, read back (``--resume``); a task without details gets n and stderr None."""
    out = {}
    for task, score in scores.items():
        rec = (details or {}).get(task) or {}
        samples = ids = None
        if rec.get("samples") is not None and rec.get("examples") in examples:
            samples = tuple(float(x) for x in str(rec["samples"]).split(","))
            ids = tuple(examples[rec["examples"]])
        out[task] = TaskScore(float(score), rec.get("n"), rec.get("stderr"), samples, ids)
    return out
