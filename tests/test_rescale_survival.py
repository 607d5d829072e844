"""RAM+'s rescale and the output dtype (issue 15): float32 by default, and how much of λ the written model kept.

The oracle for the kept counts is two independent merges: RAM+ and RAM of the same inputs in the same dtype. An
element only one agent changed is kept when the two written values differ (RAM writes b + τ there).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

import rlmerge
from conftest import TINY, load_output
from rlmerge.cli import main
from rlmerge.recipe import load_recipe
from rlmerge.synthetic import config, random_base, write_checkpoint


def _one_step_agents(root: Path, densities: tuple[float, ...] = (0.05, 0.4, 0.5)) -> tuple[Path, list[Path]]:
    """A bf16 base and agents that move each changed element by one bfloat16 step: RL's micro-updates, which a
    rescale by λ ≈ 1.2 cannot carry in bf16."""
    cfg = config(TINY, torch.bfloat16)
    base = {k: v.to(torch.bfloat16) for k, v in random_base(TINY, seed=3).items()}
    base_dir = write_checkpoint(root / "base", base, cfg)
    agents = []
    for i, d in enumerate(densities):
        g = torch.Generator().manual_seed(10 + i)
        moved = {}
        for name, w in base.items():
            mask = torch.rand(w.shape, generator=g) < d
            bits = w.view(torch.int16)
            moved[name] = torch.where(mask, bits + 1, bits).view(torch.bfloat16)  # one step away from zero
        agents.append(write_checkpoint(root / f"agent{i}", moved, cfg))
    return base_dir, agents


def _unique_masks(base: Path, agents: list[Path], eps: float = 1e-5) -> dict[str, np.ndarray]:
    """name → [N, n] bool: the elements only agent t changed (|τ| > ε in float32)."""
    b = load_file(str(base / "model.safetensors"))
    a = [load_file(str(p / "model.safetensors")) for p in agents]
    out = {}
    for k, w in b.items():
        tau = torch.stack([x[k].float() - w.float() for x in a]).reshape(len(a), -1)
        changed = tau.abs() > eps
        out[k] = (changed & (changed.sum(0) == 1)).numpy()
    return out


def _oracle_kept(ram_plus: Path, ram: Path, masks: dict[str, np.ndarray]) -> list[float]:
    rp, r = load_output(ram_plus), load_output(ram)
    n = next(iter(masks.values())).shape[0]
    rescaled, kept = np.zeros(n, dtype=np.int64), np.zeros(n, dtype=np.int64)
    for k, m in masks.items():
        differs = (rp[k].float() != r[k].float()).reshape(-1).numpy()
        rescaled += m.sum(1)
        kept += (m & differs).sum(1)
    return (kept / rescaled).tolist()


@pytest.mark.parametrize("fast", ["1", "0"], ids=["numba", "torch"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_kept_counts_equal_two_independent_merges(example, tmp_path: Path, monkeypatch, fast: str, dtype: str) -> None:
    monkeypatch.setenv("RLMERGE_FAST", fast)
    base, agents = example
    res = rlmerge.merge(base, agents, tmp_path / "plus", method="ram+", dtype=dtype, quiet=True)
    rlmerge.merge(base, agents, tmp_path / "ram", method="ram", dtype=dtype, quiet=True)
    expected = _oracle_kept(tmp_path / "plus", tmp_path / "ram", _unique_masks(base, agents))
    assert res.rescale_kept == pytest.approx(expected, abs=0)
    if dtype == "float32":
        assert res.rescale_kept == [1.0, 1.0, 1.0]
    rows = json.loads((tmp_path / "plus" / "rlmerge.json").read_text())["agents"]
    assert [r["lambda_kept"] for r in rows] == res.rescale_kept
    assert "λ kept" in (tmp_path / "plus" / "README.md").read_text()


def test_one_step_updates_are_lost_in_bf16_and_kept_by_the_default(tmp_path: Path) -> None:
    base, agents = _one_step_agents(tmp_path / "in")
    narrow = rlmerge.merge(base, agents, tmp_path / "bf16", method="ram+", dtype="bfloat16", quiet=True)
    rlmerge.merge(base, agents, tmp_path / "ram", method="ram", dtype="bfloat16", quiet=True)
    expected = _oracle_kept(tmp_path / "bf16", tmp_path / "ram", _unique_masks(base, agents))
    assert narrow.rescale_kept == pytest.approx(expected, abs=0)
    assert max(narrow.rescale_kept) < 0.5  # × λ ≤ 1.2 on one step rounds back to the step
    lost = [w for w in narrow.warnings if "keep λ in bfloat16" in w]
    assert len(lost) == 3 and all(f"agent{i}" in w for i, w in enumerate(lost))
    assert "--dtype float32" in lost[0]
    assert all(w in json.loads((tmp_path / "bf16" / "rlmerge.json").read_text())["warnings"] for w in lost)

    wide = rlmerge.merge(base, agents, tmp_path / "default", method="ram+", quiet=True)  # float32 by default
    assert wide.rescale_kept == [1.0, 1.0, 1.0]
    assert not [w for w in wide.warnings if "keep λ" in w]
    assert {t.dtype for t in load_output(tmp_path / "default").values()} == {torch.float32}


def test_default_output_dtype(example, tmp_path: Path) -> None:
    """ram+ writes float32 over a bf16 base unless a dtype is given; other methods keep the base's; 'base' keeps
    the base's for ram+ too; the config says what was written."""
    base, agents = example

    def written(out: str, **kw) -> set[torch.dtype]:
        rlmerge.merge(base, agents, tmp_path / out, quiet=True, **kw)
        torch_dtype = json.loads((tmp_path / out / "config.json").read_text()).get("torch_dtype")
        dtypes = {t.dtype for t in load_output(tmp_path / out).values() if t.is_floating_point()}
        assert torch_dtype == str(dtypes.pop() if len(dtypes) == 1 else "mixed").removeprefix("torch."), out
        return {t.dtype for t in load_output(tmp_path / out).values() if t.is_floating_point()}

    assert written("plus", method="ram+") == {torch.float32}
    assert written("plus-base", method="ram+", dtype="base") == {torch.bfloat16}
    assert written("plus-bf16", method="ram+", dtype="bf16") == {torch.bfloat16}
    assert written("ram", method="ram") == {torch.bfloat16}
    assert written("ta", method="task_arithmetic") == {torch.bfloat16}
    assert rlmerge.dry_run(base, agents, tmp_path / "p").to_json()["merged_dtypes"] == ["float32"]  # plan says so
    assert rlmerge.dry_run(base, agents, tmp_path / "p", dtype="base").to_json()["merged_dtypes"] == ["bfloat16"]


