"""Match base and agents from headers (and, for a tied base that also stores its lm_head, that head's bytes):
one job per stored base tensor, every problem at once."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from ..errors import InputError, RLMergeError, raise_all
from ..io.checkpoint import Checkpoint, TensorInfo
from ..io.dtypes import DType
from ..io.lora import bind_to_base
from ..io.vocab import EMBEDDING_SUFFIXES

LM_HEAD = "lm_head.weight"
# config.json fields that fix the tensor layout: an agent that differs here is not a fine-tune of the base.
# (vocab_size is left to the embedding shape check, which says what to do about a resized vocabulary.)
STRUCTURAL_KEYS = ("model_type", "num_hidden_layers", "hidden_size", "intermediate_size", "num_attention_heads",
                   "num_key_value_heads", "head_dim", "num_local_experts", "num_experts")


@dataclass(frozen=True)
class Job:
    """One stored base tensor: merged from float32 deltas, or copied byte for byte from the base."""

    name: str
    kind: Literal["merge", "copy"]
    info: TensorInfo  # the base's copy: shape, dtype, where it lives
    out_dtype: DType
    present: tuple[bool, ...]  # per agent; False only when the user allowed missing tensors
    weight: int = 1  # how many times the statistics count it (2: the authors' tied double count)

    @property
    def numel(self) -> int:
        return self.info.numel

    @property
    def shape(self) -> tuple[int, ...]:
        return self.info.shape

    @property
    def out_nbytes(self) -> int:
        return self.numel * self.out_dtype.itemsize


@dataclass
class Match:
    base: Checkpoint
    agents: list[Checkpoint]
    jobs: list[Job]
    dropped: dict[str, list[str]] = field(default_factory=dict)  # tensor → agents that have it, base not
    missing: dict[str, list[str]] = field(default_factory=dict)  # tensor → agents without it (allowed)
    tied: list[str] = field(default_factory=list)  # stored once, used as both embedding and lm_head
    untied_output: bool = False  # lm_head merged on its own although the base ties it: the config must say so
    warnings: list[str] = field(default_factory=list)
    base_agents: list[str] = field(default_factory=list)  # agents that are the base folder itself
    tokenizer: Any = None  # io.tokenizer_plan.TokenizerPlan: the output's tokenizer files (set by preflight)
    code: list[Path] = field(default_factory=list)  # the modules the output's auto_maps need (io/remote_code.py)

    @property
    def merge_jobs(self) -> list[Job]:
        return [j for j in self.jobs if j.kind == "merge"]

    @property
    def read_bytes(self) -> int:
        """Bytes of weights one merge pass reads: the base plus each agent's copy of merged tensors."""
        total = 0
        for j in self.jobs:
            total += j.info.nbytes
            if j.kind == "merge":
                total += sum(a.tensors[j.name].nbytes for a, p in zip(self.agents, j.present) if p)
        return total

    @property
    def write_bytes(self) -> int:
        return sum(j.out_nbytes for j in self.jobs)

    @property
    def merged_dtypes(self) -> list[str]:
        """The dtypes the merged tensors are written in ("bfloat16", "float32" …)."""
        return sorted({str(j.out_dtype).removeprefix("torch.") for j in self.merge_jobs})


def tied_tensors(base: Checkpoint) -> list[str]:
    """Embeddings that double as lm_head: tied in config and lm_head not stored."""
    if not base.tie_word_embeddings or any(n.endswith("lm_head.weight") for n in base.tensors):
        return []
    return [n for n in base.tensors if n.endswith(EMBEDDING_SUFFIXES)]


def _config_problems(base: Checkpoint, agent: Checkpoint) -> list[RLMergeError]:
    """Architecture and layer-layout fields of config.json that must agree with the base's."""
    out: list[RLMergeError] = []
    where = str(agent.path / "config.json")
    arch, base_arch = agent.config.get("architectures"), base.config.get("architectures")
    if base_arch and arch and arch != base_arch:
        out.append(InputError(f"architecture {arch} differs from the base's {base_arch}", file=where,
                              hint="agents must be fine-tuned from the same base model"))
    for key in STRUCTURAL_KEYS:
        mine, theirs = agent.config.get(key), base.config.get(key)
        if mine is not None and theirs is not None and mine != theirs:
            out.append(InputError(f"config {key} = {mine!r} differs from the base's {theirs!r}", file=where,
                                  hint="agents must be fine-tuned from the same base model"))
    return out


def _embedding(ckpt: Checkpoint) -> str | None:
    return next((n for n in ckpt.tensors if n.endswith(EMBEDDING_SUFFIXES)), None)


def _own_head(ckpt: Checkpoint) -> bool:
    """Whether a checkpoint has an lm_head of its own: stored (not the embedding standing in for it). Called after
    ``_drop_copied_head``, which drops a stored copy equal to a tied model's embedding; a stored head that is left
    is one transformers loads as a head (an untied config, a config saying nothing — its default differs between
    model classes, and dropping a trained head would lose part of the model — or a tied one whose head differs)."""
    head = ckpt.tensors.get(LM_HEAD)
    return head is not None and head.name == LM_HEAD


