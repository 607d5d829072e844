"""The mechanism sweep: the same base, agents trained under different dials, and what the merge gaps do.

Dials: GRPO learning rate, precision (`fp32-master`: float32 training, bf16 save; `bf16-pure`: weights
rounded to bf16 after every step), an SFT control (same budget and precision, supervised on correct
answers), and a pruning control (the reference agents' task vectors magnitude-pruned to the paper's
densities, 3.2 / 46.2 / 54.3 %). For each setting: density, unique share and density by |w| of the task
vectors, and the test scores of TA, RAM and RAM+ (each tuned on the same-size validation grid as
in the main table), so the gaps RAM − TA and RAM+ − TA can be read against density
(`plot_mechanism`). Results are written after every setting, so a stopped sweep keeps what it measured.
"""

from __future__ import annotations

import json
import shutil
import statistics
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, Literal

from rlmerge.lab.density import PAPER_DENSITY, task_vector_stats
from rlmerge.lab.grpo import Precision, train_agent
from rlmerge.lab.mechanism import density_by_magnitude, prune_task_vector
from rlmerge.lab.merging import MECHANISM_GRIDS
from rlmerge.lab.paired import bootstrap_difference
from rlmerge.lab.pipeline import SIZES, LabSize, SeedResult, _eval_sets, _log, _score, run_merges
from rlmerge.lab.sft import train_sft_agent
from rlmerge.lab.tasks import FAMILIES
from rlmerge.lab.workdir import claim
from rlmerge.sandbox import ensure_isolation


@dataclass(frozen=True)
class Dial:
    label: str
    trainer: Literal["grpo", "sft", "prune", "reference"]
    lr: float
    precision: Precision = "fp32-master"


# The tiny lab's own agents (lr 5e-5, fp32 master) are the reference; the rest are trained from its base.
# Ordered so that a sweep started while the lab run is still training its agents has work to do first
# (the reference and its pruned copy wait for them), and results are written after each setting.
DIALS: tuple[Dial, ...] = (
    Dial("GRPO 5e-6 fp32-master", "grpo", 5e-6),
    Dial("GRPO 5e-5 bf16-pure", "grpo", 5e-5, "bf16-pure"),
    Dial("SFT 5e-5 fp32-master", "sft", 5e-5),
    Dial("GRPO 5e-5 fp32-master (lab)", "reference", 5e-5),
    Dial("GRPO 5e-5 pruned to paper densities", "prune", 5e-5),
    Dial("GRPO 1.5e-5 fp32-master", "grpo", 1.5e-5),
    Dial("GRPO 1.5e-5 bf16-pure", "grpo", 1.5e-5, "bf16-pure"),
)
WAIT_S = 30.0  # poll interval while the lab run that owns `seed_dir` is still writing what a dial needs


def _wait_for(folders: list[Path], what: str) -> None:
    """Block until each folder holds a finished stage (the lab pipeline's lab-stage.json marker)."""
    from rlmerge.lab.pipeline import DONE

    while not all((f / DONE).is_file() for f in folders):
        _log(f"mechanism: waiting for {what} ({', '.join(str(f) for f in folders if not (f / DONE).is_file())})")
        time.sleep(WAIT_S)


def _agents_for(dial: Dial, size: LabSize, seed_dir: Path, work: Path, seed: int) -> tuple[list[Path], dict[str, Any]]:
    base = seed_dir / "base"
    reference = [seed_dir / "agents" / f for f in FAMILIES]
    _wait_for([base], "the lab's base")
    if dial.trainer in ("reference", "prune"):
        _wait_for(reference, "the lab's agents")
    if dial.trainer == "reference":
        return reference, {}
    out = work / "agents"
    if out.exists():  # a finished setting from an earlier, interrupted sweep (its own folder, its own files)
        return [out / f for f in FAMILIES], json.loads((work / "training.json").read_text())
    tmp = work / "agents.partial"
    shutil.rmtree(tmp, ignore_errors=True)
    info: dict[str, Any] = {}
    settings = replace(size.grpo, lr=dial.lr, precision=dial.precision)
    for fam, ref in zip(FAMILIES, reference, strict=True):
        t = time.time()
        if dial.trainer == "grpo":
            info[fam] = train_agent(base, fam, tmp / fam, settings, seed=seed)
            shutil.rmtree(tmp / fam / "_trainer", ignore_errors=True)
        elif dial.trainer == "sft":
            info[fam] = train_sft_agent(base, fam, tmp / fam, settings, seed=seed)
        else:
            info[fam] = prune_task_vector(base, ref, PAPER_DENSITY[fam] / 100.0, tmp / fam)
        info[fam]["seconds"] = time.time() - t
    (work / "training.json").write_text(json.dumps(info, default=str))
    tmp.rename(out)
    return [out / f for f in FAMILIES], info


