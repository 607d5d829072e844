"""What the output says about itself: ``rlmerge.json`` (provenance) and the model card ``README.md``.

Both are deterministic (no timestamps, no block size), so the same inputs and recipe give the same bytes.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from .._version import __version__
from ..io.checkpoint import Checkpoint
from .data import num

if TYPE_CHECKING:
    from ..engine.match import Match
    from ..engine.merge import MergeResult


COLUMN = {"rho": "ρ", "lambda": "λ", "lambda_kept": "λ kept"}  # the agent table's headers, where not the key
PERCENT = ("density", "kept", "lambda_kept")


def _files(ckpt: Checkpoint) -> list[dict[str, Any]]:
    """Each weight file with its size and the SHA-256 of its header (names, dtypes, shapes, offsets).

    Hashing the header, not the whole file, keeps provenance free: the data are read once, by the merge.
    """
    out = []
    for f in ckpt.files:
        raw = ckpt.header_bytes.get(f)
        entry: dict[str, Any] = {"name": f.name, "bytes": f.stat().st_size}
        if raw is not None:
            entry["header_sha256"] = hashlib.sha256(raw).hexdigest()
        out.append(entry)
    return out


def _input(role: str, ckpt: Checkpoint) -> dict[str, Any]:
    return {"role": role, "source": ckpt.label, "path": str(ckpt.path.resolve()), "revision": ckpt.revision,
            "format": ckpt.format, "files": _files(ckpt)}


def agent_rows(result: MergeResult) -> list[dict[str, Any]]:
    stats = result.statistics
    rows = []
    numel = max(stats.numel, 1)
    for t, label in enumerate(stats.agents):
        row: dict[str, Any] = {"agent": label}
        if stats.tensors:
            row.update(changed=int(stats.changed[t]), shared=int(stats.shared[t]), unique=int(stats.unique[t]),
                       density=float(stats.changed[t]) / numel, rho=num(stats.rho[t]))
        if result.lambdas is not None:
            row["lambda"] = float(result.lambdas[t])
        if result.kept is not None:
            row["kept"] = float(result.kept[t])  # what TIES' trim kept: the count k, not the change density
        if result.rescale_kept is not None:  # the share of its rescaled unique elements the output dtype kept
            row["lambda_kept"] = result.rescale_kept[t]
        rows.append(row)
    return rows


def provenance(match: Match, result: MergeResult, recipe: Mapping[str, Any] | None) -> dict[str, Any]:
    """``rlmerge.json``'s content (the writer adds the list of files it wrote)."""
    params = dataclasses.asdict(result.params) if dataclasses.is_dataclass(result.params) else {}
    doc = {
        "rlmerge_version": __version__,
        "method": result.method,
        "parameters": params,
        "epsilon": result.statistics.epsilon,
        "recipe": dict(recipe) if recipe else None,
        "inputs": [_input("base", match.base), *(_input("agent", a) for a in match.agents)],
        "output_dtypes": sorted({str(j.out_dtype).removeprefix("torch.") for j in match.jobs}),
        "agents": agent_rows(result),
        "elements": result.statistics.numel,
        "tied_tensors": match.tied,
        "dropped_tensors": match.dropped,
        "missing_tensors_allowed": match.missing,
        "warnings": result.warnings,
    }
    if result.per_tensor:  # a recipe's gradients and filters: "parameters" holds what no tensor overrides
        doc["per_tensor_parameters"] = dict(result.per_tensor)
    if result.defaults:
        doc["defaults_applied"] = list(result.defaults)
    if match.tokenizer is not None:  # what the output's tokenizer is, and how the agents' differ
        doc["tokenizer"] = match.tokenizer.to_json()
    return doc


def model_card(match: Match, result: MergeResult) -> str:
    tags = ["merge", "rlmerge", result.method]
    lines = ["---", f"base_model: {match.base.label}", "base_model_relation: merge", "library_name: transformers",
             "tags:", *(f"- {t}" for t in tags), "---", "",
             f"# Merged with rlmerge ({result.method})", "",
             f"Base model: `{match.base.label}`. Agents merged: {len(match.agents)}.", ""]
    params = dataclasses.asdict(result.params) if dataclasses.is_dataclass(result.params) else {}
    if params:
        shown = {k: ("per tensor" if k in result.per_tensor else v) for k, v in params.items()}
        lines += ["Parameters: " + ", ".join(f"`{k}={v}`" for k, v in shown.items()), ""]
    if result.per_tensor:
        lines += ["Per tensor (the recipe's gradients over the layers and filters on tensor names, as mergekit):",
                  *(f"- `{k}`: {v}" for k, v in result.per_tensor.items()), ""]
    if result.defaults:
        lines += ["Defaults applied (mergekit's, for a recipe in its layout):", *(f"- {d}" for d in result.defaults),
                  ""]
    rows = agent_rows(result)
    cols = [c for c in ("agent", "density", "kept", "changed", "unique", "shared", "rho", "lambda", "lambda_kept")
            if c in rows[0]]
    lines += ["| " + " | ".join(COLUMN.get(c, c) for c in cols) + " |", "|" + "---|" * len(cols)]
    for r in rows:
        cells = []
        for c in cols:
            v = r[c]
            cells.append("—" if v is None else f"{v:.2%}" if c in PERCENT else f"{v:.4f}" if isinstance(v, float)
                         else f"{v}")
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", f"Elements counted: {result.statistics.numel:,} (changed means |τ| > {result.statistics.epsilon:g}).",
              "Provenance (inputs, file hashes, parameters): `rlmerge.json`.", ""]
    if result.warnings:
        lines += ["## Warnings", "", *(f"- {w}" for w in result.warnings), ""]
    return "\n".join(lines)