def test_cli_shows_the_kept_column_and_refuses_an_unknown_dtype(example, tmp_path: Path, capsys) -> None:
    base, agents = example
    assert main(["merge", str(base), *map(str, agents), "-o", str(tmp_path / "o"), "--dtype", "bfloat16"]) == 0
    printed = capsys.readouterr().out
    assert "λ kept" in printed and "(bfloat16)" in printed
    assert main(["merge", str(base), *map(str, agents), "-o", str(tmp_path / "d")]) == 0
    assert "(float32)" in capsys.readouterr().out
    assert main(["merge", str(base), *map(str, agents), "-o", str(tmp_path / "p"), "--dtype", "int8"]) == 2
    assert "float32, or base" in capsys.readouterr().err


def test_a_mergekit_recipe_keeps_mergekits_dtype(example, tmp_path: Path) -> None:
    """mergekit writes the models' own dtype: its ``ramplus_tl`` recipe without a dtype gives bf16, and says so."""
    base, agents = example
    doc = {"merge_method": "ramplus_tl", "base_model": str(base), "models": [{"model": str(a)} for a in agents]}
    path = tmp_path / "r.yaml"
    path.write_text(json.dumps(doc))
    rec = load_recipe(path)
    assert rec.dtype == "base"
    assert any("dtype = the base's" in d for d in rec.defaults)
    doc["merge_method"] = "ram+"  # rlmerge's own name: rlmerge's default
    path.write_text(json.dumps(doc))
    assert load_recipe(path).dtype is None
