"""The recipe folder (``tests/recipes/*.yml``): mergekit's own example and test recipes and the cases of issue 15,
each run through ``rlmerge merge --recipe``'s code and through mergekit 0.1.5 on the same small checkpoints.

A recipe's header says what must happen, so that no recipe is ever silently different:

    # expect: equal [N ulp]   every tensor within N ulps (default 8) of its largest |value| of mergekit's output
    # expect: law             random methods (DARE, DELLA; the tools draw different numbers): both change the same
                              fraction of elements (within 6σ) and the merged task vectors' L1 norms agree within 5 %
    # expect: refused: TEXT   rlmerge refuses, with a message that contains TEXT, and writes nothing
    ... ; warns: TEXT         rlmerge warns with TEXT;  ; no warning: it warns about nothing;  ; not: TEXT: its
                              message does not contain TEXT

The models (``base``, agents ``a`` ``b`` ``c`` with 30 / 46 / 54 % of elements changed, dense ``d`` ``e``) are a
4-layer Llama in float32 whose values lie on grids where θ_t − θ₀ is exact and every |τ| of an agent's tensor is
distinct: a top-k has no ties at its threshold, which mergekit breaks arbitrarily (its argsort is unstable), so a
difference can only be one of meaning. All mergekit merges run in one process (tests/mergekit_driver.py).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import MERGEKIT_PY, load_output, run_mergekit
from rlmerge.cli.merge import gather
from rlmerge.engine.merge import merge
from rlmerge.errors import RLMergeError
from rlmerge.synthetic import Shape, config, tensor_shapes, write_checkpoint

RECIPES = sorted((Path(__file__).parent / "recipes").glob("*.yml"))
ULP = 2.0 ** -23
SHAPE = Shape("llama", vocab=128, hidden=32, layers=4, heads=4, kv_heads=2, intermediate=64, tie=False)
AGENTS = {"a": 0.30, "b": 0.46, "c": 0.54, "d": 1.0, "e": 1.0}


@dataclass(frozen=True)
class Expect:
    kind: str  # "equal", "law" or "refused"
    text: str = ""  # refused: in the message
    ulp: float = 8.0
    warns: str | None = None
    no_warning: bool = False
    absent: str | None = None  # refused: not in the message

    @classmethod
    def of(cls, path: Path) -> Expect:
        line = next((x for x in path.read_text().splitlines() if x.startswith("# expect:")), None)
        assert line is not None, f"{path.name} has no '# expect:' header: say what must happen"
        parts = [p.strip() for p in line.removeprefix("# expect:").split(";")]
        head, kw = parts[0], {}
        for p in parts[1:]:
            if p.startswith("warns:"):
                kw["warns"] = p.removeprefix("warns:").strip()
            elif p == "no warning":
                kw["no_warning"] = True
            elif p.startswith("not:"):
                kw["absent"] = p.removeprefix("not:").strip()
        if head.startswith("refused:"):
            return cls("refused", head.removeprefix("refused:").strip(), **kw)
        m = re.fullmatch(r"equal(?: ([\d.]+) ulp)?", head)
        if m:
            return cls("equal", ulp=float(m.group(1) or 8.0), **kw)
        assert head == "law", f"{path.name}: unknown expectation {head!r}"
        return cls("law", **kw)


def _grid(x: np.ndarray, step: float) -> np.ndarray:
    return (np.round(x / step) * step).astype(np.float32)


def _models(root: Path) -> dict[str, Path]:
    """The base on a 2⁻¹⁶ grid; each agent moves a random subset of elements by distinct multiples of 2⁻²²."""
    rng = np.random.default_rng(15)
    cfg = config(SHAPE, torch.float32)
    base = {}
    for name, shape in tensor_shapes(SHAPE).items():
        noise = rng.normal(0.0, 0.05 if name.endswith("norm.weight") else 0.02, size=shape)
        base[name] = _grid((1.0 if name.endswith("norm.weight") else 0.0) + np.clip(noise, -0.12, 0.12), 2.0**-16)
    paths = {"base": write_checkpoint(root / "base", {k: torch.from_numpy(v) for k, v in base.items()}, cfg,
                                      tokenizer=False)}
    for agent, density in AGENTS.items():
        tensors = {}
        for name, b in base.items():
            mags = (rng.permutation(b.size) + 1).astype(np.float64) * 2.0**-22  # distinct |τ| within the tensor
            signs = np.where(rng.random(b.size) < 0.5, -1.0, 1.0)
            moved = rng.random(b.size) < density
            tau = np.where(moved, signs * mags, 0.0).reshape(b.shape)
            tensors[name] = torch.from_numpy((b.astype(np.float64) + tau).astype(np.float32))
            assert np.array_equal(tensors[name].numpy() - b, tau.astype(np.float32)), "τ must be exact"
        paths[agent] = write_checkpoint(root / agent, tensors, cfg, tokenizer=False)
    return paths


def _resolve(text: str, paths: dict[str, Path]) -> str:
    return re.sub(r"((?:base_)?model:\s*)([A-Za-z_]\w*)", lambda m: m.group(1) + str(paths.get(m.group(2), m.group(2))),
                  text)


@dataclass
class Outcome:
    ours: Path | None  # the merged folder, or None when refused
    message: str  # rlmerge's refusal ("" when it merged)
    warnings: list[str]
    theirs: Path | None  # mergekit's output, or None when mergekit refused
    theirs_error: str


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Outcome]:
    if not MERGEKIT_PY.exists():
        pytest.skip("mergekit is not installed: run `make mergekit` (creates .venv-mergekit)")
    root = tmp_path_factory.mktemp("recipes")
    paths = _models(root / "in")
    out: dict[str, Outcome] = {}
    jobs = []
    for recipe in RECIPES:
        name = recipe.stem
        resolved = root / recipe.name
        resolved.write_text(_resolve(recipe.read_text(), paths))
        ours, message, warnings = root / f"rl-{name}", "", []
        try:
            req = gather(None, resolved, None, None, None)
            tokenizer = {k: v for k, v in req.options.items() if k in ("tokenizer_source", "chat_template")}
            res = merge(req.base, req.agents, ours, method=req.method, params=req.params, dtype=req.dtype,
                        recipe=req.raw, defaults=req.defaults, notes=req.warnings, seed=1, fsync=False, **tokenizer)
            warnings = res.warnings
        except RLMergeError as e:
            message = e.render()
        jobs.append({"recipe": str(resolved), "out": str(root / f"mk-{name}"), "seed": 1,
                     "errors": str(root / f"mk-{name}.error")})
        out[name] = Outcome(None if message else ours, message, warnings, root / f"mk-{name}", "")
    run_mergekit(jobs, root, timeout=900)
    for name, o in out.items():
        err = root / f"mk-{name}.error"
        if err.exists():
            o.theirs, o.theirs_error = None, err.read_text()
    return out


def _float_tensors(folder: Path) -> dict[str, torch.Tensor]:
    return {k: v for k, v in load_output(folder).items() if v.is_floating_point()}


@pytest.mark.parametrize("recipe", RECIPES, ids=[r.stem for r in RECIPES])
def test_recipe_is_equal_to_mergekit_or_refused(outcomes: dict[str, Outcome], recipe: Path) -> None:
    expect, o = Expect.of(recipe), outcomes[recipe.stem]
    if expect.kind == "refused":
        assert o.ours is None, f"rlmerge merged a recipe it should refuse ({expect.text!r})"
        assert expect.text in o.message, o.message
        assert expect.absent is None or expect.absent not in o.message, o.message
        print(f"{recipe.stem}: refused; mergekit: {o.theirs_error.splitlines()[0] if o.theirs_error else 'runs'}")
        return
    assert o.ours is not None, f"rlmerge refused: {o.message}"
    assert o.theirs is not None, f"mergekit refused: {o.theirs_error}"
    if expect.warns is not None:
        assert any(expect.warns in w for w in o.warnings), o.warnings
    if expect.no_warning:
        assert o.warnings == [], o.warnings
    ours, theirs = _float_tensors(o.ours), _float_tensors(o.theirs)
    assert set(ours) == set(theirs), set(ours) ^ set(theirs)
    if expect.kind == "equal":
        worst = 0.0
        for k, t in ours.items():
            ref = theirs[k]
            assert t.dtype == ref.dtype == torch.float32 and t.shape == ref.shape, k
            diff, scale = float((t - ref).abs().max()), float(ref.abs().max())
            worst = max(worst, diff / (scale * ULP) if scale else diff)
            assert diff <= expect.ulp * ULP * scale, f"{k}: max |diff| {diff:.3g} = {diff / (scale * ULP):.1f} ulp"
        print(f"{recipe.stem}: equal, worst {worst:.2f} ulp of a tensor's largest value")
        return
    base = _float_tensors(Path(str(o.ours).replace("rl-" + recipe.stem, "in/base")))
    changed, l1 = [], []
    for merged in (ours, theirs):
        moved = sum(int((merged[k] != b).sum()) for k, b in base.items())
        changed.append(moved / sum(b.numel() for b in base.values()))
        l1.append(sum(float((merged[k].double() - b.double()).abs().sum()) for k, b in base.items()))
    n = sum(b.numel() for b in base.values())
    p = (changed[0] + changed[1]) / 2
    assert abs(changed[0] - changed[1]) <= 6 * math.sqrt(max(p * (1 - p), 1e-12) * 2 / n), changed
    assert abs(l1[0] / l1[1] - 1) <= 0.05, l1
    print(f"{recipe.stem}: law, changed {changed[0]:.4f} vs {changed[1]:.4f}, L1 ratio {l1[0] / l1[1]:.4f}")


def test_the_folder_covers_mergekit_and_the_issue() -> None:
    """At least the 45 recipes of issue 15's comparison; every one says what must happen."""
    assert len(RECIPES) >= 45
    kinds = [Expect.of(r).kind for r in RECIPES]
    assert kinds.count("equal") >= 25 and kinds.count("refused") >= 10 and kinds.count("law") >= 2
