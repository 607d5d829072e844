"""What a sweep tries: candidates from grids ("ram+ r=0.05,0.1 alpha=1,2") or a YAML recipe, checked all at once.

A candidate is a method, its parameters and, for a method that draws random masks (DARE, DELLA), its seed: two
seeds are two candidates. Its ``id`` is a hash of the method and the *parsed* parameters (so ``r=0.1`` and
``r=0.10`` are one candidate, and a preset's defaults spelled out change nothing), which is what ``--resume``
matches finished candidates by.

Grid syntax: ``METHOD KEY=V1,V2 KEY=V3 …``; every combination of the values is a candidate. A per-agent value is
one value in brackets: ``weights=[1,0.5,0.5],[2,1,1]`` is two candidates. ``seed=0,1`` is a grid too.

    >>> [c.label for c in parse_grid("ties density=0.1,0.3 scaling=1")]
    ['ties density=0.1 scaling=1', 'ties density=0.3 scaling=1']
"""

from __future__ import annotations

import hashlib
import itertools
import shlex
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, Literal

import yaml

from ..errors import ConfigError, ProblemsError, RLMergeError, raise_all
from ..methods import MethodSpec, get_method
from ..params import coerce, parse_params


@dataclass(frozen=True)
class Candidate:
    """One merge to try: ``method`` (the registry's name), its parameters as given, and its seed."""

    method: str
    params: tuple[tuple[str, Any], ...] = ()  # (name, loose value) in the order given
    seed: int = 0

    @property
    def spec(self) -> MethodSpec:
        return get_method(self.method)

    def parsed(self) -> Any:
        """The method's parameter dataclass (raises ConfigError on a bad value)."""
        return self.spec.parse(dict(self.params))

    @property
    def random(self) -> bool:
        return self.spec.seeded  # drawn masks: the seed is part of a candidate

    @property
    def label(self) -> str:
        """How tables name it: the method and the values given (and the seed of a random method)."""
        parts = [self.spec.name, *(f"{k}={_text(v)}" for k, v in self.params)]
        return " ".join(parts + ([f"seed={self.seed}"] if self.random else []))

    @property
    def id(self) -> str:
        """12 hex digits of SHA-256 over the method, the parsed parameters and (random methods) the seed."""
        key = repr((self.spec.name, repr(self.parsed()), self.seed if self.random else None))
        return hashlib.sha256(key.encode()).hexdigest()[:12]

    def to_json(self) -> dict[str, Any]:
        return {"id": self.id, "label": self.label, "method": self.spec.name,
                "params": {k: _plain(v) for k, v in self.params}, "seed": self.seed if self.random else None}


def _text(v: Any) -> str:
    if isinstance(v, (list, tuple)):
        return "[" + ",".join(_text(x) for x in v) + "]"
    return str(v)


def _plain(v: Any) -> Any:
    return [_plain(x) for x in v] if isinstance(v, (list, tuple)) else v


def _split(values: str) -> list[str]:
    """Split at the commas outside brackets: "1,2" → ["1", "2"]; "[1,2],[3,4]" → ["[1,2]", "[3,4]"]."""
    out, depth, cur = [], 0, ""
    for ch in values:
        depth += ch == "["
        depth -= ch == "]"
        if ch == "," and depth == 0:
            out.append(cur)
            cur = ""
        else:
            cur += ch
    return [*out, cur]


def _value(text: str) -> Any:
    """A grid value: "[1,0.5]" → ["1", "0.5"] (one per-agent value); else the text itself (the method's
    parameter types read it)."""
    text = text.strip()
    return [x.strip() for x in text[1:-1].split(",")] if text.startswith("[") and text.endswith("]") else text


def parse_grid(text: str, *, seed: int = 0) -> list[Candidate]:
    """Candidates of one grid string (see the module docstring); ``seed``: the default seed."""
    try:
        tokens = shlex.split(text)
    except ValueError as e:
        raise ConfigError(f"--candidate {text!r}: {e}") from e
    if not tokens:
        raise ConfigError("an empty --candidate", hint='write e.g. --candidate "ram+ r=0.05,0.1"')
    axes: dict[str, list[Any]] = {}
    for tok in tokens[1:]:
        key, sep, values = tok.partition("=")
        if not sep or not key or not values:
            raise ConfigError(f"--candidate {text!r}: {tok!r} is not KEY=V1,V2,…",
                              hint='e.g. --candidate "ties density=0.1,0.3 scaling=0.7,1.0"')
        axes[key.strip()] = [_value(v) for v in _split(values)]
    return expand(tokens[0], axes, seed=seed, where=f"--candidate {text!r}")


