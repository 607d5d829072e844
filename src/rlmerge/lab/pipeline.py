"""The lab pipeline, top to bottom: base → three GRPO agents → task-vector stats → merges → test scores.

Every stage writes into one folder per seed, and the run ends with results.json, table.md and plot.png
in the output folder (rewritten after each seed, so a long run shows its finished seeds). Merges go only
through the engine: a row's validation grid is one `rlmerge.sweep` (`grid.evaluate_candidates`), a fixed
merge `rlmerge.lab.merging.merge_checkpoints` (`rlmerge.merge`).

Resuming: the base and each agent are finished when their folder holds `lab-stage.json` (an agent trained
with other settings than the size's is trained again); the task-vector statistics, each model's test scores
and each merge row are saved under `seedN/stages/` as they finish (`stages.py`), so a rerun into the same
--out skips every finished stage, and each stage records its wall and CPU time.
"""

from __future__ import annotations

import itertools
import json
import os
import shutil
import statistics
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from rlmerge.errors import InputError
from rlmerge.lab.density import PAPER_DENSITY, PAPER_UNIQUE_SHARE, task_vector_stats
from rlmerge.lab.evaluate import score_checkpoint_each
from rlmerge.lab.grid import evaluate_candidates, grid_position, pick
from rlmerge.lab.grpo import train_agent
from rlmerge.lab.jobs import GB, MemoryBook, Workers, each, workers_for
from rlmerge.lab.merging import (
    EngineUnavailable,
    MergeFailed,
    MethodPlan,
    estimate_fishers,
    merge_checkpoints,
    plan_skip_reason,
    skip_reason,
)
from rlmerge.lab.model import build_model, save_bf16, warm_up
from rlmerge.lab.paired import paired_report, sign_test
from rlmerge.lab.report import markdown_table, plot
from rlmerge.lab.sizes import SIZES, LabSize, with_steps
from rlmerge.lab.stages import Clock, examples_digest, fingerprint, run_stage, write_json
from rlmerge.lab.tasks import FAMILIES, Example, held_out_split, make_family, make_split
from rlmerge.lab.tokenizer import build_tokenizer
from rlmerge.lab.views import Kind
from rlmerge.lab.workdir import claim
from rlmerge.sandbox import ensure_isolation
from rlmerge.scoring import TaskScorer
from rlmerge.sweeping.cache import StatsCache

__all__ = ["SIZES", "LabSize", "SeedResult", "run_lab", "run_pilot", "run_seed", "with_steps"]


@dataclass
class SeedResult:
    seed: int
    scores: dict[str, dict[str, float]] = field(default_factory=dict)  # row → family → accuracy
    examples: dict[str, dict[str, list[float]]] = field(default_factory=dict)  # row → family → 0/1 per example
    notes: dict[str, str] = field(default_factory=dict)  # row → chosen hyperparameters / λ
    picks: dict[str, dict[str, Any]] = field(default_factory=dict)  # row → chosen point, grid position, all vals
    skipped: dict[str, str] = field(default_factory=dict)  # method label → reason
    timings: dict[str, float] = field(default_factory=dict)
    stages: dict[str, dict[str, Any]] = field(default_factory=dict)  # stage → wall_s, cpu_s, reused
    training: dict[str, dict[str, float]] = field(default_factory=dict)
    task_vectors: dict[str, Any] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)


