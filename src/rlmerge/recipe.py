"""What to merge, from YAML: mergekit's recipe layout, all problems reported together.

    merge_method: ram+
    base_model: ./base
    models:
      - model: ./coder
      - model: ./tools
        parameters: {weight: 1.0}
    parameters: {preset: paper, r: 0.1}
    dtype: bfloat16
    options: {shard_size: 5GB, allow_missing: false}   # rlmerge's own run options
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

import yaml

from .errors import ConfigError, ProblemsError, RLMergeError, raise_all
from .mergekit_names import translate
from .params import parse_params

TOP_KEYS = {"merge_method", "base_model", "models", "parameters", "dtype", "out_dtype", "options", "tokenizer_source"}
MODEL_KEYS = {"model", "parameters"}


@dataclass(frozen=True)
class RunOptions:
    """A recipe's ``options:``, typed like the command line's flags (a quoted "false" is false)."""

    shard_size: str | None = None
    block_size: int | None = None
    allow_missing: bool | None = None
    count_tied_twice: bool | None = None
    seed: int | None = None
    device: str | None = None


OPTIONS = {f.name for f in fields(RunOptions)}


@dataclass
class Recipe:
    method: str
    base: str
    agents: list[str]
    parameters: dict[str, Any] = field(default_factory=dict)
    dtype: str | None = None
    options: dict[str, Any] = field(default_factory=dict)
    raw: dict[str, Any] = field(default_factory=dict)


def load_recipe(path: str | Path) -> Recipe:
    p = Path(path)
    try:
        doc = yaml.safe_load(p.read_text(encoding="utf-8"))
    except OSError as e:
        raise ConfigError(f"cannot read recipe: {e.strerror}", file=str(p)) from e
    except UnicodeDecodeError as e:
        raise ConfigError(f"recipe is not UTF-8 text: {e}", file=str(p)) from e
    except (yaml.YAMLError, RecursionError) as e:
        raise ConfigError(f"recipe is not valid YAML: {e}", file=str(p)) from e
    return parse_recipe(doc, where=str(p))


def _unknown(mapping: dict[Any, Any], known: set[str]) -> list[Any]:
    """Keys not in ``known``, sorted by their text (YAML keys may be numbers, lists' reprs, None)."""
    return sorted((k for k in mapping if k not in known), key=repr)


def parse_recipe(doc: Any, *, where: str = "recipe") -> Recipe:
    if not isinstance(doc, dict):
        raise ConfigError("recipe must be a mapping with merge_method, base_model and models", file=where)
    problems: list[RLMergeError] = []

    def bad(msg: str, hint: str | None = None) -> None:
        problems.append(ConfigError(msg, file=where, hint=hint))

    for key in _unknown(doc, TOP_KEYS):
        bad(f"unsupported key {key!r}", hint=f"supported keys: {', '.join(sorted(TOP_KEYS))}")
    method = doc.get("merge_method")
    if not isinstance(method, str):
        bad("merge_method is missing or not a string")
    base = doc.get("base_model")
    models = doc.get("models")
    # mergekit's linear needs no base: the first model then serves as the plan's reference, and stays an agent.
    linear = method == "linear"
    if base is None and linear and isinstance(models, list) and models:
        first = models[0]
        base = first if isinstance(first, str) else (first or {}).get("model") if isinstance(first, dict) else None
    if not isinstance(base, str):
        bad("base_model is missing or not a string (a folder or a hub id)")
    if doc.get("tokenizer_source", "base") != "base":
        bad(f"tokenizer_source {doc['tokenizer_source']!r} is not supported",
            hint="rlmerge keeps the base's tokenizer: use tokenizer_source: base")
    agents: list[str] = []
    per_model: list[dict[str, Any]] = []
    if not isinstance(models, list) or not models:
        bad("models must be a non-empty list of {model: PATH}")
        models = []
    for i, m in enumerate(models):
        entry = {"model": m} if isinstance(m, str) else m
        if not isinstance(entry, dict) or not isinstance(entry.get("model"), str):
            bad(f"models[{i}] needs a 'model' path")
            continue
        for key in _unknown(entry, MODEL_KEYS):
            bad(f"models[{i}]: unsupported key {key!r}")
        mp = entry.get("parameters") or {}
        if not isinstance(mp, dict):
            bad(f"models[{i}].parameters must be a mapping")
            mp = {}
        if entry["model"] == base and not linear:
            continue  # mergekit recipes may list the base among the models; it is not an agent (but is in linear)
        agents.append(entry["model"])
        per_model.append(dict(mp))
    params = doc.get("parameters") or {}
    if not isinstance(params, dict):
        bad("parameters must be a mapping")
        params = {}
    if any("weight" in m for m in per_model) and "weights" in params:
        bad("weights given both per model and under parameters")
    method, params, problems_mk = translate(str(method), params, per_model)
    for msg in problems_mk:
        bad(msg)
    options = doc.get("options") or {}
    if not isinstance(options, dict):
        bad("options must be a mapping")
        options = {}
    for key in _unknown(options, OPTIONS):
        bad(f"unsupported option {key!r}", hint=f"supported options: {', '.join(sorted(OPTIONS))}")
    typed: dict[str, Any] = {}
    try:
        run = parse_params(RunOptions, {k: v for k, v in options.items() if k in OPTIONS}, where="recipe options")
        typed = {k: v for k, v in asdict(run).items() if v is not None}
    except RLMergeError as e:
        problems += e.problems if isinstance(e, ProblemsError) else [e]
    dtype = doc.get("out_dtype", doc.get("dtype"))  # mergekit computes in dtype and writes out_dtype
    raise_all(problems)
    return Recipe(str(method), str(base), agents, params, None if dtype is None else str(dtype), typed, raw=doc)
