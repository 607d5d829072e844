"""The version, from the installed package's metadata (pyproject.toml is its one home)."""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("rlmerge")
except PackageNotFoundError:  # run from a source tree that was never installed
    __version__ = "0+unknown"
