"""TIES, DARE, Breadcrumbs, DELLA, SLERP, Model Stock, Fisher against dense references; block-size invariance,
seeded determinism, parameter ranges, mergekit recipe translation."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import reference_baselines as ref
import rlmerge
from conftest import assert_same_tensors, load_output
from reference import load_models
from rlmerge.errors import ConfigError, InputError, RLMergeError
from rlmerge.methods import get_method
from rlmerge.methods._select import KthLargest
from rlmerge.methods.sparsify.rng import uniform
from rlmerge.recipe import parse_recipe
from rlmerge.report.provenance import agent_rows
from rlmerge.synthetic import write_checkpoint

ULP = 2.0 ** -23
W = (1.0, 0.6, 1.3)


def _close(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], ulps: float = 8) -> None:
    assert got.keys() == want.keys()
    for k in got:
        scale = float(want[k].abs().max()) or 1.0
        diff = float((got[k].float() - want[k].float()).abs().max())
        assert diff <= ulps * ULP * scale, f"{k}: max |diff| {diff:.3g} (scale {scale:.3g})"


def _merge_twice(base: Path, agents: list[Path], out: Path, method: str, params: dict, seed: int = 0
                 ) -> dict[str, torch.Tensor]:
    """Merge with two block sizes (997 elements, and whole tensors); they must agree bit for bit."""
    rlmerge.merge(base, agents, out / "small", method=method, params=params, dtype="float32", block_size=997,
                  seed=seed)
    rlmerge.merge(base, agents, out / "large", method=method, params=params, dtype="float32",
                  block_size=1 << 22, seed=seed)
    small, large = load_output(out / "small"), load_output(out / "large")
    assert_same_tensors(small, large)
    return small


def _dense(base: Path, agents: list[Path], method: str, seed: int = 0, **kw: object) -> dict[str, torch.Tensor]:
    b, ags = load_models(base, agents)
    names = [k for k, v in b.items() if v.is_floating_point()]
    n = len(ags)
    taus = {k: [a[k].float() - b[k].float() for a in ags] for k in names}
    dens = list(kw.get("density", (0.2,) * n))  # type: ignore[arg-type]
    global_tau = [torch.cat([taus[k][t].reshape(-1) for k in names]) for t in range(n)]
    out = {}
    for k in names:
        base_k, tk = b[k].float(), taus[k]
        if method in ("ties", "ties_global"):
            masks = ref.ties_masks(tk, dens, global_tau=global_tau if method == "ties_global" else None,
                                   tie_break=str(kw.get("tie_break") or "index"))
            pruned = [t * m for t, m in zip(tk, masks)]
            out[k] = ref.gta_combine(base_k, pruned, list(W), sign=True, normalize=True, scaling=0.7)
        elif method.startswith("breadcrumbs"):
            masks = ref.breadcrumbs_masks(tk, dens, [0.05] * n)
            pruned = [t * m for t, m in zip(tk, masks)]
            out[k] = ref.gta_combine(base_k, pruned, list(W), sign=method.endswith("ties"), normalize=False,
                                     scaling=1.0)
        elif method.startswith("dare"):
            us = [ref.whole_uniform(seed, t, k, base_k.numel()).reshape(base_k.shape) for t in range(n)]
            pruned = [tau * (u < d) / torch.tensor(d, dtype=torch.float32) for tau, u, d in zip(tk, us, dens)]
            out[k] = ref.gta_combine(base_k, pruned, list(W), sign=method == "dare_ties",
                                     normalize=method == "dare_ties", scaling=1.0)
        else:  # della
            us = [ref.whole_uniform(seed, t, k, base_k.numel()).reshape(base_k.shape) for t in range(n)]
            probs = [ref.della_probs(tau, d, 0.1) for tau, d in zip(tk, dens)]
            pruned = [tau * (u < p) / p for tau, u, p in zip(tk, us, probs)]
            out[k] = ref.gta_combine(base_k, pruned, list(W), sign=method == "della", normalize=method == "della",
                                     scaling=1.0)
    return out


GTA_CASES = [
    ("ties", {"density": (0.3, 0.2, 0.1), "scaling": 0.7}),
    ("ties", {"density": (0.3, 0.2, 0.1), "scaling": 0.7, "tie_break": "keep-all"}),
    ("ties_global", {"density": (0.3, 0.2, 0.1), "scaling": 0.7}),
    ("breadcrumbs", {"density": (0.5, 0.3, 0.2), "gamma": 0.05}),
    ("breadcrumbs_ties", {"density": (0.5, 0.3, 0.2), "gamma": 0.05}),
    ("dare_ta", {"p": (0.5, 0.7, 0.9)}),
    ("dare_ties", {"density": (0.5, 0.3, 0.1)}),
    ("della", {"density": (0.5, 0.4, 0.3), "epsilon": 0.1}),
    ("della_linear", {"density": (0.5, 0.4, 0.3), "epsilon": 0.1}),
]


@pytest.mark.parametrize(("method", "params"), GTA_CASES,
                         ids=[c[0] + ("-" + c[1]["tie_break"] if "tie_break" in c[1] else "") for c in GTA_CASES])
def test_gta_methods_equal_dense_reference(example, tmp_path: Path, method: str, params: dict) -> None:
    base, agents = example
    got = _merge_twice(base, agents, tmp_path, method, {**params, "weights": W}, seed=5)
    dens = params["density"] if "density" in params else tuple(1 - p for p in params["p"])
    want = _dense(base, agents, method, seed=5, density=dens, tie_break=params.get("tie_break"))
    _close({k: v for k, v in got.items() if v.is_floating_point()}, want)


def test_ties_global_threshold_is_whole_model(example, tmp_path: Path) -> None:
    """The paper's TIES keeps ~density of each WHOLE task vector; per-tensor TIES keeps ~density of each tensor."""
    base, agents = example
    b, ags = load_models(base, agents)
    for method in ("ties", "ties_global"):
        rlmerge.merge(base, agents[2:], tmp_path / method, method=method, params={"density": 0.2}, dtype="float32")
        got = load_output(tmp_path / method)
        kept = {k: int((got[k] != b[k].float()).sum()) for k in b}
        total_kept, total = sum(kept.values()), sum(v.numel() for v in b.values())
        nonzero = sum(int((ags[2][k] != b[k]).sum()) for k in b)
        assert total_kept <= nonzero
        if method == "ties_global":  # the ⌊0.2·D⌋ + 1 largest |τ| of the whole model, plus ties at the threshold
            flat = torch.cat([(ags[2][k].float() - b[k].float()).abs().reshape(-1) for k in b])
            kth = flat.sort(descending=True).values[int(0.2 * total)]
            assert int((flat > kth).sum()) < int(0.2 * total) + 1 <= total_kept == int((flat >= kth).sum())
        per_tensor = [kept[k] / b[k].numel() for k in b]
        assert (max(per_tensor) - min(per_tensor) > 0.1) == (method == "ties_global")


