"""Tokenizers, chat templates and vocabularies (issue 25, part 1): differences reported, union as mergekit, reachable.

Agents here add special tokens the base lacks (``<tool_call>``, ``<memory>``), change the chat template and the
generation config, as tool-use agents do. Oracles: the files themselves (every difference by agent and file in
``plan`` and ``rlmerge.json``), mergekit 0.1.5's own output on the same inputs (``tokenizer_source: union``), the
rows each token must get by mergekit's rule written out by hand, and the written tokenizer loaded by transformers.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import yaml

import rlmerge
from conftest import MERGEKIT_PY, TINY, load_output, run_mergekit
from rlmerge.cli import main as cli_main
from rlmerge.errors import ConfigError, InputError, ProblemsError, RLMergeError
from rlmerge.synthetic import Shape, config, make_example, perturb, random_base, write_checkpoint

EMBED = "model.embed_tokens.weight"
TOOL_TEMPLATE = "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{% endfor %}"
ULP = 2.0 ** -23


def _edit(folder: Path, name: str, change) -> None:  # noqa: ANN001  a small helper
    path = folder / name
    doc = json.loads(path.read_text())
    change(doc)
    path.write_text(json.dumps(doc, indent=2))


def _add_tokens(folder: Path, tokens: list[str], first: int) -> None:
    """Special tokens added as transformers' add_special_tokens writes them (tokenizer.json's added_tokens)."""
    _edit(folder, "tokenizer.json", lambda d: d["added_tokens"].extend(
        {"id": first + i, "content": t, "single_word": False, "lstrip": False, "rstrip": False, "normalized": False,
         "special": True} for i, t in enumerate(tokens)))


def vocab_models(root: Path, *, tie: bool = True) -> dict[str, Path]:
    """A float32 base with 98 tokens and 98 rows; agents with rows appended for the tokens they add:
    tools (<tool_call> 98, </tool_call> 99, its own chat template), memory (<memory> 98), coder (<tool_call> 98)."""
    shape = Shape("qwen2" if tie else "llama", vocab=98, hidden=32, layers=2, heads=4, kv_heads=2, intermediate=64,
                  tie=tie)
    cfg = config(shape, torch.float32)
    base = random_base(shape, seed=3)
    out = {"base": write_checkpoint(root / "base", base, cfg)}
    added = {"tools": ["<tool_call>", "</tool_call>"], "memory": ["<memory>"], "coder": ["<tool_call>"]}
    for i, (name, tokens) in enumerate(added.items()):
        t = perturb(base, 0.3, seed=11 + i, dtype=torch.float32)
        g = torch.Generator().manual_seed(100 + i)
        for key in ([EMBED] if tie else [EMBED, "lm_head.weight"]):
            t[key] = torch.cat([t[key], 0.02 * torch.randn(len(tokens), 32, generator=g)])
        out[name] = write_checkpoint(root / name, t, {**cfg, "vocab_size": 98 + len(tokens)})
        _add_tokens(out[name], tokens, 98)
    for folder in out.values():  # transformers' Qwen2 tokenizer would add a pad token of its own otherwise
        _edit(folder, "tokenizer_config.json", lambda d: d.update(pad_token="</s>"))
    _edit(out["tools"], "tokenizer_config.json", lambda d: d.update(chat_template=TOOL_TEMPLATE))
    return out


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return vocab_models(tmp_path_factory.mktemp("vocab"))


def _agents(models: dict[str, Path]) -> list[Path]:
    return [models["tools"], models["memory"], models["coder"]]


# -- differences, reported ---------------------------------------------------------------------------------------
def test_plan_and_merge_report_every_difference_by_agent_and_file(tmp_path: Path, capsys) -> None:  # noqa: ANN001
    """The Qwen case: the agent puts <tool_call> in a padding row (same embedding shape), changes its template and its
    eos. The merge succeeds with the base's tokenizer and says so; plan says it first; rlmerge.json records it."""
    base, agents = make_example(tmp_path / "in", shape=TINY)  # 128 rows, 98 tokens
    tools = agents[1]
    _add_tokens(tools, ["<tool_call>"], 98)
    _edit(tools, "tokenizer_config.json", lambda d: d.update(chat_template=TOOL_TEMPLATE))
    _edit(tools, "generation_config.json", lambda d: d.update(eos_token_id=[2, 98]))
    expected = [("tokenizer.json", "1 token(s) the base lacks: '<tool_call>' (id 98)"),
                ("tokenizer_config.json", "chat template differs"),
                ("generation_config.json", "eos_token_id 2 → [2, 98]")]

    assert cli_main(["plan", str(base), *map(str, agents), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert [(d["agent"], d["file"], d["what"]) for d in doc["tokenizer"]["differences"]] == \
        [(str(tools), f, w) for f, w in expected]
    assert [w for w in doc["warnings"] if "tokenizer files differ" in w] == [
        f"agent {tools}'s tokenizer files differ from the base's ("
        + "; ".join(f"{f}: {w}" for f, w in expected)
        + "); the output carries the base's tokenizer and the chat template of base (--tokenizer-source, "
          "--chat-template to choose)"]

    res = rlmerge.merge(base, agents, tmp_path / "out", method="ram+")
    out = tmp_path / "out"
    prov = json.loads((out / "rlmerge.json").read_text())
    assert prov["tokenizer"]["source"] == "base (rows as stored)" and prov["tokenizer"]["chat_template"] == "base"
    assert [(d["file"], d["what"]) for d in prov["tokenizer"]["differences"]] == expected
    assert any("tokenizer files differ" in w for w in res.warnings) and prov["warnings"] == res.warnings
    for f in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):  # the base's, byte for byte
        assert (out / f).read_bytes() == (base / f).read_bytes()
    card = (out / "README.md").read_text()
    assert "Chat template: the base's" in card and "tokenizer files differ" in card


def test_identical_tokenizers_report_nothing(example, tmp_path: Path) -> None:
    base, agents = example
    res = rlmerge.merge(base, agents, tmp_path / "o", method="ram")
    assert not [w for w in res.warnings if "tokenizer" in w]
    assert json.loads((tmp_path / "o" / "rlmerge.json").read_text())["tokenizer"]["differences"] == []


# -- union, against mergekit ---------------------------------------------------------------------------------------
RECIPES = {
    "task_arithmetic": {"merge_method": "task_arithmetic", "parameters": {"lambda": 0.7},
                        "weights": [1.0, 0.5, 1.0]},
    "ties": {"merge_method": "ties", "parameters": {"density": 0.5}, "weights": [1.0, 1.0, 0.8]},
    "ram": {"merge_method": "ram", "parameters": {}, "weights": None},
}


def _recipe(models: dict[str, Path], name: str, tie: bool) -> dict:
    spec = RECIPES[name]
    weights = spec["weights"] or [None] * 3
    return {"merge_method": spec["merge_method"], "base_model": str(models["base"]),
            "models": [{"model": str(p), **({"parameters": {"weight": w}} if w is not None else {})}
                       for p, w in zip(_agents(models), weights)],
            "parameters": spec["parameters"], "dtype": "float32", "out_dtype": "float32",
            "tokenizer_source": "union"}


@pytest.fixture(scope="module")
def union(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[str, bool], tuple[Path, Path, dict[str, Path]]]:
    """Each recipe with tokenizer_source: union, merged by mergekit (one subprocess) and by rlmerge, on a tied and an
    untied (lm_head) model."""
    root = tmp_path_factory.mktemp("union")
    jobs, out = [], {}
    for tie in (True, False):
        ins = vocab_models(root / f"in-{tie}", tie=tie)
        for name in RECIPES:
            recipe = root / f"{name}-{tie}.yml"
            recipe.write_text(yaml.safe_dump(_recipe(ins, name, tie)))
            jobs.append({"recipe": str(recipe), "out": str(root / f"mk-{name}-{tie}"), "seed": None})
            assert cli_main(["merge", "--recipe", str(recipe), "-o", str(root / f"rl-{name}-{tie}"), "-q"]) == 0
            out[(name, tie)] = (root / f"rl-{name}-{tie}", root / f"mk-{name}-{tie}", ins)
    if MERGEKIT_PY.exists():
        run_mergekit(jobs, root, timeout=600)
    return out


@pytest.mark.skipif(not MERGEKIT_PY.exists(), reason="mergekit is not installed: run `make mergekit`")
@pytest.mark.parametrize("tie", [True, False], ids=["tied", "untied"])
@pytest.mark.parametrize("name", sorted(RECIPES))
def test_union_matches_mergekit(union, name: str, tie: bool) -> None:
    """Every tensor within 2 ulp of mergekit's, the vocabulary rows compared token by token: mergekit numbers the
    new tokens in the order of a Python set of its models (hash-randomised per process), rlmerge in agent order."""
    tokenizers = pytest.importorskip("tokenizers")
    ours_dir, theirs_dir, _ = union[(name, tie)]
    ours, theirs = load_output(ours_dir), load_output(theirs_dir)
    vocab = [tokenizers.Tokenizer.from_file(str(d / "tokenizer.json")).get_vocab() for d in (ours_dir, theirs_dir)]
    assert vocab[0].keys() == vocab[1].keys() and len(vocab[0]) == 101
    assert all(vocab[0][t] == vocab[1][t] < 98 for t in vocab[0] if vocab[0][t] < 98)  # the base's ids stay
    order = [vocab[1][t] for t in sorted(vocab[0], key=vocab[0].__getitem__)]  # mergekit's row of our row i
    assert set(ours) == set(theirs)
    for k, t in ours.items():
        ref = theirs[k][order] if k in (EMBED, "lm_head.weight") else theirs[k]
        assert t.shape == ref.shape, k
        assert float((t - ref).abs().max()) <= 2 * ULP * float(ref.abs().max()), k
    cfg = [json.loads((d / "config.json").read_text())["vocab_size"] for d in (ours_dir, theirs_dir)]
    assert cfg == [101, 101]
    assert [vocab[0][t] for t in ("<tool_call>", "</tool_call>", "<memory>")] == [98, 99, 100]  # agent order


def test_added_tokens_are_reachable_and_get_mergekits_rows(union) -> None:
    """Tokenize each added token with the written tokenizer (transformers): its id's row is what mergekit's rule
    says. <memory> only the memory agent has: its own row, whatever the method. <tool_call> two agents have: the
    base stands in with their mean, each agent's τ is its row minus the mean, the others' τ is 0."""
    transformers = pytest.importorskip("transformers")
    out_dir, _, ins = union[("task_arithmetic", True)]
    tok = transformers.AutoTokenizer.from_pretrained(out_dir)
    ids = {t: tok.convert_tokens_to_ids(t) for t in ("<tool_call>", "</tool_call>", "<memory>")}
    assert ids == {"<tool_call>": 98, "</tool_call>": 99, "<memory>": 100}
    assert tok("a<memory>b", add_special_tokens=False)["input_ids"][1] == 100
    got = load_output(out_dir)[EMBED]
    rows = {n: load_output(ins[n])[EMBED] for n in ("base", "tools", "memory", "coder")}
    assert got.shape == (101, 32)
    assert torch.equal(got[100], rows["memory"][98])
    assert torch.equal(got[99], rows["tools"][99])
    mean = (torch.zeros(32) + rows["tools"][98] + rows["coder"][98]) / 2
    want = mean + 0.7 * (1.0 * (rows["tools"][98] - mean) + 1.0 * (rows["coder"][98] - mean))
    torch.testing.assert_close(got[98], want, rtol=0, atol=4 * ULP)
    base_rows = rows["base"][:98] + 0.7 * sum(w * (rows[n][:98] - rows["base"][:98])
                                              for n, w in (("tools", 1.0), ("memory", 0.5), ("coder", 1.0)))
    torch.testing.assert_close(got[:98], base_rows, rtol=0, atol=4 * ULP)


@pytest.mark.parametrize("method", ["ram+", "ties", "dare_ties"])
def test_union_writes_the_same_bytes_on_both_paths_and_any_block_size(models, tmp_path: Path, monkeypatch,
                                                                      method: str) -> None:
    outs = []
    for fast, block in ((True, 1 << 20), (True, 777), (False, 777)):
        monkeypatch.setenv("RLMERGE_FAST", "1" if fast else "0")
        out = tmp_path / f"{fast}-{block}"
        rlmerge.merge(models["base"], _agents(models), out, method=method, block_size=block, seed=3,
                      tokenizer_source="union")
        outs.append(load_output(out))
    for other in outs[1:]:
        assert outs[0].keys() == other.keys()
        assert all(torch.equal(outs[0][k], other[k]) for k in other)
    assert outs[0][EMBED].shape == (101, 32)


def test_union_over_a_padded_vocabulary_keeps_the_base_rows(tmp_path: Path) -> None:
    """Qwen-style: 128 rows for 98 tokens; an agent put <tool_call> in row 98. union: row 98 is the agent's row
    (the base lacks the token); padding rows 99..127 are merged as stored; the row count stays the base's."""
    base, agents = make_example(tmp_path / "in", shape=TINY, dtype=torch.float32, densities=(0.3, 0.5))
    _add_tokens(agents[0], ["<tool_call>"], 98)
    rlmerge.merge(base, agents, tmp_path / "o", method="task_arithmetic", tokenizer_source="union")
    got = load_output(tmp_path / "o")[EMBED]
    b, a0, a1 = (load_output(p)[EMBED] for p in (base, *agents))
    assert got.shape == b.shape
    assert torch.equal(got[98], a0[98])
    torch.testing.assert_close(got[99:], b[99:] + (a0[99:] - b[99:]) + (a1[99:] - b[99:]), rtol=0, atol=1e-7)
    assert json.loads((tmp_path / "o" / "config.json").read_text())["vocab_size"] == 128


# -- base, an agent -------------------------------------------------------------------------------------------------
def test_tokenizer_source_base_maps_rows_and_drops_the_agents_tokens(models, tmp_path: Path) -> None:
    res = rlmerge.merge(models["base"], _agents(models), tmp_path / "o", method="task_arithmetic",
                        tokenizer_source="base")
    got = load_output(tmp_path / "o")[EMBED]
    rows = [load_output(p)[EMBED] for p in (models["base"], *_agents(models))]
    assert got.shape == (98, 32)
    torch.testing.assert_close(got, rows[0] + sum(r[:98] - rows[0] for r in rows[1:]), rtol=0, atol=1e-7)
    dropped = [w for w in res.warnings if "are not in the output's vocabulary" in w]
    assert len(dropped) == 3 and "'<tool_call>', '</tool_call>'" in dropped[0]
    assert (tmp_path / "o" / "tokenizer.json").read_bytes() == (models["base"] / "tokenizer.json").read_bytes()


def test_tokenizer_source_agent(models, tmp_path: Path) -> None:
    """memory's tokenizer: 99 rows, <memory> at 98 from the memory agent alone; tools' <tool_call> dropped."""
    rlmerge.merge(models["base"], _agents(models), tmp_path / "o", method="task_arithmetic",
                  tokenizer_source=str(models["memory"]))
    out = tmp_path / "o"
    got = load_output(out)[EMBED]
    mem = load_output(models["memory"])[EMBED]
    assert got.shape == (99, 32) and torch.equal(got[98], mem[98])
    assert (out / "tokenizer.json").read_bytes() == (models["memory"] / "tokenizer.json").read_bytes()
    prov = json.loads((out / "rlmerge.json").read_text())["tokenizer"]
    assert prov["source"] == str(models["memory"]) and prov["vocab_size"] == 99
    assert prov["dropped_tokens"] == {str(models["tools"]): ["<tool_call>", "</tool_call>"],
                                      str(models["coder"]): ["<tool_call>"]}


# -- chat templates ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("choice", ["base", "tools", "file", "auto"])
def test_chat_template_choices(models, tmp_path: Path, choice: str) -> None:
    transformers = pytest.importorskip("transformers")
    base_template = json.loads((models["base"] / "tokenizer_config.json").read_text())["chat_template"]
    given = {"base": None, "tools": str(models["tools"]), "auto": "auto"}.get(choice)
    if choice == "file":
        given = str(tmp_path / "mine.jinja")
        Path(given).write_text("{% for m in messages %}[{{ m['content'] }}]{% endfor %}")
    rlmerge.merge(models["base"], _agents(models), tmp_path / "o", method="ram", tokenizer_source="union",
                  chat_template=given)
    want = {"base": base_template, "tools": TOOL_TEMPLATE, "auto": base_template,  # base, memory, coder share it
            "file": "{% for m in messages %}[{{ m['content'] }}]{% endfor %}"}[choice]
    out = tmp_path / "o"
    cfg = json.loads((out / "tokenizer_config.json").read_text())
    assert cfg["chat_template"] == want and not (out / "chat_template.jinja").exists()
    assert cfg["added_tokens_decoder"]["100"]["content"] == "<memory>"  # union's tokens kept beside the template
    tok = transformers.AutoTokenizer.from_pretrained(out)
    rendered = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)
    assert rendered == {"base": "user: hi\n", "auto": "user: hi\n", "tools": "<|user|>hi", "file": "[hi]"}[choice]
    said = json.loads((out / "rlmerge.json").read_text())["tokenizer"]["chat_template"]
    assert said == {"base": "base", "tools": str(models["tools"]), "file": given,
                    "auto": f"auto: the template of {models['base']}, {models['memory']}, {models['coder']}"}[choice]