def parse_all(texts: Sequence[Any], *, seed: int = 0, where: str = "--candidate") -> list[Candidate]:
    """The candidates of several grids (strings, or a recipe's mappings), every problem at once."""
    out: list[Candidate] = []
    problems: list[RLMergeError] = []
    for i, entry in enumerate(texts):
        try:
            out += from_yaml(entry, seed=seed, where=f"{where}[{i}]")
        except RLMergeError as e:
            problems.append(e)
    try:
        if out or not problems:  # "no candidates" is news only when no grid was refused
            out = check(out)
    except RLMergeError as e:
        problems += e.problems if isinstance(e, ProblemsError) else [e]
    raise_all(problems)
    return out


def expand(method: str, axes: Mapping[str, Sequence[Any]], *, seed: int = 0, where: str) -> list[Candidate]:
    """Every combination of ``axes`` (parameter → values; ``seed`` → seeds) for ``method``."""
    spec = get_method(method)
    axes = dict(axes)
    ranges = [f"{k}={v}" for k, vs in axes.items() for v in vs if isinstance(v, str) and ".." in v]
    if ranges:
        raise ConfigError(f"{where}: {', '.join(ranges)}: a range is searched, not listed in a grid",
                          hint="add --search tpe (or random, cmaes) and --trials N, or list the values: KEY=V1,V2")
    seeds = axes.pop("seed", [seed])
    keys = list(axes)
    out = []
    for combo in itertools.product(*(axes[k] for k in keys)):
        for s in seeds:
            try:
                s = coerce(s, int)  # the recipe parser's int: "2" is 2, 1.5 and true are errors
            except (TypeError, ValueError):
                raise ConfigError(f"{where}: seed {s!r} is not a whole number") from None
            out.append(Candidate(spec.name, tuple(zip(keys, combo)), s))
    if len(seeds) > 1 and not out[0].random:
        raise ConfigError(f"{where}: {spec.name} draws nothing at random, so its seed changes nothing",
                          hint="give seeds only to dare_ta, dare_ties, della, della_linear")
    return out


def from_yaml(entry: Any, *, seed: int = 0, where: str) -> list[Candidate]:
    """A recipe's candidate: a grid string, or {method: NAME, parameters: {KEY: [values] or value}, seed: …}."""
    if isinstance(entry, str):
        return parse_grid(entry, seed=seed)
    if not isinstance(entry, dict) or "method" not in entry:
        raise ConfigError(f"{where}: a candidate is a grid string or a mapping with method and parameters")
    unknown = sorted(set(entry) - {"method", "parameters", "seed"}, key=str)
    if unknown:
        raise ConfigError(f"{where}: unknown key(s) {', '.join(map(str, unknown))} in a candidate",
                          hint="a candidate has method, parameters and seed")
    params = entry.get("parameters") or {}
    if not isinstance(params, dict):
        raise ConfigError(f"{where}: parameters must be a mapping")
    axes = {str(k): (v if isinstance(v, list) else [v]) for k, v in params.items()}
    if "seed" in entry:
        axes["seed"] = entry["seed"] if isinstance(entry["seed"], list) else [entry["seed"]]
    return expand(str(entry["method"]), axes, seed=seed, where=where)


def check(candidates: Sequence[Candidate]) -> list[Candidate]:
    """The candidates, each once (first occurrence), after parsing every one's parameters: every problem at once."""
    problems: list[RLMergeError] = []
    seen: dict[str, Candidate] = {}
    for c in candidates:
        try:
            key = c.id
        except RLMergeError as e:
            problems.append(ConfigError(f"candidate {c.label!r}: {e.render()}"))
            continue
        seen.setdefault(key, c)
    raise_all(problems)
    if not seen:
        raise ConfigError("no candidates to sweep", hint='give --candidate "METHOD KEY=V1,V2", or candidates: in YAML')
    return list(seen.values())


