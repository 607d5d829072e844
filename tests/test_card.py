"""The model card (issue 25, part 2): metadata the Hub accepts, hub ids only, and a recipe that reproduces the merge.

Oracles: huggingface_hub's own card parsing (``ModelCard`` / ``ModelCardData``) and repo-id validation
(``validate_repo_id``, the rule the Hub applies to ``base_model``), inputs resolved from a Hugging Face cache the way
hub ids are, and the card's recipe run again: the same bytes.
"""

from __future__ import annotations

import json
import re
import shlex
import shutil
from pathlib import Path

import pytest
import yaml
from huggingface_hub import ModelCard
from huggingface_hub.utils import validate_repo_id

import rlmerge
from conftest import TINY
from rlmerge.cli import main as cli_main
from rlmerge.synthetic import make_example

COMMIT = "0123456789abcdef0123456789abcdef01234567"


def _card(out: Path) -> ModelCard:
    card = ModelCard((out / "README.md").read_text())
    for repo in card.data.base_model or []:
        validate_repo_id(repo)  # raises for a local path or org/name@rev
    return card


def _cache(root: Path, repo: str, src: Path) -> None:
    """``src`` as the Hugging Face cache holds a download of ``repo`` at COMMIT (refs/main pointing there)."""
    folder = root / f"models--{repo.replace('/', '--')}"
    shutil.copytree(src, folder / "snapshots" / COMMIT)
    (folder / "refs").mkdir()
    (folder / "refs" / "main").write_text(COMMIT)


def test_local_inputs_give_no_base_model_and_valid_metadata(example, tmp_path: Path) -> None:
    base, agents = example
    rlmerge.merge(base, agents, tmp_path / "o", method="ram+")
    card = _card(tmp_path / "o")
    assert card.data.base_model is None and card.data.get("base_model_relation") is None
    assert card.data.tags == ["merge", "rlmerge", "ram+"] and card.data.library_name == "transformers"
    assert f"Base model: `{base}`" in card.text and all(f"- `{a}`" in card.text for a in agents)


def test_hub_inputs_are_listed_by_id_without_revision(example, tmp_path: Path, monkeypatch) -> None:
    """base and one agent come from the Hub (one by id, one as a cache snapshot path); the third is local."""
    import huggingface_hub.constants as hc

    base, agents = example
    cache = tmp_path / "hub"
    _cache(cache, "org/base-model", base)
    _cache(cache, "org/tool-agent", agents[0])
    monkeypatch.setattr(hc, "HF_HUB_CACHE", str(cache))
    monkeypatch.chdir(tmp_path)
    snapshot = cache / "models--org--tool-agent" / "snapshots" / COMMIT
    rlmerge.merge("org/base-model", [str(snapshot), agents[1], agents[2]], tmp_path / "o", method="ties")
    card = _card(tmp_path / "o")
    assert card.data.base_model == ["org/base-model", "org/tool-agent"]
    assert card.data.get("base_model_relation") == "merge"
    assert "[org/base-model](https://huggingface.co/org/base-model)" in card.text
    assert str(agents[1]) in card.text  # local paths in the body …
    prov = json.loads((tmp_path / "o" / "rlmerge.json").read_text())
    assert [i["source"] for i in prov["inputs"]][2:] == [str(agents[1]), str(agents[2])]  # … and in rlmerge.json
    rlmerge.merge(f"org/base-model@{COMMIT}", agents, tmp_path / "p", method="ram")
    card = _card(tmp_path / "p")
    assert card.data.base_model == ["org/base-model"] and f"revision `{COMMIT}`" in card.text
    assert "@" not in yaml.safe_dump(card.data.to_dict())


def _recipe_or_command(out: Path) -> tuple[str, str]:
    text = (out / "README.md").read_text()
    m = re.search(r"## Recipe\n\n.*?\n\n```yaml\n(.*?)```", text, re.S)
    if m:
        return "recipe", m.group(1)
    m = re.search(r"## Command\n\n```sh\n(.*?)\n```", text, re.S)
    assert m, "the card gives neither a recipe nor a command"
    return "command", m.group(1)


