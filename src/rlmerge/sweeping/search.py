"""A sweep beyond a grid: Optuna asks for candidates from a search space (space.py), the sweep builds and scores
them as it does a grid's, and tells Optuna each one's average score (the ranking's). ``pip install
'rlmerge[search]'``; imported only for ``search`` other than ``grid``.

- **Samplers**: ``random`` (``RandomSampler``), ``tpe`` (``TPESampler``: multivariate, its default in Optuna 5;
  ``group=True`` for several spaces, so that each method's parameters are modelled together; its first 10 trials
  are random), ``cmaes`` (``CmaEsSampler``: one space with at least two ranges; its lists are sampled
  independently, at random, as Optuna's CMA-ES does for a categorical parameter).
- **Seeded, trial by trial**: the sampler of trial ``t`` is made afresh with the seed ``(seed, t)`` (``trial_seed``),
  so a trial depends on the seed, its number and the study's history only: the same command gives the same trials,
  and a resumed study asks what the uninterrupted one would have.
- **Floats** are rounded to ``DIGITS`` significant digits once sampled (``_round``), so a label says exactly what
  was merged; Optuna keeps the value it sampled.
- **Exactly N**: ``trials`` is the number of trials told to the study, a failed one included (a scorer's failure,
  or a combination the method refuses: told ``FAIL``, ranked last, not asked again). A trial whose candidate was
  scored already (a sampler may repeat a point of a list or an int range) is told that score without a merge.
- **Resumable**: with a sweep folder the study is Optuna's journal file ``study.journal`` there (``JournalStorage``
  on a ``JournalFileBackend``; the sweep folder's lock is its only lock, and the folder records it after each
  complete ask and tell: io/sweepdir.py). A trial left running by an interrupted run is scored first, with its own
  parameters, then the study continues to ``trials`` told.
- **Batches**: ``batch`` trials are asked at once (Ray: one per worker) and told as they finish; the next batch is
  asked when the whole batch is told, so the trials depend on the batch size but not on the order results come
  back in.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from ..errors import ConfigError, RLMergeError
from ..io.sweepdir import SweepDir
from .candidates import Candidate
from .space import Space, names

try:
    import optuna
    from optuna.storages.journal import JournalFileBackend, JournalStorage
    from optuna.trial import FixedTrial, TrialState
except ImportError as e:  # the ``search`` extra is not installed
    raise ConfigError("--search random, tpe and cmaes need Optuna",
                      hint="pip install 'rlmerge[search]' (pinned: optuna==5.0.0, cmaes==0.13.1)") from e

SAMPLERS = ("random", "tpe", "cmaes")
JOURNAL = "study.journal"
DIGITS = 6  # significant digits a sampled float keeps
STUDY = "rlmerge-sweep"


def check(kind: str, spaces: Sequence[Space], trials: Any) -> list[RLMergeError]:
    """What a search of ``kind`` cannot do with these spaces and this number of trials (every problem)."""
    problems: list[RLMergeError] = []
    if type(trials) is not int or trials < 1:
        given = "no --trials" if trials is None else f"--trials {trials!r}"
        problems.append(ConfigError(f"{given}: a search runs a whole number ≥ 1 of trials",
                                    hint="e.g. --trials 20 (or --search grid to try every candidate)"))
    if kind == "cmaes":
        try:
            import cmaes  # noqa: F401 - Optuna's CmaEsSampler imports it only when it first samples
        except ImportError:
            problems.append(ConfigError("--search cmaes needs the cmaes package",
                                        hint="pip install 'rlmerge[search]' (pinned: cmaes==0.13.1)"))
        if len(spaces) > 1:
            problems.append(ConfigError(
                "--search cmaes samples one method's ranges: with several --candidate (a method choice) Optuna's "
                "CMA-ES would sample every parameter at random",
                hint="use --search tpe, or one cmaes sweep per method"))
        elif spaces and spaces[0].ranges < 2:
            problems.append(ConfigError(
                f"--search cmaes needs at least two ranges (KEY=LO..HI) to adapt; {spaces[0].text!r} has "
                f"{spaces[0].ranges}", hint="use --search tpe (or random) for one range"))
    return problems


def trial_seed(seed: int, number: int) -> int:
    """The seed of trial ``number``'s sampler: 32 bits of SHA-256 over (seed, number)."""
    return int.from_bytes(hashlib.sha256(f"rlmerge-search:{seed}:{number}".encode()).digest()[:4], "little")


