"""Which tokenizer, chat template and vocabulary rows the output gets: decided here, once, before any weight is read.

``plan_tokenizer`` compares every agent's tokenizer files with the base's (io/tokenizer.py) and applies the two
choices, with mergekit's meaning (``tokenizer_source``, ``chat_template``):

- ``tokenizer_source`` not given: the base's tokenizer, the vocabulary rows merged as stored (an agent whose
  embedding has other rows is refused by the match, naming the choices);
- ``base``: the base's tokenizer; every model's rows mapped by token into it (an agent's tokens the base lacks are
  dropped, and said);
- ``union``: the base's vocabulary, then every token an agent has and the base lacks, appended in agent order
  (regular tokens first, then added tokens, each agent's by id) as mergekit's ``build_union_tokenizer`` does;
- an agent (as listed, or its folder's name): that agent's tokenizer and vocabulary.

``chat_template``: ``base`` (the default), an agent, ``auto`` (the template most models share, as mergekit), a
``.jinja`` file, a ``chat_template.json`` (a ``.json`` file: its ``chat_template``), or the template's text. The
chosen template, with its named templates, is put where the output's tokenizer keeps its template, and nowhere
else. ``generation_config.json`` is the base's.

When the rows move (io/vocab.py) the plan carries a ``RowPlan``; preflight wraps every model in a ``VocabView``.
"""

from __future__ import annotations

import json
import os
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import ConfigError, InputError, RLMergeError
from .checkpoint import Checkpoint
from .tokenizer import (
    ADDED_FLAGS,
    GENERATION,
    TEMPLATE_DIR,
    TEMPLATE_FILES,
    TOKENIZER_FILES,
    Tokenizer,
    differences,
    named_templates,
    read_tokenizer,
    template_text,
)
from .vocab import RowPlan, embedding_rows

SOURCES = ("base", "union")  # besides an agent
TEMPLATES = ("base", "auto")  # besides an agent, a file or the template's text


@dataclass
class TokenizerPlan:
    """What the output's tokenizer is, and what ``rlmerge.json`` says about it (``to_json``)."""

    source: str  # "base (rows as stored)", "base", "union" or the agent's label
    chat_template: str  # "base", "auto: …", an agent's label, a file, or "given in the recipe"
    differences: list[dict[str, str]] = field(default_factory=list)  # {"agent", "file", "what"}
    warnings: list[str] = field(default_factory=list)
    added: list[dict[str, Any]] = field(default_factory=list)  # tokens new to the base: {"token", "id", "from"}
    dropped: dict[str, list[str]] = field(default_factory=dict)  # agent → its tokens the output lacks
    not_compared: list[str] = field(default_factory=list)  # agents without tokenizer files
    rows: RowPlan | None = None  # None: every vocabulary row as stored
    files: dict[str, Path | bytes] = field(default_factory=dict)  # the output's tokenizer, template, generation files
    vocab_size: int | None = None  # the output's rows when they are not the base's

    @property
    def key(self) -> str:
        """What decides the output's vocabulary rows (part of the resume fingerprint)."""
        if self.rows is None:
            return ""
        return json.dumps([self.source, self.rows.rows, [s.tolist() for s in self.rows.sources]])

    def to_json(self) -> dict[str, Any]:
        doc: dict[str, Any] = {"source": self.source, "chat_template": self.chat_template,
                               "differences": self.differences}
        if self.added:
            doc["added_tokens"] = self.added
        if self.dropped:
            doc["dropped_tokens"] = self.dropped
        if self.not_compared:
            doc["not_compared"] = self.not_compared
        if self.vocab_size is not None:
            doc["vocab_size"] = self.vocab_size
        return doc


def pick_agent(text: str, agents: list[Checkpoint]) -> int | None:
    """The agent ``text`` names: as listed, the same folder, or its folder's name when only one agent has it."""
    for i, a in enumerate(agents):
        if text == a.label:
            return i
    resolved = Path(text).expanduser().resolve() if os.path.exists(text) else None
    for i, a in enumerate(agents):
        if resolved is not None and resolved == a.path.resolve():
            return i
    named = [i for i, a in enumerate(agents) if Path(a.label).name == text or a.path.name == text]
    return named[0] if len(named) == 1 else None