def test_recipe_keys_mean_the_flags(models, tmp_path: Path) -> None:
    """mergekit's ``tokenizer: {source: union}`` and ``chat_template: MODEL`` in YAML: the flags' output, byte for
    byte; a mergekit recipe naming the base as source means base."""
    doc = {"merge_method": "ram", "base_model": str(models["base"]), "models": [{"model": str(p)}
                                                                                for p in _agents(models)],
           "tokenizer": {"source": "union"}, "chat_template": str(models["tools"])}
    (tmp_path / "r.yml").write_text(yaml.safe_dump(doc))
    assert cli_main(["merge", "--recipe", str(tmp_path / "r.yml"), "-o", str(tmp_path / "a"), "-q"]) == 0
    assert cli_main(["merge", str(models["base"]), *map(str, _agents(models)), "--method", "ram", "--dtype", "base",
                     "--tokenizer-source", "union", "--chat-template", str(models["tools"]), "-o",
                     str(tmp_path / "b"), "-q"]) == 0
    for f in ("model.safetensors", "tokenizer.json", "tokenizer_config.json", "config.json"):
        assert (tmp_path / "a" / f).read_bytes() == (tmp_path / "b" / f).read_bytes(), f
    from rlmerge.recipe import parse_recipe

    rec = parse_recipe({**doc, "tokenizer": None, "tokenizer_source": str(models["base"])})
    assert rec.options["tokenizer_source"] == "base"
    with pytest.raises(ConfigError, match="tokenizer.tokens is not supported"):
        parse_recipe({**doc, "tokenizer": {"source": "union", "tokens": {"<x>": {"source": "base"}}}})


