"""The RAM authors' other modes, as declared in the new shape (methods/): arm-r and arm-ties, against dense
references written from ../shared/docs/ram-method.md, on the fused and the torch path."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import rlmerge
from conftest import TINY, assert_same_tensors, load_output
from reference import arm_ties_tensor, load_models, ram_reference
from rlmerge.methods import REGISTRY
from rlmerge.synthetic import make_example


@pytest.mark.parametrize("fast", ["1", "0"], ids=["fused", "torch"])
@pytest.mark.parametrize("dtype", ["base", "float32"])  # ram+ writes float32 by default: "base" asks for bf16
def test_arm_r_matches_its_dense_reference(example, tmp_path: Path, monkeypatch, fast: str, dtype: str,
                                           ) -> None:
    base, agents = example
    monkeypatch.setenv("RLMERGE_FAST", fast)
    res = rlmerge.merge(base, agents, tmp_path / "out", method="ram+", params={"preset": "arm-r",
                                                                               "rescale_factor": 1.5},
                        dtype=dtype, block_size=777)
    want = ram_reference(base, agents, preset="arm-r", big_r=1.5,
                         out_dtype=torch.float32 if dtype == "float32" else None)
    assert_same_tensors(load_output(tmp_path / "out"), want)
    assert res.lambdas is not None and all(1.0 <= lam <= 1.5 for lam in res.lambdas)


@pytest.mark.parametrize("fast", ["1", "0"], ids=["fused", "torch"])
@pytest.mark.parametrize(("dtype", "params"), [(None, {}), ("float32", {}),
                                               ("float32", {"mask_rate": 0.5, "scaling": 0.8})])
def test_arm_ties_matches_its_dense_reference(tmp_path: Path, monkeypatch, fast: str, dtype: str | None,
                                              params: dict) -> None:
    base, agents = make_example(tmp_path / "in", shape=TINY, densities=(0.3, 0.5, 0.6))  # a large shared region
    monkeypatch.setenv("RLMERGE_FAST", fast)
    rlmerge.merge(base, agents, tmp_path / "out", method="arm-ties", params=params, dtype=dtype, block_size=777)
    b, ags = load_models(base, agents)
    want = {}
    for name, bt in b.items():
        if not bt.is_floating_point():
            want[name] = bt
            continue
        merged = arm_ties_tensor(bt, [a[name] for a in ags], 1e-5, params.get("mask_rate", 0.9),
                                 params.get("scaling", 1.0))
        want[name] = merged.to(torch.float32 if dtype else bt.dtype)
    got = load_output(tmp_path / "out")
    assert_same_tensors(got, want)
    # not RAM: the shared region is trimmed and elected, so some shared elements differ from the active mean
    ram = ram_reference(base, agents, preset=None, out_dtype=torch.float32 if dtype else None)
    assert any(not torch.equal(got[k], ram[k]) for k in got if got[k].is_floating_point())


def test_each_new_mode_is_one_declaration() -> None:
    """arm-ties is one MethodSpec with a rule (so every backend runs it); arm-r one preset of ram+."""
    from rlmerge.methods.ram import PRESETS

    spec = REGISTRY["arm-ties"]
    assert spec.rule is not None and spec.merge is None and spec.program(spec.parse({}), 3) is not None
    assert "arm-r" in PRESETS
