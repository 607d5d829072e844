"""The lab pipeline, top to bottom: base → three GRPO agents → task-vector stats → merges → test scores.

Every stage writes into one folder per seed, and the run ends with results.json, table.md and plot.png
in the output folder. Merges go only through the engine: a row's validation grid is one `rlmerge.sweep`
(`grid.evaluate_candidates`), a fixed merge `rlmerge.lab.merging.merge_checkpoints` (`rlmerge.merge`).
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from rlmerge.engine.cache import StatsCache
from rlmerge.lab.density import PAPER_DENSITY, PAPER_UNIQUE_SHARE, task_vector_stats
from rlmerge.lab.evaluate import score_checkpoint_each
from rlmerge.lab.grid import evaluate_candidates, grid_position, pick
from rlmerge.lab.grpo import GRPOSettings, train_agent
from rlmerge.lab.merging import (
    SMOLLM2_GRIDS,
    TINY_GRIDS,
    EngineUnavailable,
    MergeFailed,
    MethodPlan,
    estimate_fishers,
    merge_checkpoints,
    plan_skip_reason,
    skip_reason,
)
from rlmerge.lab.model import ModelShape, build_model, save_bf16, warm_up
from rlmerge.lab.paired import PAIRS, bootstrap_difference, markdown_pairs, seed_differences
from rlmerge.lab.report import markdown_table, plot
from rlmerge.lab.tasks import FAMILIES, Example, make_family, make_split
from rlmerge.lab.tokenizer import build_tokenizer
from rlmerge.lab.views import Kind
from rlmerge.lab.workdir import claim
from rlmerge.sandbox import ensure_isolation
from rlmerge.scoring import TaskScorer


@dataclass(frozen=True)
class LabSize:
    name: str
    shape: ModelShape
    warmup_steps: int
    warmup_batch: int
    grpo: GRPOSettings
    n_val: int  # per family, for choosing each baseline's hyperparameters
    n_test: int  # per family, held out
    max_grid: int = 99  # cap on grid points per method (smoke keeps one)
    n_fisher: int = 64  # examples per agent for the diagonal Fisher
    kind: Kind = "word"  # word: the tiny lab's own models; chat: SmolLM2 (rlmerge.lab.smollm2)
    methods: tuple[MethodPlan, ...] = TINY_GRIDS
    unique_rows: bool = True  # the paper's unique-region probe (base + one agent's unique elements)


SIZES: dict[str, LabSize] = {
    "smoke": LabSize(
        "smoke",
        ModelShape(hidden=64, layers=2, heads=2, kv_heads=1, intermediate=128),
        400,  # enough for some partial rewards, so GRPO's advantages (and the task vectors) are not all zero
        16,
        GRPOSettings(steps=3, prompts_per_step=4, generations=4, temperature=0.7),
        n_val=4,
        n_test=6,
        max_grid=1,
        n_fisher=4,
    ),
    "tiny": LabSize("tiny", ModelShape(), 700, 32, GRPOSettings(), n_val=48, n_test=128),
    # SmolLM2-135M-Instruct (no warm-up: a pretrained base). A GRPO step of 8 completions of ~200 tokens
    # costs ~1 CPU-minute on one thread; lr from the pilot (docs/lab.md).
    "smollm2": LabSize(
        "smollm2",
        ModelShape(),  # unused: the base is SmolLM2's own architecture
        0,
        0,
        GRPOSettings(steps=12, prompts_per_step=2, generations=4, lr=2e-5, temperature=0.7),
        n_val=8,
        n_test=32,
        n_fisher=16,
        kind="chat",
        methods=SMOLLM2_GRIDS,
        unique_rows=False,
    ),
}


@dataclass
class SeedResult:
    seed: int
    scores: dict[str, dict[str, float]] = field(default_factory=dict)  # row → family → accuracy
    examples: dict[str, dict[str, list[float]]] = field(default_factory=dict)  # row → family → 0/1 per example
    notes: dict[str, str] = field(default_factory=dict)  # row → chosen hyperparameters / λ
    picks: dict[str, dict[str, Any]] = field(default_factory=dict)  # row → chosen point, grid position, all vals
    skipped: dict[str, str] = field(default_factory=dict)  # method label → reason
    timings: dict[str, float] = field(default_factory=dict)
    training: dict[str, dict[str, float]] = field(default_factory=dict)
    task_vectors: dict[str, Any] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)


def _log(msg: str) -> None:
    print(f"[lab {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def _eval_sets(size: LabSize, split: str, n: int, seed: int) -> dict[str, list[Example]]:
    return {f: make_split(make_family(f), split, n, seed) for f in FAMILIES}


def build_base(size: LabSize, out: Path, seed: int) -> dict[str, float]:
    if size.kind == "chat":
        from rlmerge.lab import smollm2

        start = time.time()
        info = smollm2.build_base(out)
        return {**info, "warmup_seconds": 0.0, "convert_seconds": time.time() - start}
    tokenizer = build_tokenizer()
    model = build_model(tokenizer, size.shape, seed)
    start = time.time()
    losses = warm_up(
        model,
        tokenizer,
        steps=size.warmup_steps,
        batch_size=size.warmup_batch,
        seed=seed,
        log_every=max(1, size.warmup_steps // 4),
    )
    save_bf16(model, tokenizer, out)
    return {
        "warmup_seconds": time.time() - start,
        "final_loss": statistics.fmean(losses[-10:]),
        "parameters": float(sum(p.numel() for p in model.parameters())),
    }


def _fisher_inputs(agents: list[Path], work: Path, examples: int, seed: int, kind: Kind = "word") -> dict[str, Any]:
    """Each agent's diagonal Fisher on (prompt, gold answer) pairs of its own family's training split."""
    from rlmerge.lab.tokenizer import load_tokenizer
    from rlmerge.lab.views import task_view

    tokenizer = load_tokenizer(agents[0])
    data = []
    for fam in FAMILIES:
        view = task_view(kind, fam, tokenizer)
        path = work / f"fisher-data-{fam}.jsonl"
        rows = make_split(make_family(fam), "train", examples, seed + 7)
        text = "".join(json.dumps({"prompt": view.prompt(ex), "completion": view.target(ex)}) + "\n" for ex in rows)
        path.write_text(text)
        data.append(path)
    return {"fisher": [str(p) for p in estimate_fishers(agents, data, work, examples)]}


def _note(params: dict[str, Any], info: dict[str, Any]) -> str:
    note = ", ".join(f"{k}={v}" for k, v in params.items())
    if "lambdas" in info:
        note += (", " if note else "") + "λ=" + "/".join(f"{x:.3f}" for x in info["lambdas"])
    return note


def val_scorer(size: LabSize, seed: int) -> TaskScorer:
    """The scorer a row's sweep calls: every family's accuracy (%) on the seed's validation split, in the view of
    the size's models (the examples `_eval_sets(size, "val", size.n_val, seed)` holds)."""
    return TaskScorer([f"lab:{f}" for f in FAMILIES], limit=size.n_val, split="val", seed=seed, kind=size.kind)