def _log(msg: str) -> None:
    print(f"[lab {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def _ran(record: dict[str, Any]) -> bool:
    """Whether a stage computed its result (its memory peak says what it takes), not read it back: an agent
    trained (a reused one's gate is small beside its training), a score or a row not reused."""
    return not record.get("reused", False)


def _eval_sets(size: LabSize, split: str, n: int, seed: int) -> dict[str, list[Example]]:
    return {f: held_out_split(f, split, n, seed, size.disjoint_from_test) for f in FAMILIES}


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
    return TaskScorer([f"lab:{f}" for f in FAMILIES], limit=size.n_val, split="val", seed=seed, kind=size.kind,
                      disjoint_from_test=size.disjoint_from_test)


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
    # sweep-<row>: a folder name the grid loop before the sweep (merges/<row>/candidate-i) never used
    results = evaluate_candidates(
        base, agents, plan.method, candidates, work / f"sweep-{_slug(plan.label)}", val_scorer(size, seed), extra=extra,
        cache=cache,
    )
    chosen = pick(results)
    assert chosen.path is not None  # the sweep keeps the best merge on disk (best-1)
    return chosen.path, {
        "params": chosen.params,
        "note": _note(chosen.params, chosen.info),
        "position": grid_position({k: v for k, v in plan.grid.items()}, chosen.params),
        "grid_points": len(candidates),
        # accuracy 0..1 as before the sweep (whose lab scores are in %); None: a grid of one point is not scored
        "validation": [{"params": c.params, "val_average": c.val_average / 100.0 if c.val else None} for c in results],
    }


def _score(res: SeedResult, row: str, path: Path, test: dict[str, list[Example]], kind: Kind) -> None:
    each = score_checkpoint_each(path, test, kind)
    res.examples[row] = each
    res.scores[row] = {f: sum(v) / len(v) for f, v in each.items()}


def _slug(label: str) -> str:
    return label.replace(" ", "_").replace("/", "_").replace("(", "").replace(")", "").replace(":", "")


def _timed(res: SeedResult, stage: str, record: dict[str, Any]) -> None:
    """Keep a stage's wall and CPU seconds (those recorded when it ran, also when this run reused it)."""
    res.stages[stage] = {k: record[k] for k in ("wall_s", "cpu_s", "reused") if k in record}


DONE = "lab-stage.json"  # written into a base / agent folder when its stage finished: a rerun reuses it


def _reuse(folder: Path) -> dict[str, Any] | None:
    """What a finished stage recorded, when `folder` holds one (a rerun into the same --out resumes)."""
    marker = folder / DONE
    return json.loads(marker.read_text()) if marker.is_file() else None


def _finish(folder: Path, info: dict[str, Any]) -> dict[str, Any]:
    write_json(folder / DONE, info)
    return info


def _agent_settings(size: LabSize, fam: str) -> dict[str, Any]:
    """What an agent's marker must say for a rerun to reuse it: its GRPO settings and split rule."""
    return {"settings": asdict(size.grpo_for(fam)), "disjoint_from_test": size.disjoint_from_test}


def _stale(done: dict[str, Any], wanted: dict[str, Any]) -> bool:
    # Markers written before the settings were recorded (older runs) are reused as they are.
    return "settings" in done and any(done.get(k) != v for k, v in wanted.items())


def _gate(size: LabSize, base: Path, agent: Path, fam: str, seed: int) -> dict[str, Any]:
    """Base and agent scored on the agent's own family's validation split (a saved stage beside the agent,
    keyed by both checkpoints): `passed` when the agent's accuracy is above the base's and, with
    `size.gate_alpha`, the sign test over the examples they score differently (``better``: the agent right and
    the base wrong; ``worse``: the reverse) gives p below it."""
    sets = {fam: held_out_split(fam, "val", size.n_val, seed, size.disjoint_from_test)}

    def score() -> dict[str, Any]:
        base_each, agent_each = (score_checkpoint_each(p, sets, size.kind)[fam] for p in (base, agent))
        pairs = list(zip(base_each, agent_each, strict=True))
        return {"base": sum(base_each) / len(base_each), "agent": sum(agent_each) / len(agent_each),
                "n": len(agent_each), "better": sum(a > b for b, a in pairs), "worse": sum(a < b for b, a in pairs)}

    key = {"base": fingerprint([base], DONE), "agent": fingerprint([agent], DONE), "kind": size.kind,
           "examples": examples_digest(sets), "counts": "better/worse"}
    record = run_stage(agent.parent / f"{fam}.gate.json", key, score, _log)
    result = record["result"]
    p = sign_test(result["better"], result["worse"])
    passed = result["agent"] > result["base"] and (size.gate_alpha is None or p < size.gate_alpha)
    return {**result, "p": p, "alpha": size.gate_alpha, "passed": passed,
            **{k: record[k] for k in ("wall_s", "cpu_s", "reused")}}


def _failed_attempts(path: Path, wanted: dict[str, Any]) -> list[dict[str, Any]]:
    """The runs of an agent that did not pass the gate so far, when they were trained with `wanted` settings."""
    if not path.is_file():
        return []
    record = json.loads(path.read_text())
    return record["failed"] if record.get("settings") == json.loads(json.dumps(wanted)) else []


def _agent_family(size: LabSize, base: Path, out: Path, seed: int, fam: str) -> dict[str, Any]:
    """One family's agent for ``train_agents`` (a process of its own with --jobs > 1): reused when its folder holds a
    finished marker with the size's settings, else trained, and gated. Returns its marker (``done``), the runs not
    kept, whether it was reused, the kept run's gate, warnings and the wall seconds."""
    t = time.time()
    wanted = _agent_settings(size, fam)
    done = _reuse(out / fam)
    if done is not None and _stale(done, wanted):
        _log(f"seed {seed}: agent '{fam}' in {out / fam} was trained with other settings; training it again")
        done = None
    history = out / f"{fam}.attempts.json"
    failed = _failed_attempts(history, wanted)
    reused = done is not None
    gate: dict[str, Any] | None = None
    warnings: list[str] = []
    again: dict[str, Any] | None = None  # the best failed run, trained again to be kept (every run failed)
    while True:
        if done is None and (out / fam).exists():
            # an interrupted, outdated or failed training: inside the lab's own --out (workdir.claim)
            shutil.rmtree(out / fam)
        if done is not None:
            _log(f"seed {seed}: GRPO agent '{fam}' reused from {out / fam}")
        else:
            g = size.grpo_for(fam)
            # the first training seed no recorded run used: the next run, or the best run trained again to be kept
            # (also when a resume finds that training interrupted: the records then lack only the best run)
            attempt = next(k for k in itertools.count() if k not in {f["attempt"] for f in failed})
            retrain = bool(failed) and attempt < max(f["attempt"] for f in failed)
            which = (f", run {attempt + 1} again: the best of {size.agent_attempts} on validation" if retrain else
                     f", attempt {len(failed) + 1} of {size.agent_attempts}" if failed else "")
            _log(f"seed {seed}: GRPO agent '{fam}' ({g.steps} steps, lr {g.lr}, {g.precision}, {g.reward} "
                 f"reward{which})")
            clock = Clock()
            info = train_agent(base, fam, out / fam, g, seed=seed, kind=size.kind,
                               disjoint_from_test=size.disjoint_from_test, attempt=attempt)
            shutil.rmtree(out / fam / "_trainer", ignore_errors=True)
            done = _finish(out / fam, {**info, **wanted, "attempt": attempt, **clock.elapsed()})
        if size.agent_attempts <= 1:
            break
        gate = _gate(size, base, out / fam, fam, seed)  # the kept run's; a failed run's are in its record
        done = {**done, "gate": gate}
        if gate["passed"]:
            break
        this = {"attempt": done.get("attempt", len(failed)),
                **{k: done.get(k) for k in ("gate", "rewards", "density_by_step", "wall_s", "cpu_s")}}
        if len(failed) + 1 >= size.agent_attempts:
            # the best run trained again is kept as it scores (another pick could train again without end)
            best = this if again is not None else _best_run([this, *failed])
            if best is this:
                if again is not None and _verdict(gate) != _verdict(again["gate"]):
                    _log(f"seed {seed}: NOTE agent '{fam}' run {again['attempt'] + 1} trained again scores "
                         f"{_verdict(gate)}, where its first training scored {_verdict(again['gate'])}")
                warnings.append(f"specialist {fam}: every one of {size.agent_attempts} runs failed the gate; run "
                                f"{this['attempt'] + 1}, the best on validation, is kept")
                _log(f"seed {seed}: WARNING agent '{fam}' {_verdict(gate)}: run {this['attempt'] + 1}, the best of "
                     f"{size.agent_attempts} on validation, kept")
                break
            # an earlier run was better: it is trained again (the same seed gives the same weights here) and kept
            _log(f"seed {seed}: agent '{fam}' {_verdict(gate)}: every run failed the gate; run "
                 f"{best['attempt'] + 1} was the best on validation ({_verdict(best['gate'])})")
            failed = [f for f in failed if f is not best] + [this]
            write_json(history, {"settings": wanted, "failed": failed})
            again, done, reused = best, None, False
            continue
        _log(f"seed {seed}: agent '{fam}' {_verdict(gate)}: training it again with another seed")
        failed.append(this)
        write_json(history, {"settings": wanted, "failed": failed})
        done, reused = None, False
    return {"done": done, "failed": failed, "reused": reused, "gate": gate, "warnings": warnings,
            "seconds": time.time() - t}


def _verdict(gate: dict[str, Any]) -> str:
    needs = "" if gate.get("alpha") is None else f", needs < {gate['alpha']}"
    return (f"{100 * gate['agent']:.1f} % against the base's {100 * gate['base']:.1f} % on {gate['n']} validation "
            f"examples ({gate['better']} better, {gate['worse']} worse: sign test p {gate['p']:.3g}{needs})")


def _best_run(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The run to keep when none passed the gate: the highest validation accuracy (the base and examples are the
    same for every run, so also the most better-than-worse examples), then the smaller sign-test p; on a tie the
    first of ``runs`` (the run just gated comes first: nothing is trained again for an equal score)."""
    return max(runs, key=lambda r: (r["gate"]["agent"], -r["gate"]["p"]))


def train_agents(size: LabSize, base: Path, out: Path, seed: int, res: SeedResult,
                 workers: Workers | None = None) -> list[Path]:
    """Each family's agent (``_agent_family``; side by side in ``workers``' processes when given). With
    `size.agent_attempts` > 1 an agent must beat the base on its family's validation split (the gate, test
    examples untouched); one that does not is deleted and trained again with the next training seed
    (`train_agent(attempt=k)`), at most that many runs; when every one fails, the best on validation is kept with
    a warning (trained again from its seed when it was not the last). The runs not kept (their gate scores,
    rewards, times) are in `<fam>.attempts.json` beside the folder, so a resumed run goes on from the next
    attempt, and reported in `res.training[fam]["failed_attempts"]`."""
    for fam, r in zip(FAMILIES, each(workers, _agent_family, [(size, base, out, seed, fam) for fam in FAMILIES],
                                         [f"agent {fam}" for fam in FAMILIES], _ran)):
        if r["gate"] is not None:
            _timed(res, f"gate {fam}", r["gate"])
        res.warnings += r["warnings"]
        done, failed = r["done"], r["failed"]
        res.training[fam] = {**done, "failed_attempts": failed}
        res.timings[f"grpo_{fam}"] = r["seconds"]
        _timed(res, f"agent {fam}", {"reused": r["reused"], **done})
        if failed:
            res.stages[f"agent {fam} failed runs"] = {"wall_s": sum(f["wall_s"] or 0.0 for f in failed),
                                                      "cpu_s": sum(f["cpu_s"] or 0.0 for f in failed),
                                                      "reused": r["reused"]}
    return [out / fam for fam in FAMILIES]


def _merge_row(
    plan: MethodPlan,
    size: LabSize,
    base: Path,
    agents: list[Path],
    work: Path,
    test: dict[str, list[Example]],
    seed: int,
    cache: StatsCache,
) -> dict[str, Any]:
    """One row: its grid searched on validation, the pick scored on test; what the report needs, as JSON."""
    work.mkdir(parents=True, exist_ok=True)
    extra = _fisher_inputs(agents, work, size.n_fisher, seed, size.kind) if plan.needs_fisher else {}
    chosen, pick_info = _run_plan(plan, size, base, agents, work, seed, extra, cache)
    examples = score_checkpoint_each(chosen, test, size.kind)
    if not size.keep_merges:
        shutil.rmtree(work / f"sweep-{_slug(plan.label)}", ignore_errors=True)  # the sweep's own folder
    return {"examples": examples, "note": pick_info["note"], "pick": pick_info}


def _row_stage(path: Path | None, key: dict[str, Any], plan: MethodPlan, size: LabSize, base: Path, agents: list[Path],
               work: Path, test: dict[str, list[Example]], seed: int, cache: StatsCache | None = None
               ) -> dict[str, Any]:
    """One merge row, saved as a stage at ``path`` (None: not saved), or {"failed": why} when the engine refused
    its parameters. ``cache``: the statistics shared with the seed's other rows in this process (a worker process
    of --jobs counts its own)."""
    def row() -> dict[str, Any]:
        return _merge_row(plan, size, base, agents, work, test, seed, StatsCache() if cache is None else cache)

    try:
        return {"result": row()} if path is None else run_stage(path, key, row, _log)
    except (EngineUnavailable, MergeFailed) as err:  # e.g. an unknown name: reported, the other rows go on
        return {"failed": f"{type(err).__name__}: {err}"}


def run_merges(
    size: LabSize,
    base: Path,
    agents: list[Path],
    work: Path,
    test: dict[str, list[Example]],
    res: SeedResult,
    methods: Sequence[MethodPlan],
    stages: Path | None = None,
    workers: Workers | None = None,
) -> None:
    """Every plan: grid on validation (one sweep, float32 merges), the pick scored on test; skips say why.

    With `stages`, each finished row is saved there and a rerun with the same inputs and grid reuses it. With
    ``workers``, rows run side by side in its processes.
    """
    # one process's rows share the statistics of these inputs (a worker's process runs one row)
    cache = None if workers is not None and workers.pool is not None else StatsCache()
    inputs = fingerprint([base, *agents], DONE) if stages is not None else ""
    # the examples a row is chosen on (the sweep's validation split) and scored on (test)
    examples = examples_digest({**{f"val:{f}": v for f, v in _eval_sets(size, "val", size.n_val, res.seed).items()},
                                **{f"test:{f}": v for f, v in test.items()}}) if stages is not None else ""
    plans, items = [], []
    for plan in methods:
        reason = plan_skip_reason(plan)
        if reason is not None:
            res.skipped[plan.label] = reason
            _log(f"seed {res.seed}: skip {plan.label}: {reason}")
            continue
        candidates = plan.candidates()[: size.max_grid]
        _log(f"seed {res.seed}: merge {plan.label} ({len(candidates)} grid points)")
        key = {"method": plan.method, "grid": candidates, "n_val": size.n_val, "n_test": size.n_test,
               "kind": size.kind, "disjoint_from_test": size.disjoint_from_test, "inputs": inputs,
               "examples": examples}
        path = stages / f"row-{_slug(plan.label)}.json" if stages is not None else None
        plans.append(plan)
        items.append((path, key, plan, size, base, agents, work, test, res.seed, cache))
    for plan, record in zip(plans, each(workers, _row_stage, items, [f"row {p.label}" for p in plans], _ran)):
        if "failed" in record:
            res.skipped[plan.label] = record["failed"]
            _log(f"seed {res.seed}: {plan.label} failed: {record['failed']}")
            continue
        if stages is not None:
            _timed(res, f"row {plan.label}", record)
        out = record["result"]
        res.examples[plan.label] = out["examples"]
        res.scores[plan.label] = {f: sum(v) / len(v) for f, v in out["examples"].items()}
        res.notes[plan.label] = out["note"]
        res.picks[plan.label] = out["pick"]


def _task_vectors(base: Path, agents: list[Path]) -> dict[str, Any]:
    from rlmerge.lab.mechanism import density_by_magnitude

    stats = task_vector_stats(base, dict(zip(FAMILIES, agents, strict=True)))
    stats["density_by_abs_w"] = {fam: density_by_magnitude(base, path) for fam, path in zip(FAMILIES, agents)}
    return stats


def _score_stage(path: Path, key: dict[str, Any], checkpoint: Path, sets: dict[str, list[Example]], kind: Kind
                 ) -> dict[str, Any]:
    return run_stage(path, key, lambda: score_checkpoint_each(checkpoint, sets, kind), _log)


def _score_models(
    res: SeedResult, models: Sequence[tuple[str, Path]], sets: dict[str, list[Example]], size: LabSize, stages: Path,
    split: str = "test", workers: Workers | None = None,
) -> None:
    """Each model's 0/1 scores on `sets`, one saved stage per model (keyed by its checkpoint and the split); side
    by side in ``workers``' processes when given."""
    n = len(next(iter(sets.values())))
    items = [(stages / f"{split}-{_slug(row)}.json",
              {"split": split, "n": n, "kind": size.kind, "disjoint_from_test": size.disjoint_from_test,
               "checkpoint": fingerprint([path], DONE), "examples": examples_digest(sets)}, path, sets, size.kind)
             for row, path in models]
    names = [f"scores {row}" for row, _ in models]
    for (row, _), record in zip(models, each(workers, _score_stage, items, names, _ran)):
        _timed(res, f"{split} scores {row}", record)
        if split == "test":
            res.examples[row] = record["result"]
            res.scores[row] = {f: sum(v) / len(v) for f, v in record["result"].items()}


