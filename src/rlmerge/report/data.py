"""Statistics → the report document: one plain dict with a versioned, documented schema (docs/inspect.md).

Everything here reads counters that a statistics pass already collected, and checkpoint headers; no
weights are read. Tables, Markdown and plots all render this one dict, so they always agree.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from .._version import __version__
from ..stats import MAG_SHIFT, Magnitudes, Statistics, bin_lower_edge, hist_quantiles
from .advice import recommend

if TYPE_CHECKING:
    from ..stream.match import Match

SCHEMA = "rlmerge.report"
VERSION = 1
QUANTILES = (0.01, 0.1, 0.25, 0.5, 0.75, 0.9, 0.99)
# Mantissa bits of each float dtype: the spacing of representable values at |x| in [2^e, 2^(e+1)) is 2^(e−bits).
MANTISSA_BITS = {"BF16": 7, "F16": 10, "F32": 23, "F64": 52}
TORCH_NAMES = {"BF16": "bfloat16", "F16": "float16", "F32": "float32", "F64": "float64"}
MIN_EXPONENT = {"BF16": -126, "F16": -14, "F32": -126, "F64": -1022}  # below it, subnormals: fixed spacing
# Module types, first match wins; matched against the dot-separated parts of a Hugging Face tensor name.
MODULES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("embed", ("embed_tokens", "wte", "word_embeddings", "embed_in")),
    ("lm_head", ("lm_head", "embed_out")),
    ("attn_q", ("q_proj",)), ("attn_k", ("k_proj",)), ("attn_v", ("v_proj",)),
    ("attn_qkv", ("qkv_proj", "query_key_value", "c_attn", "Wqkv")),
    ("attn_o", ("o_proj", "out_proj")),
    ("mlp_gate", ("gate_proj", "w1")), ("mlp_up", ("up_proj", "w3")), ("mlp_gate_up", ("gate_up_proj",)),
    ("mlp_down", ("down_proj", "w2")),
)
LAYER = re.compile(r"(?:^|\.)(?:layers|h|blocks|layer)\.(\d+)\.")


@dataclass(frozen=True)
class DtypeFacts:
    """What the headers say about dtypes, over the merged (float) tensors: dtype name → elements."""

    base: dict[str, int]
    agents: list[dict[str, int]]
    differs: list[int]  # per agent: elements stored in another dtype than the base's copy


def dtype_facts(match: Match) -> DtypeFacts:
    """Read from the jobs' headers only."""
    base: dict[str, int] = {}
    agents: list[dict[str, int]] = [{} for _ in match.agents]
    differs = [0] * len(match.agents)
    for job in match.merge_jobs:
        name = job.info.dtype.code
        base[name] = base.get(name, 0) + job.numel
        for t, agent in enumerate(match.agents):
            info = agent.tensors.get(job.name)
            if info is None:
                continue
            theirs = info.dtype.code
            agents[t][theirs] = agents[t].get(theirs, 0) + job.numel
            differs[t] += job.numel if info.dtype != job.info.dtype else 0
    return DtypeFacts(base, agents, differs)


def module_type(name: str) -> str:
    parts = name.split(".")
    for label, keys in MODULES:
        if any(p in keys for p in parts):
            return label
    if any("norm" in p or p.startswith("ln") for p in parts):
        return "norm"
    return "other"


def layer_index(name: str) -> int | None:
    m = LAYER.search(name)
    return int(m.group(1)) if m else None


def num(x: float | None) -> float | str | None:
    """A number for JSON, which has no infinity and no NaN: ±∞ are written "inf" / "-inf", NaN as null."""
    if x is None or math.isnan(x):
        return None
    return ("inf" if x > 0 else "-inf") if math.isinf(x) else float(x)


def _g(x: float) -> float:
    """10 significant digits: float64 sums (norms, cosines) then read the same whatever the block size."""
    return float(f"{x:.10g}")


def _ratio(a: float, b: float) -> float | None:
    return float(a) / float(b) if b else None


def build_report(stats: Statistics, facts: DtypeFacts | None, *, base: str, warnings: Iterable[str] = (),
                 methods: Mapping[str, Sequence[Any]] | None = None) -> dict[str, Any]:
    """The report document (schema ``rlmerge.report`` version 1) from whole-model statistics. ``methods``: what
    the methods would make of these statistics, per agent (``MethodSpec.inspect``: RAM+'s λ per preset), as
    they computed it; each key a field of every ``per_agent`` row."""
    thresholds = sorted({stats.epsilon, *stats.thresholds})
    doc: dict[str, Any] = {
        "schema": SCHEMA, "version": VERSION, "rlmerge_version": __version__,
        "base": base, "agents": list(stats.agents), "epsilon": stats.epsilon, "thresholds": thresholds,
        "elements": stats.numel, "tensors": len(stats.tensors), "extras": bool(stats.thresholds),
        "per_agent": _per_agent(stats, facts, thresholds, methods or {}),
        "pairwise": _pairwise(stats),
        "layers": _groups(stats, lambda n: layer_index(n), "layer"),
        "modules": _groups(stats, module_type, "module"),
        "precision": _precision(stats.magnitudes, facts, stats.epsilon),
    }
    doc["warnings"] = list(warnings)  # the match's (dtypes, tying, dropped tensors) and the method's
    doc["recommendation"] = recommend(doc)
    return doc


