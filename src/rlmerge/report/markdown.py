"""The report document as Markdown: the model card's section and ``rlmerge inspect --markdown``."""

from __future__ import annotations

from typing import Any

from .tables import precision_line, sections


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def to_markdown(doc: dict[str, Any], *, level: int = 1) -> str:
    """``level`` is the heading level of the title (2 inside a model card)."""
    h = "#" * level
    lines = [f"{h} Task-vector anatomy", "",
             f"{len(doc['agents'])} agent(s) against base `{doc['base']}`; changed means |τ| > {doc['epsilon']:g}. "
             f"Machine-readable: `rlmerge-report.json` (schema {doc['schema']} v{doc['version']}).", "",
             f"**Recommendation:** {doc['recommendation']['summary']}", ""]
    for s in sections(doc):
        lines += [f"{h}# {s.title}", "", "| " + " | ".join(_cell(c) or " " for c in s.columns) + " |",
                  "|" + "|".join("---:" if i in s.right else "---" for i in range(len(s.columns))) + "|"]
        lines += ["| " + " | ".join(_cell(c) for c in row) + " |" for row in s.rows]
        lines += ["", s.note, ""] if s.note else [""]
    line = precision_line(doc)
    if line:
        lines += [line, ""]
    if doc["warnings"]:
        lines += [f"{h}# Warnings", "", *(f"- {w}" for w in doc["warnings"]), ""]
    return "\n".join(lines)
