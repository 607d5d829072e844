"""Tied and untied lm_heads (issue 14, part 3): each model's head as it uses it, the output tied only when all are.

A tied model's lm_head is its embedding; an untied one's is its stored lm_head. lm_head is merged from those, and
the output ties it only when the base and every agent tie it; otherwise it is written, with
``tie_word_embeddings: false``, and transformers loads it as an untied head and generates.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import rlmerge
from conftest import TINY, load_output
from reference import ram_tensor
from rlmerge.synthetic import Shape, config, make_example, write_checkpoint

EMBED, HEAD = "model.embed_tokens.weight", "lm_head.weight"


def _untie(model: Path, out: Path, *, head_seed: int | None) -> Path:
    """``model`` saved untied: lm_head stored (its embedding, moved by a seeded perturbation when given)."""
    state = load_output(model)
    head = state[EMBED].float().clone()
    if head_seed is not None:
        g = torch.Generator().manual_seed(head_seed)
        moved = torch.rand(head.shape, generator=g) < 0.3
        head = head + moved * 0.01 * torch.randn(head.shape, generator=g)
    state[HEAD] = head.to(state[EMBED].dtype)
    cfg = json.loads((model / "config.json").read_text())
    cfg["tie_word_embeddings"] = False
    return write_checkpoint(out, state, cfg)


def _generates(folder: Path) -> torch.nn.Module:
    transformers = pytest.importorskip("transformers")
    model = transformers.AutoModelForCausalLM.from_pretrained(folder)
    tok = transformers.AutoTokenizer.from_pretrained(folder)
    ids = tok("hello", return_tensors="pt")
    out = model.generate(**ids, max_new_tokens=4, do_sample=False)
    assert out.shape[1] == ids["input_ids"].shape[1] + 4
    return model


def test_a_tied_base_with_an_agent_that_trained_its_head(tmp_path: Path) -> None:
    base, agents = make_example(tmp_path / "in", shape=TINY)
    untied = _untie(agents[0], tmp_path / "untied", head_seed=1)
    out = tmp_path / "out"
    plan = rlmerge.dry_run(base, [untied, agents[1], agents[2]], out, method="ram")
    assert plan.ok and HEAD in {j.name for j in plan.match.jobs}  # plan sees the untied layout from headers
    res = rlmerge.merge(base, [untied, agents[1], agents[2]], out, method="ram")
    got = load_output(out)
    b, a0, a1, a2 = (load_output(m) for m in (base, untied, agents[1], agents[2]))
    # lm_head: the base's embedding stands for its head, and so do the tied agents' embeddings
    want = ram_tensor(b[EMBED], [a0[HEAD], a1[EMBED], a2[EMBED]], 1e-5, None).to(torch.bfloat16)
    assert torch.equal(got[HEAD].view(torch.int16), want.view(torch.int16))
    want_embed = ram_tensor(b[EMBED], [a0[EMBED], a1[EMBED], a2[EMBED]], 1e-5, None).to(torch.bfloat16)
    assert torch.equal(got[EMBED].view(torch.int16), want_embed.view(torch.int16))
    assert not torch.equal(got[HEAD], got[EMBED])
    assert json.loads((out / "config.json").read_text())["tie_word_embeddings"] is False
    assert any("tensor of its own" in w for w in res.warnings)
    model = _generates(out)
    assert model.lm_head.weight.data_ptr() != model.model.embed_tokens.weight.data_ptr()
    assert torch.equal(model.lm_head.weight.detach(), got[HEAD])


@pytest.mark.parametrize("fast", ["1", "0"], ids=["fused", "torch"])
def test_an_untied_base_with_a_tied_agent(tmp_path: Path, monkeypatch, fast: str) -> None:
    monkeypatch.setenv("RLMERGE_FAST", fast)
    shape = Shape("llama", vocab=128, hidden=32, layers=2, heads=4, kv_heads=2, intermediate=64, tie=False)
    base, agents = make_example(tmp_path / "in", shape=shape)
    tied_state = load_output(agents[1])
    tied_state.pop(HEAD)
    cfg = config(shape, torch.bfloat16)
    cfg["tie_word_embeddings"] = True
    tied = write_checkpoint(tmp_path / "tied", tied_state, cfg)
    out = tmp_path / "out"
    rlmerge.merge(base, [agents[0], tied], out, method="ram+", params={"preset": "paper"}, dtype="base")
    b, a0, a1 = (load_output(m) for m in (base, agents[0], tied))
    got = load_output(out)
    lam = json.loads((out / "rlmerge.json").read_text())["agents"]
    want = ram_tensor(b[HEAD], [a0[HEAD], a1[EMBED]], 1e-5, [r["lambda"] for r in lam]).to(torch.bfloat16)
    assert torch.equal(got[HEAD].view(torch.int16), want.view(torch.int16))
    assert json.loads((out / "config.json").read_text())["tie_word_embeddings"] is False
    _generates(out)


def test_every_model_tied_gives_a_tied_output(example, tmp_path: Path) -> None:
    base, agents = example
    rlmerge.merge(base, agents, tmp_path / "out", method="ram")
    assert HEAD not in load_output(tmp_path / "out")
    model = _generates(tmp_path / "out")
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
