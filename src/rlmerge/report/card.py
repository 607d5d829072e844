"""The model card (``README.md``): metadata the Hub accepts, written with huggingface_hub's ``ModelCardData``.

The metadata follows the Hub's convention for merges: ``base_model`` lists the Hub repositories of the base and of
every agent that came from the Hub (a local folder is not a model id, and ``org/name@rev`` is not one either: local
paths and revisions go in the body and in ``rlmerge.json``), with ``base_model_relation: merge``; ``tags`` hold
``merge``, ``rlmerge`` and the method. A LoRA adapter output (``--output-format peft``) is an adapter of the base:
``base_model`` is the base's id, ``base_model_relation: adapter``, ``library_name: peft``. The body says what was
merged, with what tokenizer and chat template, the agents' table, the recipe that reproduces the merge (checked
by engine/reproduce.py), and every warning. Deterministic: no timestamps.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..stream.match import Match
from .provenance import COLUMN, PERCENT, Merged, agent_rows

if TYPE_CHECKING:
    from huggingface_hub import ModelCardData

HUB = "https://huggingface.co/"


@dataclass(frozen=True)
class Reproduce:
    """How to run this merge again: ``kind`` "recipe" (``text`` is YAML) or "command" (a command line); engine/
    reproduce.py makes it, checked by parsing it back."""

    kind: str
    text: str


def hub_ids(match: Match) -> list[str]:
    """The Hub repositories among the inputs, base first, each once."""
    return list(dict.fromkeys(m.hub_id for m in (match.base, *match.agents) if m.hub_id))


def card_data(match: Match, result: Merged, *, adapter: bool = False) -> ModelCardData:
    from huggingface_hub import ModelCardData  # imported when used: it reads HF_* variables once, at import

    tags = ["merge", "rlmerge", result.method, *(["lora", "peft"] if adapter else [])]
    if adapter:
        ids = [match.base.hub_id] if match.base.hub_id else []
        relation = "adapter"
    else:
        ids = hub_ids(match)
        relation = "merge"
    return ModelCardData(base_model=ids or None, library_name="peft" if adapter else "transformers", tags=tags,
                         **({"base_model_relation": relation} if ids else {}))


def _model(m: Any) -> str:
    where = f" ([{m.hub_id}]({HUB}{m.hub_id})" + (f", revision `{m.revision}`" if m.revision else "") + ")" \
        if m.hub_id else ""
    return f"`{m.label}`{where}"


def _tokenizer_lines(match: Match) -> list[str]:
    plan = match.tokenizer
    if plan is None:
        return []
    source = {"base (rows as stored)": "the base's", "base": "the base's (every model's rows mapped by token)",
              "union": "the union of the models' tokenizers"}.get(plan.source, f"the agent `{plan.source}`'s")
    template = "the base's" if plan.chat_template == "base" else f"`{plan.chat_template}`"
    lines = [f"Tokenizer: {source}. Chat template: {template}."]
    if plan.added:
        lines[0] += " Tokens added to the base's vocabulary: " + ", ".join(
            f"`{a['token']}` (id {a['id']})" for a in plan.added[:10]) + (" …" if len(plan.added) > 10 else "") + "."
    return [*lines, ""]


def _table(result: Merged) -> list[str]:
    rows = agent_rows(result)
    cols = [c for c in ("agent", "density", "kept", "changed", "unique", "shared", "rho", "lambda", "lambda_kept")
            if c in rows[0]]
    lines = ["| " + " | ".join(COLUMN.get(c, c) for c in cols) + " |", "|" + "---|" * len(cols)]
    for r in rows:
        cells = []
        for c in cols:
            v = r[c]
            cells.append("—" if v is None else f"{v:.2%}" if c in PERCENT else f"{v:.4f}" if isinstance(v, float)
                         else f"{v}")
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def adapter_lines(summary: Mapping[str, Any] | None) -> list[str]:
    """The adapter's section: each linear layer's kept rank and relative error (the SVD tail ‖Δ − BA‖_F / ‖Δ‖_F)."""
    if summary is None:
        return []
    mats = summary["matrices"]
    lines = ["## LoRA adapter", "",
             f"The merged task vector Δ = merged − base of each linear layer, as B·A of the rank asked "
             f"(`--rank {summary['rank']}`): {len(mats)} matrices, {summary['parameters']:,} parameters, largest "
             f"relative error {summary['max_relative_error']:.3g}. Saved whole (modules_to_save): "
             + (", ".join(f"`{m}`" for m in summary["modules_to_save"]) or "none") + ".", "",
             "| matrix | rank kept | of | relative error |", "|---|---:|---:|---:|"]
    lines += [f"| {n} | {m['rank']} | {m['of']} | {m['relative_error']:.3g} |" for n, m in mats.items()]
    return [*lines, ""]


def model_card(match: Match, result: Merged, *, reproduce: Reproduce | None = None,
               adapter: Mapping[str, Any] | None = None, extra: Sequence[str] = ()) -> str:
    """The card's text: metadata, then the body (``extra``: more Markdown before the warnings).

    The text ``huggingface_hub.ModelCard`` makes of it (``card_text``; tests/test_card.py parses it back with
    ``ModelCard`` and checks that it is unchanged), written without importing ``ModelCard``'s module, which imports the
    Hub's client: 0.23–0.26 s of every merge in a fresh process (docs/benchmarks.md, 2026-12-07)."""
    data = card_data(match, result, adapter=adapter is not None)
    what = "A LoRA adapter of a merge" if adapter is not None else "Merged"
    lines = [f"# {what} with rlmerge ({result.method})", "",
             f"Base model: {_model(match.base)}. Agents merged ({len(match.agents)}):",
             *(f"- {_model(a)}" for a in match.agents), "", *_tokenizer_lines(match)]
    params = dataclasses.asdict(result.params) if dataclasses.is_dataclass(result.params) else {}
    if params:
        shown = {k: ("per tensor" if k in result.per_tensor else v) for k, v in params.items()}
        lines += ["Parameters: " + ", ".join(f"`{k}={v}`" for k, v in shown.items()), ""]
    if result.per_tensor:
        lines += ["Per tensor (the recipe's gradients over the layers and filters on tensor names, as mergekit):",
                  *(f"- `{k}`: {v}" for k, v in result.per_tensor.items()), ""]
    if result.defaults:
        lines += ["Defaults applied (mergekit's, for a recipe in its layout):", *(f"- {d}" for d in result.defaults),
                  ""]
    lines += [*_table(result), "",
              f"Elements counted: {result.statistics.numel:,} (changed means |τ| > {result.statistics.epsilon:g}).",
              "Provenance (inputs, file hashes, parameters): `rlmerge.json`.", ""]
    if reproduce is not None and reproduce.kind == "recipe":
        lines += ["## Recipe", "", "Run again with `rlmerge merge --recipe recipe.yml -o OUT` (mergekit's layout; "
                  "rlmerge's own keys beside it):", "", "```yaml", reproduce.text.rstrip("\n"), "```", ""]
    elif reproduce is not None:
        lines += ["## Command", "", "```sh", reproduce.text, "```", ""]
    lines += list(extra)
    if result.warnings:
        lines += ["## Warnings", "", *(f"- {w}" for w in result.warnings), ""]
    return card_text(data, lines)


def card_text(data: ModelCardData, lines: Sequence[str]) -> str:
    """The card's metadata, then its body's ``lines``: the text ``huggingface_hub.ModelCard`` makes of them."""
    return f"---\n{data.to_yaml()}\n---\n\n" + "\n".join(lines)
