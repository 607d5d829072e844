"""Everything checked before a merge reads a weight: one function, called by ``merge`` and by ``rlmerge plan``.

Configuration (method, parameters against the number of agents, dtype, shard and block sizes, device, seed),
the output location, every input checkpoint, the base/agent match, side inputs and memory. Problems are
collected, not raised, so that ``match`` can report them all at once; ``merge`` raises them together. What only
the data can tell (NaN/Inf in a task vector, a copied tensor an agent changed, a value that overflows the output
dtype) is found while merging, before the output is published.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import ConfigError, InputError, ProblemsError, RLMergeError, raise_all
from ..io.checkpoint import Checkpoint
from ..io.dtypes import BF16, F16, F32, DType, by_name
from ..io.hub import push_problems
from ..io.open import open_one
from ..io.partial import fingerprint, input_identity, output_problems, resume_problems
from ..io.remote_code import code_files
from ..io.tokenizer_plan import TokenizerPlan, plan_tokenizer
from ..io.vocab import VocabView
from ..io.writer import layout_shards, parse_size, shard_header
from ..methods import MethodSpec, get_method, validate
from ..methods.spec import Parsed
from ..schedule import layer_positions
from ..stream.blocks import DEFAULT_BLOCK, device_type
from ..stream.fast import compute_threads
from ..stream.match import BASE_ITSELF, Match, match_models
from . import budget
from .adapter import AdapterOptions, widen_to_f32, with_adapter
from .budget import MemoryEstimate, check_memory, estimate_memory
from .route import Route, route

OUT_DTYPES = (BF16, F16, F32)  # what --dtype may ask for
KEEP_BASE = "base"  # --dtype base: the base's dtype, also for a method that would widen it (float32_output)


def parse_dtype(name: str | DType | Any | None) -> DType | None:
    """'bfloat16', 'bf16', 'fp16', 'float32', … (or a DType, or a torch dtype) → the output DType; None (and
    'base') → the base's own."""
    if isinstance(name, DType):
        return name
    if name is None or str(name).strip().lower() == KEEP_BASE:
        return None
    dtype = by_name(str(name))
    if dtype not in OUT_DTYPES:
        raise ConfigError(f"unknown dtype {name!r}", hint="use bfloat16, float16, float32, or base (the base's)")
    return dtype


def parse_block_size(value: Any) -> int:
    """Elements per block: a positive integer (a recipe may write it as a string of digits)."""
    if isinstance(value, str) and value.strip().isdigit():
        value = int(value)
    if type(value) is not int or value < 1:
        raise ConfigError(f"block size {value!r} must be a positive whole number of elements",
                          hint="e.g. --block-size 4194304 (the default); smaller blocks use less memory")
    return value


def parse_seed(value: Any) -> int:
    if isinstance(value, str) and value.strip().lstrip("-").isdigit():
        value = int(value)
    if type(value) is not int:
        raise ConfigError(f"seed {value!r} must be a whole number")
    return value


def flat(e: RLMergeError) -> list[RLMergeError]:
    return list(e.problems) if isinstance(e, ProblemsError) else [e]


@dataclass
class Preflight:
    """The checked request. ``problems`` empty means the merge can start; ``close()`` the checkpoints after."""

    spec: MethodSpec | None = None
    params: Any = None  # the parameters every tensor shares
    parsed: Parsed | None = None
    at: Callable[[str], Any] | None = None  # tensor name → its parameters (a recipe's gradients resolved)
    out_dtype: DType | None = None
    shard_bytes: int = 0
    block_size: int = 0
    base: Checkpoint | None = None
    agents: list[Checkpoint | None] = field(default_factory=list)
    extras: list[Checkpoint | None] = field(default_factory=list)
    match: Match | None = None
    route: Route | None = None
    tokenizer: TokenizerPlan | None = None  # the output's tokenizer, template and vocabulary rows
    out_dtypes: dict[str, DType] | None = None  # --output-format peft: what each tensor would be written in
    adapter: AdapterOptions | None = None  # --output-format peft: its rank and what it does with other tensors
    memory: MemoryEstimate | None = None
    available: int | None = None
    problems: list[RLMergeError] = field(default_factory=list)

    @property
    def models(self) -> list[Checkpoint]:
        return [m for m in (self.base, *self.agents, *self.extras) if m is not None]

    def close(self) -> None:
        for m in self.models:
            m.close()


