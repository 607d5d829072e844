"""Options that several commands share (`merge` and `plan`; `eval`, `sweep` and `lab`): one declaration, one help
text. A method's own options are generated from its parameter dataclass (``method_flags``)."""

from __future__ import annotations

import dataclasses
import functools
import inspect
import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from ..methods.registry import load
from ..params import FLAG
from ..sandbox import UNSAFE_FLAG

if TYPE_CHECKING:
    from ..scoring import TaskScorer

Models = Annotated[list[str] | None, typer.Argument(help="BASE then AGENT... (folders or hub ids)")]
Method = Annotated[str | None, typer.Option(help=f"{', '.join(load(strict=False))} (docs/methods.md)")]
Recipe = Annotated[Path | None, typer.Option(help="YAML recipe (mergekit layout)")]
Param = Annotated[list[str] | None, typer.Option("--param", help="any method parameter, KEY=VALUE")]
Dtype = Annotated[str | None, typer.Option(help="output dtype: bfloat16, float16, float32, or base (default: the "
                                                 "base's; float32 for ram+, whose rescale rounds away in bf16)")]
ShardSize = Annotated[str | None, typer.Option(help="max shard size, e.g. 5GB")]
BlockSize = Annotated[int | None, typer.Option(help="elements per block (memory bound; the numba path may grow "
                                                  "it by up to 1/8 to hold a tensor whole)")]
AllowMissing = Annotated[bool, typer.Option(help="an agent missing a tensor counts as unchanged")]
CountTiedTwice = Annotated[bool, typer.Option(help="count tied embeddings twice, as the authors' script")]
TokenizerSource = Annotated[str | None, typer.Option(help="the output's tokenizer, as mergekit's tokenizer_source: "
                                                         "base (rows mapped by token), union (every model's tokens) "
                                                         "or an AGENT (default: the base's, rows as stored)")]
ChatTemplate = Annotated[str | None, typer.Option(help="the output's chat template: base (default), auto (the one "
                                                       "most models share), an AGENT, a .jinja FILE, a "
                                                       "chat_template.json, or its text")]
PushToHub = Annotated[str | None, typer.Option(help="upload the finished output to this Hub repository (ORG/NAME): "
                                                    "checked before any weight is read, pushed once complete")]
Private = Annotated[bool, typer.Option(help="--push-to-hub: create the repository private")]
Revision = Annotated[str | None, typer.Option(help="--push-to-hub: the branch to commit to (created if needed)")]
OutputFormat = Annotated[str | None, typer.Option(help="hf (a full model, default) or peft (the merged task vector "
                                                       "as a LoRA adapter of the base)")]
Rank = Annotated[str | None, typer.Option(help="--output-format peft: the LoRA rank, R, full (exact) or energy=0.99 "
                                               "(per matrix, the share of ‖Δ‖² kept)")]
NonLinear = Annotated[str | None, typer.Option(help="--output-format peft: save (changed norms, embeddings and biases "
                                                    "go into modules_to_save, default) or refuse")]
# The scorers' options, as `rlmerge sweep` and `rlmerge eval` take them (scoring.TaskScorer; `task_scorer` below)
Tasks = Annotated[list[str] | None, typer.Option(
    help="scorers, comma-separated, repeatable: lab:FAMILY, lm-eval:TASK, bfcl:CATEGORY (simple, multiple, "
         "parallel, parallel_multiple), humaneval, py:MODULE:FUNCTION, 'cmd:COMMAND {model}' (a cmd: entry "
         "takes the rest of its --tasks value, commas included)")]
Limit = Annotated[int | None, typer.Option(min=1, help="examples per task (default 128)")]
LabView = Annotated[str | None, typer.Option(help="how the model sees a lab task: word (the tiny lab's models, "
                                                  "default) or chat (an instruct model, e.g. SmolLM2)")]
IncludePath = Annotated[list[Path] | None, typer.Option(help="folder of lm-eval task YAMLs (repeatable)")]
NumFewshot = Annotated[int | None, typer.Option(min=0, help="few-shot examples for lm-eval tasks")]
BatchSize = Annotated[int | None, typer.Option(min=1, help="lm-eval batch size; prompts generated at once")]
LmEvalBackend = Annotated[str | None, typer.Option(help="lm-eval's model: hf (in process, default) or vllm "
                                                        "(pip install vllm; a CUDA machine)")]
CmdTimeout = Annotated[float | None, typer.Option(help="seconds a cmd: scorer may run per model (default 3600)")]
CmdEnv = Annotated[list[str] | None, typer.Option(help="KEY=VALUE added to a cmd: scorer's environment "
                                                       "(repeatable)")]
