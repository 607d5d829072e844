"""RAM / RAM+ against the dense reference, hand-computed cases and the documented edge cases."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch

import rlmerge
from conftest import assert_same_tensors, load_output
from reference import counts, lam, load_models, ram_reference
from rlmerge.synthetic import write_checkpoint

PRESETS = [
    ("paper", {"r": 0.1, "alpha": 2.0}),
    ("paper-soft", {"r": 0.1}),
    ("official", {"big_r": 1.2}),
    ("tensor-local", {"r": 0.1, "alpha": 0.2}),
]


@pytest.mark.parametrize("dtype", ["base", "float32", None])  # None: ram+'s default, float32 over a bf16 base
@pytest.mark.parametrize(("preset", "knobs"), PRESETS)
def test_ram_plus_equals_dense_reference(example, tmp_path: Path, preset: str, knobs: dict, dtype: str | None) -> None:
    base, agents = example
    res = rlmerge.merge(base, agents, tmp_path / "out", method="ram+", params={"preset": preset}, dtype=dtype,
                        block_size=1000)
    want = ram_reference(base, agents, preset=preset, out_dtype=None if dtype == "base" else torch.float32, **knobs)
    assert_same_tensors(load_output(tmp_path / "out"), want)
    if preset != "tensor-local":
        b, ags = load_models(base, agents)
        shared, unique = counts(b, ags, 1e-5)
        assert res.lambdas == pytest.approx([lam(preset, s, u, **knobs) for s, u in zip(shared, unique)], abs=0)
        assert list(res.statistics.shared) == shared and list(res.statistics.unique) == unique


def test_ram_equals_dense_reference_and_r0(example, tmp_path: Path) -> None:
    base, agents = example
    rlmerge.merge(base, agents, tmp_path / "ram", method="ram")
    rlmerge.merge(base, agents, tmp_path / "r0", method="ram+", params={"r": 0.0})  # float32 (ram+'s default)
    assert_same_tensors(load_output(tmp_path / "ram"), ram_reference(base, agents, preset=None))
    want32 = ram_reference(base, agents, preset=None, out_dtype=torch.float32)
    assert_same_tensors(load_output(tmp_path / "r0"), want32)  # r = 0 is RAM


def _tiny(tmp_path: Path, base: list[float], agents: list[list[float]]) -> tuple[Path, list[Path]]:
    """One float32 tensor 'w' per model, with the given values."""
    cfg = {"architectures": ["Tiny"], "tie_word_embeddings": False}
    b = write_checkpoint(tmp_path / "b", {"w": torch.tensor(base)}, cfg, tokenizer=False)
    a = [write_checkpoint(tmp_path / f"a{i}", {"w": torch.tensor(v)}, cfg, tokenizer=False)
         for i, v in enumerate(agents)]
    return b, a


def test_hand_computed_case(tmp_path: Path) -> None:
    # element:        0 unchanged, 1 unique to a0, 2 unique to a1, 3 shared a0+a1, 4 shared by all, 5 sub-ε
    base = [1.0, 1.0, 1.0, 1.0, 1.0, 1.0]
    a0 = [1.0, 1.5, 1.0, 1.2, 1.3, 1.0 + 5e-6]
    a1 = [1.0, 1.0, 0.5, 1.4, 1.6, 1.0]
    a2 = [1.0, 1.0, 1.0, 1.0, 1.9, 1.0]
    b, ags = _tiny(tmp_path, base, [a0, a1, a2])
    rlmerge.merge(b, ags, tmp_path / "ram", method="ram")
    got = load_output(tmp_path / "ram")["w"]
    mean3 = 1.0 + ((0.3 + 0.6) + 0.9) / 3  # mean over all three active agents
    expected = [1.0, 1.5, 0.5, 1.0 + (0.2 + 0.4) / 2, mean3, 1.0]
    assert got.tolist() == pytest.approx(expected, abs=1e-6)
    # RAM+ paper: a0 has 1 unique, 2 shared → ρ=2 → λ=1.2; a1 has 1 unique, 2 shared → 1.2; a2 0 unique → ρ=∞.
    res = rlmerge.merge(b, ags, tmp_path / "plus", method="ram+")
    assert res.rho == [2.0, 2.0, math.inf]
    assert res.lambdas == pytest.approx([1.2, 1.2, 1.2])  # a2: 1 + r·α by the no-unique rule
    got = load_output(tmp_path / "plus")["w"]
    assert got[1].item() == pytest.approx(1.0 + 0.5 * 1.2, abs=1e-6)  # unique × λ
    assert got[2].item() == pytest.approx(1.0 - 0.5 * 1.2, abs=1e-6)
    assert got[3].item() == pytest.approx(1.3, abs=1e-6)  # shared: mean over the 2 active, not over N=3
    assert got[0].item() == 1.0 and got[5].item() == 1.0


def test_identical_agent_warns_and_gets_lambda_one(tmp_path: Path) -> None:
    b, ags = _tiny(tmp_path, [1.0, 2.0, 3.0], [[1.0, 2.5, 3.0], [1.0, 2.0, 3.0]])
    res = rlmerge.merge(b, ags, tmp_path / "o", method="ram+")
    assert res.rho[1] == 0.0 and res.lambdas[1] == 1.0
    assert any("identical to the base" in w for w in res.warnings)
    # a0's only change is unique, ρ0 = 0 → λ0 = 1: the change is kept whole.
    assert load_output(tmp_path / "o")["w"].tolist() == [1.0, 2.5, 3.0]
    res = rlmerge.merge(b, ags, tmp_path / "o2", method="ram")
    assert any("identical to the base" in w for w in res.warnings)


@pytest.mark.parametrize("preset", ["official", "arm-r"])
def test_a_rescale_factor_below_one_counts_as_one_and_says_so(example, tmp_path: Path, preset: str) -> None:
    """R < 1 was silently raised to 1 (the authors' script does): every λ 1, plain RAM, no word of it (QA pass,
    2026-12-07). The λ stay the script's; a warning now says so. R ≥ 1 warns nothing."""
    base, agents = example
    low = rlmerge.merge(base, agents, tmp_path / "low", method="ram+",
                        params={"preset": preset, "rescale_factor": 0.8})
    assert low.lambdas == [1.0] * len(agents)
    assert any("rescale_factor 0.8 is below 1" in w and "plain RAM" in w for w in low.warnings), low.warnings
    one = rlmerge.merge(base, agents, tmp_path / "one", method="ram+", params={"preset": preset, "rescale_factor": 1})
    assert one.lambdas == low.lambdas and not any("below 1" in w for w in one.warnings)
    assert_same_tensors(load_output(tmp_path / "low"), load_output(tmp_path / "one"))


