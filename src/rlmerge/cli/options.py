"""Options that several commands share (`merge` and `plan`; `eval`, `sweep` and `lab`): one declaration, one help
text."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from ..methods import REGISTRY
from ..methods.ram import PRESETS
from ..sandbox import UNSAFE_FLAG

Models = Annotated[list[str] | None, typer.Argument(help="BASE then AGENT... (folders or hub ids)")]
Method = Annotated[str | None, typer.Option(help=f"{', '.join(REGISTRY)} (docs/methods.md)")]
Recipe = Annotated[Path | None, typer.Option(help="YAML recipe (mergekit layout)")]
Preset = Annotated[str | None, typer.Option(help=f"RAM+: {', '.join(PRESETS)}")]
R = Annotated[float | None, typer.Option("--r", help="RAM+ strength r (paper: 0.1)")]
Alpha = Annotated[float | None, typer.Option(help="RAM+ clip α on ρ (paper: 2.0)")]
RescaleFactor = Annotated[float | None, typer.Option(help="RAM+ official preset's R (1.2)")]
Eps = Annotated[float | None, typer.Option("--eps", help="changed means |τ| > eps (1e-5)")]
Scaling = Annotated[float | None, typer.Option(help="task arithmetic λ")]
Param = Annotated[list[str] | None, typer.Option("--param", help="any method parameter, KEY=VALUE")]
Dtype = Annotated[str | None, typer.Option(help="output dtype: bfloat16, float16, float32, or base (default: the "
                                                 "base's; float32 for ram+, whose rescale rounds away in bf16)")]
ShardSize = Annotated[str | None, typer.Option(help="max shard size, e.g. 5GB")]
BlockSize = Annotated[int | None, typer.Option(help="elements per block (memory bound)")]
AllowMissing = Annotated[bool, typer.Option(help="an agent missing a tensor counts as unchanged")]
CountTiedTwice = Annotated[bool, typer.Option(help="count tied embeddings twice, as the authors' script")]
TokenizerSource = Annotated[str | None, typer.Option(help="the output's tokenizer, as mergekit's tokenizer_source: "
                                                         "base (rows mapped by token), union (every model's tokens) "
                                                         "or an AGENT (default: the base's, rows as stored)")]
ChatTemplate = Annotated[str | None, typer.Option(help="the output's chat template: base (default), auto (the one "
                                                       "most models share), an AGENT, a .jinja FILE, or its text")]
PushToHub = Annotated[str | None, typer.Option(help="upload the finished output to this Hub repository (ORG/NAME): "
                                                    "checked before any weight is read, pushed once complete")]
Private = Annotated[bool, typer.Option(help="--push-to-hub: create the repository private")]
Revision = Annotated[str | None, typer.Option(help="--push-to-hub: the branch to commit to (created if needed)")]
UnsafeUnisolatedCode = Annotated[bool, typer.Option(
    UNSAFE_FLAG, help="where bubblewrap cannot isolate it, run model-written code (the coding scorer) WITHOUT "
                      "isolation: it can then read and write your files and reach the network. Only for models you "
                      "trust (docs/guarantees.md)")]
