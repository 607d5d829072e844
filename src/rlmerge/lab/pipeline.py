"""The lab pipeline, top to bottom: base → three GRPO agents → task-vector stats → merges → test scores.

Every stage writes into one folder per seed, and the run ends with results.json, table.md and plot.png
in the output folder. Merges go only through `rlmerge.lab.merging.merge_checkpoints` (the engine).
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from rlmerge.lab.density import PAPER_DENSITY, PAPER_UNIQUE_SHARE, task_vector_stats
from rlmerge.lab.evaluate import score_checkpoint
from rlmerge.lab.grpo import GRPOSettings, train_agent
from rlmerge.lab.merging import (
    METHOD_PLANS,
    EngineUnavailable,
    MergeFailed,
    MethodPlan,
    estimate_fishers,
    merge_checkpoints,
    skip_reason,
)
from rlmerge.lab.model import ModelShape, build_model, save_bf16, warm_up
from rlmerge.lab.report import markdown_table, plot
from rlmerge.lab.tasks import FAMILIES, Example, make_family, make_split
from rlmerge.lab.tokenizer import build_tokenizer


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
}


@dataclass
class SeedResult:
    seed: int
    scores: dict[str, dict[str, float]] = field(default_factory=dict)  # row → family → accuracy
    notes: dict[str, str] = field(default_factory=dict)  # row → chosen hyperparameters / λ
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


def _fisher_inputs(agents: list[Path], work: Path, examples: int, seed: int) -> dict[str, Any]:
    """Each agent's diagonal Fisher on (prompt, gold answer) pairs of its own family's training split."""
    data = []
    for fam in FAMILIES:
        path = work / f"fisher-data-{fam}.jsonl"
        rows = make_split(make_family(fam), "train", examples, seed + 7)
        path.write_text("".join(json.dumps({"prompt": ex.prompt, "completion": ex.target}) + "\n" for ex in rows))
        data.append(path)
    return {"fisher": [str(p) for p in estimate_fishers(agents, data, work, examples)]}


def _merge_and_choose(
    plan: MethodPlan,
    base: Path,
    agents: list[Path],
    work: Path,
    val: dict[str, list[Example]],
    max_grid: int,
    extra: dict[str, Any],
) -> tuple[Path, str]:
    """Merge every grid point, keep the one with the best validation average. Returns (path, note)."""
    best: tuple[float, Path, str] | None = None
    for i, params in enumerate(plan.candidates()[:max_grid]):
        out = work / f"{plan.label.replace(' ', '_').replace('/', '_')}-{i}"
        info = merge_checkpoints(base, agents, out, plan.method, {**params, **extra})
        val_avg = statistics.fmean(score_checkpoint(out, val).values()) if len(plan.candidates()) > 1 else 0.0
        note = ", ".join(f"{k}={v}" for k, v in params.items())
        if "lambdas" in info:
            note += (", " if note else "") + "λ=" + "/".join(f"{x:.3f}" for x in info["lambdas"])
        if best is None or val_avg > best[0]:
            best = (val_avg, out, note)
    assert best is not None  # a plan always has at least one candidate (the empty grid gives one)
    return best[1], best[2]


def run_seed(size: LabSize, out: Path, seed: int, methods: list[MethodPlan]) -> SeedResult:
    res = SeedResult(seed)
    torch.manual_seed(seed)
    base = out / "base"
    t0 = time.time()
    _log(f"seed {seed}: supervised warm-up of the base ({size.warmup_steps} steps)")
    res.training["base"] = build_base(size, base, seed)
    res.timings["base"] = time.time() - t0
    agents: list[Path] = []
    for fam in FAMILIES:
        t = time.time()
        _log(f"seed {seed}: GRPO agent '{fam}' ({size.grpo.steps} steps)")
        res.training[fam] = train_agent(base, fam, out / "agents" / fam, size.grpo, seed=seed)
        shutil.rmtree(out / "agents" / fam / "_trainer", ignore_errors=True)
        res.timings[f"grpo_{fam}"] = time.time() - t
        agents.append(out / "agents" / fam)
    res.task_vectors = task_vector_stats(base, dict(zip(FAMILIES, agents, strict=True)))
    test = _eval_sets(size, "test", size.n_test, seed)
    val = _eval_sets(size, "val", size.n_val, seed)
    t = time.time()
    res.scores["Base"] = score_checkpoint(base, test)
    for fam, path in zip(FAMILIES, agents, strict=True):
        res.scores[f"Specialist: {fam}"] = score_checkpoint(path, test)
    res.timings["score_base_and_specialists"] = time.time() - t
    for fam in FAMILIES:
        # The sanity check on the RL set-up: a specialist must beat the base on its own task.
        if res.scores[f"Specialist: {fam}"][fam] <= res.scores["Base"][fam]:
            res.warnings.append(f"specialist {fam} does not beat the base on {fam}")
            _log(f"seed {seed}: WARNING specialist {fam} does not beat the base on its own task")
    t = time.time()
    for plan in methods:
        reason = skip_reason(plan.method)
        if reason is not None:
            res.skipped[plan.label] = reason
            _log(f"seed {seed}: skip {plan.label}: {reason}")
            continue
        _log(f"seed {seed}: merge {plan.label}")
        try:
            (out / "merges").mkdir(parents=True, exist_ok=True)
            extra = _fisher_inputs(agents, out / "merges", size.n_fisher, seed) if plan.needs_fisher else {}
            chosen, note = _merge_and_choose(plan, base, agents, out / "merges", val, size.max_grid, extra)
        except (EngineUnavailable, MergeFailed) as err:
            # The engine refused these parameters (e.g. an unknown name): report, keep going.
            res.skipped[plan.label] = f"{type(err).__name__}: {err}"
            _log(f"seed {seed}: {plan.label} failed: {err}")
            continue
        res.scores[plan.label] = score_checkpoint(chosen, test)
        res.notes[plan.label] = note
    res.timings["merges"] = time.time() - t
    t = time.time()
    unique_reason = skip_reason("unique")
    for i, fam in enumerate(FAMILIES):
        for divide in (False, True):
            label = f"Unique only: {fam}" + (" / N" if divide else "")
            if unique_reason is not None:
                res.skipped[label] = unique_reason
                continue
            path = out / "merges" / f"unique-{fam}-{'divN' if divide else 'full'}"
            try:
                merge_checkpoints(base, agents, path, "unique", {"agent": i, "divide_by_n": divide})
            except (EngineUnavailable, MergeFailed) as err:
                res.skipped[label] = f"{type(err).__name__}: {err}"
                continue
            res.scores[label] = score_checkpoint(path, test)
    res.timings["unique_region"] = time.time() - t
    return res


def run_lab(
    size_name: str, out: Path, *, seeds: int = 1, first_seed: int = 0, methods: list[MethodPlan] | None = None
) -> dict[str, Any]:
    """Run the whole lab for `seeds` seeds and write results.json, table.md and plot.png into `out`."""
    for var in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_DATASETS_OFFLINE"):
        os.environ.setdefault(var, "1")
    # One thread: the lab's matrices are tiny, and on a shared 2-core machine a second OpenMP thread
    # mostly waits at barriers (measured 6-12 s vs 0.6 s per warm-up step).
    torch.set_num_threads(1)
    size = SIZES[size_name]
    plans = list(methods if methods is not None else METHOD_PLANS)
    out.mkdir(parents=True, exist_ok=True)
    start = time.time()
    results = [run_seed(size, out / f"seed{s}", s, plans) for s in range(first_seed, first_seed + seeds)]
    rows = list(results[0].scores)
    scores = {r: [res.scores[r] for res in results if r in res.scores] for r in rows}
    table = markdown_table(scores, results[0].notes)
    plot(scores, out / "plot.png", f"rlmerge lab ({size_name}): test accuracy, {seeds} seed(s)")
    summary = {
        "size": size_name,
        "config": {
            "shape": asdict(size.shape),
            "grpo": asdict(size.grpo),
            "warmup_steps": size.warmup_steps,
            "n_val": size.n_val,
            "n_test": size.n_test,
        },
        "seeds": [asdict(r) for r in results],
        "paper": {"density_pct": PAPER_DENSITY, "unique_share_pct": PAPER_UNIQUE_SHARE},
        "table": table,
        "total_seconds": time.time() - start,
    }
    (out / "results.json").write_text(json.dumps(summary, indent=2, default=str))
    (out / "table.md").write_text(table + "\n")
    return summary


def with_steps(size: LabSize, grpo_steps: int | None = None, warmup_steps: int | None = None) -> LabSize:
    """A size with overridden step counts (CLI --grpo-steps / --warmup-steps)."""
    grpo = size.grpo if grpo_steps is None else replace(size.grpo, steps=grpo_steps)
    return replace(size, grpo=grpo, warmup_steps=size.warmup_steps if warmup_steps is None else warmup_steps)
