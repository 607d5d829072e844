"""benchmarks/run.py's mergekit recipes and table: both numeric settings, side by side."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent


def _run_module():  # type: ignore[no-untyped-def]
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        spec = importlib.util.spec_from_file_location("bench_run", ROOT / "benchmarks" / "run.py")
        assert spec is not None and spec.loader is not None
        mod = importlib.util.module_from_spec(spec)
        sys.modules["bench_run"] = mod  # dataclasses look their module up
        spec.loader.exec_module(mod)
        return mod
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))


def test_mergekit_recipes_both_ways() -> None:
    run = _run_module()
    case = run.CASES["ties"]
    bf16 = yaml.safe_load(run.mergekit_config(case, Path("/b"), [Path("/a1"), Path("/a2")], "bf16"))
    fp32 = yaml.safe_load(run.mergekit_config(case, Path("/b"), [Path("/a1"), Path("/a2")], "fp32"))
    assert bf16["dtype"] == "bfloat16" and "out_dtype" not in bf16  # as users write it: mergekit computes in bf16
    assert fp32["dtype"] == "float32" and fp32["out_dtype"] == "bfloat16"  # rlmerge's numeric policy
    assert {k: v for k, v in bf16.items() if "dtype" not in k} == {k: v for k, v in fp32.items() if "dtype" not in k}
    assert bf16["models"][0] == {"model": "/a1", "parameters": {"weight": 1.0, "density": 0.5}}


def test_table_shows_both_settings(capsys) -> None:  # type: ignore[no-untyped-def]
    run = _run_module()
    row = {"method": "ties", "wall_s": 2.0, "sync_s": 0.0, "merge_s": 1.5, "rss_gb": 0.2, "x_floor": 1.5,
           "mk_method": "ties"}
    for st, wall in (("bf16", 8.0), ("fp32", 20.0)):
        row.update({f"mk_{st}_wall_s": wall, f"mk_{st}_sync_s": 0.5, f"mk_{st}_rss_gb": 5.0,
                    f"mk_{st}_x_wall": wall / 2.0, f"mk_{st}_x_on_disk": (wall + 0.5) / 2.0,
                    f"mk_{st}_max_abs_diff": 0.0})
    run.print_table([row], 1.0, "0.5b", ["bf16", "fp32"])
    line = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("| ties")][0]
    cells = [c.strip() for c in line.strip("|").split("|")]
    assert "4.0×" in cells and "10.0×" in cells  # × mergekit for bf16 (8 s / 2 s) and fp32 (20 s / 2 s)
    assert "machine" not in line


def test_machine_line_has_free_memory_and_load() -> None:
    text = _run_module().machine()
    assert "MemAvailable" in text and "load" in text and "GiB" in text