def plan_tokenizer(base: Checkpoint, agents: list[Checkpoint], *, source: str | None = None,
                   chat_template: str | None = None) -> tuple[TokenizerPlan, list[RLMergeError]]:
    """The output's tokenizer (see the module docstring) and every problem with the choices."""
    problems: list[RLMergeError] = []
    pick = None
    if source is not None and source not in SOURCES:
        pick = pick_agent(source, agents)
        if pick is None:
            problems.append(ConfigError(f"tokenizer source {source!r} is neither base, union nor an agent",
                                        hint="give base, union, or an agent as listed (or its folder's name)"))
    plan = TokenizerPlan(source="base (rows as stored)" if source is None else
                         agents[pick].label if pick is not None else source, chat_template="base")
    toks: list[Tokenizer] = []
    for i, m in enumerate((base, *agents)):
        try:
            toks.append(read_tokenizer(m))
        except RLMergeError as e:  # the output's own tokenizer must be read; another agent's is only compared
            toks.append(Tokenizer(m.side_dir))
            if i == 0 or i - 1 == pick or source == "union" or chat_template not in (None, "base"):
                problems.append(e)
            else:
                plan.warnings.append(f"agent {m.label}'s tokenizer files were not compared: {e.render()}")
                plan.not_compared.append(m.label)
    for a, tok in zip(agents, toks[1:]):
        if not tok.has_tokenizer and a.label not in plan.not_compared:
            plan.not_compared.append(a.label)
        found = differences(toks[0], tok)
        plan.differences += [{"agent": a.label, "file": f, "what": w} for f, w in found]
    chosen = toks[0] if pick is None else toks[1 + pick]
    plan.files = {n: chosen.folder / n for n in TOKENIZER_FILES if n in chosen.present}
    plan.files.update({n: toks[0].folder / n for n in TEMPLATE_FILES if n in toks[0].present and pick is None})
    if pick is not None:
        plan.files.update({n: chosen.folder / n for n in TEMPLATE_FILES if n in chosen.present})
    if GENERATION in toks[0].present:
        plan.files[GENERATION] = toks[0].folder / GENERATION
    if source is not None and not problems:
        problems += _rows(plan, base, agents, toks, source, pick)
    if not problems:
        problems += _template(plan, base, agents, toks, chat_template, chosen)
    plan.warnings = _warnings(plan, agents)
    return plan, problems


def _vocab(tok: Tokenizer, rows: int | None, fallback: Tokenizer) -> dict[str, int]:
    """token → id of the rows a model stores (mergekit: ids past its vocab_size do not count); a model without a
    readable vocabulary has the base's (mergekit assumes so too)."""
    vocab = tok.vocab if tok.vocab is not None else (fallback.vocab or {})
    return {t: i for t, i in vocab.items() if rows is None or i < rows}


def _rows(plan: TokenizerPlan, base: Checkpoint, agents: list[Checkpoint], toks: list[Tokenizer], source: str,
          pick: int | None) -> list[RLMergeError]:
    """The output's vocabulary and where each of its rows comes from in every model (io/vocab.RowPlan)."""
    models = [base, *agents]
    counts = [embedding_rows(m) for m in models]
    if toks[0].vocab is None or (pick is not None and toks[1 + pick].vocab is None):
        whose = toks[0] if toks[0].vocab is None else toks[1 + pick]  # type: ignore[operator]
        return [InputError(f"tokenizer_source {source}: no vocabulary rlmerge can read (tokenizer.json or vocab.json)",
                           file=str(whose.folder), hint="save the tokenizer with a tokenizer.json "
                                                         "(transformers' save_pretrained writes one)")]
    vocabs = [_vocab(t, counts[m], toks[0]) for m, t in enumerate(toks)]
    for m, tok in enumerate(toks[1:], 1):
        if tok.vocab is None:
            plan.warnings.append(f"agent {models[m].label} has no tokenizer files: its vocabulary is taken to be "
                                 "the base's (as mergekit assumes)")
    if pick is not None:
        out = dict(vocabs[1 + pick])
    else:
        out = dict(vocabs[0])
        if source == "union":
            _union(plan, out, vocabs, toks, agents)
    stored = counts[1 + pick] if pick is not None else counts[0]
    n_rows = max(stored or 0, max(out.values(), default=-1) + 1)
    plan.dropped = {agents[m - 1].label: sorted(set(v) - set(out), key=v.__getitem__)
                    for m, v in enumerate(vocabs) if m and set(v) - set(out)}
    keys: list[Any] = [("pad", i) for i in range(n_rows)]
    for t, i in out.items():
        keys[i] = ("tok", t)
    sources = []
    for m, v in enumerate(vocabs):
        own: dict[Any, int] = {("tok", t): i for t, i in v.items()}
        taken = set(v.values())
        own.update({("pad", i): i for i in range(counts[m] or 0) if i not in taken})
        sources.append(np.array([own.get(k, -1) for k in keys], dtype=np.int64))
    rows = RowPlan(n_rows, sources, models)
    if all(rows.identity(m, c) for m, c in enumerate(counts) if c is not None):
        return []  # every model stores the output's rows as they are: nothing to remap
    lora = [m for m in agents if not m.stored_bytes]
    if lora:
        return [InputError(f"the vocabulary rows move (tokenizer_source {source}) and agent {lora[0].label} is a "
                           "LoRA adapter, whose τ is laid out on the base's rows", file=str(lora[0].path),
                           hint="merge the adapter into a full model first (PEFT's merge_and_unload) and pass "
                                "that, or leave tokenizer_source unset")]
    plan.rows = rows
    if n_rows != counts[0]:
        plan.vocab_size = n_rows
    return []


