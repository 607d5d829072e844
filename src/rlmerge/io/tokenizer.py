"""What a model's tokenizer files say, and how an agent's differ from the base's: read as JSON, no transformers.

A merged model is used through its tokenizer and chat template: an agent that added a special token
(``<tool_call>``) or changed its chat template must not be merged silently under the base's. This module reads
each model's tokenizer files (``tokenizer.json``, ``tokenizer_config.json``, ``special_tokens_map.json``,
``added_tokens.json``, ``vocab.json``, ``merges.txt``, ``tokenizer.model``, ``chat_template.jinja`` /
``.json``, ``additional_chat_templates/*.jinja``, ``generation_config.json``) and lists every difference by agent
and file:

- the vocabulary (token → id, from ``tokenizer.json``'s model and added tokens, or ``vocab.json`` +
  ``added_tokens.json``): tokens only one side has, tokens with another id;
- added tokens (their ``special`` flag, stripping), the bos / eos / pad / unk tokens;
- the chat template in force (``chat_template.jinja`` with transformers 5's named templates in
  ``additional_chat_templates/``, else ``chat_template.json``, else ``tokenizer_config.json``'s, as transformers
  reads them): one template, or named ones (a list of ``{"name", "template"}``), compared name by name;
  ``generation_config.json``'s fields, and files compared as bytes (``merges.txt``, ``tokenizer.model``).

Every file is read inside the model's folder (``Checkpoint.check_inside``); a file that is not valid JSON is an
``InputError`` naming it.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import InputError
from .checkpoint import Checkpoint

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                   "vocab.json", "merges.txt", "tokenizer.model")
TEMPLATE_FILES = ("chat_template.jinja", "chat_template.json")
TEMPLATE_DIR = "additional_chat_templates"  # transformers 5: the named templates besides chat_template.jinja
GENERATION = "generation_config.json"
ROLES = ("bos_token", "eos_token", "pad_token", "unk_token")
BYTES_ONLY = ("merges.txt", "tokenizer.model")  # compared as bytes: rlmerge does not parse them
ADDED_FLAGS = ("special", "lstrip", "rstrip", "normalized", "single_word")
SHOWN = 5  # tokens listed in a difference; the count says how many more
# the files a tokenizer is built from (fast JSON, its config, SentencePiece, BPE vocabulary): a folder with none of
# them loads an empty one from config.json alone
LOADABLE = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def loadable_tokenizer(folder: Path) -> bool:
    """Whether ``folder`` holds a file a tokenizer can be built from (``LOADABLE``)."""
    return any((folder / name).is_file() for name in LOADABLE)


@dataclass
class Tokenizer:
    """One model's tokenizer files, as read (nothing here is a decision)."""

    folder: Path
    present: list[str] = field(default_factory=list)  # the tokenizer, template and generation files found
    vocab: dict[str, int] | None = None  # token → id, added tokens included; None: unreadable (sentencepiece only)
    added: dict[str, dict[str, Any]] = field(default_factory=dict)  # content → {"id", "special", …} (added tokens)
    roles: dict[str, str | None] = field(default_factory=dict)  # bos_token … → its text
    chat: str | dict[str, str] | None = None  # the chat template in force, as transformers holds it: one or named
    template: str | None = None  # the same as one text to compare (named templates: their JSON, by name)
    template_file: str | None = None  # where it lives (TEMPLATE_DIR: chat_template.jinja and the named files)
    generation: dict[str, Any] | None = None
    docs: dict[str, Any] = field(default_factory=dict)  # parsed JSON files, by name
    digests: dict[str, str] = field(default_factory=dict)  # SHA-256 of the files compared as bytes

    @property
    def has_tokenizer(self) -> bool:
        return any(n in self.present for n in TOKENIZER_FILES)