CmdCwd = Annotated[Path | None, typer.Option(help="a cmd: scorer's working folder (default: this one)")]


def task_scorer(s: Mapping[str, Any], *, split: str) -> TaskScorer:
    """The scorer the options in ``s`` name (the keys are the options' names; a missing one takes its default,
    ``split`` that of the command)."""
    from ..scoring import TaskScorer, split_task_list

    values = [s["tasks"]] if isinstance(s["tasks"], str) else list(s["tasks"])
    return TaskScorer([t for v in values for t in split_task_list(str(v))], limit=s.get("limit", 128),
                      split=s.get("split", split), seed=s.get("seed", 0),
                      include_path=[str(p) for p in s.get("include_path") or []], num_fewshot=s.get("num_fewshot"),
                      batch_size=s.get("batch_size", 8), kind=s.get("lab_view", "word"),
                      lm_eval_backend=s.get("lm_eval_backend", "hf"), cmd_timeout=s.get("cmd_timeout", 3600.0),
                      cmd_env=s.get("cmd_env", ()), cmd_cwd=s.get("cmd_cwd"))


UnsafeUnisolatedCode = Annotated[bool, typer.Option(
    UNSAFE_FLAG, help="where bubblewrap cannot isolate it, run model-written code (the coding scorer) WITHOUT "
                      "isolation: it can then read and write your files and reach the network. Only for models you "
                      "trust (docs/guarantees.md)")]


# -- a method's options, from its parameters --------------------------------------------------------------------
@dataclass(frozen=True)
class MethodFlag:
    """One command-line option a method's parameter declares (``params.flag`` in its field's metadata)."""

    key: str  # the parameter's name, as every method that has it reads it
    name: str  # the option, e.g. --eps
    help: str
    kind: type  # float, int or str: what the option takes (the method's parameters check the rest)


def declared_flags() -> list[MethodFlag]:
    """Every option the registered methods' parameters declare, in the registry's order, each name once (the first
    declaration's help)."""
    out: dict[str, MethodFlag] = {}
    for spec in load(strict=False).values():
        hints = typing.get_type_hints(spec.params)
        for f in dataclasses.fields(spec.params):
            meta = f.metadata.get(FLAG)
            if meta is None:
                continue
            name = meta["name"] or "--" + f.name.replace("_", "-")
            if name not in out:
                out[name] = MethodFlag(f.name, name, meta["help"], _kind(hints[f.name]))
    return list(out.values())


def _kind(hint: Any) -> type:
    """float or int for a number (optional or not), else str (a preset's name, a value the method parses)."""
    args = [a for a in typing.get_args(hint) if a is not type(None)] if typing.get_args(hint) else [hint]
    return args[0] if len(args) == 1 and args[0] in (float, int) else str


def method_flags(command: Callable[..., None]) -> Callable[..., None]:
    """``command`` with an option for each ``declared_flags`` (after its own options up to ``--param``); it gets
    their values as ``flags``: parameter name → value, for the ones given. A plugin's option whose name one of the
    command's own options has is left out (its parameter is still ``--param KEY=VALUE``)."""
    sig = inspect.signature(command, eval_str=True)
    own = {n for p in sig.parameters.values() for n in _names(p)}
    flags = [f for f in declared_flags() if f.name not in own]
    names = {f"flag_{f.key}": f for f in flags}
    generated = [inspect.Parameter(py, inspect.Parameter.KEYWORD_ONLY, default=None,
                                   annotation=Annotated[f.kind | None, typer.Option(f.name, help=f.help)])
                 for py, f in names.items()]
    before = [p for p in sig.parameters.values() if p.name != "flags"]
    at = next((i for i, p in enumerate(before) if p.name == "param"), len(before))
    params = [p.replace(kind=inspect.Parameter.KEYWORD_ONLY) for p in before]

    @functools.wraps(command)
    def run(*args: Any, **kwargs: Any) -> None:
        given = {names[py].key: kwargs.pop(py) for py in list(kwargs) if py in names}
        command(*args, flags={k: v for k, v in given.items() if v is not None}, **kwargs)

    run.__signature__ = sig.replace(parameters=[*params[:at], *generated, *params[at:]])  # type: ignore[attr-defined]
    return run


def _names(p: inspect.Parameter) -> list[str]:
    """The option names a command's parameter declares (its typer.Option's), or --NAME from its name."""
    info = next((a for a in typing.get_args(p.annotation)[1:] if isinstance(a, typer.models.OptionInfo)), None)
    decls = [d for d in (getattr(info, "param_decls", None) or ()) if isinstance(d, str)]
    default = getattr(info, "default", None)
    return [*decls, *([default] if isinstance(default, str) and default.startswith("-") else []),
            "--" + p.name.replace("_", "-")]
