"""The mechanism measurements: density by |w|, the pruning control, and the bf16-storage dial."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from rlmerge.lab.grpo import Bf16Storage, round_to_bf16_
from rlmerge.lab.mechanism import density_by_magnitude, prune_task_vector


def _ckpt(folder: Path, tensors: dict[str, torch.Tensor]) -> Path:
    folder.mkdir()
    save_file({k: v.to(torch.bfloat16) for k, v in tensors.items()}, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps({"model_type": "toy"}))
    return folder


def test_density_by_magnitude_counts_each_bin(tmp_path: Path) -> None:
    # bins [2^-4, 2^-3): 0.07, 0.08, 0.09 ; [2^-1, 1): 0.6, 0.7 ; zero: 0.0
    w = torch.tensor([0.07, 0.08, 0.09, 0.6, 0.7, 0.0])
    moved = w.clone()
    moved[0] += 0.01  # one of three small weights changes
    moved[3] += 0.1  # one of two large ones
    moved[5] = 1.0  # the zero one
    bins = density_by_magnitude(_ckpt(tmp_path / "b", {"w": w}), _ckpt(tmp_path / "a", {"w": moved}))
    by_low = {b["low"]: (b["elements"], b["density"]) for b in bins}
    assert by_low[0.0] == (1, 1.0)
    assert by_low[2.0**-4] == (3, pytest.approx(1 / 3))
    assert by_low[0.5] == (2, 0.5)
    assert sum(b["elements"] for b in bins) == 6


def test_prune_keeps_exactly_the_largest_task_vector_entries(tmp_path: Path) -> None:
    base = {"a": torch.zeros(4), "b": torch.ones(6)}
    agent = {"a": torch.tensor([0.5, -2.0, 0.0, 0.25]), "b": torch.tensor([1.0, 4.0, 1.125, 0.0, 1.0, 2.0])}
    # |τ| over the model: a: .5 2 0 .25 ; b: 0 3 .125 1 0 1 → the top 3 of 10 are 3, 2, and a tie at 1 (both kept)
    info = prune_task_vector(_ckpt(tmp_path / "base", base), _ckpt(tmp_path / "agent", agent), 0.3, tmp_path / "p")
    got = load_file(tmp_path / "p" / "model.safetensors")
    assert torch.equal(got["a"].float(), torch.tensor([0.0, -2.0, 0.0, 0.0]))
    assert torch.equal(got["b"].float(), torch.tensor([1.0, 4.0, 1.0, 0.0, 1.0, 2.0]))
    assert got["a"].dtype == torch.bfloat16 and info["kept"] == 4.0
    assert (tmp_path / "p" / "config.json").is_file()
    with pytest.raises(ValueError):
        prune_task_vector(tmp_path / "base", tmp_path / "agent", 0.0, tmp_path / "q")


def test_bf16_storage_absorbs_a_step_smaller_than_half_the_spacing() -> None:
    """One Adam step moves every weight by exactly lr; bf16 storage keeps it only where lr > ulp(w)/2."""
    torch.manual_seed(0)
    lin = torch.nn.Linear(64, 64, bias=False)
    with torch.no_grad():
        lin.weight.copy_(torch.exp2(torch.empty(64, 64).uniform_(-12, 0)) * torch.sign(torch.randn(64, 64)))
    round_to_bf16_(lin)
    w0 = lin.weight.detach().clone()
    lr = 2.0**-14
    opt = torch.optim.AdamW(lin.parameters(), lr=lr, weight_decay=0.0)
    lin(torch.randn(8, 64)).pow(2).sum().backward()
    opt.step()
    Bf16Storage().on_optimizer_step(None, None, None, model=lin)
    w1 = lin.weight.detach()
    assert torch.equal(w1, w1.to(torch.bfloat16).float())  # stored in bf16
    half_ulp = torch.exp2(torch.floor(torch.log2(w0.abs())) - 8)  # half of 2^(e−7)
    absorbed, kept = half_ulp > lr, half_ulp < lr
    assert absorbed.any() and kept.any()
    assert torch.equal(w1[absorbed], w0[absorbed])  # too small a step for these weights: nothing changed
    assert (w1[kept] != w0[kept]).all()  # every weight with a fine enough spacing moved