def _text(value: Any) -> str | None:
    """A special token as tokenizer_config.json writes it: a string, or {"content": …} (an AddedToken)."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _json(ckpt: Checkpoint, path: Path) -> Any:
    ckpt.check_inside(path)
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError) as e:  # ValueError: bad JSON or bad UTF-8
        raise InputError(f"cannot parse {path.name}: {type(e).__name__}: {e}", file=str(path),
                         hint="the tokenizer file is corrupt: copy it again from the model it came from") from e


def _mapping(doc: Any, path: Path, key: str) -> dict[str, Any]:
    value = doc.get(key) if isinstance(doc, dict) else None
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise InputError(f"{key} is not a mapping", file=str(path), hint="the tokenizer file is corrupt")
    return value


def _entry(raw: Any, path: Path) -> tuple[str, dict[str, Any]]:
    """(content, {"id", flags…}) of one added token."""
    if not isinstance(raw, dict) or not isinstance(raw.get("content"), str) or type(raw.get("id")) is not int:
        raise InputError(f"an added token without a string content and an integer id: {raw!r}"[:200],
                         file=str(path), hint="the tokenizer file is corrupt")
    return raw["content"], {"id": raw["id"], **{k: bool(raw.get(k, False)) for k in ADDED_FLAGS}}


def read_tokenizer(ckpt: Checkpoint) -> Tokenizer:
    """The tokenizer files of ``ckpt`` (its ``side_dir``); files it lacks stay empty."""
    tok = Tokenizer(ckpt.side_dir)
    folder = ckpt.side_dir
    for name in (*TOKENIZER_FILES, *TEMPLATE_FILES, GENERATION):
        path = folder / name
        if not path.is_file():
            continue
        tok.present.append(name)
        if name in BYTES_ONLY:
            ckpt.check_inside(path)
            tok.digests[name] = hashlib.sha256(path.read_bytes()).hexdigest()
        elif name == "chat_template.jinja":
            ckpt.check_inside(path)
            tok.docs[name] = path.read_text(encoding="utf-8", errors="replace")
        else:
            tok.docs[name] = _json(ckpt, path)
    named = folder / TEMPLATE_DIR
    if named.is_dir():  # what transformers 5's save_pretrained writes for named templates, and its loader globs
        for path in sorted(named.glob("*.jinja")):
            ckpt.check_inside(path)
            name = f"{TEMPLATE_DIR}/{path.name}"
            tok.present.append(name)
            tok.docs[name] = path.read_text(encoding="utf-8", errors="replace")
    _read_vocab(tok)
    config = tok.docs.get("tokenizer_config.json")
    specials = tok.docs.get("special_tokens_map.json")
    for role in ROLES:
        value = _text(config.get(role)) if isinstance(config, dict) else None
        if value is None and isinstance(specials, dict):
            value = _text(specials.get(role))
        tok.roles[role] = value
    tok.chat, tok.template_file = _template(tok)
    tok.template = template_text(tok.chat)
    gen = tok.docs.get(GENERATION)
    tok.generation = gen if isinstance(gen, dict) else None
    return tok


def _read_vocab(tok: Tokenizer) -> None:
    """token → id from tokenizer.json (its model's vocabulary and its added tokens), else vocab.json and
    added_tokens.json; added tokens also from tokenizer_config.json's added_tokens_decoder."""
    folder = tok.folder
    fast = tok.docs.get("tokenizer.json")
    if fast is not None:
        path = folder / "tokenizer.json"
        model = fast.get("model") if isinstance(fast, dict) else None
        vocab = model.get("vocab") if isinstance(model, dict) else None
        if isinstance(vocab, dict) and all(type(v) is int for v in vocab.values()):
            tok.vocab = dict(vocab)  # BPE, WordLevel, WordPiece
        elif isinstance(vocab, list):  # Unigram: [[piece, score], …], the id is the position
            tok.vocab = {p[0]: i for i, p in enumerate(vocab) if isinstance(p, list) and p and isinstance(p[0], str)}
        else:
            raise InputError("tokenizer.json has no model vocabulary rlmerge can read", file=str(path),
                             hint="the tokenizer file is corrupt")
        for raw in fast.get("added_tokens") or []:
            content, entry = _entry(raw, path)
            tok.added[content] = entry
    elif "vocab.json" in tok.docs:
        path = folder / "vocab.json"
        vocab = tok.docs["vocab.json"]
        if not isinstance(vocab, dict) or not all(type(v) is int for v in vocab.values()):
            raise InputError("vocab.json is not a mapping of tokens to ids", file=str(path))
        tok.vocab = dict(vocab)
    extra = tok.docs.get("added_tokens.json")
    if extra is not None:
        path = folder / "added_tokens.json"
        if not isinstance(extra, dict) or not all(type(v) is int for v in extra.values()):
            raise InputError("added_tokens.json is not a mapping of tokens to ids", file=str(path))
        for content, i in extra.items():
            tok.added.setdefault(content, {"id": i, **{k: False for k in ADDED_FLAGS}})
    config = tok.docs.get("tokenizer_config.json")
    path = folder / "tokenizer_config.json"
    for key, raw in _mapping(config, path, "added_tokens_decoder").items():
        if not str(key).isdigit():
            raise InputError(f"added_tokens_decoder key {key!r} is not a token id", file=str(path))
        content, entry = _entry({**raw, "id": int(key)} if isinstance(raw, dict) else raw, path)
        tok.added.setdefault(content, entry)
    if tok.vocab is not None:
        tok.vocab.update({c: e["id"] for c, e in tok.added.items()})


def named_templates(value: Any, path: Path) -> str | dict[str, str] | None:
    """A ``chat_template`` value as transformers holds it: a text, or named texts (tokenizer_config.json writes them
    as a list of ``{"name", "template"}``); ``{"default": text}`` alone is that text. InputError for anything else."""
    if value is None or isinstance(value, str):
        return value
    items: list[tuple[Any, Any]] = [(None, None)]
    if isinstance(value, list):  # tokenizer_config.json's form
        items = [(e.get("name"), e.get("template")) if isinstance(e, dict) else (None, None) for e in value]
    elif isinstance(value, dict):  # transformers' own (tokenizer.chat_template)
        items = list(value.items())
    if not items or not all(isinstance(n, str) and isinstance(t, str) for n, t in items):
        raise InputError(f"chat_template is neither a template nor a list of named templates: {value!r}"[:200],
                         file=str(path), hint='write one template\'s text, or [{"name": …, "template": …}, …]')
    named = dict(items)
    return named["default"] if list(named) == ["default"] else named


def template_text(chat: str | dict[str, str] | None) -> str | None:
    """A chat template as one text to compare: named templates as their JSON, sorted by name (transformers picks
    them by name, so their order does not matter)."""
    return json.dumps(chat, sort_keys=True) if isinstance(chat, dict) else chat


def _template(tok: Tokenizer) -> tuple[str | dict[str, str] | None, str | None]:
    """The chat template transformers uses, and the file it comes from: the template files (chat_template.jinja, the
    named ones in additional_chat_templates/) win, then chat_template.json, then tokenizer_config.json's."""
    extra = {n.removeprefix(f"{TEMPLATE_DIR}/").removesuffix(".jinja"): t for n, t in tok.docs.items()
             if n.startswith(f"{TEMPLATE_DIR}/")}
    if extra:  # transformers 5: {"default": chat_template.jinja, NAME: additional_chat_templates/NAME.jinja, …}
        default = {"default": tok.docs["chat_template.jinja"]} if "chat_template.jinja" in tok.docs else {}
        return {**default, **extra}, TEMPLATE_DIR
    if "chat_template.jinja" in tok.docs:
        return tok.docs["chat_template.jinja"], "chat_template.jinja"
    for name in ("chat_template.json", "tokenizer_config.json"):
        doc = tok.docs.get(name)
        value = named_templates(doc.get("chat_template"), tok.folder / name) if isinstance(doc, dict) else None
        if value is not None:
            return value, name
    return None, None


def _template_change(base: Tokenizer, agent: Tokenizer) -> tuple[str, str]:
    """(file, what) for an agent whose chat template is not the base's: the named templates that differ, by name."""
    if agent.chat is None:
        return "tokenizer_config.json", "has no chat template (the base has one)"
    if base.chat is None:
        return agent.template_file or "chat_template.jinja", "has a chat template (the base has none)"
    if not isinstance(base.chat, dict) and not isinstance(agent.chat, dict):
        return agent.template_file or "chat_template.jinja", "chat template differs"
    b = base.chat if isinstance(base.chat, dict) else {"default": base.chat}
    a = agent.chat if isinstance(agent.chat, dict) else {"default": agent.chat}
    names = sorted((n for n in {*a, *b} if a.get(n) != b.get(n)), key=lambda n: (n != "default", n))
    where = agent.template_file or "chat_template.jinja"
    if where == TEMPLATE_DIR:  # the first file that differs
        where = "chat_template.jinja" if names[0] == "default" else f"{TEMPLATE_DIR}/{names[0]}.jinja"
    return where, "chat template differs (named: " + _listed(
        [f"{n} ({'the base lacks it' if n not in b else 'the agent lacks it' if n not in a else 'differs'})"
         for n in names]) + ")"


# -- differences --------------------------------------------------------------------------------------------
def _listed(items: list[str]) -> str:
    shown = ", ".join(items[:SHOWN])
    return shown + (f" and {len(items) - SHOWN} more" if len(items) > SHOWN else "")


def _vocab_file(tok: Tokenizer) -> str:
    return "tokenizer.json" if "tokenizer.json" in tok.present else "vocab.json"


def differences(base: Tokenizer, agent: Tokenizer) -> list[tuple[str, str]]:
    """(file, what differs) for every way ``agent``'s tokenizer files differ from ``base``'s."""
    out: list[tuple[str, str]] = []
    if base.vocab is not None and agent.vocab is not None:
        theirs = sorted(set(agent.vocab) - set(base.vocab), key=lambda t: agent.vocab[t])  # type: ignore[index]
        ours = sorted(set(base.vocab) - set(agent.vocab), key=lambda t: base.vocab[t])  # type: ignore[index]
        moved = sorted((t for t in set(base.vocab) & set(agent.vocab) if base.vocab[t] != agent.vocab[t]),
                       key=lambda t: base.vocab[t])  # type: ignore[index]
        where = _vocab_file(agent)
        if theirs:
            out.append((where, f"{len(theirs)} token(s) the base lacks: "
                               + _listed([f"{t!r} (id {agent.vocab[t]})" for t in theirs])))
        if ours:
            out.append((where, f"lacks {len(ours)} token(s) of the base's: " + _listed([repr(t) for t in ours])))
        if moved:
            out.append((where, f"{len(moved)} token(s) with another id: " + _listed(
                [f"{t!r} {base.vocab[t]} → {agent.vocab[t]}" for t in moved])))
    elif (base.vocab is None) != (agent.vocab is None) and base.has_tokenizer and agent.has_tokenizer:
        out.append(("tokenizer.json", "only one of the two has a vocabulary rlmerge can read (tokenizer.json or "
                                      "vocab.json)"))
    for content in sorted(set(base.added) & set(agent.added), key=lambda c: base.added[c]["id"]):
        a, b = agent.added[content], base.added[content]
        flags = [k for k in ADDED_FLAGS if a[k] != b[k]]
        if flags:
            out.append(("tokenizer.json", f"added token {content!r}: " + ", ".join(
                f"{k} {b[k]} → {a[k]}" for k in flags)))
    for role in ROLES:
        if base.roles.get(role) != agent.roles.get(role) and agent.has_tokenizer:
            out.append(("tokenizer_config.json", f"{role} {base.roles.get(role)!r} → {agent.roles.get(role)!r}"))
    if base.template != agent.template and agent.has_tokenizer:
        out.append(_template_change(base, agent))
    if agent.generation is not None and base.generation != agent.generation:
        b_gen = base.generation or {}
        keys = sorted(k for k in set(b_gen) | set(agent.generation) if b_gen.get(k) != agent.generation.get(k))
        out.append((GENERATION, ", ".join(f"{k} {b_gen.get(k)!r} → {agent.generation.get(k)!r}"
                                          for k in keys[:SHOWN]) + (" …" if len(keys) > SHOWN else "")))
    for name in BYTES_ONLY:
        if name in agent.digests and base.digests.get(name) != agent.digests[name]:
            out.append((name, "differs" if name in base.digests else "the base has none"))
    return out