def _per_agent(stats: Statistics, facts: DtypeFacts | None, thresholds: list[float],
               methods: Mapping[str, Sequence[Any]]) -> list[dict[str, Any]]:
    numel, n = stats.numel, stats.n_agents
    kofn = stats.kofn if stats.tensors else np.zeros((n, n + 1), dtype=np.int64)
    # Each stored element once, so that unique + shared = changed; only ρ (and the methods' λ) count a tied
    # tensor twice under count_tied_twice (stats.unique / stats.shared), as the merge does.
    changed, unique, shared = kofn.sum(axis=1), stats.unique_once, stats.shared_once
    norms, rho = stats.norms, stats.rho
    extra = stats.thresholds and stats.tensors
    above = stats._sum("above") if extra else None
    nonzero = stats._sum("nonzero") if extra else None
    rows = []
    for t, label in enumerate(stats.agents):
        c = int(changed[t])
        row: dict[str, Any] = {
            "agent": label, "changed": c, "density": _ratio(c, numel), "unique": int(unique[t]),
            "shared": int(shared[t]), "unique_share": _ratio(int(unique[t]), c),
            "kofn": [int(v) for v in kofn[t, 1:]], "kofn_share": [_ratio(int(v), c) for v in kofn[t, 1:]],
            "rho": num(rho[t]), "norm": _g(norms[t]),
            "value_changed": None, "value_changed_density": None, "density_at": None, "magnitude_quantiles": None,
            **{key: values[t] for key, values in methods.items()},
            "dtypes": facts.agents[t] if facts else None,
            "dtype_differs_elements": facts.differs[t] if facts else None,
        }
        if above is not None and nonzero is not None:
            extra_at = dict(zip(stats.thresholds, above[t]))
            row["density_at"] = [_ratio(c if th == stats.epsilon else int(extra_at[th]), numel) for th in thresholds]
            row["value_changed"] = int(nonzero[t])
            row["value_changed_density"] = _ratio(int(nonzero[t]), numel)
        if stats.magnitudes is not None:
            row["magnitude_quantiles"] = hist_quantiles(stats.magnitudes.tau[t], QUANTILES)
        rows.append(row)
    return rows


def _pairwise(stats: Statistics) -> dict[str, Any]:
    n = stats.n_agents
    overlap = stats._sum("overlap").reshape(n, n) if stats.tensors else np.zeros((n, n), dtype=np.int64)
    agree = stats._sum("sign_agree").reshape(n, n) if stats.tensors else np.zeros((n, n), dtype=np.int64)
    changed = stats.changed
    # The per-tensor counters keep the diagonal at 0 (the torch and fused-kernel paths agree bit for bit, and the
    # sweep cache stores them); in the report an agent overlaps itself on all it changed, as jaccard's 1.0 says.
    overlap = overlap.copy()
    np.fill_diagonal(overlap, changed)
    jaccard = [[_ratio(int(overlap[a, b]), int(changed[a] + changed[b] - overlap[a, b])) if a != b else 1.0
                for b in range(n)] for a in range(n)]
    sign = [[_ratio(int(agree[a, b]), int(overlap[a, b])) if a != b else 1.0 for b in range(n)] for a in range(n)]
    cos = stats.cosine if stats.tensors else np.eye(n)
    return {"overlap": overlap.tolist(), "jaccard": jaccard, "sign_agreement": sign,
            "cosine": [[_g(v) for v in row] for row in cos]}


def _groups(stats: Statistics, key: Any, field: str) -> list[dict[str, Any]]:
    """Sum per-tensor counts by ``key(name)`` (None: not in any group); density per agent per group. Each stored
    element once (also under count_tied_twice, which weighs only ρ's counts): the groups add up to the whole."""
    acc: dict[Any, list[Any]] = {}
    for name, ts in stats.tensors.items():
        k = key(name)
        if k is None:
            continue
        numel, changed = acc.setdefault(k, [0, np.zeros(stats.n_agents, dtype=np.int64)])
        acc[k][0] = numel + ts.numel
        acc[k][1] = changed + ts.changed
    order = sorted(acc) if field == "layer" else [m for m, _ in MODULES if m in acc] + [
        m for m in ("norm", "other") if m in acc]
    return [{field: k, "elements": acc[k][0], "changed": [int(c) for c in acc[k][1]],
             "density": [_ratio(int(c), acc[k][0]) for c in acc[k][1]]} for k in order]


def _precision(mags: Magnitudes | None, facts: DtypeFacts | None, epsilon: float) -> dict[str, Any] | None:
    """The smallest change the base's dtype can store at typical |θ₀|, against ε."""
    if mags is None or facts is None or not facts.base:
        return None
    dtype = max(facts.base, key=lambda k: facts.base[k])
    bits = MANTISSA_BITS.get(dtype)
    median = hist_quantiles(mags.base, (0.5,))[0]
    if bits is None or median is None:
        return None
    step = _spacing(median, bits, MIN_EXPONENT[dtype])
    # Every element of a bin shares its exponent (bins are finer than exponents), so this share is exact.
    finite = 255 << (23 - MAG_SHIFT)  # first bin of exponent 255: inf and NaN (never counted: NaN is an error)
    exponents = np.floor(np.log2(bin_lower_edge(np.arange(1, finite)).astype(np.float64)))
    spacing = np.exp2(np.maximum(exponents, MIN_EXPONENT[dtype]) - bits)
    fine = int(mags.base[0] + mags.base[1:finite][spacing <= epsilon].sum())
    total = int(mags.base.sum())
    return {"dtype": dtype.lower(), "median_abs_base": median, "step_at_median": step,
            "step_over_epsilon": step / epsilon if epsilon else None,
            "share_step_at_most_epsilon": _ratio(fine, total), "bins_resolution": 2.0 ** -(23 - MAG_SHIFT)}


def _spacing(x: float, bits: int, min_exp: int) -> float:
    """Distance from x > 0 to the next representable value above it."""
    return 2.0 ** (max(math.floor(math.log2(x)), min_exp) - bits)
