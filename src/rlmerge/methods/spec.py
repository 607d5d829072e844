"""What a merge method is: a ``MethodSpec``, and the checks every method's parameters go through.

A method is a ``MethodSpec``: a frozen parameter dataclass, whether it needs the statistics pass,
a ``prepare`` step that turns whole-model statistics into constants (RAM+'s λ, a global threshold),
and ``merge``, a pure function of (base block [n], float32 deltas [N, n], parameters, context)
returning the merged float32 weights [n]. No IO, no global state, no mutation of inputs.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from .._torch import torch
from ..errors import ConfigError, RLMergeError
from ..params import parse_params
from ..schedule import PerTensor, evaluate
from ..stats import Statistics, TensorStats
from .rule import Program, Rule, program, torch_eval

Scope = Literal["elementwise", "global", "tensor-local"]


@dataclass(frozen=True)
class BlockContext:
    """Where a block sits, and what the statistics pass learned about its tensor."""

    name: str  # tensor name
    start: int  # flat element range [start, stop) of the tensor
    stop: int
    shape: tuple[int, ...]
    present: tuple[bool, ...]  # per agent; a missing agent's deltas are zero
    prepared: Any  # what the method's prepare() returned
    tensor_stats: TensorStats | None  # None when the method ran without a statistics pass
    seed: int = 0
    extra: torch.Tensor | None = None  # [N, n] float32 side inputs of the block (e.g. Fisher), if any
    params: Any = None  # the tensor's own parameters when they vary per tensor (a recipe's gradient), else None


Constants = Mapping[str, Any]  # name → a number, or one number per agent (what a rule reads as t.const / t.agent)


@dataclass(frozen=True)
class MethodSpec:
    """One merge method, declared once: every backend reads this declaration, none compares its name.

    An elementwise method gives ``rule`` (methods/rule.py) and ``constants``, the per-tensor numbers the rule reads,
    from the parameters, what ``prepare`` made of the whole-model statistics, the tensor's statistics, N and the
    tensor's name. The
    torch reference and the numba kernels both run that one rule. A method the rule language cannot say (slerp,
    fisher, model_stock per row, the sparsify family's pruning) gives ``merge``, a torch block function.
    """

    name: str
    summary: str
    paper: str  # arXiv id or citation
    scope: Scope
    params: type  # frozen dataclass; field defaults are the paper's
    merge: Callable[[torch.Tensor, torch.Tensor, Any, BlockContext], torch.Tensor] | None = None
    rule: Rule | None = None
    constants: Callable[[Any, Any, TensorStats | None, int, str], Constants] | None = None
    elementwise: Callable[[Any], bool] = lambda p: True  # whether ``rule`` covers these parameters
    needs_stats: Callable[[Any], bool] = lambda p: False
    prepare: Callable[[Any, Statistics | None, int], Any] = lambda p, s, n: None
    epsilon: Callable[[Any], float] = lambda p: getattr(p, "epsilon", 1e-5)
    exact_gram: bool = False  # the Gram matrix feeds the merge (model_stock): float64 products on every path
    # Optional: an object fed every block of the statistics pass (``observe(ctx, base, deltas)``); after each
    # tensor and after the whole model, ``again(name | None)`` may ask for that range to be streamed once more
    # (exact order statistics need a second look). prepare() finds it as ``stats.observed``. ``observer(p, n, at)``:
    # ``at`` (or None) gives each tensor's parameters where they vary per tensor.
    observer: Callable[..., Any] = lambda p, n, at=None: None
    row_blocks: Callable[[Any], bool] = lambda p: False  # blocks hold whole rows (shape[1:]) of each tensor
    # Per-agent side inputs (folders shaped like the agents, e.g. Fisher diagonals), read blockwise as ``extra``.
    extra_inputs: Callable[[Any], tuple[str, ...] | None] = lambda p: None
    # What the parameters ask of the number of agents N beyond per-agent lengths (``validate``); raises ConfigError.
    check: Callable[[Any, int], None] = lambda p, n: None
    sparsify: Any = None  # the sparsify family's preset (methods/gta.Preset): pruning, sign election, mean
    # The parameters that may take a value per tensor (mergekit's gradients and filters, schedule.py): numbers the
    # method reads per tensor (its constants, its observer's thresholds), never one that shapes the route.
    per_tensor: Callable[[Any], Collection[str]] = lambda p: ()
    # It merges task vectors τ = θ_t − θ₀, so an agent equal to the base adds nothing (and is warned about); False
    # for a method that averages the models themselves (linear), where such an agent counts like any other.
    task_vectors: bool = True
    # Written in float32 where the base stores a narrower float, unless a dtype is asked for: what the method adds
    # to RAM is about one bf16 step and would round away (docs/methods.md, "Rounding").
    float32_output: bool = False
    # The per-agent constant a unique element's τ is multiplied by (RAM+'s ``lam``): the merge counts how many
    # unique elements keep that rescale in the output dtype (engine/survival.py).
    unique_scale: str | None = None

    def parse(self, values: Mapping[str, Any] | None) -> Any:
        """Build the parameter dataclass from loose values (CLI, YAML); all problems at once."""
        parsed = self.parse_scheduled(values)
        if parsed.schedule:
            raise ConfigError(f"method {self.name!r}: {', '.join(parsed.schedule)} vary per tensor here; "
                              "the caller must bind them to the tensors (Parsed.bind)")
        return parsed.params

    def parse_scheduled(self, values: Mapping[str, Any] | None) -> Parsed:
        """``parse``, where a value may be a ``schedule.PerTensor`` (a recipe's gradient or filters): the
        parameters every tensor shares, and the schedule ``Parsed.bind`` resolves per tensor."""
        values = dict(values or {})
        schedule = {k: v for k, v in values.items() if isinstance(v, PerTensor)}
        where = f"method {self.name!r}"
        plain = {k: v for k, v in values.items() if k not in schedule}
        params = parse_params(self.params, {**plain, **{k: _sample(v) for k, v in schedule.items()}}, where=where)
        fixed = sorted(set(schedule) - set(self.per_tensor(params)))
        if fixed:
            raise ConfigError(f"{where}: {', '.join(map(repr, fixed))} must be one value for the whole model "
                              "(rlmerge does not take a gradient or filters for it)",
                              hint="give one value; parameters that may vary per tensor here: "
                                   + (", ".join(self.per_tensor(params)) or "none"))
        return Parsed(self, params, plain, schedule)

    def program(self, p: Any, n: int) -> Program | None:
        """The traced elementwise rule for these parameters and N agents, or None (no rule covers them)."""
        if self.rule is None or not self.elementwise(p):
            return None
        return program(self.rule, p, n)

    def values(self, p: Any, prepared: Any, ts: TensorStats | None, n: int, name: str) -> Constants:
        """The rule's constants for tensor ``name``."""
        assert self.constants is not None  # a declaration with a rule gives its constants
        return self.constants(p, prepared, ts, n, name)

    def merge_block(self, base: torch.Tensor, deltas: torch.Tensor, p: Any, ctx: BlockContext) -> torch.Tensor:
        """The torch reference: base [n], deltas [N, n] float32 → merged weights [n] float32."""
        prog = self.program(p, deltas.shape[0])
        if prog is not None:
            return torch_eval(prog, base, deltas, self.values(p, ctx.prepared, ctx.tensor_stats, deltas.shape[0],
                                                              ctx.name))
        assert self.merge is not None, f"method {self.name!r} declares neither a rule nor a merge"
        return self.merge(base, deltas, p, ctx)


def _sample(p: PerTensor) -> Any:
    """A value the schedule takes somewhere (the first number it holds), for the checks that do not depend on it."""
    def first(chain: tuple[Any, ...]) -> Any:
        for s in chain:
            v = evaluate(s, "", 0.0)
            if v is not None:
                return v
            for f in getattr(s, "filters", ()):
                return evaluate(f.value, "", 0.0)
        return p.default
    values = tuple(first(c) for c in p.chains)
    return values if p.per_agent else values[0]


@dataclass(frozen=True)
class Parsed:
    """A method's parameters: ``params``, which every tensor shares (the route, the rule's shape and the report read
    these), and a ``schedule`` of the ones a recipe gave per tensor (empty for almost every merge)."""

    spec: MethodSpec
    params: Any
    plain: Mapping[str, Any] = field(default_factory=dict)
    schedule: Mapping[str, PerTensor] = field(default_factory=dict)

    def bind(self, positions: Mapping[str, float], n: int) -> tuple[Callable[[str], Any] | None, list[RLMergeError]]:
        """(tensor name → its parameters, problems): the schedule resolved for every tensor of ``positions``
        (name → t, schedule.layer_positions), each tensor's parameters checked as ``params`` are. None without a
        schedule: every tensor has ``params`` (and a sweep's statistics cache, keyed by one parameter set, applies)."""
        if not self.schedule:
            return None, []
        where = f"method {self.spec.name!r}"
        by_values: dict[tuple[Any, ...], Any] = {}
        by_tensor: dict[str, Any] = {}
        problems: dict[str, tuple[RLMergeError, int]] = {}  # one entry per distinct message: its first tensor
        for name, t in positions.items():
            values = {k: s.at(name, t) for k, s in self.schedule.items()}
            key = tuple(values.items())
            if key not in by_values:
                try:
                    p = parse_params(self.spec.params, {**self.plain, **values}, where=where)
                    errors = validate(self.spec, p, n)
                except RLMergeError as e:
                    p, errors = None, list(getattr(e, "problems", [e]))
                for e in errors:
                    seen = problems.get(e.message)
                    problems[e.message] = (seen[0], seen[1] + 1) if seen else (ConfigError(
                        f"{e.message} (from the recipe's per-tensor values: {', '.join(self.schedule)})",
                        tensor=name, hint=e.hint), 1)
                by_values[key] = p
            by_tensor[name] = by_values[key]
        out = [e for e, _ in problems.values()]
        return (lambda name: by_tensor.get(name) or self.params), out


def validate(spec: MethodSpec, params: Any, n: int) -> list[RLMergeError]:
    """Everything about ``params`` that depends on the number of agents ``n``, before any file is read.

    Every tuple-valued parameter holds one value per agent (weights, per-agent densities, Fisher folders), so
    its length must be ``n``; then the method's own ``check``. ``merge`` and ``plan`` both call this.
    """
    for f in dataclasses.fields(params):
        value = getattr(params, f.name)
        if isinstance(value, tuple) and len(value) != n:
            what = "weight(s)" if f.name == "weights" else f"value(s) of {f.name}"
            return [ConfigError(f"method {spec.name!r}: {len(value)} {what} given for {n} agent(s)",
                                hint="give one per agent, in the order the agents are listed")]
    try:
        spec.check(params, n)
    except RLMergeError as e:
        return [e]
    return []
