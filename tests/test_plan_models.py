"""Mismatched models: refused with every problem at once, or a documented, reported choice — never silent."""

from __future__ import annotations

import json
import math
import warnings
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import rlmerge
from conftest import TINY, assert_same_tensors, load_output
from rlmerge.engine import budget
from rlmerge.errors import ConfigError, InputError, ProblemsError
from rlmerge.io.partial import partial_path
from rlmerge.synthetic import Shape, config, make_example, write_checkpoint


def _load(folder: Path) -> tuple[dict[str, torch.Tensor], dict]:
    return load_file(str(folder / "model.safetensors")), json.loads((folder / "config.json").read_text())


def _variant(src: Path, dst: Path, *, edit=None, cfg_edit=None) -> Path:
    """A copy of checkpoint ``src`` with its tensors and/or config edited."""
    tensors, cfg = _load(src)
    if edit:
        edit(tensors)
    if cfg_edit:
        cfg_edit(cfg)
    return write_checkpoint(dst, tensors, cfg)


def _problems(excinfo: pytest.ExceptionInfo) -> list[str]:
    e = excinfo.value
    return [p.render() for p in e.problems] if isinstance(e, ProblemsError) else [e.render()]


def test_other_architecture_and_layer_count_reported_together(example, tmp_path: Path) -> None:
    base, agents = example
    llama = _variant(agents[0], tmp_path / "llama", cfg_edit=lambda c: c.update(architectures=["LlamaForCausalLM"]))
    deeper_shape = Shape(**{**TINY.__dict__, "layers": 3})
    deeper, _ = make_example(tmp_path / "deep", shape=deeper_shape, densities=())
    with pytest.raises(ProblemsError) as info:
        rlmerge.merge(base, [llama, deeper, agents[1]], tmp_path / "out")
    text = "\n".join(_problems(info))
    assert "LlamaForCausalLM" in text and "num_hidden_layers = 3" in text
    assert info.value.exit_code == InputError.exit_code
    assert not (tmp_path / "out").exists() and not partial_path(tmp_path / "out").exists()


def test_resized_vocabulary_is_a_clear_error(example, tmp_path: Path) -> None:
    base, agents = example

    def grow(t: dict[str, torch.Tensor]) -> None:
        e = t["model.embed_tokens.weight"]
        t["model.embed_tokens.weight"] = torch.cat([e, e[:8]])

    bigger = _variant(agents[0], tmp_path / "bigger", edit=grow,
                      cfg_edit=lambda c: c.update(vocab_size=TINY.vocab + 8))
    with pytest.raises(InputError, match="vocabulary was resized") as info:
        rlmerge.merge(base, [bigger, agents[1]], tmp_path / "out")
    assert info.value.tensor == "model.embed_tokens.weight"


def test_agent_storing_a_redundant_lm_head_is_dropped_and_reported(example, tmp_path: Path) -> None:
    base, agents = example
    with_head = _variant(agents[0], tmp_path / "with-head",
                         edit=lambda t: t.update({"lm_head.weight": t["model.embed_tokens.weight"].clone()}))
    res = rlmerge.merge(base, [with_head, *agents[1:]], tmp_path / "out", method="ram")
    assert any("lm_head.weight" in w and "dropped" in w for w in res.warnings)
    prov = json.loads((tmp_path / "out" / "rlmerge.json").read_text())
    assert prov["dropped_tensors"] == {"lm_head.weight": [str(with_head)]}
    rlmerge.merge(base, agents, tmp_path / "ref", method="ram")
    assert_same_tensors(load_output(tmp_path / "out"), load_output(tmp_path / "ref"))


def test_an_agent_with_its_own_head_unties_the_output(example, tmp_path: Path) -> None:
    """Against a tied base, an agent that trained its lm_head keeps it: lm_head is merged and written untied
    (tests/test_heads.py checks the values and that transformers loads it). A config that does not say is not
    taken as tied: transformers' default differs between model classes."""
    base, agents = example
    untied = _variant(agents[0], tmp_path / "untied",
                      edit=lambda t: t.update({"lm_head.weight": t["model.embed_tokens.weight"] * 1.5}),
                      cfg_edit=lambda c: c.update(tie_word_embeddings=False))
    unsaid = _variant(untied, tmp_path / "unsaid", cfg_edit=lambda c: c.pop("tie_word_embeddings"))
    for i, agent in enumerate((untied, unsaid)):
        rlmerge.merge(base, [agent, *agents[1:]], tmp_path / f"out{i}", method="ram")
        assert "lm_head.weight" in load_output(tmp_path / f"out{i}")
        assert json.loads((tmp_path / f"out{i}" / "config.json").read_text())["tie_word_embeddings"] is False


def test_extra_adapter_and_value_head_keys_are_dropped_and_reported(example, tmp_path: Path) -> None:
    base, agents = example
    extra = {"v_head.summary.weight": torch.ones(1, TINY.hidden),
             "model.layers.0.self_attn.q_proj.lora_A.weight": torch.ones(4, TINY.hidden)}
    rl = _variant(agents[2], tmp_path / "rl", edit=lambda t: t.update(extra))
    res = rlmerge.merge(base, [*agents[:2], rl], tmp_path / "out", method="ram+")
    prov = json.loads((tmp_path / "out" / "rlmerge.json").read_text())
    assert set(prov["dropped_tensors"]) == set(extra)
    assert any("dropped" in w for w in res.warnings)
    rlmerge.merge(base, agents, tmp_path / "ref", method="ram+")
    assert_same_tensors(load_output(tmp_path / "out"), load_output(tmp_path / "ref"))


