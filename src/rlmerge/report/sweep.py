"""A sweep's results → ``report.md`` (per-task table, average with its interval, the candidates indistinguishable
from the best, the Pareto set, confirmed scores, the search's trials, cost) and ``plot.png``.

Reads the sweep's ``results.json`` document only (sweeping/sweep.py writes it; sweeping/noise.py says how the
intervals and the indistinguishable set are computed).
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


def _interval(iv: Mapping[str, float] | None) -> str:
    return "—" if not iv else f"[{iv['low']:.2f}, {iv['high']:.2f}]"


def _noise_section(doc: dict[str, Any], by_id: dict[str, Any]) -> list[str]:
    """Which candidates the scores cannot tell from the best (``=`` in the table), and how that was decided."""
    same = doc.get("indistinguishable") or []
    ranking = [cid for cid in doc.get("ranking", []) if by_id[cid].get("average") is not None]
    if not ranking:
        return []
    noise = doc.get("noise") or {}
    lines = ["", "## Indistinguishable from the best", ""]
    if not same:
        return lines + ["Nothing is known of these scores' noise (no standard errors, no per-example results), so "
                        "no candidate can be said to be indistinguishable from the best, nor better than another."]
    how = " and ".join(noise.get("how") or [])
    lines += [f"{len(same)} candidate(s) (`=` above): the best, and those whose 95 % interval of (best − candidate) "
              "average score contains 0 " + (f"({how}; " if how else "(") + f"{noise.get('draws')} bootstrap draws, "
              f"seed {noise.get('seed')}, where paired). The scores do not say which of these is best.", "",
              "| candidate | average | best − candidate | 95 % interval | how |", "|---|---:|---:|---:|---|"]
    for cid in ranking:
        c, v = by_id[cid], by_id[cid].get("vs_best")
        if cid == ranking[0]:
            lines.append(f"| `{c['label']}` | {_fmt(c['average'])} | (best) | | |")
        elif v is not None:
            mark = "" if v["indistinguishable"] else " (worse)"
            lines.append(f"| `{c['label']}` | {_fmt(c['average'])} | {v['difference']:.2f} | "
                         f"[{v['low']:.2f}, {v['high']:.2f}]{mark} | {v['how']} |")
    return lines


def kept_share(score: float | None, best_input: float | None) -> float | None:
    """How much of the best input's score on a task a candidate keeps, in %: 100 · candidate / best input.

    A ratio, not a difference in points, because it is what "one model that keeps every agent's skill" promises and
    it reads the same on tasks of different scales (a 0-100 accuracy, a command's 0-1 score): 95 % kept is 95 % of the
    specialist's skill on any task. The difference in points, with its interval, is beside it in the comparison with
    the best input. None where either score is unknown, or where the best input's score is ≤ 0 (a share of nothing
    or of a negative score says nothing)."""
    if score is None or best_input is None or best_input <= 0:
        return None
    return 100.0 * score / best_input


def _share(v: float | None) -> str:
    return "—" if v is None else f"{v:.1f} %"


def short_names(refs: Sequence[Mapping[str, Any]]) -> dict[str, str]:
    """How the report's tables name the inputs, by reference id: ``base``, and each agent by its folder's name where
    those are distinct (and none is ``base``), else by its name in full (results.json's ``agents``)."""
    short = {r["id"]: str(r["name"]).rstrip("/").rsplit("/", 1)[-1] for r in refs if r["role"] == "agent"}
    full = {r["id"]: str(r["name"]) for r in refs}
    if len(set(short.values())) < len(short) or "base" in short.values():
        return full
    return {**full, **short}


def _references_section(doc: dict[str, Any], by_id: dict[str, Any]) -> list[str]:
    """The inputs scored as they are (``--references``): per task the base, each agent, the best candidate and the
    share of the best input's score it keeps, its difference from the best input (paired where possible); then
    every candidate's share on each task."""
    refs, versus = doc.get("references") or [], doc.get("versus_inputs") or {}
    if not refs:
        return []
    names = short_names(refs)
    tasks = list(versus.get("tasks") or {})
    best = by_id.get(versus.get("candidate") or "")
    lines = ["", "## Against the inputs", "",
             "The base and each agent scored as they are, by the same scorers on the same examples as the candidates "
             "(not ranked, never kept). *Kept* is the candidate's score as a share of the best input's on that task "
             "(100 · candidate / best input); *best − input* is the best candidate's difference from that input in "
             "points, with its 95 % interval (paired bootstrap where both have per-example results on the same "
             "examples, else normal; noise as above).", "",
             *(["Agents: " + ", ".join(f"`{names[r['id']]}` is `{r['name']}`" for r in refs[1:]) + ".", ""]
               if any(names[r["id"]] != r["name"] for r in refs) else []),
             "| task | " + " | ".join(f"`{names[r['id']]}`" for r in refs) + " | best input | best candidate | kept | "
             "best − input | 95 % interval | verdict |",
             "|---|" + "---:|" * len(refs) + "---|---:|---:|---:|---:|---|"]
    for t in tasks:
        v = versus["tasks"][t]
        cells = ["failed" if r.get("error") is not None else _fmt(r["scores"].get(t)) for r in refs]
        diff = [f"{v['difference']:+.2f}", f"[{v['low']:+.2f}, {v['high']:+.2f}]", v["verdict"]] \
            if "verdict" in v else ["—", "—", "unknown noise" if "candidate_score" in v else "—"]
        lines.append(f"| {t} | " + " | ".join(cells) + f" | `{names[v['input']]}` | {_fmt(v.get('candidate_score'))}"
                     f" | {_share(kept_share(v.get('candidate_score'), v['input_score']))} | " + " | ".join(diff)
                     + " |")
    lines.append("| average | " + " | ".join("failed" if r.get("error") is not None else _fmt(r["average"])
                                              for r in refs)
                 + f" | | {_fmt(best['average']) if best else '—'} | | | | |")
    if best is not None:
        lines += ["", f"Best candidate: `{best['label']}`."]
    failed = [r for r in refs if r.get("error") is not None]
    if failed:
        lines += ["", "The scorer failed on these inputs (recorded; `--resume` scores them again):", ""]
        lines += [f"- `{names[r['id']]}`: " + " ".join(str(r["error"]).split()) for r in failed]
    ranked = [by_id[cid] for cid in doc.get("ranking", []) if by_id[cid].get("average") is not None]
    if ranked and tasks:
        top = {t: versus["tasks"][t]["input_score"] for t in tasks}
        lines += ["", "Each candidate's share of the best input's score (best average first; *least* is its lowest "
                  "share: the skill it keeps worst):", "",
                  "| candidate | " + " | ".join(f"{t} kept" for t in tasks) + " | least |",
                  "|---|" + "---:|" * (len(tasks) + 1)]
        for c in ranked:
            shares = [kept_share(c["scores"].get(t), top[t]) for t in tasks]
            known = [x for x in shares if x is not None]
            lines.append(f"| `{c['label']}` | " + " | ".join(_share(x) for x in shares)
                         + f" | {_share(min(known)) if len(known) == len(shares) else '—'} |")
    return lines


def _confirmed_section(doc: dict[str, Any], by_id: dict[str, Any]) -> list[str]:
    """The best candidates scored again on the held-out split: search score, confirmed score, the gap."""
    rows = doc.get("confirmed")
    if not rows:
        return []
    split = ((doc.get("confirm") or {}).get("settings") or {}).get("split", "the held-out split")
    lines = ["", f"## Confirmed on {split}", "",
             f"The best {len(rows)} scored again on {split}: the search chose on its own scores, so they are biased "
             "upwards (the winner's curse); the gap is search − confirmed.", "",
             "| candidate | search average | confirmed average | 95 % interval | gap |", "|---|---:|---:|---:|---:|"]
    for r in rows:
        confirmed = "failed: " + " ".join(str(r["error"]).split()) if r.get("error") else _fmt(r["average"])
        lines.append(f"| `{by_id[r['id']]['label']}` | {_fmt(r['search_average'])} | {confirmed} | "
                     f"{_interval(r.get('interval'))} | {_fmt(r.get('gap'))} |")
    names = short_names(doc.get("references") or [])
    for ref in doc.get("references") or []:  # the inputs as they are (--references), on the held-out split too
        c = ref.get("confirmed")
        if c is not None:
            confirmed = "failed: " + " ".join(str(c["error"]).split()) if c.get("error") else _fmt(c["average"])
            gap = None if c["average"] is None or ref["average"] is None else ref["average"] - c["average"]
            lines.append(f"| `{names[ref['id']]}` (input) | {_fmt(ref['average'])} | {confirmed} | "
                         f"{_interval(c.get('interval'))} | {_fmt(gap)} |")
    return lines


def _search_section(doc: dict[str, Any]) -> list[str]:
    search, trials = doc.get("search"), doc.get("trials") or []
    if not search:
        return []
    states = {s: sum(t["state"] == s for t in trials) for s in dict.fromkeys(t["state"] for t in trials)}
    done = [t for t in trials if t.get("value") is not None]
    best = max(done, key=lambda t: t["value"], default=None)
    lines = ["", "## Search", "",
             f"`{search['kind']}` (Optuna), seed {search['seed']}, {len(trials)} trials ("
             + ", ".join(f"{n} {s}" for s, n in states.items()) + f"), asked {search.get('batch', 1)} at a time, over:",
             "", *(f"- `{sp}`" for sp in search["spaces"])]
    if best is not None:
        lines += ["", f"The best average was first reached at trial {best['number'] + 1} of {len(trials)}."]
    return lines


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
    same = set(doc.get("indistinguishable") or [])
    search = doc.get("search")
    of = (f"scored, from {len(doc.get('trials') or [])} trials of a {search['kind']} search" if search
          else f"of {len(doc.get('planned', by_id))} scored")
    lines += [f"## Candidates, best average first ({len(by_id) - len(failed)} {of}"
              f"{f', {len(failed)} failed' if failed else ''})", "",
              "| rank | candidate | " + "".join(f"{t} | " for t in tasks) + "average | 95 % interval | ≈ best | "
              "Pareto | kept | built in | merge s | score s |",
              "|---:|---|" + "---:|" * len(tasks) + "---:|---:|:-:|:-:|---|---|---:|---:|"]
    for rank, cid in enumerate(doc.get("ranking", []), 1):
        c = by_id[cid]
        average = "failed" if c.get("error") is not None else _fmt(c["average"])
        cells = [str(rank), f"`{c['label']}`", *(_fmt(c["scores"].get(t)) for t in tasks), average,
                 _interval(c.get("interval")), "=" if cid in same else "", "★" if cid in front else "",
                 kept.get(cid, ""), c["where"], f"{c['merge_seconds']:.1f}", f"{c['score_seconds']:.1f}"]
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", "The 95 % interval is the average ± 1.96 standard errors (each task's standard error, tasks taken "
              "as independent); — where a task's is unknown."]
    lines += _noise_section(doc, by_id)
    lines += _references_section(doc, by_id)
    lines += _confirmed_section(doc, by_id)
    lines += _search_section(doc)
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
    same = set(doc.get("indistinguishable") or [])
    half = [(c["average"] - c["interval"]["low"]) if c.get("interval") else 0.0 for c in ranked]
    bars = ax.barh(range(len(ranked)), [c["average"] for c in ranked], color=colors,
                   xerr=half if any(half) else None, error_kw={"elinewidth": 0.8, "capsize": 2})
    for bar, c in zip(bars, ranked):
        if c["id"] in same:
            bar.set_hatch("///")
    ax.set_yticks(range(len(ranked)), [_short(c["label"]) for c in ranked], fontsize=7)
    ax.invert_yaxis()
    ax.set_xlabel("average score ± 1.96 stderr (orange: Pareto set; hatched: indistinguishable from the best)")
    if two:
        ax2 = axes[1]
        x, y = tasks[0], tasks[1]
        for c in ranked:
            if x in c["scores"] and y in c["scores"]:
                ax2.errorbar(c["scores"][x], c["scores"][y], xerr=_half(c, x), yerr=_half(c, y), fmt="o",
                             color="#d95f02" if c["id"] in front else "#7570b3", elinewidth=0.6, capsize=1.5)
                ax2.annotate(_short(c["label"]), (c["scores"][x], c["scores"][y]), fontsize=6)
        ax2.set_xlabel(f"{x} (± 1.96 stderr where known)")
        ax2.set_ylabel(y)
    return fig


def _half(c: Mapping[str, Any], task: str) -> float | None:
    """Half the 95 % error bar of a candidate's score on ``task``: 1.96 standard errors (None where unknown)."""
    se = ((c.get("details") or {}).get(task) or {}).get("stderr")
    return None if se is None else 1.96 * se


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