def run_mechanism(seed_dir: Path, out: Path, *, seed: int, size_name: str = "tiny") -> dict[str, Any]:
    """Every dial from one lab seed's base (`seed_dir` = a `rlmerge lab` output's seedN folder)."""
    size = SIZES[size_name]
    ensure_isolation()  # the coding agents' rewards and scores run model-written programs
    claim(out, [seed_dir], what="rlmerge lab --mechanism-from")
    test = _eval_sets(size, "test", size.n_test, seed)
    base = seed_dir / "base"
    _wait_for([base], "the lab's base")
    results: dict[str, Any] = {"seed": seed, "base": str(base), "settings": []}
    res_path = out / "mechanism.json"
    for dial in DIALS:
        t = time.time()
        slug = dial.label.replace(" ", "_").replace("(", "").replace(")", "")
        _log(f"mechanism: {dial.label}")
        agents, training = _agents_for(dial, size, seed_dir, out / slug, seed)
        res = SeedResult(seed)
        res.training = training
        res.task_vectors = task_vector_stats(base, dict(zip(FAMILIES, agents, strict=True)))
        res.task_vectors["density_by_abs_w"] = {f: density_by_magnitude(base, a) for f, a in zip(FAMILIES, agents)}
        _score(res, "Base", base, test, size.kind)
        for fam, path in zip(FAMILIES, agents, strict=True):
            _score(res, f"Specialist: {fam}", path, test, size.kind)
        run_merges(size, base, agents, out / slug / "merges", test, res, MECHANISM_GRIDS)
        shutil.rmtree(out / slug / "merges", ignore_errors=True)  # only the scores are kept
        results["settings"].append({"dial": asdict(dial), "seconds": time.time() - t, **asdict(res)})
        res_path.write_text(json.dumps(results, indent=1, default=str))
    return results


def summary_rows(results: dict[str, Any]) -> list[dict[str, Any]]:
    """Per setting: mean density and unique share over agents, the specialists' own-task gains, the gaps."""
    rows = []
    for s in results["settings"]:
        tv = s["task_vectors"]["agents"]
        sc = s["scores"]

        def avg(row: str, sc: dict[str, dict[str, float]] = sc) -> float | None:
            return 100.0 * statistics.fmean(sc[row].values()) if row in sc else None

        gains = {f: 100.0 * (sc[f"Specialist: {f}"][f] - sc["Base"][f]) for f in FAMILIES}
        ta, ram, ramp = avg("Task arithmetic"), avg("RAM"), avg("RAM+")
        ex = s.get("examples", {})
        ci = {
            f"{a}-TA": bootstrap_difference(ex[a], ex["Task arithmetic"], seed=s["seed"])
            for a in ("RAM", "RAM+")
            if a in ex and "Task arithmetic" in ex
        }
        rows.append({
            "setting": s["dial"]["label"],
            "density": {f: tv[f]["density_pct"] for f in FAMILIES},
            "mean_density": statistics.fmean(tv[f]["density_pct"] for f in FAMILIES),
            "mean_unique_share": statistics.fmean(tv[f]["unique_share_pct"] for f in FAMILIES),
            "gains": gains,
            "TA": ta, "RAM": ram, "RAM+": ramp,
            "RAM-TA": None if ram is None or ta is None else ram - ta,
            "RAM+-TA": None if ramp is None or ta is None else ramp - ta,
            "picks": {k: v["note"] for k, v in s["picks"].items()},
            "ci": ci,  # paired bootstrap over test examples: (difference, low, high) in points
        })  # fmt: skip
    return rows


