"""Lab results → the tables and plots in docs/ (`python -m rlmerge.lab.writeup --help`).

Reads only what the runs wrote (results.json per `rlmerge lab` run, mechanism.json per sweep) and
prints Markdown; plots go where asked. Nothing here measures anything.
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rlmerge.lab.paired import (
    PAIRS,
    bootstrap_difference,
    markdown_pairs,
    pooled_difference,
    seed_differences,
    t_interval,
)
from rlmerge.lab.report import markdown_table, plot
from rlmerge.lab.tasks import FAMILIES

# Paper, Table 1 (Qwen2.5-7B-Instruct, three RL agents, average over 12 tasks): ram-method.md.
PAPER_TABLE1 = {
    "Base": 48.70,
    "Specialists (paper's order)": "49.35 / 54.16 / 57.77",
    "Task arithmetic": 58.28,
    "Fisher": 52.20,
    "TIES": 60.02,
    "DARE+TA": 63.33,
    "DARE+TIES": 62.47,
    "RAM": 64.82,
    "RAM+ (paper defaults)": 66.55,  # the paper reports RAM+ at its defaults r = 0.1, α = 2 (no tuning)
}


def load_seeds(files: Sequence[Path]) -> list[dict[str, Any]]:
    return seeds_of([json.loads(Path(f).read_text()) for f in files])


def seeds_of(docs: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """The seeds of one or more results.json documents, in seed order."""
    return sorted((seed for d in docs for seed in d["seeds"]), key=lambda s: s["seed"])


def _avg(scores: dict[str, float]) -> float:
    return 100.0 * statistics.fmean(scores[f] for f in FAMILIES)


def picks_table(seeds: Sequence[dict[str, Any]]) -> str:
    """Per tuned row and seed: the chosen point and where it sits in the grid."""
    rows = sorted({r for s in seeds for r, p in s.get("picks", {}).items() if p.get("grid_points", 1) > 1})
    lines = ["| row | " + " | ".join(f"seed {s['seed']}" for s in seeds) + " |", "|---|" + "---|" * len(seeds)]
    for row in rows:
        cells = []
        for s in seeds:
            p = s.get("picks", {}).get(row)
            if p is None:
                cells.append("–")
                continue
            searched = [k for k, v in p["position"].items() if v not in ("fixed", "categorical")]
            where = ", ".join(f"{k} {p['position'][k]}" for k in searched)
            vals = ", ".join(f"{k}={p['params'][k]}" for k in searched)
            cells.append(f"{vals} ({where})")
        lines.append(f"| {row} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def density_table(seeds: Sequence[dict[str, Any]]) -> str:
    lines = [
        "| seed | density tool_use / coding / memory (%) | unique share (%) | changed by 0 / 1 / 2 / 3 agents (%) "
        "| cosine range |",
        "|---|---|---|---|---|",
    ]
    for s in seeds:
        tv = s["task_vectors"]
        dens = " / ".join(f"{tv['agents'][f]['density_pct']:.1f}" for f in FAMILIES)
        uniq = " / ".join(f"{tv['agents'][f]['unique_share_pct']:.1f}" for f in FAMILIES)
        counts = " / ".join(f"{v:.1f}" for v in tv["count_share_pct"].values())
        cos = list(tv["cosine"].values())
        lines.append(f"| {s['seed']} | {dens} | {uniq} | {counts} | {min(cos):.3f} … {max(cos):.3f} |")
    return "\n".join(lines)


def specialist_table(seeds: Sequence[dict[str, Any]]) -> str:
    head = " | ".join(f"{f} base → specialist" for f in FAMILIES)
    lines = [
        f"| seed | {head} | stage times (s): warm-up + 3 agents + scoring + merges + unique rows | total (s) |",
        "|---|" + "---|" * (len(FAMILIES) + 2),
    ]
    for s in seeds:
        sc = s["scores"]
        cells = " | ".join(f"{100 * sc['Base'][f]:.1f} → {100 * sc[f'Specialist: {f}'][f]:.1f}" for f in FAMILIES)
        # A rerun into the same folder reuses a finished base and agents (lab-stage.json): their stage times
        # are the ones recorded when they were trained, the other stages' the last run's.
        t = s["timings"]
        train = [float(s["training"]["base"].get("warmup_seconds", 0.0))]
        train += [float(s["training"][f]["train_seconds"]) for f in FAMILIES]
        rest = [t.get("score_base_and_specialists", 0.0), t.get("merges", 0.0), t.get("unique_region", 0.0)]
        cells += " | " + " + ".join(f"{x:.0f}" for x in train + rest)
        total = sum(train + rest)
        lines.append(f"| {s['seed']} | {cells} | {total:.0f} |")
    return "\n".join(lines)


def tiny(files: Sequence[Path], plot_path: Path | None) -> str:
    seeds = load_seeds(files)
    scores = {r: [s["scores"][r] for s in seeds if r in s["scores"]] for r in seeds[0]["scores"]}
    if plot_path is not None:
        plot(scores, plot_path, f"rlmerge lab (tiny): test accuracy, {len(seeds)} seeds, mean ± std")
    pairs = seed_differences([s["scores"] for s in seeds])
    return "\n\n".join([
        markdown_table(scores),
        "Paired differences:\n\n" + markdown_pairs(pairs, how=f"Student-t 95 % over {len(seeds)} seeds, n − 1 df"),
        "Picks on validation (value, and where it sits in its grid):\n\n" + picks_table(seeds),
        "Specialists against the base on their own task:\n\n" + specialist_table(seeds),
        "Task vectors:\n\n" + density_table(seeds),
    ])  # fmt: skip


def real_size(file: Path) -> str:
    """One-seed run (SmolLM2): the paper's Table 1 layout, our columns next to the paper's average."""
    (seed,) = load_seeds([file])
    sc = seed["scores"]
    lines = [
        "| model | " + " | ".join(FAMILIES) + " | average (ours) | average (paper, Table 1) | chosen on validation |",
        "|---|" + "---|" * (len(FAMILIES) + 3),
    ]
    order = ["Base", *(f"Specialist: {f}" for f in FAMILIES), "Average", "Task arithmetic", "Fisher", "TIES",
             "DARE+TA", "DARE+TIES", "RAM", "RAM+", "RAM+ (paper defaults)"]  # fmt: skip
    for row in order:
        if row not in sc:
            continue
        specialists = str(PAPER_TABLE1["Specialists (paper's order)"]) + " (the three)"
        paper = PAPER_TABLE1.get(row, specialists if row == f"Specialist: {FAMILIES[0]}" else "–")
        cells = " | ".join(f"{100 * sc[row][f]:.1f}" for f in FAMILIES)
        note = seed.get("notes", {}).get(row, "")
        lines.append(f"| {row} | {cells} | {_avg(sc[row]):.1f} | {paper} | {note} |")
    n = len(next(iter(seed["examples"]["Base"].values())))
    boot = []
    for a, b in PAIRS:
        if a in seed["examples"] and b in seed["examples"]:
            d, lo, hi = bootstrap_difference(seed["examples"][a], seed["examples"][b], seed=seed["seed"])
            boot.append({"pair": f"{a} − {b}", "diffs": [d], "mean": d, "low": lo, "high": hi})
    gains = []
    for f in FAMILIES:
        own = {f: seed["examples"][f"Specialist: {f}"][f]}
        d, lo, hi = bootstrap_difference(own, {f: seed["examples"]["Base"][f]}, seed=seed["seed"])
        gains.append({"pair": f"Specialist: {f} − Base, on {f}", "diffs": [d], "mean": d, "low": lo, "high": hi})
    how = f"paired bootstrap over the {n} test examples per task, 2000 draws"
    return "\n\n".join([
        "\n".join(lines),
        "Specialists against the base on their own task:\n\n" + markdown_pairs(gains, how=how),
        "Paired differences:\n\n" + markdown_pairs(boot, how=how),
        "Picks on validation:\n\n" + picks_table([seed]),
        "Task vectors:\n\n" + density_table([seed]),
    ])  # fmt: skip


# The paper's Table 1 rows in its order (Base first; RAM+ is the paper's reported RAM+, at its defaults).
TABLE1_ORDER = ("Base", "Task arithmetic", "Fisher", "TIES", "DARE+TA", "DARE+TIES", "RAM", "RAM+ (paper defaults)")


def _mean_sd(values: Sequence[float]) -> str:
    if len(values) < 2:
        return f"{values[0]:.1f}"
    return f"{statistics.fmean(values):.1f} ± {statistics.stdev(values):.1f}"


def _rank(values: dict[str, float]) -> dict[str, int]:
    order = sorted(values, key=lambda r: -values[r])
    return {r: order.index(r) + 1 for r in values}


def beside_table1(seeds: Sequence[dict[str, Any]]) -> str:
    """Ours (mean over seeds) beside the paper's Table 1: averages, gaps to the base and to TA, and ranks."""
    rows = [r for r in TABLE1_ORDER if all(r in s["scores"] for s in seeds)]
    ours = {r: statistics.fmean(_avg(s["scores"][r]) for s in seeds) for r in rows}
    paper = {r: float(PAPER_TABLE1[r]) for r in rows if isinstance(PAPER_TABLE1.get(r), float)}
    ranks_ours = _rank({r: v for r, v in ours.items() if r != "Base"})
    ranks_paper = _rank({r: v for r, v in paper.items() if r != "Base"})
    lines = ["| row | ours: average | − Base | − TA | rank | paper: average | − Base | − TA | rank |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        o_ta = f"{ours[r] - ours['Task arithmetic']:+.1f}" if "Task arithmetic" in ours else "–"
        cells = [f"{ours[r]:.1f}", f"{ours[r] - ours['Base']:+.1f}", o_ta, str(ranks_ours.get(r, "–"))]
        if r in paper:
            cells += [f"{paper[r]:.2f}", f"{paper[r] - paper['Base']:+.2f}",
                      f"{paper[r] - paper['Task arithmetic']:+.2f}", str(ranks_paper.get(r, "–"))]
        else:
            cells += ["–"] * 4
        lines.append(f"| {r} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def agents_table(seeds: Sequence[dict[str, Any]], settings: dict[str, dict[str, Any]]) -> str:
    """Per seed and agent: lr × steps, reward, runs trained (the gate), density, unique share, ρ, λ at the paper's
    defaults, own-task gain."""
    lines = ["| seed | agent | lr × steps | reward | runs (gate on validation: base → agent, %) | density (%) "
             "| unique share (%) | ρ | λ (r 0.1, α 2) | own task: base → specialist (%) |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for s in seeds:
        for f in FAMILIES:
            a, g = s["task_vectors"]["agents"][f], s["training"][f].get("settings", settings.get(f, {}))
            lam = f"{a['lambda_paper']:.3f}" if "lambda_paper" in a else "–"
            gain = f"{100 * s['scores']['Base'][f]:.1f} → {100 * s['scores'][f'Specialist: {f}'][f]:.1f}"
            regime = f"{g.get('lr', 0):g} × {g.get('steps', 0)} | {g.get('reward', 'shaped')}"
            regime += f" | {_runs(s['training'][f])}"
            lines.append(f"| {s['seed']} | {f} | {regime} | {a['density_pct']:.1f} | {a['unique_share_pct']:.1f} "
                         f"| {a['rho']:.2f} | {lam} | {gain} |")
    return "\n".join(lines)


def _runs(training: dict[str, Any]) -> str:
    """How many runs an agent took and each run's gate scores in the order they were trained ("1" for a run
    without the gate), and which was kept when it was not the last (every run failed: the best on validation)."""
    failed = training.get("failed_attempts", [])
    kept = training.get("attempt", len(failed))
    runs = sorted([(f.get("attempt", i), f.get("gate")) for i, f in enumerate(failed)]
                  + [(kept, training.get("gate"))], key=lambda r: r[0])
    if training.get("gate") is None:
        return str(len(runs))
    def one(g: dict[str, Any]) -> str:  # the sign test's p where the gate recorded it
        p = f", p {g['p']:.2g}" if g.get("p") is not None else ""
        return f"{100 * g['base']:.1f} → {100 * g['agent']:.1f}{p}"

    which = "" if runs[-1][0] == kept else f"; run {kept + 1} kept"
    return f"{len(runs)} (" + "; ".join(one(g) for _, g in runs if g) + which + ")"


def stage_times(seeds: Sequence[dict[str, Any]]) -> str:
    """Per stage, wall and CPU seconds in each seed (as recorded when the stage ran)."""
    names = list(dict.fromkeys(k for s in seeds for k in s.get("stages", {})))
    lines = ["| stage | " + " | ".join(f"seed {s['seed']} wall / CPU (s)" for s in seeds) + " |",
             "|---|" + "---|" * len(seeds)]
    for name in names:
        cells = []
        for s in seeds:
            t = s.get("stages", {}).get(name, {})
            cells.append(f"{t['wall_s']:.0f} / {t['cpu_s']:.0f}" if "wall_s" in t and "cpu_s" in t else "–")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    totals = [sum(t.get("wall_s", 0.0) for t in s.get("stages", {}).values()) for s in seeds]
    cpus = [sum(t.get("cpu_s", 0.0) for t in s.get("stages", {}).values()) for s in seeds]
    lines.append("| total | " + " | ".join(f"{w:.0f} / {c:.0f}" for w, c in zip(totals, cpus, strict=True)) + " |")
    return "\n".join(lines)


def uneven(files: Path | Sequence[Path], plot_to: Path | None = None) -> str:
    """A multi-seed real-size run (the uneven SmolLM2 run): Table 1 beside ours, the agents, paired intervals.

    ``files``: the results.json of one run, or of several runs of the same size that each made other seeds
    (``--first-seed``: seeds run side by side); ``plot_to``: where to draw their test scores."""
    files = [Path(files)] if isinstance(files, (str, Path)) else [Path(f) for f in files]
    docs = [json.loads(f.read_text()) for f in files]
    seeds = seeds_of(docs)
    if len({s["seed"] for s in seeds}) < len(seeds):
        raise ValueError(f"{', '.join(map(str, files))}: a seed appears in more than one run; give each seed once")
    settings = [d.get("config", {}).get("agent_grpo", {}) for d in docs]
    if any(s != settings[0] for s in settings):
        raise ValueError(f"{', '.join(map(str, files))}: the runs trained their agents with different settings "
                         "(config.agent_grpo); only runs of one setting go in one table")
    doc = docs[0]
    scores = {r: [s["scores"][r] for s in seeds if r in s["scores"]] for r in seeds[0]["scores"]}
    over = seed_differences([s["scores"] for s in seeds]) if len(seeds) > 1 else []
    own = []
    for f in FAMILIES:
        diffs = [100 * (s["scores"][f"Specialist: {f}"][f] - s["scores"]["Base"][f]) for s in seeds]
        row: dict[str, Any] = {"pair": f"Specialist: {f} − Base, on {f}", "diffs": diffs,
                               "mean": statistics.fmean(diffs), "low": None, "high": None}
        if len(diffs) > 1:
            row["mean"], row["low"], row["high"] = t_interval(diffs)
        own.append(row)
    boot = {s["seed"]: [{"pair": f"{a} − {b}", "diffs": [d], "mean": d, "low": lo, "high": hi}
                        for a, b in PAIRS if a in s["examples"] and b in s["examples"]
                        for d, lo, hi in [bootstrap_difference(s["examples"][a], s["examples"][b], seed=s["seed"])]]
            + [{"pair": f"Specialist: {f} − Base, on {f}", "diffs": [d], "mean": d, "low": lo, "high": hi}
               for f in FAMILIES if f"Specialist: {f}" in s["examples"] and "Base" in s["examples"]
               for d, lo, hi in [bootstrap_difference({f: s["examples"][f"Specialist: {f}"][f]},
                                                      {f: s["examples"]["Base"][f]}, seed=s["seed"])]]
            for s in seeds}
    n = len(seeds)
    if plot_to is not None:
        plot(scores, plot_to, f"rlmerge lab (uneven SmolLM2): test accuracy, {n} seed(s)")
    parts = [
        markdown_table(scores),
        "Beside the paper's Table 1 (average over tasks, mean over seeds; rank among the rows other than the base):\n\n"
        + beside_table1(seeds),
        "Each specialist against the base on its own task:\n\n"
        + markdown_pairs(own, how=f"Student-t 95 % over {n} seeds, n − 1 df"),
    ]
    if over:
        parts.append("Paired differences over seeds:\n\n"
                     + markdown_pairs(over, how=f"Student-t 95 % over {n} seeds, n − 1 df"))
    if n > 1:
        per_seed = {r["pair"]: r["diffs"] for r in over}  # the same points: each seed's difference of averages
        pooled = []
        for a, b in PAIRS:
            if (r := pooled_difference(seeds, a, b)) is not None:
                d, lo, hi = r
                pooled.append({"pair": f"{a} − {b}", "diffs": per_seed.get(f"{a} − {b}", []), "mean": d, "low": lo,
                               "high": hi})
        parts.append(f"The {n} seeds' test examples pooled (these agents only: the agents' training luck is in the "
                     "interval over seeds, not here):\n\n"
                     + markdown_pairs(pooled, how="paired bootstrap over the seeds' test examples, resampled within "
                                                  "each seed and task, 2000 draws; the mean is over seeds"))
    for seed, rows in boot.items():
        parts.append(f"Seed {seed}, paired bootstrap over test examples:\n\n"
                     + markdown_pairs(rows, how="paired bootstrap over the test examples, 2000 draws"))
    parts += [
        "Agents:\n\n" + agents_table(seeds, doc.get("config", {}).get("agent_grpo", {})),
        "Task vectors:\n\n" + density_table(seeds),
        "Picks on validation:\n\n" + picks_table(seeds),
        "Stage times:\n\n" + stage_times(seeds),
    ]
    return "\n\n".join(parts)


def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--tiny", nargs="*", type=Path, default=[], help="results.json files of tiny lab runs")
    ap.add_argument("--tiny-plot", type=Path, help="where to write the combined tiny plot")
    ap.add_argument("--mechanism", type=Path, help="mechanism.json of a sweep")
    ap.add_argument("--mechanism-plot", type=Path, help="where to write the mechanism plot")
    ap.add_argument("--real", type=Path, help="results.json of the SmolLM2 run")
    ap.add_argument("--uneven", nargs="*", type=Path, default=[],
                    help="results.json of the uneven SmolLM2 run (several seeds; or of runs that made one seed each)")
    ap.add_argument("--uneven-plot", type=Path, help="where to write the uneven run's plot")
    args = ap.parse_args(argv)
    if args.tiny:
        print(tiny(args.tiny, args.tiny_plot), end="\n\n")
    if args.mechanism:
        from rlmerge.lab.dials import markdown_mechanism, plot_mechanism

        results = json.loads(args.mechanism.read_text())
        print(markdown_mechanism(results), end="\n\n")
        if args.mechanism_plot:
            plot_mechanism(results, args.mechanism_plot)
    if args.real:
        print(real_size(args.real))
    if args.uneven:
        print(uneven(args.uneven, args.uneven_plot))


if __name__ == "__main__":
    main()
