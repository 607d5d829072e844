"""What a merge method is: a ``MethodSpec``, the checks its parameters go through, and how a family's own backend
declares itself to the engine (``Capability``, ``Runner``, over the ``Run`` the passes share).

A method is one ``MethodSpec``: a frozen parameter dataclass, and hooks the engine calls (below; nothing else). An
elementwise method is an instance: its ``rule`` (methods/rule.py), a pure function of the element's base value
and the agents' τ, and the per-tensor ``constants`` that rule reads; the torch reference evaluates it on blocks,
the numba backend compiles it. A method that needs more overrides the hooks in a subclass of its own (one level:
``ram.RamPlus``, ``sparsify.family.Sparsify``), so that a parameter can be followed from the command line to the
kernel by reading one class. No IO, no global state, no mutation of inputs.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from .._torch import torch
from ..errors import ConfigError, RLMergeError
from ..io.checkpoint import Checkpoint
from ..io.writer import CheckpointWriter
from ..params import parse_params
from ..schedule import PerTensor, evaluate
from ..stats import Statistics, TensorStats
from ..stream.blocks import Block
from ..stream.fast import FastPath
from ..stream.match import Job, Match
from .interface import BlockContext, Entries, Observer, Prepared, Rows, Scope
from .rule import Program, Rule, program, torch_eval

Constants = Mapping[str, Any]  # name → a number, or one number per agent (what a rule reads as t.const / t.agent)
ConstantsFn = Callable[[Any, Any, "TensorStats | None", int, str], Constants]
BlockFn = Callable[["torch.Tensor", "torch.Tensor", Any, BlockContext], "torch.Tensor"]  # strings: torch stays lazy


@dataclass(frozen=True)
class MethodSpec:
    """One merge method, declared once: every backend reads this declaration, none compares its name.

    ``rule`` and ``constants`` (tensor → the numbers the rule reads: ``constants(p, prepared, tensor_stats, n,
    name)``) make an elementwise method; ``merge`` is a torch block function for what no rule can say (slerp,
    fisher, the sparsify family's pruning): base [n], deltas [N, n] float32 → merged weights [n]. ``checks(p, n)``:
    what the parameters ask of the number of agents N beyond per-agent lengths (raises ConfigError); ``varying``:
    the parameters that may take a value per tensor (mergekit's gradients and filters, schedule.py), numbers the
    method reads per tensor, never one that shapes the route.
    """

    name: str
    summary: str
    paper: str  # arXiv id or citation
    scope: Scope
    params: type  # frozen dataclass; field defaults are the paper's
    merge: BlockFn | None = None
    rule: Rule | None = None
    constants: ConstantsFn | None = None
    checks: Callable[[Any, int], None] | None = None
    varying: tuple[str, ...] = ()
    exact_gram: bool = False  # the Gram matrix feeds the merge (model_stock): float64 products on every path
    # It merges task vectors τ = θ_t − θ₀, so an agent equal to the base adds nothing (and is warned about); False
    # for a method that averages the models themselves (linear), where such an agent counts like any other.
    task_vectors: bool = True
    # Written in float32 where the base stores a narrower float, unless a dtype is asked for: what the method adds
    # to RAM is about one bf16 step and would round away (docs/methods.md, "Rounding").
    float32_output: bool = False
    # The per-agent constant a unique element's τ is multiplied by (RAM+'s ``lam``): the merge counts how many
    # unique elements keep that rescale in the output dtype (engine/survival.py).
    unique_scale: str | None = None
    seeded: bool = False  # it draws random masks: the seed is part of what it merges (DARE, DELLA)

    # -- hooks: a subclass overrides what its method needs; each default is what an elementwise rule needs ---------
    def epsilon(self, p: Any) -> float:
        """The statistics' threshold: an element is changed when |τ| > ε (the parameters' ``epsilon``, else 1e-5)."""
        return float(getattr(p, "epsilon", 1e-5))

    def needs_stats(self, p: Any) -> bool:
        """Whether ``prepare`` reads whole-model statistics (a statistics pass runs first)."""
        return False

    def observer(self, p: Any, n: int, at: Callable[[str], Any] | None = None) -> Observer | None:
        """A fresh observer for the statistics pass (interface.Observer), or None. ``at`` (or None) gives each
        tensor's parameters where they vary per tensor."""
        return None

    def prepare(self, p: Any, stats: Statistics | None, n: int) -> Prepared | None:
        """What the merge pass needs from the whole-model statistics (``stats`` None: no statistics pass ran; its
        observer is ``stats.observed``)."""
        return None

    def elementwise(self, p: Any) -> bool:
        """Whether ``rule`` covers these parameters (else ``merge`` runs)."""
        return True

    def row_blocks(self, p: Any) -> bool:
        """Whether its blocks must hold whole rows (``shape[1:]``) of each tensor."""
        return False

    def extra_inputs(self, p: Any) -> tuple[str, ...] | None:
        """Per-agent side inputs (folders shaped like the agents, e.g. Fisher diagonals), read blockwise as
        ``BlockContext.extra``."""
        return None

    def check(self, p: Any, n: int) -> None:
        """Raise ConfigError when the parameters do not fit ``n`` agents (``checks``)."""
        if self.checks is not None:
            self.checks(p, n)

    def per_tensor(self, p: Any) -> Collection[str]:
        """The parameters that may take a value per tensor (``varying``)."""
        return self.varying

    def report(self, p: Any, prepared: Prepared | None, observer: Observer | None, stats: Statistics) -> Rows:
        """Its own numbers about the merge it did, after the merge pass: ``prepared`` and the run's ``observer``
        (which a family's backend may have fed while merging)."""
        return Rows()

    def inspect(self, stats: Statistics) -> Mapping[str, Sequence[Any]]:
        """What it would make of these whole-model statistics, per agent, with its default parameters: fields of
        every agent's row in the report (``rlmerge inspect``, every merge's rlmerge-report.json), under names of
        its own; RAM+'s λ per preset. None by default."""
        return {}

    def backend(self, p: Any) -> Capability | None:
        """A numba backend of its own (a family's, in its folder), tried first by the route; None: its rule
        compiled (when it has one), else torch."""
        return None

    # -- what the backends call ----------------------------------------------------------------------------------
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

    def values(self, p: Any, prepared: Prepared | None, ts: TensorStats | None, n: int, name: str) -> Constants:
        """The rule's constants for tensor ``name``."""
        if self.constants is None:
            raise TypeError(f"method {self.name!r} declares a rule but no constants for it")
        return self.constants(p, prepared, ts, n, name)

    def merge_block(self, base: torch.Tensor, deltas: torch.Tensor, p: Any, ctx: BlockContext) -> torch.Tensor:
        """The torch reference: base [n], deltas [N, n] float32 → merged weights [n] float32."""
        prog = self.program(p, deltas.shape[0])
        if prog is not None:
            return torch_eval(prog, base, deltas, self.values(p, ctx.prepared, ctx.tensor_stats, deltas.shape[0],
                                                              ctx.name))
        if self.merge is None:
            raise TypeError(f"method {self.name!r} declares neither a rule nor a merge")
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


# -- a family's own backend, as the engine sees it --------------------------------------------------------------
@dataclass
class Run:
    """What the passes share: the inputs, the method, the statistics being gathered, and what prepare() made."""

    match: Match
    spec: MethodSpec
    params: Any
    stats: Statistics
    seed: int = 0
    observer: Observer | None = None  # the method's statistics observer (spec.observer), if it has one
    extras: list[Checkpoint] = field(default_factory=list)  # per-agent side inputs (Fisher diagonals)
    prepared: Prepared | None = None  # spec.prepare's constants, set between the passes
    read_bytes: int = 0  # what the passes read, as they read it
    cache: Entries | None = None  # what earlier merges of the same inputs gathered (a sweep's cache), or None
    at: Callable[[str], Any] | None = None  # tensor name → its parameters, where a recipe gave them per tensor

    def params_of(self, name: str) -> Any:
        """The parameters of tensor ``name`` (``params`` unless a recipe's gradient or filter made them its own)."""
        return self.params if self.at is None else self.at(name)

    def context(self, job: Job, blk: Block, prepared: Prepared | None) -> BlockContext:
        return BlockContext(job.name, blk.start, blk.stop, job.info.shape, job.present, prepared,
                            self.stats.tensors.get(job.name), self.seed, blk.extra,
                            None if self.at is None else self.at(job.name))


class Runner(Protocol):
    """A backend that runs a merge's two passes over the tensors the route gives it (engine/backends.py has the
    torch and fused ones; a family may have its own): it counts their statistics (``statistics``), then merges
    them (``begin_merge`` with the tensors it will merge, in order, then ``merge_job`` for each), writing through
    the checkpoint writer in job order."""

    fast: FastPath | None  # the numba block stream it runs on, if any (its threads stop with the merge)

    def reads(self, job: Job) -> int: ...
    def statistics(self, jobs: list[Job], bar: Any) -> None: ...
    def begin_merge(self, jobs: list[Job]) -> None: ...
    def merge_job(self, job: Job, ts: TensorStats | None, out: CheckpointWriter, bar: Any) -> None: ...


class Capability(Protocol):
    """A family's own numba backend as it declares itself to the route (``MethodSpec.backend``): the route runs it
    on every merged tensor or on none, reports it as ``kind``, and asks it how often it reads each tensor and how
    much memory it adds; the engine then ``open``s it on the block stream."""

    kind: str  # the route's name for it (``rlmerge plan`` and tests/test_route.py read it)

    def observed(self, observer: Observer | None) -> bool:
        """Whether the method's observer is fed in the statistics pass (then the pass runs, and reads each tensor
        ``observer.streams`` times); else the backend finds what it needs while merging."""
        ...

    def merge_reads(self, observer: Observer | None, job: Job, block: int, step: int, cache: Entries | None) -> int:
        """Reads of ``job`` in the merge pass: ``block`` elements per block of the stream, ``step`` this job's."""
        ...

    def memory(self, jobs: Sequence[Job], n: int) -> int:
        """Bytes it holds beyond the block stream's own, for ``n`` agents (the route's peak memory adds them)."""
        ...

    def open(self, run: Run, stream: FastPath) -> Runner: ...
