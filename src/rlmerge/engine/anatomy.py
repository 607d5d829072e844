"""``rlmerge.inspect``: the anatomy of RL task vectors, from one streaming statistics pass.

The same pass as a two-pass merge (same match, same blocks, same memory bound), with the extra counters
turned on: density at other thresholds, values changed at all, and |τ| / |θ₀| magnitude histograms.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

from .._torch import torch
from ..errors import ConfigError, OutputError, RLMergeError, raise_all
from ..io.open import open_all
from ..io.partial import output_problems, partial_path, target, write_file
from ..methods import BlockContext, Observer, Run, inspected
from ..report import Report, build_report, dtype_facts
from ..stats import Magnitudes, Statistics
from ..stream.blocks import DEFAULT_BLOCK, BlockReader, device_type
from ..stream.match import match_models
from .backends import TorchBackend
from .passes import statistics_pass
from .preflight import parse_block_size
from .progress import Progress
from .route import route

DEFAULT_THRESHOLDS = (1e-6, 1e-5, 1e-4, 1e-3)


class MagnitudeObserver(Observer):
    """Feeds each block of the statistics pass into the |τ| / |θ₀| histograms (the engine's observer protocol)."""

    def __init__(self, mags: Magnitudes) -> None:
        self.mags = mags

    def observe(self, ctx: BlockContext, base: torch.Tensor, deltas: torch.Tensor) -> None:
        self.mags.update(base, deltas)  # each stored element once, also with count_tied_twice (only ρ's counts)

    def again(self, name: str | None) -> bool:
        return False  # one pass is enough


def _check(epsilon: float, thresholds: Sequence[float], block_size: Any, device: str) -> tuple[float, ...]:
    """Every problem of the arguments at once (the merge's own checks for the block size and the device)."""
    problems: list[RLMergeError] = []
    for name, v in [("epsilon", epsilon), *(("threshold", t) for t in thresholds)]:
        if not (isinstance(v, (int, float)) and 0.0 <= v <= 1.0):
            problems.append(ConfigError(f"inspect: {name} = {v!r} is out of range [0, 1]"))
    for check, value in ((parse_block_size, block_size), (device_type, device)):
        try:
            check(value)
        except RLMergeError as e:
            problems.append(e)
    raise_all(problems)
    return tuple(sorted({float(t) for t in thresholds}))


def _nested(save: str | os.PathLike[str], plots: str | os.PathLike[str]) -> list[RLMergeError]:
    """``save`` at or inside the ``plots`` folder (or its partial folder): the report would be written first and
    then either block the figures or be taken for a foreign file in the folder, so refuse it before the pass."""
    file, folder = target(save), target(plots)
    for where, what in ((folder, f"the --plots folder {plots}"), (partial_path(folder), "the --plots partial folder")):
        if file == where or where in file.parents:
            how = "is" if file == where else "lies inside"
            return [OutputError(f"--save {save} {how} {what}", file=str(file),
                                hint="put the report outside the plots folder (e.g. beside it)")]
    return []


def inspect(base: str | os.PathLike[str], agents: Sequence[str | os.PathLike[str]], *, epsilon: float = 1e-5,
            thresholds: Sequence[float] = DEFAULT_THRESHOLDS, block_size: int = DEFAULT_BLOCK,
            device: str = "cpu", allow_missing: bool = False, count_tied_twice: bool = False,
            quiet: bool = True, save: str | os.PathLike[str] | None = None,
            plots: str | os.PathLike[str] | None = None, force: bool = False) -> Report:
    """Measure the task vectors τ_t = θ_t − θ₀ of ``agents`` against ``base``.

    ``save`` (a JSON file) and ``plots`` (a folder of PNGs) are written at the end, and checked like every
    output (never an input, never through a link; ``force`` replaces only what rlmerge wrote) before the pass.

    >>> rep = rlmerge.inspect("base/", ["coder/", "tools/", "memory/"])  # doctest: +SKIP
    >>> rep.doc["recommendation"]["summary"], rep.doc["per_agent"][0]["density"]  # doctest: +SKIP
    """
    extra = _check(epsilon, thresholds, block_size, device)
    models = open_all([base, *agents])
    try:
        problems = output_problems(save, models, force=force, kind="file", option="--save") if save is not None else []
        if plots is not None:
            problems += output_problems(plots, models, force=force, option="--plots")
            problems += _nested(save, plots) if save is not None else []
        raise_all(problems)
        match = match_models(models[0], models[1:], allow_missing=allow_missing, count_tied_twice=count_tied_twice)
        mags = Magnitudes(len(match.agents))
        stats = Statistics([a.label for a in match.agents], float(epsilon), thresholds=extra, magnitudes=mags)
        run = Run(match, None, None, stats, observer=MagnitudeObserver(mags))  # type: ignore[arg-type]
        chosen = route(match, None, None, device=device, block_size=block_size)  # no method: inspect
        with Progress(quiet=quiet) as progress:
            statistics_pass(run, chosen, None, TorchBackend(run, BlockReader(match, block_size=block_size,
                                                                            device=device)), progress)
        doc = build_report(stats, dtype_facts(match), base=match.base.label,
                           warnings=[*match.warnings, *stats.identical_agents()], methods=inspected(stats))
        report = Report(doc, stats)
        if save is not None:
            write_file(save, report.to_json().encode(), force=force, inputs=models, option="--save")
        if plots is not None:
            report.save_plots(plots, force=force, inputs=models)
    finally:
        for m in models:
            m.close()
    return report