def preflight(base: str | os.PathLike[str], agents: Sequence[str | os.PathLike[str]],
              output: str | os.PathLike[str] | None, *, method: str = "ram+",
              params: Mapping[str, Any] | None = None, dtype: Any = None, shard_size: str | int = 5 * 10**9,
              block_size: Any = 1 << 22, device: str = "cpu", force: bool = False, resume: bool = False,
              allow_missing: bool = False, count_tied_twice: bool = False, seed: Any = 0,
              available: int | None = None, tokenizer_source: str | None = None,
              chat_template: str | None = None, output_format: str = "hf", rank: Any = None,
              non_linear: str | None = None, push_to_hub: str | None = None, revision: str | None = None,
              recipe: Mapping[str, Any] | None = None) -> Preflight:
    """Check a merge from headers only; every problem is collected in ``Preflight.problems``.

    ``tokenizer_source`` / ``chat_template``: the output's tokenizer and chat template (io/tokenizer_plan.py); when
    the vocabulary rows move, the models are matched through ``io.vocab.VocabView``s of them. ``output_format``
    ``peft``: the merged tensors are computed into float32 for the adapter writer (engine/adapter.py), whose
    ``rank`` and ``non_linear`` are checked here (``Preflight.adapter``) and whose memory is budgeted with the
    merge's. ``push_to_hub``: what would stop the upload is found now (io/hub.py), before any weight is read.
    ``resume``: an interrupted run kept beside ``output`` must have been made from these inputs, unchanged since,
    and these settings (``recipe``, the recipe's own text, among them): its fingerprint is compared here."""
    pf = Preflight()
    problems = pf.problems
    for fn in (lambda: _method(pf, method, params), lambda: setattr(pf, "out_dtype", parse_dtype(dtype)),
               lambda: setattr(pf, "shard_bytes", parse_size(shard_size)),
               lambda: setattr(pf, "block_size", parse_block_size(block_size)),
               lambda: device_type(device), lambda: parse_seed(seed), compute_threads):
        try:
            fn()
        except RLMergeError as e:
            problems += flat(e)
    extra_specs = list(pf.spec.extra_inputs(pf.params) or ()) if pf.params is not None else []
    if len(extra_specs) != len(agents):  # one per agent: ``validate`` below reports the mismatch
        extra_specs = []
    if output_format == "peft":
        try:
            pf.adapter = AdapterOptions.parse("full" if rank is None else rank, non_linear or "save")
        except RLMergeError as e:
            problems += flat(e)
        if resume:
            problems.append(ConfigError("--resume continues a sharded model; an adapter is written in one go",
                                        hint="run again without --resume (or with --force)"))
    else:  # a full model has no rank: an adapter's option given without one is refused, never ignored
        given = [f"--{k.replace('_', '-')} {v}" for k, v in (("rank", rank), ("non_linear", non_linear))
                 if v is not None]
        if given:
            verb = "apply" if len(given) > 1 else "applies"
            problems.append(ConfigError(f"{' and '.join(given)} {verb} to --output-format peft (a LoRA adapter); "
                                        f"this merge writes --output-format {output_format}",
                                        hint="add --output-format peft, or leave out --rank and --non-linear"))
    if push_to_hub is not None:
        problems += push_problems(push_to_hub, revision=revision)
    opened = _open([base, *agents, *extra_specs], problems)
    pf.base, pf.agents, pf.extras = opened[0], opened[1:1 + len(agents)], opened[1 + len(agents):]
    problems += _same_folder_twice(pf.agents)
    placed = output_problems(output, pf.models, force=force, resume=resume) if output is not None else []
    problems += placed
    if pf.spec is not None and pf.params is not None:
        problems += validate(pf.spec, pf.params, len(agents))
    if pf.base is None:
        return pf
    if output is not None and not (pf.base.side_dir / "config.json").is_file():  # verl: actor/huggingface/
        problems.append(InputError("the base has no config.json: the merged folder would not load in transformers",
                                   file=str(pf.base.side_dir),
                                   hint="copy the base model's config.json into that folder"))
    here = [a for a in pf.agents if a is not None]
    pf.tokenizer, found = plan_tokenizer(pf.base, here, source=tokenizer_source, chat_template=chat_template)
    problems += found
    base_m: Checkpoint = pf.base
    rows = pf.tokenizer.rows
    if rows is not None:  # the output's vocabulary rows, as a view of every model
        base_m, here = VocabView(pf.base, rows, 0), [VocabView(a, rows, i) for i, a in enumerate(here, 1)]
        if extra_specs:
            problems.append(ConfigError(f"tokenizer_source {tokenizer_source} moves the vocabulary rows, and the "
                                        "method's side inputs (Fisher files) are laid out on the base's rows",
                                        hint="leave tokenizer_source unset for this method"))
    # Agents that could not be opened are left out, so the others are still matched against the base.
    try:
        widen = dtype is None and pf.spec is not None and pf.spec.float32_output  # the one place this is decided
        pf.match = match_models(base_m, here, dtype=pf.out_dtype, allow_missing=allow_missing,
                                count_tied_twice=count_tied_twice, at_least=F32 if widen else None)
        pf.match.tokenizer = pf.tokenizer
        pf.match.warnings += pf.tokenizer.warnings
        pf.match.code, notes = _model_code(pf.base, here, pf.tokenizer, model=output_format != "peft")
        pf.match.warnings += notes
        if output_format == "peft":
            pf.out_dtypes, found = widen_to_f32(pf.match)
            problems += found
        elif output_format != "hf":
            problems.append(ConfigError(f"--output-format {output_format!r}", hint="hf (a full model) or peft "
                                                                                 "(a LoRA adapter of the base)"))
        if all(pf.extras):
            check_side_inputs(pf.match, pf.extras)  # type: ignore[arg-type]
    except RLMergeError as e:
        problems += [x for x in flat(e) if here or "no agents given" not in x.message]
    block = pf.block_size or DEFAULT_BLOCK
    n_mem = len(agents) + len(extra_specs)
    if pf.match is not None and pf.spec is not None and not pf.spec.task_vectors:  # linear: the base is an input
        itself = {BASE_ITSELF.format(a) for a in pf.match.base_agents}
        pf.match.warnings = [w for w in pf.match.warnings if w not in itself]
    if pf.match is not None and pf.parsed is not None:
        problems += _bind(pf, pf.parsed, len(agents))
    configured = pf.spec is not None and pf.params is not None and not any(
        isinstance(x, ConfigError) for x in problems)
    if pf.match is not None and configured:
        try:
            pf.route = route(pf.match, pf.spec, pf.params, device=device, block_size=block,  # type: ignore[arg-type]
                             extras=[x for x in pf.extras if x], agents=len(agents), at=pf.at)
        except RLMergeError as e:
            problems += flat(e)
    if resume and output is not None and not placed and pf.route is not None and output_format == "hf":
        problems += _resume_problems(pf, output, seed=seed, recipe=recipe, device=device)
    pf.memory = pf.route.memory if pf.route is not None else estimate_memory(
        pf.base, [*here, *(x for x in pf.extras if x)], block, n_agents=n_mem)
    adapter = pf.adapter
    if adapter is not None and pf.match is not None:  # the adapter writer's matrices beside the merge's blocks
        pf.memory = with_adapter(pf.memory, pf.match, adapter.ranks)
    pf.available = budget.available_memory() if available is None else available

    def fits(b: int) -> int:  # the estimate with blocks of b elements
        est = route(pf.match, pf.spec, pf.params, device=device, block_size=b,  # type: ignore[arg-type]
                    extras=[x for x in pf.extras if x], agents=len(agents), at=pf.at).memory
        return (with_adapter(est, pf.match, adapter.ranks) if adapter is not None else est).total

    try:
        check_memory(pf.memory, len(agents), pf.available, fits=None if pf.route is None else fits)
    except RLMergeError as e:
        problems.append(e)
    return pf