@dataclass(frozen=True)
class SweepSettings:
    """A sweep recipe's settings, typed like the command line's flags by the parser the merge recipe's ``options:``
    use (``params.parse_params``): a quoted "false" is false, ``keep: "1"`` is 1, ``seed: abc`` and ``keep: 1.5``
    are errors, all reported together."""

    tasks: tuple[str, ...] | None = None  # each item one --tasks value (the scorers split it: a cmd: keeps its commas)
    limit: int | None = None
    keep: int | None = None
    backend: Literal["local", "ray"] | None = None
    workers: int | None = None
    memory: Literal["auto", "always", "never"] | None = None
    split: Literal["val", "test"] | None = None
    lab_view: Literal["word", "chat"] | None = None
    dtype: str | None = None
    seed: int | None = None
    block_size: int | None = None
    device: str | None = None
    allow_missing: bool | None = None
    count_tied_twice: bool | None = None
    include_path: tuple[str, ...] | None = None
    num_fewshot: int | None = None
    batch_size: int | None = None
    lm_eval_backend: Literal["hf", "vllm"] | None = None
    cmd_timeout: float | None = None
    cmd_env: tuple[str, ...] | None = None  # KEY=VALUE each (a recipe's mapping is turned into these)
    cmd_cwd: str | None = None
    search: Literal["grid", "random", "tpe", "cmaes"] | None = None
    trials: int | None = None
    confirm: Literal["val", "test"] | None = None
    references: bool | None = None  # score the base and each agent as they are, beside the candidates

    def __post_init__(self) -> None:
        least = {"limit": 1, "keep": 0, "workers": 1, "block_size": 1, "num_fewshot": 0, "batch_size": 1,
                 "cmd_timeout": 0, "trials": 1}
        raise_all([ConfigError(f"{k} = {getattr(self, k)} must be ≥ {lo}") for k, lo in least.items()
                   if getattr(self, k) is not None and getattr(self, k) < lo])


@dataclass
class SweepRecipe:
    """A sweep from YAML: models, candidates, scorer settings and options (the CLI's flags override them)."""

    base: str
    agents: list[str]
    candidates: list[Any]  # a grid's Candidates; a search's spaces as written (strings or mappings), checked
    settings: dict[str, Any]  # tasks, limit, keep, backend, … as the CLI names them, typed (SweepSettings)


SETTINGS = {f.name for f in fields(SweepSettings)}


def load_sweep_recipe(path: str | Path, *, search: str | None = None) -> SweepRecipe:
    """``base_model``, ``models`` (mergekit's layout), ``candidates`` and any of ``SETTINGS``. ``search`` (the
    command line's, else the recipe's, else grid) says whether the candidates are grids or a search's spaces."""
    p = Path(path)
    try:
        doc = yaml.safe_load(p.read_text(encoding="utf-8"))
    except OSError as e:
        raise ConfigError(f"cannot read the sweep recipe: {e.strerror}", file=str(p)) from e
    except (yaml.YAMLError, UnicodeDecodeError, RecursionError) as e:
        raise ConfigError(f"the sweep recipe is not valid YAML: {e}", file=str(p)) from e
    if not isinstance(doc, dict):
        raise ConfigError("a sweep recipe is a mapping with base_model, models and candidates", file=str(p))
    problems: list[RLMergeError] = []
    unknown = sorted(set(doc) - SETTINGS - {"base_model", "models", "candidates"}, key=str)
    if unknown:
        problems.append(ConfigError(f"unknown key(s): {', '.join(map(str, unknown))}", file=str(p),
                                    hint="known: base_model, models, candidates, " + ", ".join(sorted(SETTINGS))))
    models = doc.get("models") or []
    agents = [m.get("model") if isinstance(m, dict) else m for m in models] if isinstance(models, list) else []
    if not isinstance(doc.get("base_model"), str) or not agents or not all(isinstance(a, str) for a in agents):
        problems.append(ConfigError("base_model and models (a list of paths, or of {model: path}) are needed",
                                    file=str(p)))
    given = {k: doc[k] for k in SETTINGS if k in doc}
    for key in ("include_path", "tasks", "cmd_env"):  # one value (a path, a command, an env value may hold a comma)
        if isinstance(given.get(key), str):
            given[key] = [given[key]]
    if isinstance(given.get("cmd_env"), dict):
        given["cmd_env"] = [f"{k}={v}" for k, v in given["cmd_env"].items()]
    settings: dict[str, Any] = {}
    for key, value in given.items():  # one at a time: a range check is reported beside another key's type error
        try:
            settings[key] = getattr(parse_params(SweepSettings, {key: value}, where=f"the sweep recipe {p}"), key)
        except RLMergeError as e:
            for q in e.problems if isinstance(e, ProblemsError) else [e]:
                q.file = q.file or str(p)
                problems.append(q)
    settings = {k: v for k, v in settings.items() if v is not None}
    entries = doc.get("candidates") or []
    entries = entries if isinstance(entries, list) else [entries]
    cands: list[Any] = []
    try:
        if (search or settings.get("search", "grid")) == "grid":
            cands = parse_all(entries, seed=settings.get("seed", 0), where=f"{p}: candidates")
        else:
            cands = list(entries)  # a search's spaces: checked by space.parse_spaces (the CLI, then the sweep)
    except RLMergeError as e:
        problems += e.problems if isinstance(e, ProblemsError) else [e]
    raise_all(problems)
    return SweepRecipe(str(doc["base_model"]), [str(a) for a in agents], cands, settings)