def prepare_seed(size: LabSize, out: Path, seed: int, res: SeedResult, workers: Workers | None = None
                 ) -> tuple[Path, list[Path]]:
    """Base, agents and their task-vector statistics (each a saved stage); returns (base, agents)."""
    torch.manual_seed(seed)
    base = out / "base"
    t0 = time.time()
    _log(f"seed {seed}: base ({'SmolLM2 from GGUF' if size.kind == 'chat' else f'{size.warmup_steps} warm-up steps'})")
    done = _reuse(base)
    if done is None:
        clock = Clock()
        done = _finish(base, {**build_base(size, base, seed), **clock.elapsed()})
        _timed(res, "base", {**done, "reused": False})
    else:
        _timed(res, "base", {**done, "reused": True})
    res.training["base"] = done
    res.timings["base"] = time.time() - t0
    agents = train_agents(size, base, out / "agents", seed, res, workers)
    record = run_stage(out / "stages" / "task_vectors.json", {"inputs": fingerprint([base, *agents], DONE)},
                       lambda: _task_vectors(base, agents), _log)
    _timed(res, "task vectors", record)
    res.task_vectors = record["result"]
    return base, agents


def run_seed(size: LabSize, out: Path, seed: int, methods: Sequence[MethodPlan], jobs: int = 1,
             book: MemoryBook | None = None) -> SeedResult:
    """One seed's whole pipeline; with ``jobs`` > 1 its independent stages (the agents, the models' test scores,
    the merge rows) run side by side in that many processes, as many as ``book``'s memory budget admits."""
    with workers_for(jobs, book, fresh=size.fresh_process_per_stage, log=_log) as workers:
        return _run_seed(size, out, seed, methods, workers)