def output_fingerprint(match: Match, spec: MethodSpec, p: Any, *, seed: int, recipe: Mapping[str, Any] | None,
                       device: str, shard_bytes: int, extras: Sequence[Checkpoint],
                       schedule: Mapping[str, Any] | None = None) -> tuple[dict[str, str], str]:
    """(the shards' metadata, the fingerprint of everything that decides the output bytes: what --resume checks).
    ``schedule``: a recipe's per-tensor parameters (gradients, filters), part of what decides the bytes."""
    metadata = {"rlmerge_method": spec.name}
    params_key = repr(p) + (repr(sorted((k, str(v)) for k, v in schedule.items())) if schedule else "")
    decides = {
        "method": spec.name, "params": params_key, "seed": seed, "recipe": recipe, "metadata": metadata,
        "device": device_type(device),  # float results may differ between CPU and GPU kernels
        "headers": [shard_header(s, metadata).hex() for s in layout_shards(match.jobs, shard_bytes)]}
    if match.tokenizer is not None and match.tokenizer.key:  # where each vocabulary row comes from
        decides["vocabulary"] = match.tokenizer.key
    fp = fingerprint([match.base, *match.agents, *extras], decides)
    return metadata, fp


def _resume_problems(pf: Preflight, output: str | os.PathLike[str], *, seed: Any, recipe: Mapping[str, Any] | None,
                     device: str) -> list[RLMergeError]:
    """What ``PartialDir.start`` would refuse to resume: the run's fingerprint and inputs, as the merge makes them."""
    assert pf.match is not None and pf.spec is not None
    extras = [x for x in pf.extras if x is not None]
    _, fp = output_fingerprint(pf.match, pf.spec, pf.params, seed=seed, recipe=recipe, device=device,
                               shard_bytes=pf.shard_bytes, extras=extras,
                               schedule=pf.parsed.schedule if pf.parsed else {})
    return resume_problems(output, fp, input_identity([pf.match.base, *pf.match.agents, *extras]))


