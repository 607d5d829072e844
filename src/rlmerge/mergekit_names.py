"""mergekit's recipe vocabulary → rlmerge's: method names, parameter names, per-model values → per-agent tuples.

A mergekit user switches by changing the command: ``merge_method``, ``models[].parameters`` and ``parameters``
mean what they mean in mergekit 0.1.5 (with rlmerge's defaults where a value is not given; see
docs/methods.md). Anything without a faithful translation (per-layer gradients, filters, unknown keys) is
reported, never dropped.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

# mergekit method name → (rlmerge method, parameters that select the variant)
METHODS: dict[str, tuple[str, dict[str, Any]]] = {
    "ramplus_tl": ("ram+", {"preset": "tensor-local"}),
    "dare_linear": ("dare_ta", {}),
}
# mergekit parameter name → rlmerge's (same name when absent)
PARAMS = {"lambda": "scaling", "weight": "weights"}
PER_MODEL = {"weight", "density", "gamma", "epsilon"}  # per-model in mergekit → per-agent tuples here
NO_OP = {"int8_mask"}  # mergekit memory options with no numerical effect: accepted, ignored
RANDOM_RESCALE = ("dare_ta", "dare_ties", "della", "della_linear")


def translate(method: str, top: Mapping[str, Any], per_model: Sequence[Mapping[str, Any]],
              ) -> tuple[str, dict[str, Any], list[str]]:
    """(rlmerge method, parameters, problems) from a mergekit method, its top-level and per-model parameters."""
    problems: list[str] = []
    name, params = METHODS.get(method, (method, {}))
    params = dict(params)
    for key, value in top.items():
        if isinstance(value, (list, dict)) and key not in ("weights", "fisher", "density", "gamma", "epsilon"):
            problems.append(f"parameter {key!r}: per-layer gradients and filters are not supported; give one number")
            continue
        if key in NO_OP:
            continue
        params[PARAMS.get(key, key)] = value
    keys = sorted({k for m in per_model for k in m}, key=repr)  # YAML keys may be numbers or null
    for key in keys:
        if key in NO_OP:
            continue
        if key not in PER_MODEL:
            problems.append(f"per-model parameter {key!r} is not supported; set it under parameters")
            continue
        values = []
        for i, m in enumerate(per_model):
            v = m.get(key, top.get(key, 1.0 if key == "weight" else None))  # an unweighted model weighs 1
            if v is None:
                problems.append(f"models[{i}] has no {key!r} while other models do: give it to every model, or "
                                "a default under parameters")
            elif isinstance(v, (list, dict)):
                problems.append(f"models[{i}].{key}: per-layer gradients and filters are not supported")
            values.append(v)
        params[PARAMS.get(key, key)] = tuple(values)
    if "rescale" in params and isinstance(params["rescale"], bool):
        if name in RANDOM_RESCALE:
            params["rescale"] = "l1" if params["rescale"] else "none"  # mergekit rescales to the L1 norm
        elif params["rescale"] is False:
            del params["rescale"]  # mergekit's default for the others: nothing to translate
    return name, params, problems
