"""``py:MODULE:FUNCTION``: a Python function scores a candidate, with the Python API's signature:
``FUNCTION(built) -> {task: score}`` (``rlmerge.Built``: the merged tensors in memory or the folder on disk; a score
is a number, a ``rlmerge.TaskScore`` or ``{"score", "stderr", "n", "samples", "ids"}``).

``MODULE`` is a module importable by name (on ``PYTHONPATH``: the ``rlmerge`` command does not put the current
folder there) or the path of a ``.py`` file (``py:evals/mine.py:score``, loaded once, under a private name).
``FUNCTION`` may be dotted (``Scorers.bfcl``). The function is looked up when the sweep starts (a missing module
or name is a configuration error) and again in each process that scores (a Ray worker imports it by name: a file
must be on a filesystem it sees). An exception it raises is a ScorerError on that candidate.

A function with a ``split`` parameter (or ``**kwargs``) is called ``FUNCTION(built, split=...)``: ``--split``
(``val``) while the sweep chooses, the held-out split under ``--confirm``; one without it cannot be confirmed (it
would score the same data twice).
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import inspect
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import ConfigError, RLMergeError, ScorerError
from ..sweeping.scores import TaskScore, make
from .subject import Subject


@dataclass
class PyFunction:
    """One ``py:`` scorer (see the module docstring)."""

    spec: str  # MODULE:FUNCTION, as given after "py:"
    split: str = "val"  # given to a function that takes ``split`` (see the module docstring)
    _fn: Callable[..., Any] | None = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        module, sep, name = self.spec.rpartition(":")
        if not sep or not module or not name:
            raise ConfigError(f"--tasks py:{self.spec}: not MODULE:FUNCTION",
                              hint="e.g. py:my_evals:score, or py:path/to/evals.py:score")
        if _is_file(module):
            path = Path(module).resolve()
            if not path.is_file():
                raise ConfigError(f"--tasks py:{self.spec}: no such file", file=str(path))
            self.spec = f"{path}:{name}"  # absolute: the same file from any working folder
        self.function()

    @property
    def names(self) -> None:
        return None  # the function names its tasks

    needs = "built"

    def __getstate__(self) -> dict[str, Any]:  # a Ray worker looks the function up itself
        return {**self.__dict__, "_fn": None}

    def function(self) -> Callable[..., Any]:
        if self._fn is None:
            module, _, name = self.spec.rpartition(":")
            try:
                obj: Any = _load(module)
                for part in name.split("."):
                    obj = getattr(obj, part)
            except Exception as e:  # noqa: BLE001 - whatever importing the user's module raised: said, not hidden
                raise ConfigError(f"--tasks py:{self.spec}: {type(e).__name__}: {e}") from e
            if not callable(obj):
                raise ConfigError(f"--tasks py:{self.spec}: {name} is not callable")
            self._fn = obj
        return self._fn

    @property
    def takes_split(self) -> bool:
        """Whether the function has a ``split`` parameter (or takes any keyword)."""
        try:
            params = inspect.signature(self.function()).parameters.values()
        except (TypeError, ValueError):  # a builtin without a signature
            return False
        return any(p.name == "split" or p.kind is inspect.Parameter.VAR_KEYWORD for p in params)

    def score(self, subject: Subject) -> dict[str, TaskScore]:
        where = f"py:{self.spec} on candidate {subject.id}"
        try:
            fn = self.function()
            values = fn(subject.built, split=self.split) if self.takes_split else fn(subject.built)
        except RLMergeError:
            raise
        except Exception as e:
            raise ScorerError(f"{where} raised {type(e).__name__}: {e}") from e
        if not isinstance(values, Mapping) or not values:
            raise ScorerError(f"{where} returned {type(values).__name__} {str(values)[:80]!r}",
                              hint="a scorer returns {task: score}, at least one task")
        return {str(k): make(v, task=str(k), where=where) for k, v in values.items()}


def _is_file(module: str) -> bool:
    return module.endswith(".py") or "/" in module


def _load(module: str) -> Any:
    if not _is_file(module):
        return importlib.import_module(module)
    name = "rlmerge_user_scorer_" + hashlib.sha256(module.encode()).hexdigest()[:12]
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, module)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load {module}")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod  # before running it, as an import does (dataclasses in it look their module up)
    try:
        spec.loader.exec_module(mod)
    except BaseException:
        sys.modules.pop(name, None)
        raise
    return mod