def test_tied_weights_counted_once_or_twice(tmp_path: Path) -> None:
    from conftest import TINY
    from rlmerge.synthetic import make_example

    base, agents = make_example(tmp_path / "in", shape=TINY)
    once = rlmerge.merge(base, agents, tmp_path / "once", method="ram+")
    twice = rlmerge.merge(base, agents, tmp_path / "twice", method="ram+", count_tied_twice=True)
    b, ags = load_models(base, agents)
    s1, u1 = counts(b, ags, 1e-5)
    s2, u2 = counts(b, ags, 1e-5, tied_twice=("model.embed_tokens.weight",))
    assert list(once.statistics.shared) == s1 and list(twice.statistics.shared) == s2
    assert list(twice.statistics.unique) == u2 and s1 != s2
    assert twice.lambdas == pytest.approx([lam("paper", s, u) for s, u in zip(s2, u2)], abs=0)
    # Only the counts that feed ρ double (issue 15): elements, densities, norms and cosines count each stored
    # element once either way.
    assert once.statistics.numel == twice.statistics.numel == sum(v.numel() for v in b.values()
                                                                   if v.is_floating_point())
    for attr in ("changed", "norms", "cosine"):
        assert np.array_equal(getattr(once.statistics, attr), getattr(twice.statistics, attr)), attr
    # Tied stays tied: lm_head is not stored, exactly as in the base.
    assert "lm_head.weight" not in load_output(tmp_path / "once")
    prov = json.loads((tmp_path / "once" / "rlmerge.json").read_text())
    assert prov["tied_tensors"] == ["model.embed_tokens.weight"]
    # rlmerge.json's and the card's per-agent rows count each stored element once either way (they add up to
    # `changed`); only ρ and λ carry the double count
    rows = [json.loads((tmp_path / d / "rlmerge.json").read_text())["agents"] for d in ("once", "twice")]
    for r1, r2, s, u in zip(*rows, s1, u1):
        assert r1["unique"] + r1["shared"] == r1["changed"] and (r1["shared"], r1["unique"]) == (s, u)
        assert {k: v for k, v in r2.items() if k not in ("rho", "lambda")} == {
            k: v for k, v in r1.items() if k not in ("rho", "lambda")}
    assert [r["rho"] for r in rows[1]] == pytest.approx([s / u for s, u in zip(s2, u2)]) != [r["rho"] for r in rows[0]]
    card = (tmp_path / "twice" / "README.md").read_text()
    assert all(f"| {r['changed']} | {r['unique']} | {r['shared']} |" in card for r in rows[1]), card


def test_unique_probe(example, tmp_path: Path) -> None:
    base, agents = example
    b, ags = load_models(base, agents)
    for divide in (False, True):
        out = tmp_path / f"u{divide}"
        rlmerge.merge(base, agents, out, method="unique", params={"agent": 1, "divide_by_n": divide})
        got = load_output(out)
        for name, bt in b.items():
            taus = [a[name].float() - bt.float() for a in ags]
            masks = [t.abs() > 1e-5 for t in taus]
            only = masks[1] & (sum(m.long() for m in masks) == 1)
            scale = 1 / 3 if divide else 1.0
            want = torch.where(only, bt.float() + taus[1] * scale, bt.float()).to(bt.dtype)
            assert torch.equal(got[name], want), name


@pytest.mark.parametrize("method", ["ram", "ram+"])
def test_unchanged_elements_are_the_base_bit_for_bit(tmp_path: Path, method: str) -> None:
    # −0.0 + 0.0 would be +0.0: an unchanged element must come back exactly, sign of zero included.
    b, ags = _tiny(tmp_path, [-0.0, 1.0, -0.0], [[-0.0, 2.0, 0.5], [-0.0, 1.0, -0.0]])
    rlmerge.merge(b, ags, tmp_path / "o", method=method)
    got = load_output(tmp_path / "o")["w"]
    assert torch.signbit(got[0]) and got[0] == 0.0
