"""TPE against the tiny lab's 12-point grids (RAM+ and TIES), on the lab's own agents, validation and test splits.

For each lab seed folder (``SEED_DIR/base``, ``SEED_DIR/agents/{tool_use,coding,memory}``, as ``rlmerge lab --size
tiny`` leaves them) and each method, with the lab's validation scorer (``lab.pipeline.val_scorer``: 48 examples per
task, the seed's val split, float32 merges) and its test split (128 per task) for the picks:

- **grid**: the lab's 12 points (``lab.merging.TINY_GRIDS``), one ``rlmerge.sweep``; its pick scored on test
  (``confirm``);
- **tpe**: ``rlmerge.sweep(search="tpe")`` over the grid's box (the same ends; RAM+'s r and α on a log scale, as its
  grid is spaced), seeded with the lab seed, ``--trials`` in two steps: ``BUDGET`` trials (the grid's budget), its
  pick scored on test (results.json kept as ``TAG-tpe12.json``), then resumed to ``--trials``, its pick scored on
  test.

Printed: the grid's best validation average, the trial at which TPE's best first reached it (``—``: not within the
trials), TPE's best validation average after ``BUDGET`` and after ``--trials`` trials, each pick's test average, the
paired bootstrap interval of (TPE's final pick − the grid's pick) on test, and how many candidates of each sweep its
validation scores cannot tell from its best (sweeping/noise.py).
Everything is kept under ``--work`` (one sweep folder per seed, method and search; a rerun resumes them).

    PYTHONPATH=src python benchmarks/search_vs_grid.py --work /work/lab-runs/tiny-tpe/bench --trials 36 \\
        /work/lab-runs/tiny-tpe/a/seed0 /work/lab-runs/tiny-tpe/a/seed1 /work/lab-runs/tiny-tpe/b/seed2
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

for var in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_DATASETS_OFFLINE"):
    os.environ.setdefault(var, "1")

BUDGET = 12  # the lab grids' points
SPACES = {  # the grids' boxes (lab/merging.py TINY_GRIDS), searched continuously
    "RAM+": {"method": "ram+", "parameters": {"preset": "paper", "r": "0.1..2:log", "alpha": "2..32:log"}},
    "TIES": {"method": "ties", "parameters": {"density": "0.05..0.9", "scaling": "1..3"}},
}


def _log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def _grid(label: str) -> dict[str, Any]:
    from rlmerge.lab.merging import TINY_GRIDS

    plan = next(p for p in TINY_GRIDS if p.label == label)
    assert len(plan.candidates()) == BUDGET, plan
    return {"method": plan.method, "parameters": {k: list(v) for k, v in plan.grid.items()}}


def _sweep(seed_dir: Path, out: Path, seed: int, candidates: list[Any], **kw: Any) -> dict[str, Any]:
    """One sweep (resumed when its folder exists), its pick confirmed on test; results.json's document."""
    import rlmerge
    from rlmerge.lab.pipeline import SIZES, val_scorer
    from rlmerge.scoring import TaskScorer

    size = SIZES["tiny"]
    val = val_scorer(size, seed)  # the lab's: 48 validation examples per task
    test = TaskScorer(val.tasks, limit=size.n_test, split="test", seed=seed, kind=size.kind)  # the lab's test set
    agents = [seed_dir / "agents" / f for f in ("tool_use", "coding", "memory")]
    t0 = time.perf_counter()
    rlmerge.sweep(seed_dir / "base", agents, out, candidates=candidates, scorer=val, dtype="float32", seed=seed,
                  settings=val.settings(), resume=out.exists(), confirm=test, confirm_top=1, **kw)
    doc = json.loads((out / "results.json").read_text())
    doc["seconds"] = time.perf_counter() - t0
    return doc


def _pick(doc: dict[str, Any]) -> tuple[float, float | None, str]:
    """(best validation average, its test average, its label)."""
    by_id = {c["id"]: c for c in doc["candidates"]}
    best = by_id[doc["ranking"][0]]
    test = next(r for r in doc["confirmed"] if r["id"] == best["id"])
    return best["average"], test["average"], best["label"]


def _test_difference(a: dict[str, Any], b: dict[str, Any], seed: int) -> tuple[float, float, float]:
    """(difference, low, high): the paired bootstrap (sweeping/noise.py) of a's pick − b's pick on the test split,
    from each pick's confirmed per-example results (the same test examples: paired)."""
    from rlmerge.sweeping.noise import paired_bootstrap
    from rlmerge.sweeping.scores import details_from_json

    def samples(doc: dict[str, Any]) -> dict[str, list[float]]:
        rec = next(r for r in doc["confirmed"] if r["id"] == doc["ranking"][0])
        got = details_from_json(rec["scores"], rec["details"], doc["examples"])
        return {t: list(s.samples or ()) for t, s in got.items()}

    return paired_bootstrap(samples(a), [samples(b)], seed=seed)[0]


