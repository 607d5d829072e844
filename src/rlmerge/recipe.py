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
    tokenizer_source: union          # mergekit's: base, union or a model (or tokenizer: {source: …})
    chat_template: base              # mergekit's: auto, a model, or the template's text; rlmerge: also a file
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

import yaml

from .errors import ConfigError, ProblemsError, RLMergeError, raise_all
from .mergekit_names import METHODS, NOT_SUPPORTED, translate
from .params import parse_params

TOP_KEYS = {"merge_method", "base_model", "models", "parameters", "dtype", "out_dtype", "options", "tokenizer_source",
            "tokenizer", "chat_template"}
MODEL_KEYS = {"model", "parameters"}
# mergekit keys rlmerge does not take, and why (docs/methods.md, "Not supported, and why")
MERGEKIT_ONLY = {
    "slices": "slices (layer ranges from several models, layer stacking) are not supported: rlmerge merges whole "
              "fine-tunes of one base, tensor by tensor; list them under models:",
    "modules": "modules (per-module recipes of multi-module models) are not supported; list the models under models:",
}
# mergekit's tokenizer: block; rlmerge takes its source (mergekit's default there: union)
TOKENIZER_KEYS = {"source": "union", "tokens": None, "pad_to_multiple_of": None}


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
    defaults: list[str] = field(default_factory=list)  # mergekit's defaults applied, in words (printed, provenance)
    warnings: list[str] = field(default_factory=list)  # what the recipe gives that is ignored, as mergekit does


def load_recipe(path: str | Path, *, methods: Collection[str] | None = None) -> Recipe:
    """The recipe at ``path`` (``methods``: rlmerge's method names, to name an unknown method first)."""
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
        doc = yaml.safe_load(text)
    except OSError as e:
        raise ConfigError(f"cannot read recipe: {e.strerror}", file=str(p)) from e
    except UnicodeDecodeError as e:
        raise ConfigError(f"recipe is not UTF-8 text: {e}", file=str(p)) from e
    except yaml.composer.ComposerError as e:
        if "expected a single document" in str(e):
            raise ConfigError(f"the recipe holds {_documents(text)} YAML documents (separated by ---); a recipe is "
                              "one document", file=str(p), hint="put each recipe in its own file") from e
        raise ConfigError(f"recipe is not valid YAML: {e}", file=str(p)) from e
    except (yaml.YAMLError, RecursionError) as e:
        raise ConfigError(f"recipe is not valid YAML: {e}", file=str(p)) from e
    return parse_recipe(doc, where=str(p), methods=methods)


def _documents(text: str) -> str:
    try:
        return str(sum(1 for _ in yaml.safe_load_all(text)))
    except (yaml.YAMLError, RecursionError):
        return "several"


def _unknown(mapping: dict[Any, Any], known: set[str]) -> list[Any]:
    """Keys not in ``known``, sorted by their text (YAML keys may be numbers, lists' reprs, None)."""
    return sorted((k for k in mapping if k not in known), key=repr)