def _run_seed(size: LabSize, out: Path, seed: int, methods: Sequence[MethodPlan], workers: Workers
              ) -> SeedResult:
    res = SeedResult(seed)
    base, agents = prepare_seed(size, out, seed, res, workers)
    stages = out / "stages"
    test = _eval_sets(size, "test", size.n_test, seed)
    t = time.time()
    models = [("Base", base), *((f"Specialist: {f}", p) for f, p in zip(FAMILIES, agents, strict=True))]
    _score_models(res, models, test, size, stages, workers=workers)
    res.timings["score_base_and_specialists"] = time.time() - t
    for fam in FAMILIES:
        # The sanity check on the RL set-up: a specialist must beat the base on its own task.
        if res.scores[f"Specialist: {fam}"][fam] <= res.scores["Base"][fam]:
            res.warnings.append(f"specialist {fam} does not beat the base on {fam}")
            _log(f"seed {seed}: WARNING specialist {fam} does not beat the base on its own task")
    t = time.time()
    run_merges(size, base, agents, out / "merges", test, res, methods, stages, workers)
    res.timings["merges"] = time.time() - t
    t = time.time()
    if size.unique_rows:
        _unique_rows(size, base, agents, out / "merges", test, res)
    res.timings["unique_region"] = time.time() - t
    return res