def test_random_methods_are_seeded(example, tmp_path: Path) -> None:
    base, agents = example
    for i, seed in enumerate((3, 3, 4)):
        rlmerge.merge(base, agents, tmp_path / str(i), method="dare_ties", params={"p": 0.5}, seed=seed)
    a, b, c = (load_output(tmp_path / str(i)) for i in range(3))
    assert_same_tensors(a, b)
    assert any(not torch.equal(a[k], c[k]) for k in a)


def test_uniform_is_block_invariant() -> None:
    whole = uniform(9, 1, "w", 200_000, 0, 200_000)
    assert torch.equal(whole, ref.whole_uniform(9, 1, "w", 200_000))
    parts = torch.cat([uniform(9, 1, "w", 200_000, s, min(s + 70_001, 200_000)) for s in range(0, 200_000, 70_001)])
    assert torch.equal(parts, whole)
    assert not torch.equal(whole, uniform(9, 2, "w", 200_000, 0, 200_000))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kth_largest_is_exact(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(3, 5000, generator=g) * (torch.rand(3, 5000, generator=g) < 0.3)).to(dtype).float()
    ranks = [1, 17, 1499, 1500, 1501, 4999, 5000]
    sel = KthLargest(n_streams=3, streams=[t for t in range(3) for _ in ranks])
    while not sel.done:  # one pass over the blocks per round
        for s in range(0, 5000, 777):
            sel.feed(x[:, s:s + 777])
        sel.next_round(ranks * 3 if sel.round == 0 else None)
    want = [ref.kth_largest(x[t], k) for t in range(3) for k in ranks]
    assert sel.values().tolist() == want


