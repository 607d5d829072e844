"""rlmerge.inspect on checkpoints with planted masks: every count exact, against truth built from the masks."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch

import rlmerge
from conftest import TINY
from reference import lam
from rlmerge.report.data import layer_index, module_type
from rlmerge.synthetic import config, random_base, write_checkpoint

# Planted |τ| classes: 0 unchanged, then one magnitude between each pair of thresholds (1e-6, 1e-5, 1e-4, 1e-3).
MAGS = (0.0, 3e-6, 3e-5, 3e-4, 3e-3)
EPS = 1e-5
THRESHOLDS = (1e-6, 1e-5, 1e-4, 1e-3)
# Per agent: probability of each non-zero class; uneven on purpose (a sparse agent, two denser ones).
PROBS = ((0.01, 0.01, 0.01, 0.02), (0.05, 0.1, 0.1, 0.2), (0.02, 0.2, 0.1, 0.2))


def _plant(root: Path) -> tuple[Path, list[Path], dict[str, torch.Tensor], list[dict[str, torch.Tensor]]]:
    """float32 base + agents; returns also each agent's planted class per element (sign in the class's sign)."""
    base = random_base(TINY, seed=3)
    cfg = config(TINY, torch.float32)
    g = torch.Generator().manual_seed(7)
    bpath = write_checkpoint(root / "base", base, cfg, tokenizer=False)
    paths, classes = [], []
    for t, probs in enumerate(PROBS):
        cls, tensors = {}, {}
        edges = torch.tensor(np.cumsum(probs), dtype=torch.float32)
        for name, w in base.items():
            u = torch.rand(w.shape, generator=g)
            c = (u.unsqueeze(-1) < edges).long()  # [.., 4]: 1 where u below the edge
            k = torch.where(u < edges[-1], 4 - c.sum(-1) + 1, torch.zeros_like(u, dtype=torch.long))
            sign = torch.where(torch.rand(w.shape, generator=g) < 0.5, -1, 1)
            cls[name] = k * sign
            tensors[name] = w + sign * torch.tensor(MAGS, dtype=torch.float32)[k]
        paths.append(write_checkpoint(root / f"agent{t}", tensors, cfg, tokenizer=False))
        classes.append(cls)
    return bpath, paths, base, classes


@pytest.fixture(scope="module")
def planted(tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("planted")
    base, agents, weights, classes = _plant(root)
    rep = rlmerge.inspect(base, agents, epsilon=EPS, thresholds=THRESHOLDS, block_size=1000)
    return base, agents, weights, classes, rep


def _truth(classes: list[dict[str, torch.Tensor]], names: list[str]) -> dict[str, np.ndarray]:
    """Counts straight from the planted classes over the tensors ``names``."""
    n = len(classes)
    out = {"kofn": np.zeros((n, n + 1), dtype=np.int64), "above": np.zeros((n, len(THRESHOLDS)), dtype=np.int64),
           "nonzero": np.zeros(n, dtype=np.int64), "overlap": np.zeros((n, n), dtype=np.int64),
           "agree": np.zeros((n, n), dtype=np.int64), "numel": np.zeros((), dtype=np.int64)}
    for name in names:
        k = [c[name].abs() for c in classes]
        active = [kk >= 2 for kk in k]  # 3e-5 and up: |τ| > ε = 1e-5
        count = sum(a.long() for a in active)
        out["numel"] += k[0].numel()
        for t in range(n):
            for j in range(1, n + 1):
                out["kofn"][t, j] += int((active[t] & (count == j)).sum())
            for j, th in enumerate(THRESHOLDS):
                out["above"][t, j] += int((torch.tensor(MAGS)[k[t]] > th).sum())
            out["nonzero"][t] += int((k[t] > 0).sum())
            for b in range(n):
                both = active[t] & active[b]
                out["overlap"][t, b] += int(both.sum())
                out["agree"][t, b] += int((both & (classes[t][name].sign() == classes[b][name].sign())).sum())
    return out


def test_counts_are_exact(planted) -> None:
    _, _, weights, classes, rep = planted
    doc = rep.doc
    want = _truth(classes, list(weights))
    assert doc["elements"] == int(want["numel"]) and doc["tensors"] == len(weights)
    assert doc["thresholds"] == list(THRESHOLDS)
    for t, row in enumerate(doc["per_agent"]):
        kofn = want["kofn"][t]
        changed, unique, shared = int(kofn.sum()), int(kofn[1]), int(kofn[2:].sum())
        assert row["kofn"] == kofn[1:].tolist()
        assert (row["changed"], row["unique"], row["shared"]) == (changed, unique, shared)
        assert row["density"] == changed / want["numel"]
        assert row["density_at"] == [v / want["numel"] for v in want["above"][t]]
        assert row["value_changed"] == want["nonzero"][t]
        assert row["rho"] == shared / unique
        for preset, knobs in (("paper", {}), ("paper-soft", {}), ("official", {})):
            assert row["ram_plus"][preset] == lam(preset, shared, unique, **knobs)
    pw = doc["pairwise"]
    n = len(classes)
    for a in range(n):
        for b in range(n):
            assert pw["overlap"][a][b] == want["overlap"][a, b]  # the diagonal too: changed by a (and by a)
            if a != b:
                assert pw["sign_agreement"][a][b] == want["agree"][a, b] / want["overlap"][a, b]
        assert pw["overlap"][a][a] == doc["per_agent"][a]["changed"]
        assert pw["jaccard"][a][a] == pw["sign_agreement"][a][a] == 1.0


def test_tensor_local_lambda(planted) -> None:
    _, _, weights, classes, rep = planted
    for t, row in enumerate(rep.doc["per_agent"]):
        lams, uniq = [], []
        for name in weights:
            kofn = _truth(classes, [name])["kofn"][t]
            if kofn[1]:
                lams.append(lam("tensor-local", int(kofn[2:].sum()), int(kofn[1]), r=0.1, alpha=0.2))
                uniq.append(int(kofn[1]))
        tl = row["ram_plus_tensor_local"]
        assert (tl["lambda_min"], tl["lambda_max"]) == (min(lams), max(lams))
        assert tl["lambda_effective"] == pytest.approx(np.dot(lams, uniq) / sum(uniq), rel=1e-12)


def test_layers_and_modules_are_exact(planted) -> None:
    _, _, weights, classes, rep = planted
    doc = rep.doc
    layers = sorted({layer_index(n) for n in weights} - {None})
    assert [g["layer"] for g in doc["layers"]] == layers
    for g in doc["layers"]:
        want = _truth(classes, [n for n in weights if layer_index(n) == g["layer"]])
        assert g["changed"] == want["kofn"].sum(1).tolist() and g["elements"] == want["numel"]
        assert g["density"] == [c / want["numel"] for c in want["kofn"].sum(1)]
    expected = {"embed", "attn_q", "attn_k", "attn_v", "attn_o", "mlp_gate", "mlp_up", "mlp_down", "norm"}
    assert {g["module"] for g in doc["modules"]} == expected  # tied TINY: no lm_head tensor stored
    for g in doc["modules"]:
        want = _truth(classes, [n for n in weights if module_type(n) == g["module"]])
        assert g["changed"] == want["kofn"].sum(1).tolist()


def test_norms_cosine_and_magnitudes(planted) -> None:
    base, agents, weights, _, rep = planted
    from conftest import load_output

    taus = []
    for a in agents:
        stored = load_output(a)
        taus.append(torch.cat([(stored[n] - weights[n]).flatten() for n in weights]))
    for t, row in enumerate(rep.doc["per_agent"]):
        tau = taus[t]
        assert row["norm"] == pytest.approx(float(tau.double().norm()), rel=1e-9)
        nz = tau[tau != 0].abs().sort().values
        for q, got in zip((0.01, 0.1, 0.25, 0.5, 0.75, 0.9, 0.99), row["magnitude_quantiles"]):
            exact = nz[max(1, math.ceil(q * len(nz))) - 1]
            truncated = (exact.view(torch.int32) & ~0xFFFF).view(torch.float32).item()  # to 8 significant bits
            assert got == truncated
    cos = rep.doc["pairwise"]["cosine"]
    for a in range(len(taus)):
        for b in range(len(taus)):
            want = float(taus[a].double() @ taus[b].double() / (taus[a].double().norm() * taus[b].double().norm()))
            assert cos[a][b] == pytest.approx(want, rel=1e-8, abs=1e-12)


def test_block_size_invariant(planted) -> None:
    base, agents, _, _, rep = planted
    other = rlmerge.inspect(base, agents, epsilon=EPS, thresholds=THRESHOLDS, block_size=501)
    assert other.to_json() == rep.to_json()


def test_precision_facts_bf16(example) -> None:
    base, agents = example
    doc = rlmerge.inspect(base, agents[:1]).doc
    from conftest import load_output

    b = torch.cat([v.float().flatten() for v in load_output(base).values()]).abs()
    spacing = torch.exp2(torch.floor(torch.log2(b.double())).clamp(min=-126) - 7)  # bf16: 7 mantissa bits
    p = doc["precision"]
    assert p["dtype"] == "bf16"
    assert p["share_step_at_most_epsilon"] == int(((spacing <= 1e-5) | (b == 0)).sum()) / b.numel()
    median = b.sort().values[math.ceil(0.5 * b.numel()) - 1].item()
    assert p["median_abs_base"] == median  # bf16 values are exactly representable at the bin edges
    assert p["step_at_median"] == 2.0 ** (math.floor(math.log2(median)) - 7)


def test_dtype_mismatch_and_identical_agent(example, tmp_path: Path) -> None:
    from conftest import load_output

    base, agents = example
    stored = load_output(base)
    cfg = json.loads((base / "config.json").read_text())
    wide = write_checkpoint(tmp_path / "wide", {k: v.float() for k, v in stored.items()}, cfg, tokenizer=False)
    half = write_checkpoint(tmp_path / "half", {k: v.half() for k, v in stored.items()}, cfg, tokenizer=False)
    same = write_checkpoint(tmp_path / "same", stored, cfg, tokenizer=False)
    doc = rlmerge.inspect(base, [wide, same]).doc
    numel = doc["elements"]
    assert [r["dtype_differs_elements"] for r in doc["per_agent"]] == [numel, 0]
    assert doc["per_agent"][0]["dtypes"] == {"F32": numel}
    assert [r["changed"] for r in doc["per_agent"]] == [0, 0]  # an exact upcast changes nothing
    label = doc["agents"][0]
    assert sum(w.startswith(f"agent {label} stores") for w in doc["warnings"]) == 1  # plan's warning, not twice
    assert sum("identical to the base" in w for w in doc["warnings"]) == 2
    assert doc["per_agent"][1]["rho"] == 0.0 and doc["per_agent"][1]["ram_plus"]["paper"] == 1.0
    # fp16 is as wide as bf16 and still another dtype: warned once, naming both dtypes.
    doc = rlmerge.inspect(base, [half]).doc
    warned = [w for w in doc["warnings"] if "stores" in w]
    assert len(warned) == 1 and "stores F16 against a BF16 base" in warned[0]


def test_count_tied_twice_weighs_only_rho(planted) -> None:
    """--count-tied-twice doubles the tied embedding's counts in ρ and λ only: the rows still add up (modules and
    layers to the whole, unique + shared = changed, unique share ≤ 1), and every count but ρ's stays the same."""
    base, agents, weights, classes, once = planted
    twice = rlmerge.inspect(base, agents, epsilon=EPS, thresholds=THRESHOLDS, block_size=1000, count_tied_twice=True)
    tied = "model.embed_tokens.weight"
    assert tied in weights and "lm_head.weight" not in weights  # TINY ties lm_head to the embedding
    for doc in (once.doc, twice.doc):
        assert sum(g["elements"] for g in doc["modules"]) == doc["elements"]
        for t, row in enumerate(doc["per_agent"]):
            assert sum(g["changed"][t] for g in doc["modules"]) == row["changed"]
            assert row["unique"] + row["shared"] == row["changed"] == sum(row["kofn"])
            assert row["unique_share"] == row["unique"] / row["changed"] <= 1
    for key in ("elements", "modules", "layers", "pairwise"):
        assert twice.doc[key] == once.doc[key], key
    emb = _truth(classes, [tied])["kofn"]
    for t, (a, b) in enumerate(zip(once.doc["per_agent"], twice.doc["per_agent"])):
        assert {k: v for k, v in a.items() if k not in ("rho", "ram_plus", "ram_plus_tensor_local")} == {
            k: v for k, v in b.items() if k not in ("rho", "ram_plus", "ram_plus_tensor_local")}
        shared, unique = b["shared"] + int(emb[t, 2:].sum()), b["unique"] + int(emb[t, 1])
        assert b["rho"] == shared / unique != a["rho"]  # the authors' double count: the embedding's counts twice
        assert b["ram_plus"]["paper"] == lam("paper", shared, unique)
