"""The report document as paper-style figures (PNG). matplotlib is optional: ``pip install 'rlmerge[report]'``.

Figures are built with ``matplotlib.figure.Figure`` directly (no pyplot): no global state, no GUI backend.
"""

from __future__ import annotations

import io
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .._version import __version__
from ..errors import ConfigError
from ..io.partial import owned_folder
from .tables import display_names

if TYPE_CHECKING:
    from matplotlib.figure import Figure

DPI = 150


def _figure(width: float, height: float) -> Figure:
    try:
        from matplotlib.figure import Figure
    except ImportError:
        raise ConfigError("plots need matplotlib", hint="pip install 'rlmerge[report]'") from None
    return Figure(figsize=(width, height), layout="constrained")


def _colors(n: int) -> list[Any]:
    from matplotlib import colormaps

    cmap = colormaps["viridis"]
    return [cmap(0.15 + 0.7 * i / max(n - 1, 1)) for i in range(n)]


def density_figure(doc: dict[str, Any]) -> Figure:
    """Grouped bars: per agent, the share of elements with |τ| above each threshold."""
    agents = display_names(doc["agents"])
    rows = doc["per_agent"]
    if doc["extras"]:
        labels = [f"|τ| > {t:g}" + (" (ε)" if t == doc["epsilon"] else "") for t in doc["thresholds"]]
        values = [[100 * (r["density_at"][j] or 0.0) for r in rows] for j in range(len(labels))]
    else:
        labels, values = [f"|τ| > {doc['epsilon']:g} (ε)"], [[100 * (r["density"] or 0.0) for r in rows]]
    fig = _figure(max(5.0, 1.3 * len(agents) * max(1, len(labels)) / 2 + 2), 3.8)
    ax = fig.add_subplot()
    width = 0.8 / len(labels)
    for j, (label, vals, color) in enumerate(zip(labels, values, _colors(len(labels)))):
        xs = [i - 0.4 + width * (j + 0.5) for i in range(len(agents))]
        bars = ax.bar(xs, vals, width, label=label, color=color, edgecolor="black", linewidth=0.4)
        if doc["thresholds"][j] == doc["epsilon"] or not doc["extras"]:
            ax.bar_label(bars, fmt="%.1f", fontsize=7, padding=1)
    ax.set_xticks(range(len(agents)), agents)
    ax.set_xlabel("agent")
    ax.set_ylabel("elements changed (%)")
    ax.set_ylim(0, max(max(v) for v in values) * 1.15 + 1)
    ax.set_title("Task-vector density per agent")
    ax.legend(title="threshold", fontsize=8, title_fontsize=8)
    ax.grid(axis="y", alpha=0.3)
    return fig


def kofn_figure(doc: dict[str, Any]) -> Figure:
    """Stacked bars: each agent's changed elements split by how many agents changed them (paper Fig. 2)."""
    agents, rows = display_names(doc["agents"]), doc["per_agent"]
    n = len(agents)
    fig = _figure(max(5.0, 1.2 * n + 3), 3.8)
    ax = fig.add_subplot()
    bottom = [0.0] * n
    for k, color in zip(range(1, n + 1), _colors(n)):
        vals = [100 * (r["kofn_share"][k - 1] or 0.0) for r in rows]
        ax.bar(range(n), vals, 0.6, bottom=bottom, color=color, edgecolor="black", linewidth=0.4,
               label="k = 1 (unique)" if k == 1 else f"k = {k}")
        bottom = [b + v for b, v in zip(bottom, vals)]
    ax.set_xticks(range(n), agents)
    ax.set_xlabel("agent")
    ax.set_ylabel("share of the agent's changed elements (%)")
    ax.set_ylim(0, 100)
    ax.set_title("Overlap: how many agents (k of N) changed each element")
    ax.legend(title="changed by", fontsize=8, title_fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1))
    return fig