def _method(pf: Preflight, method: str, params: Mapping[str, Any] | None) -> None:
    pf.spec = get_method(method)
    pf.parsed = pf.spec.parse_scheduled(params)
    pf.params = pf.parsed.params


def _bind(pf: Preflight, parsed: Parsed, n: int) -> list[RLMergeError]:
    """Each merged tensor's parameters (a recipe's gradients and filters resolved), checked before any weight is
    read; ``pf.at`` gives them by name."""
    assert pf.match is not None
    names = [j.name for j in pf.match.merge_jobs]
    try:
        positions = layer_positions(names, pf.match.base.config) if parsed.schedule else {}
    except RLMergeError as e:
        return flat(e)
    pf.at, problems = parsed.bind(positions, n)
    return problems


def _open(specs: Sequence[str | os.PathLike[str]], problems: list[RLMergeError]) -> list[Checkpoint | None]:
    out: list[Checkpoint | None] = []
    for s in specs:
        try:
            out.append(open_one(s))
        except RLMergeError as e:
            problems += flat(e)
            out.append(None)
    return out


def _same_folder_twice(agents: Sequence[Checkpoint | None]) -> list[RLMergeError]:
    """The same agent listed twice (any spelling of its path) would count every change twice: refused."""
    seen: dict[Path, str] = {}
    problems: list[RLMergeError] = []
    for a in agents:
        if a is None:
            continue
        key = a.path.resolve()
        if key in seen:
            problems.append(ConfigError(f"the agent {a.label} is listed twice (also as {seen[key]})",
                                        file=str(key), hint="list each agent once; to weight an agent more, give "
                                                            "weights (e.g. --param weights=2,1,1)"))
        seen.setdefault(key, a.label)
    return problems


def check_side_inputs(match: Match, extras: Sequence[Checkpoint]) -> None:
    """Every merged tensor must be in every side input (e.g. a Fisher file), with the base's shape."""
    problems: list[RLMergeError] = []
    for ckpt in extras:
        for job in match.merge_jobs:
            info = ckpt.tensors.get(job.name)
            if info is None:
                problems.append(InputError("tensor missing from the side input", file=str(ckpt.path),
                                           tensor=job.name, hint="it must hold every float tensor of the base"))
            elif info.shape != job.info.shape or not info.is_float:
                problems.append(InputError(f"side input stores {list(info.shape)} where the base has "
                                           f"{list(job.info.shape)}", file=str(info.file), tensor=job.name,
                                           hint="it was computed for another model; recompute it"))
    raise_all(problems)


def _model_code(base: Checkpoint, agents: Sequence[Any], tokenizer: TokenizerPlan, *, model: bool
                ) -> tuple[list[Path], list[str]]:
    """The modules the output's ``auto_map``s need (io/remote_code.py): config.json's from the base's folder (a model
    output only: an adapter has no config), tokenizer_config.json's from the folder of the one the output gets."""
    files: list[Path] = []
    notes: list[str] = []
    if model:
        files, notes = code_files(base.side_dir, base.config, "config.json", base.check_inside)
    chosen = tokenizer.files.get("tokenizer_config.json")  # what the output gets (None: none)
    owner = next((m for m in (base, *agents) if isinstance(chosen, Path) and chosen.parent == m.side_dir), base)
    try:
        doc = json.loads(chosen if isinstance(chosen, bytes) else chosen.read_bytes()) if chosen is not None else None
    except (OSError, ValueError):
        doc = None  # unreadable: the tokenizer plan says so
    more, said = code_files(owner.side_dir, doc, "tokenizer_config.json", owner.check_inside)
    return list(dict.fromkeys([*files, *more])), [*notes, *said]