def _drop_copied_head(ckpt: Checkpoint, role: str) -> bool:
    """A model (``role``: "base" or "agent") whose config ties lm_head to the embeddings but that also stores
    ``lm_head.weight`` (``torch.save`` of a tied model's state dict writes both keys over one storage; some tools
    save a cloned copy): a head equal to the embedding, byte for byte, is that embedding, and its copy is dropped.
    A head that differs is a head of its own, as transformers reads it (it ties only equal ones, and warns): kept,
    merged, and the output is untied. Base and agents alike, so each is merged as transformers loads it. Returns
    whether the copy is dropped (by this call, or by an earlier match of the same checkpoint)."""
    head, embed = ckpt.tensors.get(LM_HEAD), _embedding(ckpt)
    dropped = (f"the {role} {ckpt.label} stores lm_head.weight although its config ties it to the embeddings: the "
               f"copy equals {embed} and is dropped (the {role} is tied)")
    if ckpt.config.get("tie_word_embeddings") is not True or head is None or head.name != LM_HEAD or embed is None:
        return dropped in ckpt.notes  # untied or silent (its own head), no head stored (tied), or dropped before
    if ckpt.same_bytes(LM_HEAD, embed):
        del ckpt.tensors[LM_HEAD]
        ckpt.notes.append(dropped)
        return True
    note = (f"the {role} {ckpt.label} stores an lm_head.weight that differs from its embeddings although its config "
            "ties them: it is a head of its own, as transformers loads it (it does not tie a head that differs), so "
            "lm_head is merged and the output's config says tie_word_embeddings: false")
    if note not in ckpt.notes:  # said once however often this checkpoint is matched
        ckpt.notes.append(note)
    return False


def _tie_heads(base: Checkpoint, agents: list[Checkpoint], match: Match) -> list[RLMergeError]:
    """Tied and untied lm_heads, merged as each model uses them (docs/inputs.md, "Heads, tied and untied").

    A model whose lm_head is its embedding (tied) reads its embedding where the others read their lm_head. The
    output ties lm_head to the embeddings only when the base and every agent tie it; when the base stores an
    lm_head or an agent has one of its own, lm_head is merged as a tensor of its own, written, and the config
    says ``tie_word_embeddings: false``. Decided from headers and configs alone, so ``plan`` sees the same layout.
    """
    if LM_HEAD not in base.tensors and not any(_own_head(a) for a in agents):
        return []  # every model ties: the embedding serves as lm_head (match.tied)
    problems: list[RLMergeError] = []
    stand_ins = []
    for m in (base, *agents):
        if _own_head(m):
            continue  # its own lm_head
        embed = _embedding(m)
        if embed is None:
            problems.append(InputError("lm_head must be merged but this model has neither an lm_head nor an "
                                       "embedding to stand for it", file=str(m.path), tensor=LM_HEAD,
                                       hint="save the model with its lm_head (tie_word_embeddings: false)"))
            continue
        m.alias(LM_HEAD, embed)  # a tied model's lm_head is its embedding
        stand_ins.append(m.label)
    if stand_ins:
        match.warnings.append(f"lm_head is merged as a tensor of its own, the embedding standing for the lm_head "
                              f"of the tied {', '.join(stand_ins)}: the output stores lm_head and its config says "
                              "tie_word_embeddings: false")
    match.tied = []
    match.untied_output = True
    return problems


def _dtype_warning(agent: str, theirs: DType, ours: DType) -> str:
    """An agent stored in another dtype than the base: rounding alone looks like a change (3 % → 61 % measured)."""
    if theirs.itemsize > ours.itemsize:
        why = (f"the base's {ours.code} values, read as {theirs.code}, differ from the agent's unrounded ones "
               "almost everywhere")
        fix = f"save the agent in {ours.code}, the base's dtype"
    else:
        why = f"every base value rounded to {theirs.code} counts as a change"
        fix = f"merge against the base saved in {theirs.code}, the dtype the agent was saved in"
    return (f"agent {agent} stores {theirs.code} against a {ours.code} base: {why}, so its task vector looks "
            f"denser than it is and ρ, λ and the shared/unique split mean little; {fix}")


def _fp8_problems(models: list[Checkpoint]) -> list[RLMergeError]:
    """FP8 weights come with block scales (``weight_scale_inv``): copying or merging their bytes would be wrong."""
    out: list[RLMergeError] = []
    for m in models:
        fp8 = sorted(n for n, t in m.tensors.items() if t.dtype.code.startswith("F8_"))
        if fp8:
            out.append(InputError(f"{len(fp8)} tensor(s) are stored in FP8 ({m.tensors[fp8[0]].dtype.code}), which "
                                  "rlmerge does not merge", file=str(m.tensors[fp8[0]].file), tensor=fp8[0],
                                  hint="dequantise the checkpoints to bfloat16 first (e.g. load with transformers "
                                       "and save_pretrained in bfloat16), then merge; requantise the result"))
    return out


