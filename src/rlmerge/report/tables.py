"""The report document as titled tables of text: one layout shared by the terminal (rich) and Markdown."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Section:
    title: str
    columns: list[str]
    rows: list[list[str]]
    note: str = ""
    right: set[int] = field(default_factory=set)  # right-aligned (numeric) column indexes


def pct(v: float | None) -> str:
    if v is None:
        return "–"
    return f"{v:.2%}" if v >= 1e-4 or v == 0 else f"{v:.2e}"


def fnum(v: Any, digits: int = 3) -> str:
    if v is None:
        return "–"
    if isinstance(v, str):
        return "∞" if v == "inf" else v
    if isinstance(v, int):
        return f"{v:,}"
    return f"{v:.{digits}g}" if abs(v) < 1e-3 and v != 0 else f"{v:.{digits}f}"


def sig(v: float | None) -> str:
    return "–" if v is None else f"{v:.3g}"


def display_names(agents: list[str]) -> list[str]:
    """Agent labels for tables and plots: the folder's last part when those are unique, else the label."""
    short = [a.rstrip("/").rsplit("/", 1)[-1] or a for a in agents]
    return short if len(set(short)) == len(short) else list(agents)


def sections(doc: dict[str, Any]) -> list[Section]:
    """Agents; magnitudes and thresholds (inspect only); k-of-N; RAM+ presets; pairwise; modules; layers."""
    out = [_agents(doc)]
    if doc["extras"]:
        out += [_magnitudes(doc), _thresholds(doc)]
    out += [_kofn(doc), _presets(doc), *_pairwise(doc)]
    if doc["modules"]:
        out.append(_groups(doc, "modules", "module", "Density per module type"))
    if doc["layers"]:
        out.append(_groups(doc, "layers", "layer", "Density per layer"))
    return out


def _agents(doc: dict[str, Any]) -> Section:
    extras = doc["extras"]  # "value changed" is an inspect-only counter
    cols = ["agent", "density", *(["value changed"] if extras else []), "changed", "unique", "ρ", "dtype"]
    rows = []
    for r, name in zip(doc["per_agent"], display_names(doc["agents"])):
        dtypes = "/".join(k.lower() for k in sorted(r["dtypes"] or {})) or "–"
        if r["dtype_differs_elements"]:
            dtypes += " (≠ base)"
        rows.append([name, pct(r["density"]), *([pct(r["value_changed_density"])] if extras else []),
                     fnum(r["changed"]), pct(r["unique_share"]), fnum(r["rho"]), dtypes])
    note = (f"{doc['elements']:,} elements in {doc['tensors']} tensors. density: |τ| > {doc['epsilon']:g}; "
            + ("value changed: τ ≠ 0 (a changed stored value when agent and base share a dtype); " if extras else "")
            + "unique: share of the agent's changed elements no other agent changed; ρ = shared / unique.")
    return Section("Task vectors per agent", cols, rows, note, set(range(1, len(cols) - 1)))


def _magnitudes(doc: dict[str, Any]) -> Section:
    cols = ["agent", "‖τ‖₂", "p1 |τ|", "p10", "median", "p90", "p99"]
    rows = []
    for r, name in zip(doc["per_agent"], display_names(doc["agents"])):
        q = r["magnitude_quantiles"] or [None] * 7  # at QUANTILES = 1, 10, 25, 50, 75, 90, 99 %
        rows.append([name, sig(r["norm"]), *(sig(q[i]) for i in (0, 1, 3, 5, 6))])
    note = "|τ| quantiles over each agent's non-zero entries, truncated to 8 significant bits (bf16 precision)."
    return Section("Magnitudes", cols, rows, note, set(range(1, 7)))


def _thresholds(doc: dict[str, Any]) -> Section:
    cols = ["agent", *(f"|τ| > {t:g}" for t in doc["thresholds"])]
    rows = [[a, *(pct(v) for v in r["density_at"])] for a, r in zip(display_names(doc["agents"]), doc["per_agent"])]
    return Section("Density at other thresholds", cols, rows, "", set(range(1, len(cols))))