def _union(plan: TokenizerPlan, out: dict[str, int], vocabs: list[dict[str, int]], toks: list[Tokenizer],
           agents: list[Checkpoint]) -> None:
    """Append to ``out`` every token an agent has and the base lacks, and rewrite the tokenizer files to hold them."""
    next_id = max(out.values(), default=-1) + 1
    new: list[tuple[str, dict[str, Any], str]] = []  # (token, added-token entry, first agent that has it)
    for regular in (True, False):
        for m, (v, tok) in enumerate(zip(vocabs[1:], toks[1:]), 1):
            for t in sorted(v, key=v.__getitem__):
                if t in out or (t in tok.added) == regular:
                    continue
                entry = {k: False for k in ADDED_FLAGS} | {"normalized": True} if regular else dict(tok.added[t])
                entry["id"] = next_id
                out[t] = next_id
                next_id += 1
                new.append((t, entry, agents[m - 1].label))
    for t, entry, _ in new:
        plan.added.append({"token": t, "id": entry["id"], "from": [a.label for a, v in zip(agents, vocabs[1:])
                                                                  if t in v]})
    if new:
        plan.files.update(_union_files(toks[0], [(t, e) for t, e, _ in new]))


def _dumps(doc: Any) -> bytes:
    return (json.dumps(doc, indent=2, ensure_ascii=False) + "\n").encode()


def _union_files(base: Tokenizer, new: list[tuple[str, dict[str, Any]]]) -> dict[str, bytes]:
    """The base's tokenizer files with ``new`` added tokens, as transformers' ``add_tokens`` writes them."""
    files: dict[str, bytes] = {}
    flags = [(t, {"content": t, **{k: e[k] for k in ADDED_FLAGS}}, e["id"]) for t, e in new]
    fast = base.docs.get("tokenizer.json")
    if isinstance(fast, dict):
        doc = dict(fast)
        doc["added_tokens"] = [*(doc.get("added_tokens") or []), *({"id": i, **f} for _, f, i in flags)]
        files["tokenizer.json"] = _dumps(doc)
    config = base.docs.get("tokenizer_config.json")
    if isinstance(config, dict):
        doc = dict(config)
        doc["added_tokens_decoder"] = {**(doc.get("added_tokens_decoder") or {}),
                                       **{str(i): f for _, f, i in flags}}
        files["tokenizer_config.json"] = _dumps(doc)
    if "added_tokens.json" in base.present or "tokenizer.json" not in base.present:
        extra = base.docs.get("added_tokens.json")
        files["added_tokens.json"] = _dumps({**(extra if isinstance(extra, dict) else {}),
                                             **{t: i for t, _, i in flags}})
    return files


def _template(plan: TokenizerPlan, base: Checkpoint, agents: list[Checkpoint], toks: list[Tokenizer],
              choice: str | None, chosen: Tokenizer) -> list[RLMergeError]:
    """The chat template of the output (the base's by default), put where the output's tokenizer keeps one. A
    model's template comes with its named templates (``tool_use`` …): they are one choice."""
    chat, name = toks[0].chat, "base"
    if choice == "auto":  # mergekit: the template most models share (the base counted first)
        found = [t.template for t in toks if t.template is not None]
        if found:
            text = Counter(found).most_common(1)[0][0]
            owners = [m.label for m, t in zip([base, *agents], toks) if t.template == text]
            chat = next(t.chat for t in toks if t.template == text)
        name = f"auto: the template of {', '.join(owners)}" if found else "auto: no model has a template"
    elif choice not in (None, "base"):
        pick = pick_agent(choice, agents)
        if pick is not None:
            chat, name = toks[1 + pick].chat, agents[pick].label
            if chat is None:
                return [InputError(f"agent {name} has no chat template", file=str(toks[1 + pick].folder),
                                   hint="choose base, another agent, or a .jinja file")]
        elif os.path.isfile(choice):
            try:
                chat, name = _template_file(Path(choice)), str(choice)
            except RLMergeError as e:
                return [e]
        elif "{{" in choice or "{%" in choice:
            chat, name = choice, "given in the recipe"
        else:
            return [ConfigError(f"chat template {choice!r} is neither base, auto, an agent, a file nor a template",
                                hint="give base, auto, an agent as listed, a .jinja file, a chat_template.json, or "
                                     "the template's text (mergekit's built-in names are not shipped: give the "
                                     "template's file)")]
    plan.chat_template = name
    if template_text(chat) == chosen.template and chosen.template_file != TEMPLATE_DIR:
        return []  # the output's tokenizer already holds it where it keeps it
    _place_template(plan, chosen, chat)
    return []