def test_bad_choices_are_refused_before_any_weight_is_read(models, tmp_path: Path) -> None:
    agents = _agents(models)
    with pytest.raises(ProblemsError, match="neither base, union nor an agent"):  # with the resized rows
        rlmerge.merge(models["base"], agents, tmp_path / "o", tokenizer_source="everything")
    with pytest.raises(ConfigError, match="neither base, auto, an agent"):
        rlmerge.merge(models["base"], agents, tmp_path / "o", chat_template="chatml", tokenizer_source="union")
    plain = tmp_path / "plain"
    shutil.copytree(models["coder"], plain)
    _edit(plain, "tokenizer_config.json", lambda d: d.pop("chat_template"))
    with pytest.raises(InputError, match="has no chat template"):
        rlmerge.merge(models["base"], [*agents[:2], plain], tmp_path / "o", chat_template="plain",
                      tokenizer_source="union")
    with pytest.raises(ProblemsError, match="vocabulary was resized: choose the output's vocabulary"):
        rlmerge.merge(models["base"], agents, tmp_path / "o")
    assert not (tmp_path / "o").exists()


def test_a_lora_agent_is_refused_when_the_rows_move(models, tmp_path: Path) -> None:
    """A LoRA adapter's τ is laid out on the base's rows: with union moving them, it is refused with what to do (the
    adapter here is rlmerge's own --output-format peft of an agent with the base's vocabulary)."""
    base = load_output(models["base"])
    moved = {**perturb(base, 0.2, seed=5, dtype=torch.float32), EMBED: base[EMBED]}  # the embedding as the base's
    plain = write_checkpoint(tmp_path / "plain", moved, json.loads((models["base"] / "config.json").read_text()))
    rlmerge.merge(models["base"], [plain], tmp_path / "adapter", method="task_arithmetic", output_format="peft",
                  rank="4")
    with pytest.raises(RLMergeError, match="is a LoRA adapter, whose τ is laid out on the base's rows"):
        rlmerge.merge(models["base"], [models["tools"], tmp_path / "adapter"], tmp_path / "o",
                      tokenizer_source="union")
    rlmerge.merge(models["base"], [plain, tmp_path / "adapter"], tmp_path / "same", tokenizer_source="union")


def test_an_agents_corrupt_tokenizer_is_said_not_fatal_unless_it_is_used(example, tmp_path: Path) -> None:
    base, agents = example
    (agents[2] / "tokenizer.json").write_text("{not json")
    res = rlmerge.merge(base, agents, tmp_path / "o", method="ram")
    said = [w for w in res.warnings if "were not compared" in w]
    assert len(said) == 1 and str(agents[2] / "tokenizer.json") in said[0]
    assert json.loads((tmp_path / "o" / "rlmerge.json").read_text())["tokenizer"]["not_compared"] == [str(agents[2])]
    with pytest.raises(InputError, match="cannot parse tokenizer.json"):
        rlmerge.merge(base, agents, tmp_path / "p", method="ram", tokenizer_source=str(agents[2]))