@dataclass
class Asked:
    """One trial: its number, and its candidate (or why the method refused the sampled combination)."""

    number: int
    candidate: Candidate | None
    error: str | None = None


class _FolderLock:
    """No lock of its own: the sweep folder's ``flock`` (io/sweepdir.py) already keeps every other sweep out, and
    only the driver writes the study (a lock file or link would be one more file left behind by a crash). What
    ``JournalFileBackend`` asks of its ``lock_obj`` (Optuna's base class for it is private)."""

    def acquire(self) -> bool:
        return True

    def release(self) -> None:
        return None


class Study:
    """An Optuna study over ``spaces`` (see the module docstring), kept in ``folder`` when one is given."""

    def __init__(self, spaces: Sequence[Space], kind: str, *, seed: int, folder: SweepDir | None) -> None:
        if kind not in SAMPLERS:
            raise ConfigError(f"--search {kind!r}", hint="grid, random, tpe or cmaes")
        self.spaces, self.kind, self.seed, self.folder = list(spaces), kind, seed, folder
        self.names = names(self.spaces)
        with _quiet():
            if folder is not None:
                path = folder.appended(JOURNAL)
                storage: Any = JournalStorage(JournalFileBackend(str(path), lock_obj=_FolderLock()))
            else:
                storage = optuna.storages.InMemoryStorage()
            self.study = optuna.create_study(storage=storage, study_name=STUDY, direction="maximize",
                                             load_if_exists=True, sampler=self._sampler(0))
        self._record()

    def _sampler(self, number: int) -> Any:
        s = trial_seed(self.seed, number)
        if self.kind == "random":
            return optuna.samplers.RandomSampler(seed=s)
        if self.kind == "cmaes":
            return optuna.samplers.CmaEsSampler(seed=s, warn_independent_sampling=False)
        return optuna.samplers.TPESampler(seed=s, group=len(self.spaces) > 1)

    def _record(self) -> None:
        if self.folder is not None:
            self.folder.adopt(JOURNAL)

    def _trials(self) -> list[Any]:
        return self.study.get_trials(deepcopy=False)

    @property
    def told(self) -> int:
        return sum(t.state.is_finished() for t in self._trials())

    def candidates(self) -> list[str]:
        """The candidate ids of the trials so far, in trial order (a repeated candidate each time)."""
        return [t.user_attrs["candidate"] for t in self._trials() if "candidate" in t.user_attrs]

    def running(self) -> list[Asked]:
        """Trials an interrupted run asked and never told, in order, with their candidates."""
        return [self._asked(t.number, FixedTrial(t.params, t.number)) for t in self._trials()
                if t.state == TrialState.RUNNING]

    def ask(self, n: int) -> list[Asked]:
        """``n`` new trials (see the module docstring for their seeds)."""
        out = []
        for _ in range(n):
            number = len(self._trials())
            with _quiet():
                self.study.sampler = self._sampler(number)
                trial = self.study.ask()
                if trial.number != number:
                    raise RuntimeError(f"Optuna numbered a new trial {trial.number}, expected {number}")
                asked = self._asked(number, trial)
                if asked.candidate is not None:
                    trial.set_user_attr("candidate", asked.candidate.id)
            self._record()
            out.append(asked)
        return out

    def _asked(self, number: int, trial: Any) -> Asked:
        try:
            c = _suggest(trial, self.spaces, self.names)
            c.id  # noqa: B018 - the method's checks of this combination
            return Asked(number, c)
        except RLMergeError as e:
            return Asked(number, None, e.render().replace("\n  -> ", "; "))

    def tell(self, number: int, value: float | None) -> None:
        """Tell trial ``number`` its average score, or None: it failed."""
        with _quiet():
            if value is None:
                self.study.tell(number, state=TrialState.FAIL, skip_if_finished=True)
            else:
                self.study.tell(number, value, skip_if_finished=True)
        self._record()

    def to_json(self) -> list[dict[str, Any]]:
        """results.json's ``trials``: every trial's number, state, value, parameters (Optuna's names) and candidate."""
        return [{"number": t.number, "state": t.state.name.lower(), "value": t.value,
                 "candidate": t.user_attrs.get("candidate"), "params": dict(t.params)} for t in self._trials()]