def _kofn(doc: dict[str, Any]) -> Section:
    n = len(doc["agents"])
    cols = ["agent", *("k=1 (unique)" if k == 1 else f"k={k}" for k in range(1, n + 1))]
    rows = [[a, *(pct(v) for v in r["kofn_share"])] for a, r in zip(display_names(doc["agents"]), doc["per_agent"])]
    note = "share of each agent's changed elements that exactly k of the agents changed (paper Fig. 2)."
    return Section("Overlap: changed by k of N agents", cols, rows, note, set(range(1, n + 1)))


def _presets(doc: dict[str, Any]) -> Section:
    cols = ["agent", "ρ", "λ paper", "λ paper-soft", "λ official", "λ tensor-local eff. (min–max)"]
    rows = []
    for r, name in zip(doc["per_agent"], display_names(doc["agents"])):
        tl = r["ram_plus_tensor_local"]
        local = (f"{fnum(tl['lambda_effective'], 4)} ({fnum(tl['lambda_min'], 4)}–{fnum(tl['lambda_max'], 4)})"
                 if tl["lambda_effective"] is not None else "–")
        p = r["ram_plus"]
        rows.append([name, fnum(r["rho"]), fnum(p["paper"], 4), fnum(p["paper-soft"], 4),
                     fnum(p["official"], 4), local])
    note = ("RAM+ rescale factor λ per preset with its default knobs (paper r=0.1 α=2; paper-soft r=0.1; official "
            "R=1.2; tensor-local r=0.1 α=0.2, ρ per tensor: λ averaged over each agent's unique elements).")
    return Section("RAM+ ρ and λ by preset", cols, rows, note, set(range(1, 6)))


def _pairwise(doc: dict[str, Any]) -> list[Section]:
    names = display_names(doc["agents"])
    if len(names) < 2:
        return []
    pw = doc["pairwise"]
    out = []
    for key, title, fmt in (("cosine", "Cosine similarity of task vectors", lambda v: fnum(v)),
                            ("sign_agreement", "Sign agreement on elements both changed", pct),
                            ("jaccard", "Overlap of changed sets (Jaccard)", pct)):
        rows = [[a, *(fmt(v) for v in pw[key][i])] for i, a in enumerate(names)]
        out.append(Section(title, ["", *names], rows, "", set(range(1, len(names) + 1))))
    return out


def _groups(doc: dict[str, Any], key: str, field_name: str, title: str) -> Section:
    cols = [field_name, "elements", *display_names(doc["agents"])]
    rows = [[str(g[field_name]), fnum(g["elements"]), *(pct(v) for v in g["density"])] for g in doc[key]]
    return Section(title, cols, rows, f"density at |τ| > {doc['epsilon']:g}", set(range(1, len(cols))))


def precision_line(doc: dict[str, Any]) -> str | None:
    p = doc["precision"]
    if p is None:
        return None
    text = (f"Base dtype {p['dtype']}: at the median |θ₀| = {p['median_abs_base']:.3g} the smallest storable change "
            f"is {p['step_at_median']:.3g} = {p['step_over_epsilon']:.3g}× ε; "
            f"{pct(p['share_step_at_most_epsilon'])} of base elements can move by ≤ ε.")
    if p["step_over_epsilon"] and p["step_over_epsilon"] > 1:
        text += f" So in {p['dtype']} nearly every stored change counts as changed: ε filters almost nothing."
    return text


def print_report(doc: dict[str, Any], console: Any) -> None:
    """Render to a rich Console."""
    from rich.markup import escape
    from rich.table import Table

    console.print(f"[bold]Task-vector anatomy[/]: {len(doc['agents'])} agent(s) against base {escape(doc['base'])}")
    for s in sections(doc):  # every text is data, not markup: agent paths, notes
        table = Table(title=escape(s.title), caption=escape(s.note) if s.note else None, caption_justify="left")
        for i, c in enumerate(s.columns):
            table.add_column(escape(c), justify="right" if i in s.right else "left")
        for row in s.rows:
            table.add_row(*(escape(str(cell)) for cell in row))
        console.print(table, soft_wrap=False)  # a table lays itself out; soft wrap would uncentre its title
    line = precision_line(doc)
    if line:
        console.print(line, markup=False)
    for w in doc["warnings"]:
        console.print(f"[yellow]warning:[/] {escape(w)}")
    console.print(f"[bold green]recommendation[/] {escape(doc['recommendation']['summary'])}")
