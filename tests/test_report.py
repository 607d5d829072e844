"""The report's renderings: pinned JSON schema, plots (figure objects and PNGs), Markdown, CLI, merge's card."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import rlmerge
from rlmerge.cli import main
from rlmerge.report import REPORT_FILE
from rlmerge.report.advice import recommend

GOLDEN = Path(__file__).parent / "golden" / "report_schema.json"
DOCS = Path(__file__).parents[1] / "docs" / "inspect.md"
MAPS = {"dtypes"}  # objects whose keys are data (dtype names), not schema


def _shape(x: Any) -> Any:
    if isinstance(x, dict):
        return {k: ({"<dtype>": "int"} if k in MAPS and v is not None else _shape(v)) for k, v in x.items()}
    if isinstance(x, list):
        out: Any = None
        for v in x:
            out = _union(out, _shape(v))
        return [out] if x else []
    return {bool: "bool", int: "int", float: "float", str: "str", type(None): "null"}[type(x)]


def _union(a: Any, b: Any) -> Any:
    if a is None:
        return b
    if isinstance(a, dict) and isinstance(b, dict):
        return {k: _union(a.get(k), b.get(k)) if k in a and k in b else a.get(k, b.get(k)) for k in {**a, **b}}
    if isinstance(a, list) and isinstance(b, list):
        return [_union(a[0], b[0])] if a and b else a or b
    if isinstance(a, str) and isinstance(b, str):
        return "|".join(sorted(set(a.split("|")) | set(b.split("|"))))
    if isinstance(a, str) or isinstance(b, str):  # null leaf against a structure
        leaf, other = (a, b) if isinstance(a, str) else (b, a)
        return {"<or>": leaf, "value": other}
    raise AssertionError((a, b))


@pytest.fixture
def docs(example, tmp_path: Path) -> tuple[dict, dict]:
    """An inspect report (extras on) and a merge's report (the statistics the merge collected)."""
    base, agents = example
    rep = rlmerge.inspect(base, agents)
    rlmerge.merge(base, agents, tmp_path / "merged", method="ram+")
    merged = json.loads((tmp_path / "merged" / REPORT_FILE).read_text())
    return json.loads(rep.to_json()), merged


def _conforms(seen: Any, declared: Any, where: str = "") -> None:
    """Same keys everywhere; every type seen is one the golden schema declares (it may declare more)."""
    if isinstance(declared, dict) and "<or>" in declared:
        if isinstance(seen, dict) and "<or>" in seen:
            _conforms(seen["<or>"], declared["<or>"], where)
            seen = seen["value"]
        if isinstance(seen, str) and seen in declared["<or>"].split("|"):
            return
        _conforms(seen, declared["value"], where)
    elif isinstance(declared, dict):
        assert isinstance(seen, dict) and seen.keys() == declared.keys(), (where, seen, declared)
        for k in declared:
            _conforms(seen[k], declared[k], f"{where}.{k}")
    elif isinstance(declared, list):
        assert isinstance(seen, list), where
        if seen:
            _conforms(seen[0], declared[0], f"{where}[]")
    else:
        assert isinstance(seen, str) and set(seen.split("|")) <= set(declared.split("|")), (where, seen, declared)


def test_schema_is_pinned_and_documented(docs) -> None:
    inspected, merged = docs
    shape = _union(_shape(inspected), _shape(merged))
    if os.environ.get("RLMERGE_UPDATE_GOLDEN"):  # then widen the types by hand to all the schema allows
        GOLDEN.write_text(json.dumps(shape, indent=1, sort_keys=True) + "\n")
    golden = json.loads(GOLDEN.read_text())
    _conforms(shape, golden)  # on failure: bump VERSION, update docs/inspect.md and the golden file
    shape = golden
    assert inspected["schema"] == "rlmerge.report" and inspected["version"] == 1
    documented = set(re.findall(r"`([a-z_0-9-]+)`", DOCS.read_text()))
    keys: set[str] = set()

    def walk(x: Any) -> None:
        if isinstance(x, dict) and "<or>" in x:
            walk(x["value"])
        elif isinstance(x, dict):
            keys.update(k for k in x if not k.startswith("<"))
            for v in x.values():
                walk(v)
        elif isinstance(x, list):
            walk(x[0])

    walk(shape)
    assert keys - documented == set(), "every report key is documented in docs/inspect.md"


def test_merge_report_matches_inspect(example, tmp_path: Path) -> None:
    base, agents = example
    doc = rlmerge.inspect(base, agents).doc
    for method in ("ram+", "ram"):  # two-pass (statistics pass) and one-pass (counted during the merge)
        out = tmp_path / method
        rlmerge.merge(base, agents, out, method=method)
        merged = json.loads((out / REPORT_FILE).read_text())
        assert not merged["extras"] and merged["precision"] is None
        for a, b in zip(doc["per_agent"], merged["per_agent"]):
            for key in ("changed", "kofn", "unique", "shared", "rho", "ram_plus", "ram_plus_tensor_local"):
                assert a[key] == b[key], key
            # inspect sums squares in float64 (torch path), the fused merge kernel in float32 tiles (kernels.py)
            assert b["norm"] == pytest.approx(a["norm"], rel=1e-6)
            assert b["density_at"] is None and b["magnitude_quantiles"] is None
        assert merged["layers"] == doc["layers"] and merged["modules"] == doc["modules"]
        np.testing.assert_allclose(merged["pairwise"]["cosine"], doc["pairwise"]["cosine"], rtol=1e-6)
        assert {k: v for k, v in merged["pairwise"].items() if k != "cosine"} == \
            {k: v for k, v in doc["pairwise"].items() if k != "cosine"}
        card = (out / "README.md").read_text()
        assert "## Task-vector anatomy" in card and "### RAM+ ρ and λ by preset" in card
        assert f"**Recommendation:** {doc['recommendation']['summary']}" in card


