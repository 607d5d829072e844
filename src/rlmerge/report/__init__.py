"""Statistics → report: one document (``data``), rendered as tables, JSON, Markdown and plots.

Reads statistics and checkpoint headers only; never weights. ``rlmerge inspect`` and every merge's model
card (``README.md`` + ``rlmerge-report.json``) use the same document.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..stats import Statistics
from .data import SCHEMA, VERSION, build_report, dtype_facts, num
from .markdown import to_markdown

REPORT_FILE = "rlmerge-report.json"


def _clean(x: Any) -> Any:
    """JSON-safe: ∞ → "inf", NaN → null, tuples → lists."""
    if isinstance(x, float):
        return num(x)
    if isinstance(x, dict):
        return {k: _clean(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_clean(v) for v in x]
    return x


def to_json(doc: dict[str, Any]) -> str:
    return json.dumps(_clean(doc), indent=2, allow_nan=False) + "\n"


@dataclass
class Report:
    """What ``rlmerge.inspect`` returns: the document and the statistics it was built from."""

    doc: dict[str, Any]
    statistics: Statistics

    def to_json(self) -> str:
        return to_json(self.doc)

    def to_markdown(self, *, level: int = 1) -> str:
        return to_markdown(self.doc, level=level)

    def save_plots(self, folder: str | Path, *, force: bool = False, inputs: Sequence[Any] = ()) -> list[Path]:
        """Write the figures as PNGs into a new folder (``force``: replace one rlmerge wrote)."""
        from .plots import save_plots

        return save_plots(self.doc, folder, force=force, inputs=inputs)


__all__ = ["REPORT_FILE", "SCHEMA", "VERSION", "Report", "build_report", "dtype_facts", "to_json", "to_markdown"]