def parse_recipe(doc: Any, *, where: str = "recipe", methods: Collection[str] | None = None) -> Recipe:
    """A recipe from its YAML document; every problem is collected and raised together, the cause first.

    ``methods``: rlmerge's method names; given, an unknown ``merge_method`` is reported before anything that
    depends on the method (a missing base_model)."""
    if not isinstance(doc, dict):
        raise ConfigError("recipe must be a mapping with merge_method, base_model and models", file=where)
    problems: list[RLMergeError] = []

    def bad(msg: str, hint: str | None = None) -> None:
        problems.append(ConfigError(msg, file=where, hint=hint))

    method = doc.get("merge_method")
    known = isinstance(method, str) and (method in METHODS or methods is None or method in methods)
    if not isinstance(method, str):
        bad("merge_method is missing or not a string")
    elif method in NOT_SUPPORTED:
        bad(f"mergekit method {method!r} is not supported: {NOT_SUPPORTED[method]}",
            hint="docs/methods.md lists what rlmerge merges (\"Not supported, and why\")")
    elif not known:
        bad(f"unknown method {method!r}", hint=f"choose one of: {', '.join(sorted({*(methods or ()), *METHODS}))}")
    for key in _unknown(doc, TOP_KEYS):
        if key in MERGEKIT_ONLY:
            bad(MERGEKIT_ONLY[key], hint="docs/methods.md, \"Not supported, and why\"")
        else:
            bad(f"unsupported key {key!r}", hint=f"supported keys: {', '.join(sorted(TOP_KEYS))}")
    base = doc.get("base_model")
    models = doc.get("models")
    # mergekit's linear needs no base: the first model then serves as the plan's reference, and stays an agent.
    linear = method == "linear"
    listed = [m if isinstance(m, str) else m.get("model") if isinstance(m, dict) else None
              for m in (models if isinstance(models, list) else [])]
    base_input = linear and isinstance(base, str) and base not in listed
    if base is None and linear and listed:
        base = listed[0]
    if not isinstance(base, str) and known and not (isinstance(method, str) and method in NOT_SUPPORTED):
        bad("base_model is missing or not a string (a folder or a hub id)")
    tokenizer = _tokenizer_keys(doc, base, bad)
    agents: list[str] = []
    per_model: list[dict[str, Any]] = []
    if (not isinstance(models, list) or not models) and "slices" not in doc and "modules" not in doc:
        bad("models must be a non-empty list of {model: PATH}")
    if not isinstance(models, list):
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
    if base_input:  # mergekit's linear adds a base_model it does not find among the models as one more input
        if "weight" not in params:
            bad("linear with a base_model that is not among the models: mergekit merges the base as one more "
                "model and needs its weight", hint="list the base among models with its weight, give a weight "
                "under parameters, or drop base_model")
        agents.append(str(base))
        per_model.append({})
    mergekit_method = str(method) in METHODS
    tr = translate(str(method), params, per_model)
    for e in tr.problems:
        bad(e.message, e.hint)
    method, params = tr.method, tr.params
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
    if dtype is None and mergekit_method:  # mergekit writes the models' own dtype, also where rlmerge would widen
        dtype = "base"
        tr.defaults.append("dtype = the base's (mergekit's default: it writes the models' own dtype)")
    raise_all(problems)
    typed.update(tokenizer)
    return Recipe(str(method), str(base), agents, params, None if dtype is None else str(dtype), typed, raw=doc,
                  defaults=tr.defaults, warnings=tr.warnings)


def _tokenizer_keys(doc: dict[Any, Any], base: Any, bad: Any) -> dict[str, str]:
    """mergekit's ``tokenizer_source`` (or ``tokenizer: {source: …}``) and ``chat_template``, as run options; the
    base's path means ``base``."""
    out: dict[str, str] = {}
    source = doc.get("tokenizer_source")
    block = doc.get("tokenizer")
    if block is not None:
        if not isinstance(block, dict):
            bad("tokenizer must be a mapping (mergekit's: {source: base | union | MODEL})")
            block = {}
        for key in _unknown(block, set(TOKENIZER_KEYS)):
            bad(f"tokenizer: unsupported key {key!r}", hint="rlmerge takes tokenizer: {source: …}")
        for key in ("tokens", "pad_to_multiple_of"):
            if block.get(key) is not None:
                bad(f"tokenizer.{key} is not supported: rlmerge builds the vocabulary from the models' tokenizers "
                    "and keeps the base's row count", hint="drop it; docs/shipping.md says what union does")
        if source is not None:
            bad("give tokenizer_source or tokenizer: {source: …}, not both")
        source = block.get("source", TOKENIZER_KEYS["source"])
    for key, value in (("tokenizer_source", source), ("chat_template", doc.get("chat_template"))):
        if value is None:
            continue
        if not isinstance(value, str):
            bad(f"{key} must be a string (base, union, auto, a model as listed, …), not {value!r}"[:200])
            continue
        out[key] = "base" if value == base else value
    return out
