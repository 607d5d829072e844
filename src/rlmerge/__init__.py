"""rlmerge: merge RL-trained agents into one model — exact, streaming RAM / RAM+ and the standard baselines."""

from __future__ import annotations

from ._version import __version__
from .engine.anatomy import inspect
from .engine.dryrun import dry_run
from .engine.merge import MergeResult, merge
from .errors import ConfigError, InputError, OutputError, RLMergeError, ScorerError
from .sweeping.sweep import Built, NothingScored, Scored, SweepResult, TaskScore, sweep

__all__ = ["Built", "ConfigError", "InputError", "MergeResult", "NothingScored", "OutputError", "RLMergeError",
           "Scored", "ScorerError", "SweepResult", "TaskScore", "__version__", "dry_run", "inspect", "merge", "sweep"]
