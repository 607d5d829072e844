"""rlmerge: merge RL-trained agents into one model — exact, streaming RAM / RAM+ and the standard baselines."""

from __future__ import annotations

__version__ = "0.1.0"

from .errors import ConfigError, InputError, OutputError, RLMergeError  # noqa: E402
from .inspect import inspect  # noqa: E402
from .merge import MergeResult, merge  # noqa: E402

__all__ = ["ConfigError", "InputError", "MergeResult", "OutputError", "RLMergeError", "__version__", "inspect",
           "merge"]
