"""A sweep's results → ``report.md`` (per-task table, average, Pareto set, cost) and ``plot.png``.

Reads the sweep's ``results.json`` document only (engine/sweep.py writes it).
"""

from __future__ import annotations

import io
from collections.abc import Mapping, Sequence
from typing import Any

DPI = 150
PLOT_LABEL = 48  # characters of a candidate label on the plot


def pareto(scores: Sequence[Mapping[str, float]]) -> list[int]:
    """Indices of the score sets no other beats: ≥ on every task and > on one (higher is better; a task a set
    lacks counts as −∞). Equal sets are all kept."""
    tasks = list(dict.fromkeys(k for s in scores for k in s))

    def vec(s: Mapping[str, float]) -> list[float]:
        return [s.get(t, float("-inf")) for t in tasks]

    vs = [vec(s) for s in scores]
    return [i for i, a in enumerate(vs)
            if not any(all(x >= y for x, y in zip(b, a)) and any(x > y for x, y in zip(b, a)) for b in vs)]


def _fmt(v: Any) -> str:
    return "—" if v is None else f"{v:.2f}" if isinstance(v, float) else str(v)


def to_markdown(doc: dict[str, Any], *, plot: bool) -> str:
    """The report: inputs, the ranking table (one column per task, the average), the Pareto set, the cost."""
    by_id = {c["id"]: c for c in doc["candidates"]}
    tasks: list[str] = doc.get("tasks", [])
    front = set(doc.get("pareto", []))
    kept = {cid: name for name, cid in (doc.get("kept") or {}).items()}
    lines = ["# rlmerge sweep", "",
             f"Base `{doc['base']}`; agents " + ", ".join(f"`{a}`" for a in doc["agents"]) + ".", ""]
    settings = doc.get("settings") or {}
    if settings:
        lines += ["Settings: " + ", ".join(f"`{k}={v}`" for k, v in settings.items()) + ".", ""]
    failed = [c for c in by_id.values() if c.get("error") is not None]
    lines += [f"## Candidates, best average first ({len(by_id) - len(failed)} of {len(doc.get('planned', by_id))} "
              f"scored{f', {len(failed)} failed' if failed else ''})", "",
              "| rank | candidate | " + "".join(f"{t} | " for t in tasks) + "average | Pareto | kept | built in |"
              " merge s | score s |",
              "|---:|---|" + "---:|" * len(tasks) + "---:|:-:|---|---|---:|---:|"]
    for rank, cid in enumerate(doc.get("ranking", []), 1):
        c = by_id[cid]
        average = "failed" if c.get("error") is not None else _fmt(c["average"])
        cells = [str(rank), f"`{c['label']}`", *(_fmt(c["scores"].get(t)) for t in tasks), average,
                 "★" if cid in front else "", kept.get(cid, ""), c["where"], f"{c['merge_seconds']:.1f}",
                 f"{c['score_seconds']:.1f}"]
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", "## Pareto set", "",
              "Candidates no other beats on every task (≥ everywhere, > somewhere):", ""]
    lines += [f"- `{by_id[cid]['label']}`: " + ", ".join(f"{t} {_fmt(by_id[cid]['scores'].get(t))}" for t in tasks)
              for cid in doc.get("pareto", [])] or ["- (no scores)"]
    if failed:
        lines += ["", "## Candidates the scorer failed on", "",
                  "Merged, not scored, ranked last and never kept; `--resume` scores them again:", ""]
        lines += [f"- `{c['label']}`: " + " ".join(str(c["error"]).split()) for c in failed]
    cands = list(by_id.values())
    stats = sum(c["passes"].count("statistics") for c in cands)
    merges = sum(c["passes"].count("merge") for c in cands)
    gb = sum(c["read_bytes"] for c in cands) / 1e9
    lines += ["", "## Cost", "",
              f"{len(cands)} merges ran {stats} statistics pass(es) and {merges} merge pass(es), reading "
              f"{gb:.2f} GB of weights (the statistics cache holds what a pass would count again).", ""]
    if plot:
        lines += ["![average score per candidate, and the first two tasks](plot.png)", ""]
    elif doc.get("ranking"):
        lines += ["(No plot: it needs matplotlib, `pip install 'rlmerge[report]'`.)", ""]
    return "\n".join(lines)


def figure(doc: dict[str, Any]) -> Any:
    """Bars of each candidate's average (Pareto set highlighted) and, with two or more tasks, the first two tasks
    against each other. Raises ImportError without matplotlib."""
    from matplotlib.figure import Figure

    by_id = {c["id"]: c for c in doc["candidates"]}
    ranked = [by_id[i] for i in doc["ranking"] if by_id[i]["average"] is not None]
    tasks = doc.get("tasks", [])
    front = set(doc.get("pareto", []))
    two = len(tasks) >= 2
    fig = Figure(figsize=(11 if two else 7, max(3.0, 0.3 * len(ranked) + 1.2)), layout="constrained")
    axes = fig.subplots(1, 2 if two else 1, squeeze=False)[0]
    ax = axes[0]
    colors = ["#d95f02" if c["id"] in front else "#7570b3" for c in ranked]
    ax.barh(range(len(ranked)), [c["average"] for c in ranked], color=colors)
    ax.set_yticks(range(len(ranked)), [_short(c["label"]) for c in ranked], fontsize=7)
    ax.invert_yaxis()
    ax.set_xlabel("average score (orange: Pareto set)")
    if two:
        ax2 = axes[1]
        x, y = tasks[0], tasks[1]
        for c in ranked:
            if x in c["scores"] and y in c["scores"]:
                ax2.scatter(c["scores"][x], c["scores"][y], color="#d95f02" if c["id"] in front else "#7570b3")
                ax2.annotate(_short(c["label"]), (c["scores"][x], c["scores"][y]), fontsize=6)
        ax2.set_xlabel(x)
        ax2.set_ylabel(y)
    return fig


def _short(label: str, most: int = PLOT_LABEL) -> str:
    """A candidate's label as the plot shows it: long ones (side-input paths) cut, so that the bars keep their
    room; report.md has them whole."""
    return label if len(label) <= most else label[:most - 1] + "…"


def render_report(doc: dict[str, Any]) -> dict[str, bytes]:
    """File name → bytes: ``report.md`` and, with matplotlib and some scores, ``plot.png``."""
    out: dict[str, bytes] = {}
    if any(c["average"] is not None for c in doc["candidates"]):
        try:
            fig = figure(doc)
        except ImportError:
            fig = None
        if fig is not None:
            buf = io.BytesIO()
            fig.savefig(buf, format="png", dpi=DPI)
            out["plot.png"] = buf.getvalue()
    out["report.md"] = to_markdown(doc, plot="plot.png" in out).encode()
    return out