def test_model_stock_and_slerp_equal_dense_reference(example, tmp_path: Path) -> None:
    base, agents = example
    b, ags = load_models(base, agents)
    got = _merge_twice(base, agents, tmp_path / "ms", "model_stock", {})
    _close(got, {k: ref.model_stock(v.float(), [a[k].float() for a in ags]) for k, v in b.items()}, ulps=16)
    got = _merge_twice(base, agents[1:2], tmp_path / "s1", "slerp", {"t": 0.3})
    _close(got, {k: ref.slerp(v.float(), ags[1][k].float(), 0.3) for k, v in b.items()}, ulps=16)
    got = _merge_twice(base, agents[1:], tmp_path / "s2", "slerp", {"t": 0.6, "space": "task_vectors"})
    want = {k: v.float() + ref.slerp(ags[1][k].float() - v.float(), ags[2][k].float() - v.float(), 0.6)
            for k, v in b.items()}
    _close(got, want, ulps=16)
    with pytest.raises(ConfigError, match="exactly two models"):
        rlmerge.merge(base, agents, tmp_path / "s3", method="slerp")
    with pytest.raises(ConfigError, match="at least two agents"):
        rlmerge.merge(base, agents[:1], tmp_path / "ms1", method="model_stock")
    assert not (tmp_path / "s3").exists() and not (tmp_path / "ms1").exists()


def _fisher_files(tmp_path: Path, base: Path, n: int, *, drop: str | None = None) -> list[str]:
    b = load_output(base)
    out = []
    for t in range(n):
        g = torch.Generator().manual_seed(t)
        f = {k: torch.rand(v.shape, generator=g) ** 4 for k, v in b.items() if k != drop}
        out.append(str(write_checkpoint(tmp_path / f"f{t}", f, {}, tokenizer=False)))
    return out


@pytest.mark.parametrize("normalize", [False, True])
def test_fisher_equals_dense_reference(example, tmp_path: Path, normalize: bool) -> None:
    base, agents = example
    files = _fisher_files(tmp_path, base, 3)
    got = _merge_twice(base, agents, tmp_path / "o", "fisher", {"fisher": files, "weights": W, "normalize": normalize})
    b, ags = load_models(base, agents)
    fs = [load_output(Path(f)) for f in files]
    coef = list(W)
    if normalize:
        coef = [w / float(torch.cat([v.double().reshape(-1) for v in f.values()]).norm()) for w, f in zip(W, fs)]
    want = {k: ref.fisher(v.float(), [a[k].float() for a in ags], [f[k] for f in fs], coef, 1e-6) for k, v in b.items()}
    _close(got, want, ulps=16)


def test_fisher_inputs_are_validated(example, tmp_path: Path) -> None:
    base, agents = example
    files = _fisher_files(tmp_path, base, 3, drop="model.norm.weight")
    with pytest.raises(RLMergeError, match="missing from the side input") as e:
        rlmerge.merge(base, agents, tmp_path / "o", method="fisher", params={"fisher": files})
    assert e.value.exit_code == InputError.exit_code and "f2" in str(e.value)
    bad = _fisher_files(tmp_path / "shape", base, 3)
    write_checkpoint(Path(bad[1]), {k: v.reshape(-1) for k, v in load_output(Path(bad[0])).items()}, {},
                     tokenizer=False)
    with pytest.raises(RLMergeError, match="side input stores") as e:
        rlmerge.merge(base, agents, tmp_path / "o", method="fisher", params={"fisher": bad})
    assert e.value.exit_code == InputError.exit_code and not (tmp_path / "o").exists()
    with pytest.raises(ConfigError, match="2 value\\(s\\) of fisher given for 3 agent"):
        rlmerge.merge(base, agents, tmp_path / "o", method="fisher", params={"fisher": files[:2]})
    with pytest.raises(ConfigError, match="rlmerge fisher"):
        rlmerge.merge(base, agents, tmp_path / "o", method="fisher")


OUT_OF_RANGE = [
    ("ties", {"density": 0.0}), ("ties", {"density": 1.5}), ("ties", {"scaling": 11}),
    ("ties", {"density": (0.2, -0.1)}), ("ties_global", {"density": 2}), ("dare_ta", {"p": 1.0}),
    ("dare_ties", {"p": -0.1}), ("dare_ta", {"density": 0}), ("dare_ta", {"p": 0.5, "density": 0.5}),
    ("dare_ta", {"rescale": "l2"}), ("breadcrumbs", {"gamma": 1.0}), ("breadcrumbs", {"density": 0}),
    ("della", {"density": 0.1, "epsilon": 0.2}), ("della", {"epsilon": 0.5}), ("della", {"density": 1.01}),
    ("slerp", {"t": 1.5}), ("slerp", {"dot_threshold": -1}), ("fisher", {"fisher": "f", "floor": 0}),
    ("fisher", {"fisher": "f", "weights": (-1,)}), ("model_stock", {"filter_wise": "maybe"}),
    ("ties", {"weights": (1, 20)}), ("ties", {"lambda": 1}),
]