def _run_plan(
    plan: MethodPlan,
    size: LabSize,
    base: Path,
    agents: list[Path],
    work: Path,
    seed: int,
    extra: dict[str, Any],
    cache: StatsCache,
) -> tuple[Path, dict[str, Any]]:
    """Search the plan's grid on validation (one sweep); returns the chosen merge and what to report about it."""
    candidates = plan.candidates()[: size.max_grid]
    slug = plan.label.replace(" ", "_").replace("/", "_").replace("(", "").replace(")", "")
    # sweep-<row>: a folder name the grid loop before the sweep (merges/<row>/candidate-i) never used
    results = evaluate_candidates(
        base, agents, plan.method, candidates, work / f"sweep-{slug}", val_scorer(size, seed), extra=extra,
        cache=cache,
    )
    chosen = pick(results)
    assert chosen.path is not None  # the sweep keeps the best merge on disk (best-1)
    return chosen.path, {
        "params": chosen.params,
        "note": _note(chosen.params, chosen.info),
        "position": grid_position({k: v for k, v in plan.grid.items()}, chosen.params),
        "grid_points": len(candidates),
        # accuracy 0..1 as before the sweep (whose lab scores are in %)
        "validation": [{"params": c.params, "val_average": c.val_average / 100.0} for c in results],
    }


def _score(res: SeedResult, row: str, path: Path, test: dict[str, list[Example]], kind: Kind) -> None:
    each = score_checkpoint_each(path, test, kind)
    res.examples[row] = each
    res.scores[row] = {f: sum(v) / len(v) for f, v in each.items()}


DONE = "lab-stage.json"  # written into a base / agent folder when its stage finished: a rerun reuses it


def _reuse(folder: Path) -> dict[str, Any] | None:
    """What a finished stage recorded, when `folder` holds one (a rerun into the same --out resumes)."""
    marker = folder / DONE
    return json.loads(marker.read_text()) if marker.is_file() else None