def _template_file(path: Path) -> str | dict[str, str]:
    """A chat template given as a file: a ``.json`` is a chat_template.json (its ``chat_template``: a template or a
    list of named ones), anything else the template's text (a ``.jinja``)."""
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"cannot read the chat template file: {e}", file=str(path)) from e
    if path.suffix.lower() != ".json":
        return text
    hint = ('a .json file is read as a chat_template.json: {"chat_template": "…"} (or a list of {"name", '
            '"template"}); give the template itself as a .jinja file')
    try:
        doc = json.loads(text)
    except (ValueError, RecursionError) as e:
        raise ConfigError(f"the chat template file is not valid JSON: {e}", file=str(path), hint=hint) from e
    try:
        chat = named_templates(doc.get("chat_template") if isinstance(doc, dict) else None, path)
    except InputError as e:
        raise ConfigError(e.message, file=str(path), hint=hint) from e
    if chat is None:
        raise ConfigError("the chat template file has no chat_template key", file=str(path), hint=hint)
    return chat


def _place_template(plan: TokenizerPlan, tok: Tokenizer, chat: str | dict[str, str] | None) -> None:
    """Write ``chat`` where ``tok`` keeps its chat template (chat_template.jinja when it has none) and take every
    other copy out, so that transformers reads ``chat`` whatever its precedence. Named templates go into
    tokenizer_config.json as the list transformers reads there: the output folder holds plain files only (its
    manifest proves them rlmerge's), so transformers 5's additional_chat_templates/ folder is not written."""
    home = tok.template_file if tok.template_file not in (None, TEMPLATE_DIR) else "chat_template.jinja"
    if isinstance(chat, dict):
        home = "tokenizer_config.json"
    for name in TEMPLATE_FILES:
        plan.files.pop(name, None)
    current = plan.files.get("tokenizer_config.json")
    config = json.loads(current) if isinstance(current, bytes) else tok.docs.get("tokenizer_config.json")
    if config is None and home == "tokenizer_config.json":
        config = {}
    if isinstance(config, dict) and ("chat_template" in config or home == "tokenizer_config.json"):
        doc = {k: v for k, v in config.items() if k != "chat_template"}
        if home == "tokenizer_config.json" and chat is not None:
            doc["chat_template"] = chat if isinstance(chat, str) else [{"name": k, "template": v}
                                                                       for k, v in chat.items()]
        plan.files["tokenizer_config.json"] = _dumps(doc)
    if isinstance(chat, str) and home == "chat_template.json":
        plan.files[home] = _dumps({"chat_template": chat})
    elif isinstance(chat, str) and home == "chat_template.jinja":
        plan.files[home] = chat.encode()


def _warnings(plan: TokenizerPlan, agents: list[Checkpoint]) -> list[str]:
    """One warning per agent whose tokenizer files differ, saying what the output carries; and what was dropped."""
    out = list(plan.warnings)
    by_agent: dict[str, list[str]] = {}
    for d in plan.differences:
        by_agent.setdefault(d["agent"], []).append(f"{d['file']}: {d['what']}")
    tokenizer = {"base (rows as stored)": "the base's tokenizer", "base": "the base's tokenizer",
                 "union": "the union of the tokenizers"}.get(plan.source, f"the tokenizer of {plan.source}")
    carried = f"the output carries {tokenizer} and the chat template of {plan.chat_template}"
    for label, items in by_agent.items():
        out.append(f"agent {label}'s tokenizer files differ from the base's ({'; '.join(items)}); {carried} "
                   "(--tokenizer-source, --chat-template to choose)")
    for label, toks in plan.dropped.items():
        out.append(f"tokenizer_source {plan.source}: agent {label}'s token(s) "
                   + ", ".join(repr(t) for t in toks[:5]) + (" …" if len(toks) > 5 else "")
                   + " are not in the output's vocabulary: their rows are dropped")
    return out