def run_pilot(size: LabSize, out: Path, seed: int, n_val: int) -> dict[str, Any]:
    """The agents of one seed and what to check before a full run: per agent its settings, density trace,
    density, unique share, ρ and λ, and base and specialists scored on `n_val` validation examples per task."""
    ensure_isolation()  # the coding agent's rewards and scores run model-written programs
    res = SeedResult(seed)
    base, agents = prepare_seed(size, out, seed, res)
    val = _eval_sets(size, "val", n_val, seed)
    models = [("Base", base), *((f"Specialist: {f}", p) for f, p in zip(FAMILIES, agents, strict=True))]
    _score_models(res, models, val, size, out / "stages", split="val")
    val_scores = {row: json.loads((out / "stages" / f"val-{_slug(row)}.json").read_text())["result"]
                  for row, _ in models}
    return {"seed": seed, "n_val": n_val, "training": res.training, "task_vectors": res.task_vectors,
            "val_examples": val_scores, "stages": res.stages}


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


def _summary(
    size: LabSize, plans: Sequence[MethodPlan], results: Sequence[SeedResult], seconds: float
) -> dict[str, Any]:
    rows = list(results[0].scores)
    scores = {r: [res.scores[r] for res in results if r in res.scores] for r in rows}
    table = markdown_table(scores, results[0].notes)
    return {
        "size": size.name,
        "config": {
            "shape": asdict(size.shape),
            "grpo": asdict(size.grpo),
            "agent_grpo": {f: asdict(size.grpo_for(f)) for f in FAMILIES},
            "warmup_steps": size.warmup_steps,
            "n_val": size.n_val,
            "n_test": size.n_test,
            "disjoint_from_test": size.disjoint_from_test,
            "kind": size.kind,
            "grids": {p.label: {k: list(v) for k, v in p.grid.items()} for p in plans},
            "merge_dtype": "float32",
        },
        "seeds": [asdict(r) for r in results],
        "paper": {"density_pct": PAPER_DENSITY, "unique_share_pct": PAPER_UNIQUE_SHARE},
        "table": table,
        "paired": paired_report([asdict(r) for r in results]),
        "total_seconds": seconds,
    }