BASE_ITSELF = "agent {} is the base folder itself: it contributes nothing"


def match_models(base: Checkpoint, agents: list[Checkpoint], *, dtype: DType | None = None,
               allow_missing: bool = False, count_tied_twice: bool = False, at_least: DType | None = None) -> Match:
    """Check every agent against the base and lay out the jobs; raise all problems together. A merged tensor is
    written in ``dtype``, else in the base's dtype widened to ``at_least`` where that is narrower."""
    _drop_copied_head(base, "base")  # before anything reads whether the base ties
    problems: list[RLMergeError] = bind_to_base(base, agents)  # LoRA agents take the base's tensors
    copies = [a.label for a in agents if _drop_copied_head(a, "agent")]  # said by their notes; in dropped_tensors
    match = Match(base, agents, jobs=[], tied=tied_tensors(base))
    if copies:
        match.dropped[LM_HEAD] = copies
    match.warnings += [note for m in (base, *agents) for note in m.notes]
    if not agents:
        problems.append(InputError("no agents given", hint="pass at least one agent after the base"))
    problems += _fp8_problems([base, *agents])
    if not base.tensors:  # the merge would "succeed" with an empty model
        problems.append(InputError("the base holds no tensors", file=str(base.path),
                                   hint="point at the base model's folder"))
    problems += _tie_heads(base, agents, match)
    for a in agents:
        problems += _config_problems(base, a)
        if a.path.resolve() == base.path.resolve():
            match.warnings.append(BASE_ITSELF.format(a.label))
            match.base_agents.append(a.label)

    # stored order (an alias — a tied model's lm_head — after the stored tensors), the job named by the key
    order = sorted(base.tensors.items(), key=lambda kv: (kv[0] != kv[1].name, str(kv[1].file), kv[1].offset, kv[0]))
    for name, info in order:
        present = []
        for a in agents:
            other = a.tensors.get(name)
            if other is None:
                if name == LM_HEAD and a.config.get("tie_word_embeddings") is True:
                    pass  # its stored copy is redundant (a tied base): reported by _tie_heads
                elif info.is_float and not allow_missing:
                    problems.append(InputError(
                        "tensor is in the base but missing from the agent", file=str(a.path),
                        tensor=name, hint="pass --allow-missing to treat the agent as unchanged there"))
                elif info.is_float:
                    match.missing.setdefault(name, []).append(a.label)
                present.append(False)
                continue
            present.append(True)
            if other.shape != info.shape:
                vocab = name.endswith((*EMBEDDING_SUFFIXES, "lm_head.weight"))
                hint = ("the vocabulary was resized: choose the output's vocabulary with --tokenizer-source union "
                        "(every model's tokens), base or the agent (rows mapped by token, as mergekit), or resize "
                        "the agent's embeddings back to the base's vocabulary"
                        if vocab and other.shape[1:] == info.shape[1:]
                        else "the agent is not a fine-tune of this base")
                problems.append(InputError(f"shape {list(other.shape)} differs from the base's "
                                           f"{list(info.shape)}", file=str(other.file),
                                           tensor=name, hint=hint))
            elif info.is_float and not other.is_float:
                problems.append(InputError(f"agent stores {other.dtype.code} where the base stores "
                                           f"{info.dtype.code}", file=str(other.file),
                                           tensor=name, hint="re-save the agent in a float dtype"))
        # an empty float tensor has no element to merge (a block stream over it yields no block, so no statistics
        # or observer would see it): it is copied, in the dtype a merged one would take
        kind: Literal["merge", "copy"] = "merge" if info.is_float and info.numel > 0 else "copy"
        out_dtype = dtype if (dtype is not None and info.is_float) else info.dtype
        if dtype is None and at_least is not None and info.is_float and info.dtype.itemsize < at_least.itemsize:
            out_dtype = at_least
        weight = 2 if (count_tied_twice and name in match.tied) else 1
        match.jobs.append(Job(name, kind, info, out_dtype, tuple(present), weight))

    for a in agents:
        for name in a.tensors:
            if name not in base.tensors:
                match.dropped.setdefault(name, []).append(a.label)
        other = {(a.tensors[j.name].dtype, j.info.dtype) for j in match.jobs
                 if j.kind == "merge" and j.name in a.tensors and a.tensors[j.name].dtype != j.info.dtype}
        for theirs, ours in sorted(other, key=lambda d: (d[0].code, d[1].code)):
            match.warnings.append(_dtype_warning(a.label, theirs, ours))
    odd = sorted(n for n in match.dropped if n != LM_HEAD or match.dropped[n] != copies)  # not tied copies
    if odd:
        match.warnings.append(f"{len(odd)} tensor(s) only some agents have are dropped: "
                              + ", ".join(odd[:5]) + (" …" if len(odd) > 5 else ""))
    raise_all(problems)
    return match
