"""The recipe that reproduces a merge, checked before it is written into the model card.

A card's recipe must give the same merge when run again (``rlmerge merge --recipe``). A recipe's YAML is read with
mergekit's meaning (recipe.py), and mergekit's names and defaults differ from rlmerge's for some methods, so
candidates are tried in order and the first one that parses back to exactly what ran (the method, its parameter
dataclass, the per-tensor schedule, the output dtype and every run option that changes the bytes) is kept:

1. the recipe the merge was run from (``--recipe``), with any flag that overrode it;
2. a mergekit-style YAML in rlmerge's terms: the method's parameters as they were given, typed;
3. the same with every parameter of the method; then both under an alias of the method that mergekit does not
   use (``ta``), which a recipe reads with rlmerge's meaning.

When none parses back (a rare parameter that only the command line spells), the command line is given instead.
"""

from __future__ import annotations

import dataclasses
import shlex
from collections.abc import Mapping, Sequence
from typing import Any

import yaml

from ..errors import RLMergeError
from ..io.writer import DEFAULT_SHARD_SIZE, parse_size
from ..mergekit_names import METHODS as MERGEKIT
from ..methods import ALIASES, get_method
from ..recipe import parse_recipe
from ..report.card import Reproduce
from .preflight import Preflight, parse_dtype


def _plain(value: Any) -> Any:
    """A parameter value as YAML writes it (tuples as lists)."""
    if isinstance(value, tuple):
        return [_plain(v) for v in value]
    return value


def _run_keys(settings: Mapping[str, Any], pf: Preflight) -> tuple[dict[str, Any], dict[str, Any]]:
    """(top-level keys, options) every candidate carries: the output dtype, tokenizer choices, run options."""
    top: dict[str, Any] = {}
    if settings.get("dtype") is not None:
        top["out_dtype"] = str(settings["dtype"])
    for key in ("tokenizer_source", "chat_template"):
        if settings.get(key) is not None:
            top[key] = settings[key]
    options: dict[str, Any] = {}
    if settings.get("seed"):
        options["seed"] = settings["seed"]
    if pf.shard_bytes and pf.shard_bytes != DEFAULT_SHARD_SIZE:
        options["shard_size"] = f"{pf.shard_bytes}B"
    for key in ("allow_missing", "count_tied_twice"):
        if settings.get(key):
            options[key] = True
    return top, options


def _same(doc: Mapping[str, Any], pf: Preflight, settings: Mapping[str, Any]) -> bool:
    """Whether ``doc`` parses back to the merge that ran."""
    try:
        rec = parse_recipe(dict(doc))
        spec = get_method(rec.method)
        parsed = spec.parse_scheduled(rec.parameters)
        dtype = parse_dtype(rec.dtype)
    except (RLMergeError, TypeError, ValueError):
        return False
    assert pf.spec is not None and pf.parsed is not None  # a merge that ran passed its preflight
    opts = rec.options
    return (spec.name == pf.spec.name and parsed.params == pf.parsed.params
            and dict(parsed.schedule) == dict(pf.parsed.schedule) and dtype == parse_dtype(settings.get("dtype"))
            and opts.get("seed", 0) == (settings.get("seed") or 0)
            and bool(opts.get("allow_missing")) == bool(settings.get("allow_missing"))
            and bool(opts.get("count_tied_twice")) == bool(settings.get("count_tied_twice"))
            and opts.get("tokenizer_source") == settings.get("tokenizer_source")
            and opts.get("chat_template") == settings.get("chat_template")
            and parse_size(opts.get("shard_size", DEFAULT_SHARD_SIZE)) == (pf.shard_bytes or DEFAULT_SHARD_SIZE))


def reproduce(pf: Preflight, base: Any, agents: Sequence[Any], *, given: Mapping[str, Any] | None,
              recipe: Mapping[str, Any] | None, **settings: Any) -> Reproduce:
    """The first candidate (module docstring) that reproduces the merge ``pf`` checked; ``settings``: the merge's
    dtype, seed, allow_missing, count_tied_twice, tokenizer_source and chat_template as it was called."""
    assert pf.spec is not None and pf.params is not None
    base, agents, given = str(base), [str(a) for a in agents], dict(given or {})
    if settings.get("output_format") not in (None, "hf"):  # a recipe has no key for it: the command says it
        return Reproduce("command", _command(pf, base, agents, given, settings))
    top, options = _run_keys(settings, pf)
    candidates: list[dict[str, Any]] = []
    if recipe is not None and "sweep" not in recipe:
        merged_options = {**(recipe.get("options") or {}), **options}
        candidates.append({**recipe, **top, **({"options": merged_options} if merged_options else {})})
    fields = {f.name for f in dataclasses.fields(pf.params)} if dataclasses.is_dataclass(pf.params) else set()
    typed = {k: _plain(getattr(pf.params, k)) for k in given if k in fields}
    every = {k: _plain(v) for k, v in dataclasses.asdict(pf.params).items() if v is not None} if fields else {}
    names = [pf.spec.name, *(a for a, m in ALIASES.items() if m == pf.spec.name and a not in MERGEKIT)]
    for name, params in ((n, p) for n in names for p in (typed, every)):
        candidates.append({"merge_method": name, "base_model": base,
                           "models": [{"model": a} for a in agents],
                           **({"parameters": params} if params else {}), **top,
                           **({"options": options} if options else {})})
    for doc in candidates:
        if _same(doc, pf, settings):
            return Reproduce("recipe", yaml.safe_dump(doc, sort_keys=False, allow_unicode=True))
    return Reproduce("command", _command(pf, base, agents, given, settings))


def _command(pf: Preflight, base: str, agents: Sequence[str], given: Mapping[str, Any],
             settings: Mapping[str, Any]) -> str:
    assert pf.spec is not None
    words = ["rlmerge", "merge", base, *agents, "--method", pf.spec.name]
    for k, v in given.items():
        value = ",".join(map(str, v)) if isinstance(v, (list, tuple)) else v
        words += ["--param", f"{k}={value}"]
    for key in ("dtype", "seed", "tokenizer_source", "chat_template", "output_format", "rank", "non_linear"):
        if settings.get(key) not in (None, 0):  # seed 0 is the default
            words += [f"--{key.replace('_', '-')}", str(settings[key])]
    for key in ("allow_missing", "count_tied_twice"):
        if settings.get(key):
            words.append(f"--{key.replace('_', '-')}")
    if pf.shard_bytes != DEFAULT_SHARD_SIZE:
        words += ["--shard-size", f"{pf.shard_bytes}B"]
    return shlex.join(words) + " -o OUT"  # quoted: a path with a space, a template's text run again as they were
