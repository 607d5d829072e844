"""mergekit's recipe vocabulary → rlmerge's: method names, parameter names, defaults, per-model values, gradients.

A recipe means what it means in mergekit 0.1.5 (docs/methods.md, "Recipes"):

- ``merge_method`` a mergekit method name: mergekit's parameters with mergekit's defaults, every default that
  applies listed in ``Translation.defaults`` (printed, and written to rlmerge.json);
- a per-model parameter (``weight``, ``density``, ``gamma``, ``epsilon``) is one value per agent; the top-level
  one is the value of every model that does not give its own;
- a list of numbers is a gradient over the layers and a list of ``{filter, value}`` entries a set of filters
  (``schedule.py``), never one value per agent. rlmerge's own per-agent spelling is a different name: ``weights``
  (and ``fisher``) under ``parameters``, or ``--param density=0.1,0.2,0.3`` on the command line;
- what mergekit ignores (``weight`` in ``ram``, ``ramplus_tl``, ``model_stock``, ``slerp``) is ignored with a
  warning; what rlmerge cannot do (``slices``, ``passthrough``, the methods it lacks) is refused with the reason.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from .errors import ConfigError
from .schedule import Filters, PerTensor, Setting, parse_setting, varies

REQUIRED = "required"  # mergekit has no default: it refuses a recipe without the parameter


@dataclass(frozen=True)
class Param:
    """One parameter of a mergekit method: its name there, rlmerge's field, scope, and mergekit's default."""

    name: str
    ours: str | None  # None: no numerical effect in rlmerge (mergekit's int8_mask): accepted, ignored
    per_agent: bool  # per model in mergekit (a value per input), else one value for the merge
    default: Any  # mergekit's default, or REQUIRED
    fallback: Any = None  # rlmerge's value when mergekit has none (REQUIRED)


@dataclass(frozen=True)
class Method:
    ours: str  # rlmerge's method
    preset: Mapping[str, Any]  # parameters that select rlmerge's variant
    params: tuple[Param, ...]
    ignored: frozenset[str] = frozenset()  # parameters mergekit's method does not read: warned about, dropped


def _gta(ours: str, *, normalize: bool, rescale: bool, extra: tuple[Param, ...] = (), sparsify: bool = True
         ) -> Method:
    """mergekit's GeneralizedTaskArithmeticMerge presets (merge_methods/registry.py). Without sparsification
    (task_arithmetic) mergekit reads density and rescale but they change nothing."""
    return Method(ours, {}, (
        Param("int8_mask", None, False, False), Param("normalize", "normalize", False, normalize),
        Param("lambda", "scaling", False, 1.0), Param("weight", "weights", True, REQUIRED, 1.0),
        *((Param("rescale", "rescale", False, rescale), Param("density", "density", True, 1.0)) if sparsify else ()),
        *extra), frozenset() if sparsify else frozenset({"density", "rescale"}))


GAMMA = Param("gamma", "gamma", True, 0.01)
EPSILON = Param("epsilon", "epsilon", True, 0.15)
IGNORES_WEIGHT = frozenset({"weight"})
METHODS: dict[str, Method] = {
    "task_arithmetic": _gta("task_arithmetic", normalize=False, rescale=False, sparsify=False),
    "ties": _gta("ties", normalize=True, rescale=False),
    "dare_ties": _gta("dare_ties", normalize=False, rescale=True),
    "dare_linear": _gta("dare_ta", normalize=False, rescale=True),
    "breadcrumbs": _gta("breadcrumbs", normalize=False, rescale=False, extra=(GAMMA,)),
    "breadcrumbs_ties": _gta("breadcrumbs_ties", normalize=False, rescale=False, extra=(GAMMA,)),
    "della": _gta("della", normalize=True, rescale=True, extra=(EPSILON,)),
    "della_linear": _gta("della_linear", normalize=False, rescale=True, extra=(EPSILON,)),
    "linear": Method("linear", {}, (Param("weight", "weights", True, REQUIRED, 1.0),
                                    Param("normalize", "normalize", False, True))),
    "slerp": Method("slerp", {}, (Param("t", "t", False, REQUIRED, 0.5),), IGNORES_WEIGHT),
    "model_stock": Method("model_stock", {}, (Param("filter_wise", "filter_wise", False, False),), IGNORES_WEIGHT),
    "ram": Method("ram", {}, (Param("epsilon", "epsilon", False, 1e-5),), IGNORES_WEIGHT),
    "ramplus_tl": Method("ram+", {"preset": "tensor-local"}, (
        Param("r", "r", False, 0.1), Param("alpha", "alpha", False, 0.2), Param("epsilon", "epsilon", False, 1e-5)),
        IGNORES_WEIGHT),
}
RANDOM = ("dare_ta", "dare_ties", "della", "della_linear")  # rescale: true is the L1 rescale there

# mergekit methods rlmerge does not have, and why (docs/methods.md, "Not supported, and why").
NOT_SUPPORTED: dict[str, str] = {
    "passthrough": "passthrough copies or stacks layers of other models (frankenmerges); rlmerge merges fine-tunes "
                   "of one base, tensor by tensor",
    "nuslerp": "nuslerp (row-wise SLERP with weights) is not implemented; slerp is",
    "multislerp": "multislerp (barycentric SLERP of many models) is not implemented",
    "karcher": "karcher (an iterative Riemannian mean) is not implemented",
    "sce": "sce (variance-selected, matrix-level weights) is not implemented",
    "arcee_fusion": "arcee_fusion (KL-importance fusion of two models) is not implemented",
    "nearswap": "nearswap (interpolation by |θ_a − θ_b|) is not implemented",
}
# rlmerge's own names that are one value per agent by definition: a list there is per agent, not a gradient.
PER_AGENT_LISTS = frozenset({"weights", "fisher"})
PER_MODEL = ("weight", "density", "gamma", "epsilon")  # per-model parameters of rlmerge's own methods


@dataclass
class Translation:
    method: str
    params: dict[str, Any]
    defaults: list[str] = field(default_factory=list)  # every mergekit default applied, in words
    warnings: list[str] = field(default_factory=list)  # what mergekit ignores and rlmerge too
    problems: list[ConfigError] = field(default_factory=list)


def _setting(raw: Any, where: str, problems: list[ConfigError]) -> Setting | None:
    try:
        return parse_setting(raw, where)
    except ConfigError as e:
        problems.append(e)
        return None


def _chain(settings: Sequence[Setting | None]) -> tuple[Setting, ...]:
    """Settings in precedence order, up to the first that gives every tensor a value (all but filters do)."""
    out: list[Setting] = []
    for s in settings:
        if s is None:
            continue
        out.append(s)
        if not isinstance(s, Filters) or any(f.pattern in (None, "*") for f in s.filters):
            break
    return tuple(out)


def translate(method: str, top: Mapping[Any, Any], per_model: Sequence[Mapping[Any, Any]]) -> Translation:
    """rlmerge's method and parameters from a recipe's ``merge_method``, ``parameters`` and ``models[].parameters``
    (one mapping per agent, in agent order)."""
    mk = METHODS.get(method)
    out = Translation(mk.ours if mk else method, dict(mk.preset) if mk else {})
    problems = out.problems
    if "weight" in top and "weights" in top:
        problems.append(ConfigError("parameters give both weight (mergekit's) and weights (rlmerge's per-agent "
                                    "list)", hint="keep one"))
    if "weights" in top and any("weight" in m for m in per_model):
        problems.append(ConfigError("weights given both per model and under parameters", hint="keep one"))
    ignored = (mk.ignored if mk else frozenset()) | {"int8_mask"}  # int8_mask: a memory option, no effect
    for what in sorted(ignored - {"int8_mask"}):
        if what in top or any(what in m for m in per_model):
            out.warnings.append(f"{what!r} is ignored by {method} (mergekit ignores it too)")
    known = {p.name: p for p in mk.params} if mk else {}
    if mk:
        agent_keys = {p.name for p in mk.params if p.per_agent}
    else:  # rlmerge's own method: a per-model value makes a parameter per agent
        agent_keys = {k for k in PER_MODEL if any(k in m for m in per_model)}
    for key in sorted({k for m in per_model for k in m} - ignored, key=repr):
        if key not in agent_keys and not (mk is None and key in PER_MODEL):
            shared = " (mergekit reads it only under parameters)" if key in known else ""
            problems.append(ConfigError(f"per-model parameter {key!r} is not supported{shared}",
                                        hint="set it under parameters"))
    for key, raw in top.items():
        if key in ignored or key in agent_keys:
            continue
        _shared(out, key, raw, known.get(key))
    for key in sorted(agent_keys):
        _per_agent(out, method, key, known.get(key), top, per_model)
    if mk is not None:
        _shared_defaults(out, mk)
    _rescale(out, method)
    return out


def _shared(out: Translation, key: Any, raw: Any, param: Param | None) -> None:
    """A top-level parameter that is one value for the merge (a number, or a gradient / filters)."""
    name = param.ours if param is not None else str(key)
    if name is None:
        return
    if key in PER_AGENT_LISTS or (key == "rescale" and isinstance(raw, bool)):
        out.params[name] = tuple(raw) if isinstance(raw, list) else raw
        return
    s = _setting(raw, f"parameter {key!r}", out.problems)
    if s is None:
        return
    if not varies(s):
        out.params[name] = s
        return
    default = param.default if param is not None else None
    if param is not None and default == REQUIRED:
        default = param.fallback
    if _partial(s) and param is not None:
        out.defaults.append(f"{key} = {default} where no filter matches ({_why(param)})")
    out.params[name] = PerTensor(str(key), ((s,),), default, False)


def _partial(s: Setting) -> bool:
    """Filters with no catch-all entry: some tensors may get no value from them."""
    return isinstance(s, Filters) and not any(f.pattern in (None, "*") for f in s.filters)


def _why(param: Param) -> str:
    if param.default == REQUIRED:
        return f"mergekit requires {param.name} and refuses the recipe without it; rlmerge takes {param.fallback}"
    return "mergekit's default"


def _per_agent(out: Translation, method: str, key: str, param: Param | None, top: Mapping[Any, Any],
               per_model: Sequence[Mapping[Any, Any]]) -> None:
    """A per-model parameter: a model's own value, else the top level's, else mergekit's default."""
    problems = out.problems
    name = param.ours if param is not None else ("weights" if key == "weight" else key)
    given = key in top or any(key in m for m in per_model)
    if name is None or (not given and (name in out.params or (key == "density" and "p" in out.params))):
        return  # rlmerge's own spelling gave it (weights: [...], DARE's p)
    top_s = _setting(top[key], f"parameter {key!r}", problems) if key in top else None
    chains = [_chain([_setting(m[key], f"models[{i}].{key}", problems) if key in m else None, top_s])
              for i, m in enumerate(per_model)]
    missing = [i for i, c in enumerate(chains) if not c]
    falls = [i for i, c in enumerate(chains) if c and _partial(c[-1])]  # filters that may match nothing
    if param is None:  # rlmerge's own method: an unweighted model weighs 1; other values must be given
        default: Any = 1.0 if key == "weight" else None
        if missing and key != "weight":
            problems.append(ConfigError(f"models[{missing[0]}] has no {key!r} while other models do: give it to "
                                        "every model, or a default under parameters"))
    else:
        default = param.fallback if param.default == REQUIRED else param.default
        if missing or falls:
            who = [*(f"models[{i}]" for i in missing), *(f"models[{i}] where no filter matches" for i in falls)]
            every = "every model" if len(missing) == len(chains) else ", ".join(who)
            out.defaults.append(f"{key} = {default} for {every} ({_why(param)})")
    if any(varies(s) for c in chains for s in c):
        out.params[name] = PerTensor(key, tuple(chains), default, True)
    else:
        out.params[name] = tuple(c[0] if c else default for c in chains)


def _shared_defaults(out: Translation, mk: Method) -> None:
    """mergekit's defaults for the shared parameters the recipe does not give, noted."""
    for p in mk.params:
        if p.per_agent or p.ours is None or p.ours in out.params:
            continue
        value = p.fallback if p.default == REQUIRED else p.default
        out.defaults.append(f"{p.name} = {value} ({_why(p)})")
        out.params[p.ours] = value


def _rescale(out: Translation, method: str) -> None:
    """mergekit's ``rescale`` (a bool) → rlmerge's: the L1 rescale for the random presets."""
    params = out.params
    rescale = params.get("rescale")
    if isinstance(rescale, bool):
        if out.method in RANDOM:
            params["rescale"] = "l1" if rescale else "none"  # mergekit rescales to the L1 norm
        elif rescale:
            out.problems.append(ConfigError(f"rescale: true with {method} (an L1 rescale after magnitude pruning) "
                                            "is not supported", hint="drop rescale (mergekit's default is false)"))
        else:
            del params["rescale"]  # mergekit's default for the others: nothing to translate
