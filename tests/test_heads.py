"""Tied and untied lm_heads (issue 14, part 3): each model's head as it uses it, the output tied only when all are.

A tied model's lm_head is its embedding; an untied one's is its stored lm_head. lm_head is merged from those, and
the output ties it only when the base and every agent tie it; otherwise it is written, with
``tie_word_embeddings: false``, and transformers loads it as an untied head and generates.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

import rlmerge
from conftest import TINY, assert_same_tensors, load_output
from reference import ram_tensor
from rlmerge.io.checkpoint import Checkpoint
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


def _store_head(model: Path, out: Path, layout: str, *, scale: float = 1.0) -> Path:
    """``model`` (a tied one) stored with its lm_head too, its config still tied: ``bin`` as
    ``torch.save(model.state_dict())`` writes it (both keys, one storage), ``clone`` as a safetensors file with a
    cloned head (``scale`` ≠ 1: a head that differs from the embedding)."""
    shutil.copytree(model, out)
    state = load_output(model)
    (out / "model.safetensors").unlink()
    if layout == "bin":
        state[HEAD] = state[EMBED]
        torch.save(state, out / "pytorch_model.bin")
    else:
        state[HEAD] = (state[EMBED].float() * scale).to(state[EMBED].dtype)
        save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    assert json.loads((out / "config.json").read_text())["tie_word_embeddings"] is True
    return out


def _figures(doc: dict, models: list[Path]) -> dict:
    """An inspect report without its warnings, each model's path replaced by its place."""
    text = json.dumps({k: v for k, v in doc.items() if k != "warnings"})
    for i, m in enumerate(models):
        text = text.replace(json.dumps(str(m))[1:-1], f"<model {i}>")
    return json.loads(text)


@pytest.mark.parametrize("layout", ["bin", "clone"])
@pytest.mark.parametrize("who", ["base", "all"])
def test_a_tied_base_that_also_stores_its_head_is_tied(example, tmp_path: Path, layout: str, who: str) -> None:
    """A tied base whose file also holds lm_head (the same bytes as the embedding) is the same model as without it:
    the copy is dropped and said, as an agent's is; statistics, merge and the output's tie equal the originals'."""
    base, agents = example
    b2 = _store_head(base, tmp_path / "stored" / base.name, layout)
    a2 = [_store_head(a, tmp_path / "stored" / a.name, layout) for a in agents] if who == "all" else agents
    want = rlmerge.inspect(base, agents).doc
    got = rlmerge.inspect(b2, a2).doc
    assert got["elements"] == want["elements"] and got["tensors"] == want["tensors"]
    assert _figures(got, [b2, *a2]) == _figures(want, [base, *agents])
    assert any(w.startswith(f"the base {b2} stores lm_head.weight") and "dropped" in w for w in got["warnings"])
    res = rlmerge.merge(b2, a2, tmp_path / "out", method="ram+")
    rlmerge.merge(base, agents, tmp_path / "ref", method="ram+")
    assert HEAD not in load_output(tmp_path / "out")
    assert_same_tensors(load_output(tmp_path / "out"), load_output(tmp_path / "ref"))
    assert json.loads((tmp_path / "out" / "config.json").read_text())["tie_word_embeddings"] is True
    assert json.loads((tmp_path / "out" / "rlmerge.json").read_text())["tied_tensors"] == [EMBED]
    assert not any("tie_word_embeddings: false" in w or "only some agents have" in w for w in res.warnings)


def test_agents_that_store_their_tied_head_as_bin_are_as_before(example, tmp_path: Path) -> None:
    """Only the agents store the copy (``torch.save`` layout): dropped, and the merge equals the originals'."""
    base, agents = example
    a2 = [_store_head(a, tmp_path / f"a{i}", "bin") for i, a in enumerate(agents)]
    res = rlmerge.merge(base, a2, tmp_path / "out", method="ram+")
    rlmerge.merge(base, agents, tmp_path / "ref", method="ram+")
    assert_same_tensors(load_output(tmp_path / "out"), load_output(tmp_path / "ref"))
    assert sum(w.startswith("the agent") and "is dropped (the agent is tied)" in w for w in res.warnings) == 3
    assert not any(w.startswith("the base") or "only some agents have" in w for w in res.warnings)
    prov = json.loads((tmp_path / "out" / "rlmerge.json").read_text())
    assert prov["dropped_tensors"] == {HEAD: [str(a) for a in a2]}
    from rlmerge.io.checkpoint import Checkpoint as C
    from rlmerge.stream.match import match_models

    models = [C(m) for m in (base, *a2)]
    for _ in range(2):  # a checkpoint matched again (a sweep's candidates) says the same
        again = match_models(models[0], models[1:])
        assert again.dropped == {HEAD: [str(a) for a in a2]}
        assert sum("is dropped (the agent is tied)" in w for w in again.warnings) == 3


