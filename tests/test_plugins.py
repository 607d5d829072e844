"""A method declared outside the package (methods/registry.py): read from RLMERGE_PLUGINS' files and from entry
points, then merged, planned, inspected and swept like a built-in.

Oracle: examples/plugins/median_active.py merges on the numba path (its rule compiled into the fused kernel) and on
the torch path with the same bytes, equal to an obviously-correct loop over the elements. A broken plugin is an
error that names its file.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch

import rlmerge
from conftest import load_output
from rlmerge import kernels
from rlmerge.cli import main
from rlmerge.errors import ConfigError
from rlmerge.methods import registry
from rlmerge.synthetic import Shape, make_example

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "plugins" / "median_active.py"
EPS = 1e-5


@pytest.fixture
def plugins(monkeypatch: pytest.MonkeyPatch):  # type: ignore[no-untyped-def]
    """Set RLMERGE_PLUGINS (a path list) for one test; the registry is read again before and after it."""
    def use(*paths: Path) -> None:
        monkeypatch.setenv(registry.PLUGINS, ":".join(map(str, paths)))
        registry.reset()

    yield use
    registry.reset()


@pytest.fixture(scope="module")
def example(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[Path]]:
    """Four bf16 agents (an even count of changed agents happens), two tensors wider than a block of 777."""
    root = tmp_path_factory.mktemp("plugin")
    return make_example(root, shape=Shape(vocab=96, hidden=40, layers=1, intermediate=56),
                        densities=(0.3, 0.5, 0.7, 0.9), names=("a", "b", "c", "d"))


def dense_median(base: torch.Tensor, agents: list[torch.Tensor]) -> torch.Tensor:
    """Element by element: the lower median of the τ_t with |τ_t| > ε (float32 τ, as both paths compute it), added
    to the base in float32; the base where none changed; rounded to the base's dtype."""
    b = base.float().flatten().numpy()
    tau = np.stack([(a.float().flatten() - base.float().flatten()).numpy() for a in agents])
    out = np.empty_like(b)
    for i in range(b.size):
        active = sorted(float(x) for x in tau[:, i] if abs(x) > np.float32(EPS))
        out[i] = b[i] if not active else np.float32(b[i]) + np.float32(active[(len(active) - 1) // 2])
    return torch.from_numpy(out).reshape(base.shape).to(base.dtype)


def test_median_active_merges_on_both_paths_as_the_dense_loop(example, plugins, monkeypatch, tmp_path) -> None:  # type: ignore[no-untyped-def]
    base, agents = example
    plugins(EXAMPLE)
    calls = []
    real = kernels.fused_range
    monkeypatch.setattr(kernels, "fused_range", lambda *a: calls.append(1) or real(*a))
    rlmerge.merge(base, agents, tmp_path / "fast", method="median_active")
    assert calls, "the numba path did not run the plugin's rule"
    monkeypatch.setenv("RLMERGE_FAST", "0")
    rlmerge.merge(base, agents, tmp_path / "torch", method="median_active", block_size=777)
    fast, slow = load_output(tmp_path / "fast"), load_output(tmp_path / "torch")
    ins = load_output(base), [load_output(a) for a in agents]
    merged = [k for k, v in ins[0].items() if v.is_floating_point()]
    assert merged and fast.keys() == slow.keys() == ins[0].keys()
    for name in merged:
        want = dense_median(ins[0][name], [a[name] for a in ins[1]])
        assert fast[name].view(torch.int16).equal(slow[name].view(torch.int16)), name
        assert fast[name].view(torch.int16).equal(want.view(torch.int16)), name
    counts = np.array([[abs(float(x)) > EPS for x in (a[merged[0]].float() - ins[0][merged[0]].float()).flatten()]
                       for a in ins[1]]).sum(0)
    assert {2, 3, 4} <= set(counts.tolist())  # even and odd counts of changed agents were merged


def test_an_entry_point_declares_a_method(example, plugins, monkeypatch, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """A distribution on sys.path whose entry_points.txt names a module in the group rlmerge.methods."""
    site = tmp_path / "site"
    site.mkdir()
    shutil.copy(EXAMPLE, site / "median_plugin.py")
    info = site / "median_plugin-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: median-plugin\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("[rlmerge.methods]\nmedian_active = median_plugin\n")
    monkeypatch.syspath_prepend(str(site))
    plugins()  # no files: the entry point alone
    spec = rlmerge.methods.get_method("median_active")
    assert spec.params.__module__ == "median_plugin"
    base, agents = example
    res = rlmerge.merge(base, agents, tmp_path / "out", method="median_active", params={"epsilon": 1e-3})
    assert res.method == "median_active" and res.params.epsilon == 1e-3


def test_plan_inspect_and_sweep_take_a_plugin(example, plugins, tmp_path, capsys) -> None:  # type: ignore[no-untyped-def]
    base, agents = example
    plugins(EXAMPLE)
    assert main(["plan", str(base), *map(str, agents), "--method", "median_active", "--eps", "0.001",
                 "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["method"] == "median_active" and plan["passes"] == ["merge"] and plan["problems"] == []
    assert main(["merge", str(base), *map(str, agents), "-o", str(tmp_path / "cli"), "--method", "median_active",
                 "--eps", "0.001", "-q"]) == 0
    assert json.loads((tmp_path / "cli" / "rlmerge.json").read_text())["parameters"] == {"epsilon": 0.001}
    assert main(["inspect", str(base), *map(str, agents), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["per_agent"][0]["ram_plus"]  # the built-ins' fields, as before
    seen = []
    res = rlmerge.sweep(base, agents, candidates=["median_active epsilon=1e-5,1e-3"], memory="always",
                        scorer=lambda built: seen.append(built.candidate.label) or {"one": 1.0})
    assert sorted(seen) == ["median_active epsilon=1e-3", "median_active epsilon=1e-5"]
    assert len(res.ranking) == 2


def test_a_plugin_reports_what_it_would_do_in_inspect(example, plugins, tmp_path, capsys) -> None:  # type: ignore[no-untyped-def]
    """A method's ``inspect`` hook: its per-agent fields in the report, after the built-ins'."""
    (tmp_path / "counted.py").write_text(textwrap.dedent('''
        from dataclasses import dataclass
        from rlmerge.methods import MethodSpec

        @dataclass(frozen=True)
        class P:
            pass

        class Counted(MethodSpec):
            def inspect(self, stats):
                return {"counted": [int(c) for c in stats.changed]}

        METHODS = [Counted("counted", "a test", "none", "elementwise", P, rule=lambda t, p: t.b,
                           constants=lambda *a: {})]
    '''))
    plugins(tmp_path / "counted.py")
    base, agents = example
    assert main(["inspect", str(base), *map(str, agents), "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)["per_agent"]
    assert [r["counted"] for r in rows] == [r["changed"] for r in rows] and list(rows[0])[-3] == "counted"


@pytest.mark.parametrize("text, says", [
    ("def broken(:\n", "SyntaxError"),
    ("raise RuntimeError('no GPU here')\n", "(line 1): RuntimeError: no GPU here"),
    ("X = 1\n", "has no METHODS list"),
    ("METHODS = ['ties']\n", "METHODS holds str, not MethodSpec"),
    ("from rlmerge.methods import get_method\nMETHODS = [get_method('ties')]\n", "'ties', already declared"),
])
def test_a_broken_plugin_is_an_error_naming_its_file(plugins, tmp_path, text: str, says: str) -> None:  # type: ignore[no-untyped-def]
    bad = tmp_path / "bad_plugin.py"
    bad.write_text(text)
    plugins(EXAMPLE, bad)
    with pytest.raises(ConfigError) as e:
        rlmerge.methods.get_method("median_active")
    assert str(bad) in e.value.render() and says in e.value.render()
    assert "median_active" in registry.load(strict=False)  # the plugins that could be read still are


def test_a_missing_plugin_file_and_the_command_line(example, plugins, tmp_path, capsys) -> None:  # type: ignore[no-untyped-def]
    base, agents = example
    plugins(tmp_path / "nowhere.py")
    assert main(["merge", str(base), *map(str, agents), "-o", str(tmp_path / "out"), "--method", "ties"]) == 2
    err = capsys.readouterr().err
    assert "nowhere.py" in err and "is not a file" in err


def test_a_plugins_parameters_are_command_line_options(example, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """Options come from the parameter dataclasses (params.flag): a plugin's as a built-in's, the same names as
    before for the built-ins; one whose name the command has already (--dtype) is left to --param."""
    from rlmerge.cli.options import declared_flags

    assert [f.name for f in declared_flags()] == ["--preset", "--r", "--alpha", "--rescale-factor", "--eps",
                                                  "--scaling"]
    (tmp_path / "scaled.py").write_text(textwrap.dedent('''
        from dataclasses import dataclass, field
        from rlmerge.methods import MethodSpec
        from rlmerge.params import flag

        @dataclass(frozen=True)
        class P:
            q: float = field(default=1.0, metadata=flag("how much of the first agent"))
            dtype: str = field(default="x", metadata=flag("a name the command has"))

        METHODS = [MethodSpec("scaled", "base + q τ₀", "none", "elementwise", P,
                              rule=lambda t, p: t.b + t.x[0] * t.const.q, constants=lambda p, *a: {"q": p.q})]
    '''))
    env = {**os.environ, "RLMERGE_PLUGINS": str(tmp_path / "scaled.py"), "COLUMNS": "200"}
    cli = [sys.executable, "-c", "from rlmerge.cli import entry; entry()"]
    shown = subprocess.run([*cli, "merge", "--help"], env=env, capture_output=True, text=True, check=True).stdout
    assert "--q " in shown and "how much of the first agent" in shown and "a name the command has" not in shown
    base, agents = example
    out = tmp_path / "out"
    subprocess.run([*cli, "merge", str(base), str(agents[0]), "-o", str(out), "--method", "scaled", "--q", "0.5",
                    "--param", "dtype=y", "-q"], env=env, check=True)
    assert json.loads((out / "rlmerge.json").read_text())["parameters"] == {"q": 0.5, "dtype": "y"}
