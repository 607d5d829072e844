"""Named chat templates and template files: what the output's tokenizer renders, as transformers loads it.

A tool-use model often ships named templates besides its default one: a ``tokenizer_config.json`` list of
``{"name", "template"}``, or, as transformers 5's ``save_pretrained`` writes them, ``chat_template.jinja`` plus
``additional_chat_templates/NAME.jinja``. The oracle is transformers itself: the output, loaded with
``AutoTokenizer``, renders every named template exactly as the chosen source model does.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import rlmerge
from conftest import TINY
from rlmerge.cli import main as cli_main
from rlmerge.errors import ConfigError
from rlmerge.synthetic import make_example
from test_tokenizers import _edit

transformers = pytest.importorskip("transformers")

DEFAULT = "{% for m in messages %}D:{{ m['content'] }}{% endfor %}"
TOOL_USE = "{% for m in messages %}T:{{ m['content'] }}{% endfor %}"
MSGS = [{"role": "user", "content": "hi"}]


def _renders(folder: Path, names: tuple[str, ...] = ("default", "tool_use")) -> dict[str | None, str]:
    """What ``folder``'s tokenizer renders for each named template, and with none named."""
    tok = transformers.AutoTokenizer.from_pretrained(folder)
    out = {None: tok.apply_chat_template(MSGS, tokenize=False)}
    out.update({n: tok.apply_chat_template(MSGS, tokenize=False, chat_template=n) for n in names})
    return out


def _save_named(folder: Path, templates: dict[str, str]) -> None:
    """The templates as transformers 5 saves them: chat_template.jinja and additional_chat_templates/NAME.jinja."""
    tok = transformers.AutoTokenizer.from_pretrained(folder)
    tok.chat_template = templates
    tok.save_pretrained(folder)


@pytest.mark.parametrize("form", ["list", "files"])
@pytest.mark.parametrize("choice", ["agent", "auto", "base"])
def test_named_templates_come_with_the_chosen_template(tmp_path: Path, form: str, choice: str) -> None:
    """The chosen model's named templates, in either form, render in the output as in that model."""
    base, agents = make_example(tmp_path / "in", shape=TINY)
    # agent: one agent has the named templates; auto: the three agents share them; base: the base has them
    owners = {"agent": agents[1:2], "auto": agents, "base": [base]}[choice]
    for m in owners:
        if form == "list":
            _edit(m, "tokenizer_config.json", lambda d: d.update(
                chat_template=[{"name": "default", "template": DEFAULT}, {"name": "tool_use", "template": TOOL_USE}]))
        else:
            _save_named(m, {"default": DEFAULT, "tool_use": TOOL_USE})
    want = _renders(owners[0])
    assert want == {None: "D:hi", "default": "D:hi", "tool_use": "T:hi"}  # the source, as transformers reads it
    given = {"agent": str(agents[1]), "auto": "auto", "base": None}[choice]
    res = rlmerge.merge(base, agents, tmp_path / "o", method="ram", chat_template=given)
    assert _renders(tmp_path / "o") == want
    assert not list((tmp_path / "o").glob("*.jinja"))  # one copy, where transformers reads it: no stale default
    if choice != "base":  # the agents' named templates differ from the base's single one: said, by name
        said = [w for w in res.warnings if "tokenizer files differ" in w]
        assert said and all("named: default (differs), tool_use (the base lacks it)" in w for w in said)


def test_a_named_template_that_differs_is_reported_by_file(tmp_path: Path, capsys) -> None:  # noqa: ANN001
    """Base and agents share the default template; one agent's tool_use differs: plan names that file."""
    base, agents = make_example(tmp_path / "in", shape=TINY)
    for m in (base, *agents):
        _save_named(m, {"default": DEFAULT, "tool_use": TOOL_USE if m != agents[2] else "{{ 'other' }}"})
    assert cli_main(["plan", str(base), *map(str, agents), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert [(d["agent"], d["file"], d["what"]) for d in doc["tokenizer"]["differences"]] == [
        (str(agents[2]), "additional_chat_templates/tool_use.jinja", "chat template differs (named: tool_use "
                                                                      "(differs))")]
    rlmerge.merge(base, agents, tmp_path / "o", method="ram", chat_template=str(agents[2]))
    assert _renders(tmp_path / "o")["tool_use"] == "other"


def test_a_chat_template_json_file_is_read_as_one(example, tmp_path: Path) -> None:
    """--chat-template chat_template.json: its chat_template key (one template or named ones), not its JSON text;
    a .json without one is refused, naming the file, before any weight is read."""
    base, agents = example
    one = tmp_path / "chat_template.json"
    one.write_text(json.dumps({"chat_template": "{% for m in messages %}X:{{ m['content'] }}{% endfor %}"}))
    assert cli_main(["merge", str(base), *map(str, agents), "-o", str(tmp_path / "a"), "-q", "--method", "ram",
                     "--chat-template", str(one)]) == 0
    assert _renders(tmp_path / "a", ())[None] == "X:hi"
    named = tmp_path / "named.json"
    named.write_text(json.dumps({"chat_template": [{"name": "default", "template": DEFAULT},
                                                   {"name": "tool_use", "template": TOOL_USE}]}))
    rlmerge.merge(base, agents, tmp_path / "b", method="ram", chat_template=str(named))
    assert _renders(tmp_path / "b") == {None: "D:hi", "default": "D:hi", "tool_use": "T:hi"}
    for text, why in (("{not json", "not valid JSON"), (json.dumps({"template": "x"}), "no chat_template key"),
                      (json.dumps({"chat_template": [{"name": 1}]}), "neither a template nor a list")):
        bad = tmp_path / "bad.json"
        bad.write_text(text)
        with pytest.raises(ConfigError, match=why) as e:
            rlmerge.merge(base, agents, tmp_path / "c", method="ram", chat_template=str(bad))
        assert e.value.file == str(bad) and "chat_template.json" in (e.value.hint or "")
    assert not (tmp_path / "c").exists()


def test_named_templates_beside_another_tokenizer_source(tmp_path: Path) -> None:
    """tokenizer_source: an agent whose template is a single one, chat template: the base's named ones."""
    base, agents = make_example(tmp_path / "in", shape=TINY)
    _save_named(base, {"default": DEFAULT, "tool_use": TOOL_USE})
    rlmerge.merge(base, agents, tmp_path / "o", method="ram", tokenizer_source=str(agents[0]), chat_template="base")
    assert _renders(tmp_path / "o") == {None: "D:hi", "default": "D:hi", "tool_use": "T:hi"}