def test_plots(example, tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    from rlmerge.report import plots

    base, agents = example
    doc = rlmerge.inspect(base, agents).doc
    n, thresholds = len(agents), doc["thresholds"]

    ax = plots.density_figure(doc).axes[0]
    assert (ax.get_title(), ax.get_xlabel(), ax.get_ylabel()) == (
        "Task-vector density per agent", "agent", "elements changed (%)")
    assert [t.get_text() for t in ax.get_legend().get_texts()] == [
        f"|τ| > {t:g}" + (" (ε)" if t == doc["epsilon"] else "") for t in thresholds]
    heights = [p.get_height() for p in ax.patches]
    assert heights == pytest.approx([100 * r["density_at"][j] for j in range(len(thresholds))
                                     for r in doc["per_agent"]])
    assert [t.get_text() for t in ax.get_xticklabels()] == ["coder", "tool-use", "memory"]

    ax = plots.kofn_figure(doc).axes[0]
    assert ax.get_ylabel() == "share of the agent's changed elements (%)"
    assert [t.get_text() for t in ax.get_legend().get_texts()] == ["k = 1 (unique)", "k = 2", "k = 3"]
    tops = [0.0] * n
    for i, p in enumerate(ax.patches):
        tops[i % n] += p.get_height()
    assert tops == pytest.approx([100.0] * n)

    fig = plots.heatmap_figure(doc, "layers")
    ax = fig.axes[0]
    assert (ax.get_title(), ax.get_ylabel()) == ("Density per layer and agent", "layer")
    assert ax.images[0].get_array().flatten().tolist() == pytest.approx(
        [100 * d for g in doc["layers"] for d in g["density"]])

    fig = plots.pairwise_figure(doc)
    titles = [a.get_title() for a in fig.axes if a.get_title()]
    assert titles == ["Cosine similarity of task vectors", "Sign agreement on shared elements"]
    assert fig.axes[0].images[0].get_array().flatten().tolist() == pytest.approx(
        [v for row in doc["pairwise"]["cosine"] for v in row])

    paths = plots.save_plots(doc, tmp_path / "plots")
    assert [p.name for p in paths] == ["density.png", "kofn.png", "layers.png", "modules.png", "pairwise.png"]
    for p in paths:
        data = p.read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000


def test_cli(example, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    base, agents = example
    args = ["inspect", str(base), *map(str, agents)]
    assert main([*args, "--json", "--save", str(tmp_path / "r.json")]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed == json.loads((tmp_path / "r.json").read_text())
    assert printed["per_agent"][0]["changed"] == rlmerge.inspect(base, agents).doc["per_agent"][0]["changed"]
    assert main([*args, "--markdown", "--thresholds", "1e-4"]) == 0
    md = capsys.readouterr().out
    assert md.startswith("# Task-vector anatomy") and "| \\|τ\\| > 0.0001 |" in md
    assert main([*args, "-q"]) == 0
    assert "Task vectors per agent" in capsys.readouterr().out
    assert main([*args, "--thresholds", "x"]) == 2
    assert main([*args, "--eps", "2"]) == 2
    assert main(["inspect", str(base), str(tmp_path / "nope")]) == 3


def _doc(dens: list[float], uniq: list[float], cos: float) -> dict[str, Any]:
    n = len(dens)
    rows = [{"agent": f"a{i}", "density": d, "unique_share": u, "ram_plus": {"paper": 1.1}}
            for i, (d, u) in enumerate(zip(dens, uniq))]
    return {"per_agent": rows, "agents": [r["agent"] for r in rows], "epsilon": 1e-5,
            "pairwise": {"cosine": [[1.0 if a == b else cos for b in range(n)] for a in range(n)]}}


@pytest.mark.parametrize(("dens", "uniq", "cos", "method"), [
    ([0.032, 0.462, 0.543], [0.063, 0.408, 0.475], 0.05, "ram+"),  # the paper's agents
    ([0.30, 0.35, 0.40], [0.30, 0.35, 0.40], 0.05, "ram"),
    ([0.95, 0.99, 0.97], [0.01, 0.01, 0.01], 0.6, "task_arithmetic"),
    ([0.95, 0.99, 0.97], [0.01, 0.01, 0.01], 0.05, "ties"),
    ([0.3], [1.0], 1.0, "none"),
])
def test_recommendation_rules(dens: list[float], uniq: list[float], cos: float, method: str) -> None:
    rec = recommend(_doc(dens, uniq, cos))
    assert rec["method"] == method and rec["summary"].startswith(method)
    assert rec["numbers"]["density_min"] == min(dens)