@pytest.mark.parametrize("method", ["ram", "ram+"])
@pytest.mark.parametrize("bad", [math.nan, math.inf])
def test_nan_or_inf_in_a_task_vector(example, tmp_path: Path, method: str, bad: float) -> None:
    base, agents = example
    name = "model.layers.1.mlp.up_proj.weight"

    def poison(t: dict[str, torch.Tensor]) -> None:
        t[name] = t[name].clone()
        t[name].view(-1)[77] = bad

    broken = _variant(agents[1], tmp_path / "broken", edit=poison)
    with pytest.raises(InputError, match="NaN or Inf") as info:
        rlmerge.merge(base, [agents[0], broken], tmp_path / "out", method=method, block_size=50)
    assert info.value.tensor == name and "flat element 77" in info.value.message
    assert info.value.file == str(broken / "model.safetensors")
    assert not (tmp_path / "out").exists() and not partial_path(tmp_path / "out").exists()


@pytest.mark.parametrize("fast", ["0", "1"], ids=["torch", "numba"])
@pytest.mark.parametrize("method", ["ram", "task_arithmetic"])  # counted in a statistics pass; checked while merging
@pytest.mark.parametrize("agent_too", [False, True], ids=["base-only", "base-and-agent"])
def test_nan_or_inf_in_the_base_names_the_base(example, tmp_path: Path, monkeypatch, method: str, fast: str,
                                               agent_too: bool) -> None:
    # every τ is non-finite where θ₀ is: the error used to name the first agent's file; Inf in both models at the
    # same place (Inf - Inf) also printed numpy's "invalid value encountered in subtract" first
    monkeypatch.setenv("RLMERGE_FAST", fast)
    base, agents = example
    name = "model.layers.1.mlp.up_proj.weight"

    def poison(t: dict[str, torch.Tensor]) -> None:
        t[name] = t[name].clone()
        t[name].view(-1)[77] = math.inf

    broken = _variant(base, tmp_path / "broken", edit=poison)
    given = [_variant(agents[0], tmp_path / "agent", edit=poison) if agent_too else agents[0], agents[1]]
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        with pytest.raises(InputError, match="NaN or Inf in the base") as info:
            rlmerge.merge(broken, given, tmp_path / "out", method=method, block_size=50)
    assert info.value.tensor == name and "flat element 77" in info.value.message
    assert info.value.file == str(broken / "model.safetensors")
    assert not (tmp_path / "out").exists() and not partial_path(tmp_path / "out").exists()


def test_agent_identical_to_base_is_reported(example, tmp_path: Path) -> None:
    base, agents = example
    copy = _variant(base, tmp_path / "copy")
    for method in ("ram", "ram+", "task_arithmetic"):
        res = rlmerge.merge(base, [agents[0], copy], tmp_path / method, method=method)
        assert sum("identical to the base" in w for w in res.warnings) == 1, method


def test_more_agents_than_memory_allows(example, tmp_path: Path, monkeypatch) -> None:
    base, agents = example
    est = rlmerge.dry_run(base, agents, block_size=1 << 20).memory  # the route's estimate, whichever path
    # Just below what the merge needs: refused before any file is written, with a block size that fits.
    monkeypatch.setattr(budget, "available_memory", lambda: est.total - 1)
    with pytest.raises(ConfigError, match="needs about") as info:
        rlmerge.merge(base, agents, tmp_path / "out", block_size=1 << 20)
    fits = int(info.value.hint.split("--block-size ")[1].split()[0])
    assert rlmerge.dry_run(base, agents, block_size=fits).memory.total <= est.total - 1
    assert not (tmp_path / "out").exists() and not partial_path(tmp_path / "out").exists()
    # A block size that fits is accepted; two agents need less than three.
    rlmerge.merge(base, agents, tmp_path / "ok", block_size=fits)
    assert rlmerge.dry_run(base, agents[:2], block_size=1 << 20).memory.total < est.total


def test_every_problem_is_reported_at_once(example, tmp_path: Path) -> None:
    base, agents = example
    bigger = _variant(agents[0], tmp_path / "bigger", edit=lambda t: t.update(
        {"model.norm.weight": torch.ones(TINY.hidden + 1)}))
    missing = _variant(agents[1], tmp_path / "missing", edit=lambda t: t.pop("model.layers.0.mlp.up_proj.weight"))
    with pytest.raises(ProblemsError) as info:
        rlmerge.merge(base, [bigger, missing], tmp_path / "out", method="ram")
    text = "\n".join(_problems(info))
    assert len(info.value.problems) == 2
    assert "model.norm.weight" in text and "model.layers.0.mlp.up_proj.weight" in text
    assert str(config(TINY, torch.bfloat16)["hidden_size"]) in text  # the base's shape [32] is named


def test_available_memory_ignores_reclaimable_page_cache_in_a_cgroup(tmp_path: Path, monkeypatch) -> None:
    files = {"/proc/meminfo": "MemTotal: 100 kB\nMemAvailable:   4000 kB\n",
             "/sys/fs/cgroup/memory.max": "3000000\n", "/sys/fs/cgroup/memory.current": "2999000\n",
             "/sys/fs/cgroup/memory.stat": "anon 1000000\nfile 1999000\n"}
    monkeypatch.setattr(budget.Path, "read_text", lambda self, *a, **k: files[str(self)])
    # Page cache fills the cgroup (current ≈ max) but only 1 MB is anonymous: 2 MB are available.
    assert budget.available_memory() == 2_000_000
    files["/sys/fs/cgroup/memory.max"] = "max\n"
    assert budget.available_memory() == 4000 * 1024