def _finish(folder: Path, info: dict[str, Any]) -> dict[str, Any]:
    (folder / DONE).write_text(json.dumps(info))
    return info


def train_agents(size: LabSize, base: Path, out: Path, seed: int, res: SeedResult) -> list[Path]:
    agents: list[Path] = []
    for fam in FAMILIES:
        t = time.time()
        done = _reuse(out / fam)
        if done is not None:
            _log(f"seed {seed}: GRPO agent '{fam}' reused from {out / fam}")
            res.training[fam] = done
        else:
            g = size.grpo
            _log(f"seed {seed}: GRPO agent '{fam}' ({g.steps} steps, lr {g.lr}, {g.precision})")
            info = train_agent(base, fam, out / fam, size.grpo, seed=seed, kind=size.kind)
            shutil.rmtree(out / fam / "_trainer", ignore_errors=True)
            res.training[fam] = _finish(out / fam, info)
        res.timings[f"grpo_{fam}"] = time.time() - t
        agents.append(out / fam)
    return agents


def run_merges(
    size: LabSize,
    base: Path,
    agents: list[Path],
    work: Path,
    test: dict[str, list[Example]],
    res: SeedResult,
    methods: Sequence[MethodPlan],
) -> None:
    """Every plan: grid on validation (one sweep, float32 merges), the pick scored on test; skips say why."""
    cache = StatsCache()  # the rows share the statistics of these inputs (in memory, for this seed)
    for plan in methods:
        reason = plan_skip_reason(plan)
        if reason is not None:
            res.skipped[plan.label] = reason
            _log(f"seed {res.seed}: skip {plan.label}: {reason}")
            continue
        _log(f"seed {res.seed}: merge {plan.label} ({min(len(plan.candidates()), size.max_grid)} grid points)")
        try:
            work.mkdir(parents=True, exist_ok=True)
            extra = _fisher_inputs(agents, work, size.n_fisher, res.seed, size.kind) if plan.needs_fisher else {}
            chosen, pick_info = _run_plan(plan, size, base, agents, work, res.seed, extra, cache)
        except (EngineUnavailable, MergeFailed) as err:
            # The engine refused these parameters (e.g. an unknown name): report, keep going.
            res.skipped[plan.label] = f"{type(err).__name__}: {err}"
            _log(f"seed {res.seed}: {plan.label} failed: {err}")
            continue
        _score(res, plan.label, chosen, test, size.kind)
        res.notes[plan.label] = pick_info["note"]
        res.picks[plan.label] = pick_info


def run_seed(size: LabSize, out: Path, seed: int, methods: Sequence[MethodPlan]) -> SeedResult:
    res = SeedResult(seed)
    torch.manual_seed(seed)
    base = out / "base"
    t0 = time.time()
    _log(f"seed {seed}: base ({'SmolLM2 from GGUF' if size.kind == 'chat' else f'{size.warmup_steps} warm-up steps'})")
    res.training["base"] = _reuse(base) or _finish(base, build_base(size, base, seed))
    res.timings["base"] = time.time() - t0
    agents = train_agents(size, base, out / "agents", seed, res)
    res.task_vectors = task_vector_stats(base, dict(zip(FAMILIES, agents, strict=True)))
    from rlmerge.lab.mechanism import density_by_magnitude

    res.task_vectors["density_by_abs_w"] = {
        fam: density_by_magnitude(base, path) for fam, path in zip(FAMILIES, agents, strict=True)
    }
    test = _eval_sets(size, "test", size.n_test, seed)
    t = time.time()
    _score(res, "Base", base, test, size.kind)
    for fam, path in zip(FAMILIES, agents, strict=True):
        _score(res, f"Specialist: {fam}", path, test, size.kind)
    res.timings["score_base_and_specialists"] = time.time() - t
    for fam in FAMILIES:
        # The sanity check on the RL set-up: a specialist must beat the base on its own task.
        if res.scores[f"Specialist: {fam}"][fam] <= res.scores["Base"][fam]:
            res.warnings.append(f"specialist {fam} does not beat the base on {fam}")
            _log(f"seed {seed}: WARNING specialist {fam} does not beat the base on its own task")
    t = time.time()
    run_merges(size, base, agents, out / "merges", test, res, methods)
    res.timings["merges"] = time.time() - t
    t = time.time()
    if size.unique_rows:
        _unique_rows(size, base, agents, out / "merges", test, res)
    res.timings["unique_region"] = time.time() - t
    return res