def markdown_mechanism(results: dict[str, Any]) -> str:
    head = (
        "| setting | density tool_use / coding / memory (%) | unique share (%) | own-task gain (points) "
        "| TA | RAM | RAM+ | RAM − TA | RAM+ − TA |"
    )
    lines = [head, "|---|---|---|---|---|---|---|---|---|"]

    def f(x: float | None) -> str:
        return "–" if x is None else f"{x:.1f}"

    def gap(r: dict[str, Any], key: str) -> str:
        if key not in r["ci"]:
            return "–" if r[key] is None else f"{r[key]:+.1f}"
        d, lo, hi = r["ci"][key]
        return f"{d:+.1f} [{lo:+.1f}, {hi:+.1f}]"

    for r in summary_rows(results):
        dens = " / ".join(f"{r['density'][k]:.1f}" for k in FAMILIES)
        gains = " / ".join(f"{r['gains'][k]:+.1f}" for k in FAMILIES)
        lines.append(
            f"| {r['setting']} | {dens} | {r['mean_unique_share']:.1f} | {gains} | {f(r['TA'])} "
            f"| {f(r['RAM'])} | {f(r['RAM+'])} | {gap(r, 'RAM-TA')} | {gap(r, 'RAM+-TA')} |"
        )
    lines += ["", "Gaps in points, average over tasks; [95 % interval]: paired bootstrap over the test examples."]
    return "\n".join(lines)


def plot_mechanism(results: dict[str, Any], path: Path) -> None:
    """Three panels: gaps vs density, gaps vs unique share, density by |w| with the 256·lr thresholds."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = summary_rows(results)
    fig, axes = plt.subplots(1, 3, figsize=(17, 5.2))
    markers = "osD^v<>p*h"
    for ax, key, xlabel in (
        (axes[0], "mean_density", "task-vector density, mean over the 3 agents (%)"),
        (axes[1], "mean_unique_share", "unique share of changed elements, mean (%)"),
    ):
        for i, r in enumerate(rows):
            x = r[key]
            for gap, color in (("RAM-TA", "tab:blue"), ("RAM+-TA", "tab:orange")):
                if r[gap] is not None:
                    ax.scatter(x, r[gap], color=color, marker=markers[i % len(markers)], s=60)
            ax.annotate(r["setting"], (x, r["RAM-TA"] or 0.0), fontsize=6.5, xytext=(4, 4), textcoords="offset points")
        ax.axhline(0.0, color="grey", lw=0.8)
        ax.set_xlabel(xlabel)
        ax.set_ylabel("test accuracy gap, average over tasks (points)")
        ax.scatter([], [], color="tab:blue", label="RAM − TA")
        ax.scatter([], [], color="tab:orange", label="RAM+ − TA")
        ax.legend(fontsize=8)
    ax = axes[2]
    for i, s in enumerate(results["settings"]):
        bins = s["task_vectors"]["density_by_abs_w"]
        # the three agents pooled: elements-weighted density per bin
        acc: dict[float, list[float]] = {}
        for fam in FAMILIES:
            for b in bins[fam]:
                if b["low"] > 0:
                    e = acc.setdefault(b["low"], [0.0, 0.0])
                    e[0] += b["elements"]
                    e[1] += b["elements"] * b["density"]
        xs = sorted(acc)
        ax.plot(xs, [100.0 * acc[x][1] / acc[x][0] for x in xs], marker=markers[i % len(markers)], ms=4,
                label=s["dial"]["label"])  # fmt: skip
        if s["dial"]["precision"] == "bf16-pure":
            ax.axvline(256 * s["dial"]["lr"], ls=":", color=ax.lines[-1].get_color(), lw=1)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("|w| of the base weight (bin lower edge, log2)")
    ax.set_ylabel("changed elements in the bin (%)")
    ax.set_title("density by |w|; dotted: 256·lr of a bf16-pure run", fontsize=9)
    ax.legend(fontsize=6.5)
    fig.suptitle(f"rlmerge lab (tiny, seed {results['seed']}): what makes task vectors dense, and the merge gaps")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