def heatmap_figure(doc: dict[str, Any], key: str = "layers") -> Figure:
    """Group × agent density heatmap; ``key`` is "layers" or "modules"."""
    field = "layer" if key == "layers" else "module"
    groups = doc[key]
    agents = display_names(doc["agents"])
    data = [[100 * (d or 0.0) for d in g["density"]] for g in groups]
    fig = _figure(max(4.5, 1.1 * len(agents) + 2.5), max(3.0, 0.22 * len(groups) + 1.5))
    ax = fig.add_subplot()
    im = ax.imshow(data, aspect="auto", cmap="magma", vmin=0, vmax=max(max(r) for r in data) if data else 1)
    ax.set_xticks(range(len(agents)), agents)
    ax.set_yticks(range(len(groups)), [str(g[field]) for g in groups], fontsize=7 if len(groups) > 16 else 9)
    ax.set_xlabel("agent")
    ax.set_ylabel(field)
    if len(groups) * len(agents) <= 120:
        for i, row in enumerate(data):
            for j, v in enumerate(row):
                ax.text(j, i, f"{v:.1f}", ha="center", va="center", fontsize=7,
                        color="white" if v < 0.6 * (im.norm.vmax or 1) else "black")
    fig.colorbar(im, ax=ax, label=f"elements changed (%), |τ| > {doc['epsilon']:g}")
    ax.set_title(f"Density per {field} and agent")
    return fig


def pairwise_figure(doc: dict[str, Any]) -> Figure:
    """Two matrices side by side: cosine similarity of task vectors, sign agreement on shared elements."""
    agents = display_names(doc["agents"])
    n = len(agents)
    fig = _figure(max(7.0, 2.2 * n + 3), max(3.2, 0.7 * n + 2))
    panels = (("cosine", "Cosine similarity of task vectors", "coolwarm", -1.0, 1.0),
              ("sign_agreement", "Sign agreement on shared elements", "viridis", 0.0, 1.0))
    for idx, (key, title, cmap, lo, hi) in enumerate(panels, start=1):
        ax = fig.add_subplot(1, 2, idx)
        data = [[float("nan") if v is None else v for v in row] for row in doc["pairwise"][key]]
        im = ax.imshow(data, cmap=cmap, vmin=lo, vmax=hi)
        for i in range(n):
            for j in range(n):
                v = data[i][j]
                ax.text(j, i, "–" if v != v else f"{v:.2f}", ha="center", va="center", fontsize=8,
                        color="black" if key == "cosine" or v > 0.5 else "white")
        ax.set_xticks(range(n), agents, rotation=30, ha="right")
        ax.set_yticks(range(n), agents)
        ax.set_xlabel("agent")
        ax.set_ylabel("agent")
        ax.set_title(title, fontsize=10)
        fig.colorbar(im, ax=ax, shrink=0.8, label="cosine" if key == "cosine" else "share of shared elements")
    fig.suptitle("Pairwise similarity of task vectors")
    return fig


def figures(doc: dict[str, Any]) -> dict[str, Figure]:
    """File stem → figure, for every plot the document supports."""
    out = {"density": density_figure(doc), "kofn": kofn_figure(doc)}
    if doc["layers"]:
        out["layers"] = heatmap_figure(doc, "layers")
    if doc["modules"]:
        out["modules"] = heatmap_figure(doc, "modules")
    if len(doc["agents"]) > 1:
        out["pairwise"] = pairwise_figure(doc)
    return out


def save_plots(doc: dict[str, Any], folder: str | Path, *, force: bool = False,
               inputs: Sequence[Any] = ()) -> list[Path]:
    """Write one PNG per figure into the new folder ``folder`` (written whole, with its list of files in
    ``rlmerge.json``; ``force`` replaces a plots folder rlmerge wrote); returns the paths."""
    names = []
    with owned_folder(folder, {"rlmerge_version": __version__, "kind": "plots"}, force=force, inputs=inputs,
                      option="--plots") as partial:
        for stem, fig in figures(doc).items():
            buf = io.BytesIO()
            fig.savefig(buf, format="png", dpi=DPI)
            partial.write_bytes(f"{stem}.png", buf.getvalue())
            names.append(f"{stem}.png")
    return [partial.output / n for n in names]