@pytest.mark.parametrize(("args", "kind"), [
    (["--method", "ram+", "--preset", "official", "--rescale-factor", "1.3", "--seed", "3", "--shard-size", "40KB"],
     "recipe"),
    (["--method", "task_arithmetic", "--param", "weights=1,0.5,1", "--scaling", "0.7", "--dtype", "float32"],
     "recipe"),
    # mergekit's ties and dare_ties read other defaults (per-model weights, normalize, rescale): the command
    (["--method", "dare_ties", "--param", "p=0.5", "--seed", "3", "--shard-size", "40KB"], "command"),
    (["--method", "ties", "--param", "density=0.3"], "command"),
    (["--recipe", "RECIPE"], "recipe"),
])
def test_the_cards_recipe_reproduces_the_merge(example, tmp_path: Path, args: list[str], kind: str) -> None:
    base, agents = example
    if args == ["--recipe", "RECIPE"]:  # a mergekit recipe with a gradient: the card gives it back
        doc = {"merge_method": "ties", "base_model": str(base), "models": [
            {"model": str(a), "parameters": {"weight": 1.0, "density": [0.2, 0.6]}} for a in agents],
            "parameters": {"lambda": 0.9}}
        (tmp_path / "r.yml").write_text(yaml.safe_dump(doc))
        args = ["--recipe", str(tmp_path / "r.yml")]
        models: list[str] = []
    else:
        models = [str(base), *map(str, agents)]
    assert cli_main(["merge", *models, *args, "-o", str(tmp_path / "first"), "-q"]) == 0
    got, text = _recipe_or_command(tmp_path / "first")
    assert got == kind
    if kind == "recipe":
        (tmp_path / "again.yml").write_text(text)
        again = ["merge", "--recipe", str(tmp_path / "again.yml")]
    else:
        words = shlex.split(text)
        assert words[:2] == ["rlmerge", "merge"] and words[-2:] == ["-o", "OUT"]
        again = words[1:-2]
    assert cli_main([*again, "-o", str(tmp_path / "second"), "-q"]) == 0
    first = sorted(p.name for p in (tmp_path / "first").iterdir())
    assert first == sorted(p.name for p in (tmp_path / "second").iterdir())
    for name in first:
        if name.endswith(".safetensors") or name in ("config.json", "model.safetensors.index.json"):
            assert (tmp_path / "first" / name).read_bytes() == (tmp_path / "second" / name).read_bytes(), name


def test_the_cards_command_is_one_a_shell_runs_again(example, tmp_path: Path) -> None:
    """The command was the words joined by spaces: a path with a space split in two and a template's ``<|`` was a
    redirection (found by a QA pass, 2026-12-07). Now it is quoted: split as a shell splits it, it is the merge's
    arguments, and run again it writes the same files (the chat template's text included)."""

    base, agents = example
    spaced = tmp_path / "my inputs"
    shutil.copytree(base.parent, spaced)
    models = [str(spaced / base.name), *(str(spaced / a.name) for a in agents)]
    template = "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}$HOME `x`{% endfor %}"
    args = ["--method", "ties", "--param", "density=0.3", "--chat-template", template]
    assert cli_main(["merge", *models, *args, "-o", str(tmp_path / "first"), "-q"]) == 0
    got, text = _recipe_or_command(tmp_path / "first")
    assert got == "command"
    words = shlex.split(text)
    assert words == ["rlmerge", "merge", *models, *args, "-o", "OUT"]
    assert cli_main([*words[1:-2], "-o", str(tmp_path / "second"), "-q"]) == 0
    for name in sorted(p.name for p in (tmp_path / "first").iterdir()):
        if name not in ("README.md", "rlmerge.json"):
            assert (tmp_path / "first" / name).read_bytes() == (tmp_path / "second" / name).read_bytes(), name


def test_card_metadata_round_trips_through_huggingface_hub(example, tmp_path: Path) -> None:
    """What ModelCard parses is what rlmerge wrote: no key lost or invented, the body intact."""
    base, agents = make_example(tmp_path / "in", shape=TINY, densities=(0.1, 0.2))
    rlmerge.merge(base, agents, tmp_path / "o", method="ram")
    raw = (tmp_path / "o" / "README.md").read_text()
    card = ModelCard(raw)
    head = yaml.safe_load(raw.split("---\n")[1])
    assert card.data.to_dict() == head == {"library_name": "transformers", "tags": ["merge", "rlmerge", "ram"]}
    assert str(card) == raw


@pytest.mark.parametrize(("base_id", "agent_ids", "adapter"), [
    (None, [None, None], False),
    ("Qwen/Qwen2.5-0.5B", ["org/coder", None], False),
    ("Qwen/Qwen2.5-0.5B", ["org/coder", "org/tool-use"], True),
    (None, ["org/coder"], True),
])
def test_the_card_is_the_text_huggingface_hubs_model_card_makes(base_id: str | None, agent_ids: list[str | None],
                                                                adapter: bool) -> None:
    """model_card writes the metadata and body itself (card_text, without importing ModelCard's module, 0.23 s): for
    every kind of metadata card_data makes, ModelCard parses that text back to the same data and gives the same
    text."""
    from types import SimpleNamespace

    from rlmerge.report.card import card_data, card_text

    match = SimpleNamespace(base=SimpleNamespace(hub_id=base_id), agents=[SimpleNamespace(hub_id=i) for i in agent_ids])
    data = card_data(match, SimpleNamespace(method="ties"), adapter=adapter)  # type: ignore[arg-type]
    text = card_text(data, ["# A merge", "", "body", ""])
    card = ModelCard(text)
    assert str(card) == text and card.data.to_dict() == data.to_dict()
    assert bool(card.data.base_model) == bool(base_id if adapter else base_id or any(agent_ids))
