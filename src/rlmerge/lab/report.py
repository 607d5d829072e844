"""Results → a paper-style table (rows = models, columns = tasks + average, mean ± std) and a plot."""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from pathlib import Path

from rlmerge.lab.tasks import FAMILIES

# scores[row][seed] = {family: accuracy in 0..1}
Scores = Mapping[str, Sequence[Mapping[str, float]]]


def _mean_std(values: Sequence[float]) -> tuple[float, float]:
    return statistics.fmean(values), (statistics.stdev(values) if len(values) > 1 else 0.0)


def summarize(scores: Scores) -> dict[str, dict[str, tuple[float, float]]]:
    """Per row, per column (families + "average"): (mean, std) over seeds, in percent."""
    table: dict[str, dict[str, tuple[float, float]]] = {}
    for row, runs in scores.items():
        cols = {f: _mean_std([100.0 * run[f] for run in runs]) for f in FAMILIES}
        cols["average"] = _mean_std([100.0 * statistics.fmean(run[f] for f in FAMILIES) for run in runs])
        table[row] = cols
    return table


def markdown_table(scores: Scores, notes: Mapping[str, str] | None = None) -> str:
    """Markdown table; `notes` adds a last column (chosen hyperparameters, λ)."""
    table = summarize(scores)
    seeds = max((len(runs) for runs in scores.values()), default=0)
    head = ["model", *FAMILIES, "average"] + (["chosen on validation"] if notes else [])
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row, cols in table.items():
        cells = [
            f"{m:.1f} ± {s:.1f}" if seeds > 1 else f"{m:.1f}" for m, s in (cols[c] for c in [*FAMILIES, "average"])
        ]
        extra = [notes.get(row, "")] if notes else []
        lines.append("| " + " | ".join([row, *cells, *extra]) + " |")
    lines.append("")
    lines.append(
        f"Accuracy in % on held-out test sets; {seeds} seed(s) of the whole pipeline"
        + (" (mean ± std)." if seeds > 1 else ".")
    )
    return "\n".join(lines)


def plot(scores: Scores, path: Path, title: str) -> None:
    """Grouped bars: one group per model, one bar per task plus the average, with std error bars."""
    import matplotlib

    matplotlib.use("Agg")  # headless: CI and servers have no display
    import matplotlib.pyplot as plt

    table = summarize(scores)
    rows = list(table)
    cols = [*FAMILIES, "average"]
    width = 0.8 / len(cols)
    fig, ax = plt.subplots(figsize=(max(8.0, 0.9 * len(rows)), 4.5))
    for j, col in enumerate(cols):
        xs = [i + (j - (len(cols) - 1) / 2) * width for i in range(len(rows))]
        ax.bar(xs, [table[r][col][0] for r in rows], width, yerr=[table[r][col][1] for r in rows], label=col)
    ax.set_xticks(range(len(rows)))
    ax.set_xticklabels(rows, rotation=40, ha="right", fontsize=8)
    ax.set_ylabel("test accuracy (%)")
    ax.set_ylim(0, 100)
    ax.set_title(title, pad=24)  # room for the legend between the title and the bars
    ax.legend(fontsize=8, ncols=len(cols), loc="lower center", bbox_to_anchor=(0.5, 1.0), frameon=False)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def combine(results_files: Sequence[Path]) -> dict[str, list[dict[str, float]]]:
    """Scores of several lab runs (results.json each, e.g. one per --first-seed), row → one entry per seed.

    A row missing from a run (a method skipped there) is kept with the seeds that have it.
    """
    import json

    scores: dict[str, list[dict[str, float]]] = {}
    for path in results_files:
        for seed in json.loads(Path(path).read_text())["seeds"]:
            for row, cols in seed["scores"].items():
                scores.setdefault(row, []).append(cols)
    return scores