def test_an_agent_whose_stored_tied_head_differs_keeps_it(example, tmp_path: Path) -> None:
    """An agent, like the base, whose tied config comes with a head that differs from its embedding has a head of
    its own (as transformers loads it): lm_head is merged as a tensor, the tied base's embedding standing for its
    head, and the merge equals the one with that agent saved untied."""
    base, agents = example
    a0 = _store_head(agents[0], tmp_path / "a0", "clone", scale=2.0)
    untied = tmp_path / "untied"
    shutil.copytree(a0, untied)
    cfg = json.loads((untied / "config.json").read_text())
    (untied / "config.json").write_text(json.dumps({**cfg, "tie_word_embeddings": False}))
    res = rlmerge.merge(base, [a0, *agents[1:]], tmp_path / "out", method="ram")
    rlmerge.merge(base, [untied, *agents[1:]], tmp_path / "ref", method="ram")
    assert HEAD in load_output(tmp_path / "out")
    assert_same_tensors(load_output(tmp_path / "out"), load_output(tmp_path / "ref"))
    assert json.loads((tmp_path / "out" / "config.json").read_text())["tie_word_embeddings"] is False
    assert sum(w.startswith(f"the agent {a0} stores an lm_head.weight that differs") for w in res.warnings) == 1


def test_a_tied_base_whose_stored_head_differs_keeps_it(example, tmp_path: Path) -> None:
    """A head that differs from the embedding under a tied config is a head of its own, as transformers loads it
    (it ties only equal ones): merged as one, the output untied; the same as the base saved untied."""
    base, agents = example
    b2 = _store_head(base, tmp_path / "b2", "clone", scale=2.0)
    model = _generates(b2)
    assert model.lm_head.weight.data_ptr() != model.model.embed_tokens.weight.data_ptr()  # transformers' reading
    untied = tmp_path / "untied"
    shutil.copytree(b2, untied)
    cfg = json.loads((untied / "config.json").read_text())
    (untied / "config.json").write_text(json.dumps({**cfg, "tie_word_embeddings": False}))
    res = rlmerge.merge(b2, agents, tmp_path / "out", method="ram")
    rlmerge.merge(untied, agents, tmp_path / "ref", method="ram")
    assert HEAD in load_output(tmp_path / "out")
    assert_same_tensors(load_output(tmp_path / "out"), load_output(tmp_path / "ref"))
    assert json.loads((tmp_path / "out" / "config.json").read_text())["tie_word_embeddings"] is False
    assert any(w.startswith(f"the base {b2} stores an lm_head.weight that differs") for w in res.warnings)


def _last_element_differs(model: Path, folder: Path) -> tuple[Path, dict[str, torch.Tensor]]:
    """``model`` saved in ``folder`` with an lm_head that is its embedding but for the last element."""
    state = load_output(model)
    state[HEAD] = state[EMBED].clone()
    state[HEAD].view(-1)[-1] += 1
    folder.mkdir()
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
    return folder, state


def test_same_bytes_reads_nothing_for_one_storage_and_finds_a_last_element(example, tmp_path: Path,
                                                                           monkeypatch) -> None:
    base, _ = example
    shared = Checkpoint(_store_head(base, tmp_path / "bin", "bin"))
    with monkeypatch.context() as m:
        for read in ("read_into", "read_raw"):
            m.setattr(Checkpoint, read, lambda *a, **k: pytest.fail("read a storage it shares"))
        assert shared.same_bytes(HEAD, EMBED)
    ckpt = Checkpoint(_last_element_differs(base, tmp_path / "last")[0])
    assert not ckpt.same_bytes(HEAD, EMBED, chunk=1000) and ckpt.same_bytes(EMBED, EMBED, chunk=1000)
    assert not ckpt.same_bytes(HEAD, "model.norm.weight")  # another shape


def test_equal_bytes_compares_two_checkpoints_chunk_by_chunk(example, tmp_path: Path, monkeypatch) -> None:
    """The one comparison behind the tied-head check and check_copies: a change in the last element of a later
    chunk is found, a dtype of the same size is not equal, and no read is larger than the chunk."""
    from rlmerge.io.checkpoint import equal_bytes

    base, _ = example
    folder, state = _last_element_differs(base, tmp_path / "other")
    a, b = Checkpoint(base), Checkpoint(folder)
    sizes: list[int] = []
    real = Checkpoint.read_raw
    monkeypatch.setattr(Checkpoint, "read_raw", lambda self, n, lo, hi: sizes.append(hi - lo) or real(self, n, lo, hi))
    assert equal_bytes(a, EMBED, b, EMBED, chunk=1000) and not equal_bytes(a, EMBED, b, HEAD, chunk=1000)
    itemsize = a.tensors[EMBED].dtype.itemsize
    assert sizes and max(sizes) * itemsize <= 1000 and len(sizes) > 2
    state["model.norm.weight"] = state["model.norm.weight"].view(torch.int16 if itemsize == 2 else torch.int32)
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
    assert not equal_bytes(a, "model.norm.weight", Checkpoint(folder), "model.norm.weight")