def _unique_rows(
    size: LabSize, base: Path, agents: list[Path], work: Path, test: dict[str, list[Example]], res: SeedResult
) -> None:
    unique_reason = skip_reason("unique")
    for i, fam in enumerate(FAMILIES):
        for divide in (False, True):
            label = f"Unique only: {fam}" + (" / N" if divide else "")
            if unique_reason is not None:
                res.skipped[label] = unique_reason
                continue
            path = work / f"unique-{fam}-{'divN' if divide else 'full'}"
            try:
                merge_checkpoints(base, agents, path, "unique", {"agent": i, "divide_by_n": divide})
            except (EngineUnavailable, MergeFailed) as err:
                res.skipped[label] = f"{type(err).__name__}: {err}"
                continue
            _score(res, label, path, test, size.kind)


def paired_report(results: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Paired differences between rows: a t-interval over seeds, and per seed a bootstrap over examples."""
    seeds = [r["scores"] for r in results]
    over_seeds = seed_differences(seeds) if len(seeds) > 1 else []
    per_seed: dict[str, list[dict[str, Any]]] = {}
    for r in results:
        rows = []
        for a, b in PAIRS:
            if a in r["examples"] and b in r["examples"]:
                d, lo, hi = bootstrap_difference(r["examples"][a], r["examples"][b], seed=r["seed"])
                rows.append({"pair": f"{a} − {b}", "diffs": [d], "mean": d, "low": lo, "high": hi})
        per_seed[str(r["seed"])] = rows
    text = []
    if over_seeds:
        text.append(markdown_pairs(over_seeds, how=f"Student-t 95 % over {len(seeds)} seeds (t, n − 1 df)"))
    for seed, rows in per_seed.items():
        text.append(
            f"Seed {seed}:\n\n"
            + markdown_pairs(rows, how="paired bootstrap over test examples, 2000 draws, 2.5/97.5 percentiles")
        )
    return {"over_seeds": over_seeds, "bootstrap_per_seed": per_seed, "markdown": "\n\n".join(text)}


def run_lab(
    size_name: str, out: Path, *, seeds: int = 1, first_seed: int = 0, methods: list[MethodPlan] | None = None
) -> dict[str, Any]:
    """Run the whole lab for `seeds` seeds and write results.json, table.md and plot.png into `out`."""
    ensure_isolation()  # the coding agents' rewards and scores run model-written programs: refused before any work
    for var in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_DATASETS_OFFLINE"):
        os.environ.setdefault(var, "1")
    # One thread: the lab's matrices are tiny, and on a shared 2-core machine a second OpenMP thread
    # mostly waits at barriers (measured 6-12 s vs 0.6 s per warm-up step).
    torch.set_num_threads(1)
    size = SIZES[size_name]
    plans = list(methods if methods is not None else size.methods)
    claim(out)
    start = time.time()
    results = [run_seed(size, out / f"seed{s}", s, plans) for s in range(first_seed, first_seed + seeds)]
    rows = list(results[0].scores)
    scores = {r: [res.scores[r] for res in results if r in res.scores] for r in rows}
    table = markdown_table(scores, results[0].notes)
    paired = paired_report([asdict(r) for r in results])
    plot(scores, out / "plot.png", f"rlmerge lab ({size_name}): test accuracy, {seeds} seed(s)")
    summary = {
        "size": size_name,
        "config": {
            "shape": asdict(size.shape),
            "grpo": asdict(size.grpo),
            "warmup_steps": size.warmup_steps,
            "n_val": size.n_val,
            "n_test": size.n_test,
            "kind": size.kind,
            "grids": {p.label: {k: list(v) for k, v in p.grid.items()} for p in plans},
            "merge_dtype": "float32",
        },
        "seeds": [asdict(r) for r in results],
        "paper": {"density_pct": PAPER_DENSITY, "unique_share_pct": PAPER_UNIQUE_SHARE},
        "table": table,
        "paired": paired,
        "total_seconds": time.time() - start,
    }
    (out / "results.json").write_text(json.dumps(summary, indent=2, default=str))
    (out / "table.md").write_text(table + "\n\n" + paired["markdown"] + "\n")
    return summary


def with_steps(size: LabSize, grpo_steps: int | None = None, warmup_steps: int | None = None) -> LabSize:
    """A size with overridden step counts (CLI --grpo-steps / --warmup-steps)."""
    grpo = size.grpo if grpo_steps is None else replace(size.grpo, steps=grpo_steps)
    return replace(size, grpo=grpo, warmup_steps=size.warmup_steps if warmup_steps is None else warmup_steps)
