"""What the output says about itself: ``rlmerge.json`` (provenance; the model card is report/card.py).

Both are deterministic (no timestamps, no block size), so the same inputs and recipe give the same bytes.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

from .._version import __version__
from ..io.checkpoint import Checkpoint
from ..stats import Statistics
from ..stream.match import Match
from .data import num


class Merged(Protocol):
    """What the report reads of a finished merge (engine/merge.MergeResult is one): the method, its parameters, the
    statistics, its own rows (λ, kept) and what the output dtype kept of its rescale, and what to say about it."""

    @property
    def method(self) -> str: ...
    @property
    def params(self) -> Any: ...
    @property
    def statistics(self) -> Statistics: ...
    @property
    def lambdas(self) -> Sequence[float] | None: ...
    @property
    def kept(self) -> Sequence[float] | None: ...
    @property
    def rescale_kept(self) -> Sequence[float | None] | None: ...
    @property
    def warnings(self) -> Sequence[str]: ...
    @property
    def per_tensor(self) -> Mapping[str, str]: ...
    @property
    def defaults(self) -> Sequence[str]: ...


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


def agent_rows(result: Merged) -> list[dict[str, Any]]:
    stats = result.statistics
    rows = []
    numel = max(stats.numel, 1)
    for t, label in enumerate(stats.agents):
        row: dict[str, Any] = {"agent": label}
        if stats.tensors:
            # each stored element once, as the report's rows: only ρ (and λ) count a tied tensor twice when asked
            row.update(changed=int(stats.changed[t]), shared=int(stats.shared_once[t]),
                       unique=int(stats.unique_once[t]), density=float(stats.changed[t]) / numel,
                       rho=num(stats.rho[t]))
        if result.lambdas is not None:
            row["lambda"] = float(result.lambdas[t])
        if result.kept is not None:
            row["kept"] = float(result.kept[t])  # what TIES' trim kept: the count k, not the change density
        if result.rescale_kept is not None:  # the share of its rescaled unique elements the output dtype kept
            row["lambda_kept"] = result.rescale_kept[t]
        rows.append(row)
    return rows


def provenance(match: Match, result: Merged, recipe: Mapping[str, Any] | None) -> dict[str, Any]:
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