def _reached(doc: dict[str, Any], target: float) -> int | None:
    """The trial (1-based) at which the best validation average first reached ``target`` (to 12 significant digits,
    as the ranking compares averages), or None."""
    best = float("-inf")
    for t in sorted(doc["trials"], key=lambda t: t["number"]):
        if t["value"] is not None:
            best = max(best, t["value"])
        if float(f"{best:.12g}") >= float(f"{target:.12g}"):
            return t["number"] + 1
    return None


def _early(seed_dir: Path, work: Path, tag: str, seed: int, space: dict[str, Any]) -> dict[str, Any]:
    """The TPE sweep at ``BUDGET`` trials (its pick confirmed then), kept as ``TAG-tpe12.json`` beside the sweep
    folder: a rerun reads it back, since the folder itself has gone on to more trials."""
    snap = work / f"{tag}-tpe{BUDGET}.json"
    if snap.exists():
        return json.loads(snap.read_text())
    folder = work / f"{tag}-tpe"
    if folder.exists() and len(json.loads((folder / "results.json").read_text()).get("trials", [])) > BUDGET:
        raise SystemExit(f"{folder} holds more than {BUDGET} trials and no {snap.name}: remove the folder")
    _log(f"{tag}: tpe, {BUDGET} trials")
    doc = _sweep(seed_dir, folder, seed, [space], search="tpe", trials=BUDGET)
    snap.write_text(json.dumps(doc) + "\n")
    return doc


def run(seed_dirs: list[Path], work: Path, trials: int) -> list[dict[str, Any]]:
    import torch

    torch.set_num_threads(1)  # as the lab runs
    rows = []
    for seed_dir in seed_dirs:
        seed = int(seed_dir.name.removeprefix("seed"))
        for label, space in SPACES.items():
            tag = f"seed{seed}-{label.lower().rstrip('+')}{'plus' if label.endswith('+') else ''}"
            _log(f"{tag}: grid ({BUDGET} points)")
            grid = _sweep(seed_dir, work / f"{tag}-grid", seed, [_grid(label)])
            early = _early(seed_dir, work, tag, seed, space)
            _log(f"{tag}: tpe, resumed to {trials} trials")
            late = _sweep(seed_dir, work / f"{tag}-tpe", seed, [space], search="tpe", trials=trials)
            g_val, g_test, g_label = _pick(grid)
            e_val, e_test, e_label = _pick(early)
            l_val, l_test, l_label = _pick(late)
            rows.append({"seed": seed, "method": label, "grid_val": g_val, "grid_test": g_test, "grid_pick": g_label,
                         "reached": _reached(late, g_val), "trials": len(late["trials"]),
                         "distinct": len(late["candidates"]),
                         "tpe12_val": e_val, "tpe12_test": e_test, "tpe12_pick": e_label,
                         "tpe_val": l_val, "tpe_test": l_test, "tpe_pick": l_label,
                         "same_grid": len(grid["indistinguishable"]), "same_tpe": len(late["indistinguishable"]),
                         "test_gap": _test_difference(late, grid, seed),
                         "seconds": {"grid": grid["seconds"], "tpe": early["seconds"] + late["seconds"]}})
            _log(json.dumps(rows[-1]))
    (work / "search_vs_grid.json").write_text(json.dumps(rows, indent=1) + "\n")
    return rows


def table(rows: list[dict[str, Any]], trials: int) -> str:
    f = "{:.1f}".format
    lines = [f"| seed | method | grid: best val (12 evals) | TPE reached it at trial | TPE best val @12 | "
             f"TPE best val @{trials} | test: grid pick | test: TPE pick @12 | test: TPE pick @{trials} | "
             f"test: TPE @{trials} − grid [95 %] |",
             "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        d, lo, hi = r["test_gap"]
        lines.append(f"| {r['seed']} | {r['method']} | {f(r['grid_val'])} | {r['reached'] or '—'} | "
                     f"{f(r['tpe12_val'])} | {f(r['tpe_val'])} | {f(r['grid_test'])} | {f(r['tpe12_test'])} | "
                     f"{f(r['tpe_test'])} | {d:+.1f} [{lo:+.1f}, {hi:+.1f}] |")
    lines += ["", "Picks:", ""] + [f"- seed {r['seed']} {r['method']}: grid `{r['grid_pick']}`; TPE @12 "
                                   f"`{r['tpe12_pick']}`; TPE @{trials} `{r['tpe_pick']}` ({r['distinct']} distinct "
                                   f"candidates in {r['trials']} trials; indistinguishable from the best on "
                                   f"validation: {r['same_grid']} of the grid's 12, {r['same_tpe']} of TPE's)"
                                   for r in rows]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("seed_dirs", nargs="+", type=Path, help="lab seed folders (…/seedN)")
    ap.add_argument("--work", type=Path, required=True, help="where the sweep folders go (outside the repository)")
    ap.add_argument("--trials", type=int, default=3 * BUDGET, help="TPE's trials in all (default 36)")
    a = ap.parse_args()
    a.work.mkdir(parents=True, exist_ok=True)
    print(table(run(a.seed_dirs, a.work, a.trials), a.trials))


if __name__ == "__main__":
    main()