@pytest.mark.parametrize(("method", "params"), OUT_OF_RANGE)
def test_out_of_range_parameters_are_config_errors(method: str, params: dict) -> None:
    with pytest.raises(ConfigError) as e:
        get_method(method).parse(params)
    assert any(k in str(e.value) for k in (*params, "density", "epsilon", "weight")), str(e.value)


@pytest.mark.parametrize(("method", "params"), [
    ("ties", {"density": d}) for d in (0.1, 0.2, 0.3)] + [("dare_ta", {"p": p / 10, "scaling": s / 10})
                                                        for p in range(1, 10) for s in (1, 10)])
def test_ram_paper_grids_are_accepted(method: str, params: dict) -> None:
    get_method(method).parse(params)


def test_mergekit_recipe_translation() -> None:
    doc = {"merge_method": "dare_ties", "base_model": "b", "dtype": "bfloat16", "out_dtype": "float32",
           "models": [{"model": "b"}, {"model": "x", "parameters": {"weight": 0.5, "density": 0.3}},
                      {"model": "y", "parameters": {"density": 0.6}}],
           "parameters": {"lambda": 0.9, "rescale": True, "int8_mask": True}, "tokenizer_source": "base"}
    rec = parse_recipe(doc)
    assert rec.method == "dare_ties" and rec.agents == ["x", "y"] and rec.dtype == "float32"
    assert rec.parameters == {"scaling": 0.9, "rescale": "l1", "weights": (0.5, 1.0), "density": (0.3, 0.6),
                              "normalize": False}  # mergekit's dare_ties sums (normalize: false by default)
    assert "normalize = False (mergekit's default)" in rec.defaults
    assert any(d.startswith("weight = 1.0 for models[1]") for d in rec.defaults), rec.defaults
    get_method(rec.method).parse(rec.parameters)
    rec = parse_recipe({"merge_method": "ramplus_tl", "base_model": "b", "models": ["x", "y"],
                        "parameters": {"r": 0.2}})
    assert (rec.method, rec.parameters) == ("ram+", {"preset": "tensor-local", "r": 0.2, "alpha": 0.2,
                                                     "epsilon": 1e-5})  # mergekit's defaults, written out
    bad = {"merge_method": "ties", "base_model": "b", "models": [
        {"model": "x", "parameters": {"density": 0.3, "color": 1}}, {"model": "y"}],
        "parameters": {"weight": [{"filter": "mlp"}]}, "slices": []}
    with pytest.raises(RLMergeError) as e:
        parse_recipe(bad)
    text = str(e.value)
    for needle in ("slices (layer ranges", "'color'", "filter entry has no `value`"):
        assert needle in text, needle


def test_ties_keeps_exactly_k_and_reports_it(example, tmp_path: Path) -> None:
    """Issue 15: on bf16 agents many |τ| tie at the threshold; ``ties`` keeps exactly k = max(1, ⌊d·numel⌋) per
    tensor (tie_break index) and reports that fraction as ``kept``; ``keep-all`` keeps every tie (more than k)."""
    base, agents = example
    b, ags = load_models(base, agents)
    names = [k for k, v in b.items() if v.is_floating_point()]
    total = sum(b[k].numel() for k in names)
    want = [sum(min(max(1, int(0.1 * b[k].numel())), int((a[k].float() != b[k].float()).sum())) for k in names)
            / total for a in ags]
    res = {tb: rlmerge.merge(base, agents, tmp_path / tb, method="ties", dtype="float32",
                             params={"density": 0.1, "tie_break": tb}) for tb in ("index", "keep-all")}
    assert res["index"].kept == pytest.approx(want, rel=0, abs=1e-12)
    assert all(x >= y for x, y in zip(res["keep-all"].kept, want)) and res["keep-all"].kept != res["index"].kept
    assert [r["kept"] for r in agent_rows(res["index"])] == res["index"].kept
    assert "| kept |" in (tmp_path / "index" / "README.md").read_text()