def _suggest(trial: Any, spaces: Sequence[Space], labels: Sequence[str]) -> Candidate:
    """The candidate ``trial`` samples: the space (a method choice when there are several), then its parameters,
    each named ``KEY`` (one space) or ``SPACE.KEY``."""
    i, prefix = 0, ""
    if len(spaces) > 1:
        label = trial.suggest_categorical("method", list(labels))
        i, prefix = list(labels).index(label), f"{label}."
    space = spaces[i]
    values: dict[str, Any] = {}
    for d in space.dims:
        name = prefix + d.key
        if d.kind == "float":
            values[d.key] = _round(trial.suggest_float(name, d.lo, d.hi, log=d.log), d.lo, d.hi)
        elif d.kind == "int":
            values[d.key] = trial.suggest_int(name, int(d.lo), int(d.hi), log=d.log)
        elif d.kind == "choice":
            values[d.key] = d.values[d.texts.index(trial.suggest_categorical(name, d.texts))]
    return space.candidate(values)


def _round(x: float, lo: float, hi: float) -> float:
    """A sampled float to ``DIGITS`` significant digits, inside [lo, hi]: the candidate's label is then the value
    merged (``rlmerge merge`` takes it as written), and the id of a point does not hang on its last bits."""
    return min(hi, max(lo, float(f"{x:.{DIGITS}g}")))


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """Optuna's INFO lines (each trial told) and its experimental-feature warning (``group``) are not the sweep's
    output: the sweep prints its own table."""
    level = optuna.logging.get_verbosity()
    optuna.logging.set_verbosity(logging.WARNING)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
            yield
    finally:
        optuna.logging.set_verbosity(level)


Evaluate = Callable[[list[Candidate], Callable[[Any], None]], None]


def run(study: Study, trials: int, batch: int, *, known: Callable[[str], Any],
        evaluate: Evaluate, on_asked: Callable[[Asked], None]) -> None:
    """Ask, evaluate and tell until ``trials`` are told (see the module docstring).

    ``known(id)`` is a candidate's outcome when it was scored already (``Scored``: ``average`` None and ``error``
    set when the scorer failed), else None; ``evaluate(candidates, done)`` builds and scores them, calling
    ``done(scored)`` as each finishes; ``on_asked`` sees each trial as it is asked (the sweep lists its candidate).
    """
    pending = study.running() if study.told < trials else []  # a study already at N is left as it is
    for a in pending:
        on_asked(a)
    while True:
        if not pending:
            n = min(batch, trials - study.told)
            if n <= 0:
                return
            pending = study.ask(n)
            for a in pending:
                on_asked(a)
        _batch(study, pending, known, evaluate)
        pending = []


def _batch(study: Study, pending: list[Asked], known: Callable[[str], Any], evaluate: Evaluate) -> None:
    """Tell the trials whose outcome is known now (a refused combination, a candidate scored before); evaluate the
    others' candidates (each once) and tell every trial of a candidate as it finishes."""
    waiting: dict[str, list[int]] = {}
    todo: list[Candidate] = []
    for a in pending:
        if a.candidate is None:
            study.tell(a.number, None)
        elif (s := known(a.candidate.id)) is not None:
            study.tell(a.number, _value(s))
        else:
            if a.candidate.id not in waiting:
                todo.append(a.candidate)
            waiting.setdefault(a.candidate.id, []).append(a.number)

    def done(s: Any) -> None:
        for number in waiting.pop(s.candidate.id, []):
            study.tell(number, _value(s))

    if todo:
        evaluate(todo, done)


def _value(s: Any) -> float | None:
    """What a trial is told: its candidate's average score (the ranking's), None when the scorer failed."""
    return None if s.error is not None or s.average is None else float(s.average)