def restore_stages(saved: Path, out: Path, seeds: range) -> list[Path]:
    """Copy the stage records a run saved elsewhere (``collect.sh``: ``seedN/stages/*.json`` and the agents' gate
    and attempt records, ``seedN/agents/*.json``) into this run's ``out`` where it has none of its own; returns
    what was copied. A record is used only if its key matches: the checkpoints' files are fingerprinted, and the
    lab's training is deterministic, so after the base and agents are trained again to the same bytes every saved
    stage is reused, on any machine; one that does not match is recomputed. The stages' measured memory peaks
    (``memory.json``, for --jobs) come along where ``out`` has none."""
    copied = []
    if (saved / "memory.json").is_file() and not (out / "memory.json").exists():
        shutil.copyfile(saved / "memory.json", out / "memory.json")
        copied.append(out / "memory.json")
    for s in seeds:
        for sub in ("stages", "agents"):
            src = saved / f"seed{s}" / sub
            for record in sorted(src.glob("*.json")) if src.is_dir() else []:
                dst = out / f"seed{s}" / sub / record.name
                if not dst.exists():
                    dst.parent.mkdir(parents=True, exist_ok=True)
                    shutil.copyfile(record, dst)
                    copied.append(dst)
    return copied


def run_lab(
    size_name: str, out: Path, *, seeds: int = 1, first_seed: int = 0, methods: list[MethodPlan] | None = None,
    jobs: int = 1, stages_from: Path | None = None, memory_gb: float | None = None,
) -> dict[str, Any]:
    """Run the whole lab for `seeds` seeds and write results.json, table.md and plot.png into `out`, after each
    seed (with the seeds finished so far), so that a long run's finished seeds can be read while it goes on.
    ``jobs`` > 1: a seed's independent stages run side by side in that many processes (``run_seed``), while their
    memory fits ``memory_gb`` (default: 90 % of what the system has available as each batch starts); each stage's
    peak is recorded in ``out/memory.json`` (``rlmerge.lab.jobs``), so later seeds plan with measured peaks.
    ``stages_from``: stage records saved from another run of these seeds (``restore_stages``)."""
    ensure_isolation()  # the coding agents' rewards and scores run model-written programs: refused before any work
    for var in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_DATASETS_OFFLINE"):
        os.environ.setdefault(var, "1")
    # One thread: the lab's matrices are tiny, and on a shared 2-core machine a second OpenMP thread
    # mostly waits at barriers (measured 6-12 s vs 0.6 s per warm-up step).
    torch.set_num_threads(1)
    size = SIZES[size_name]
    plans = list(methods if methods is not None else size.methods)
    claim(out, [stages_from] if stages_from is not None else [])
    if stages_from is not None:
        if not stages_from.is_dir():
            raise InputError(f"--stages-from {stages_from}: no such folder",
                             hint="give a saved-<run> folder that docs/lab-results/*/collect.sh wrote")
        copied = restore_stages(stages_from, out, range(first_seed, first_seed + seeds))
        _log(f"{len(copied)} saved stage records copied from {stages_from} (each used only if its key matches)")
    book = MemoryBook.load(out / "memory.json", size.stage_gb,
                           None if memory_gb is None else int(memory_gb * GB))
    start = time.time()
    results: list[SeedResult] = []
    for s in range(first_seed, first_seed + seeds):
        results.append(run_seed(size, out / f"seed{s}", s, plans, jobs, book))
        summary = _summary(size, plans, results, time.time() - start)
        scores = {r: [res.scores[r] for res in results if r in res.scores] for r in results[0].scores}
        plot(scores, out / "plot.png", f"rlmerge lab ({size_name}): test accuracy, {len(results)} seed(s)")
        write_json(out / "results.json", summary)
        (out / "table.md").write_text(summary["table"] + "\n\n" + summary["paired"]["markdown"] + "\n")
    return summary
