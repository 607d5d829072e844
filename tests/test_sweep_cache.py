"""The statistics cache (sweeping/cache.py): merges that share it write exactly the bytes of merges that do not, and
read only what the cache does not hold.

Oracles: every file of a merge made with a warm cache against the same merge made alone (shards, report, model
card, provenance, config); the bytes read against what the passes must read, counted from the jobs' sizes.
"""

from __future__ import annotations

import inspect
import os
from pathlib import Path

import pytest

import rlmerge
from rlmerge import kernels
from rlmerge.engine import cached
from rlmerge.engine.preflight import preflight
from rlmerge.io.sweepdir import SweepDir
from rlmerge.methods._select import ROUNDS
from rlmerge.sweeping.cache import CacheView, StatsCache
from rlmerge.sweeping.sweep import sweep

# (method, [params of candidates that share one cache]): every kind of route the cache changes
GRIDS = [
    ("ram+", [{"r": 0.05}, {"r": 0.1, "alpha": 1.0}, {"preset": "official", "rescale_factor": 1.5},
              {"preset": "tensor-local"}, {"preset": "paper-soft", "r": 0.3}, {"preset": "magnitude"},
              {"preset": "sign-elect"}, {"preset": "magnitude", "r": 0.2}]),
    ("ties", [{"density": 0.1}, {"density": 0.3}, {"density": 0.3, "scaling": 0.7}]),
    ("ties", [{"density": 0.3, "tie_break": "keep-all"}, {"density": 0.3, "tie_break": "keep-all", "scaling": 0.7}]),
    ("breadcrumbs", [{"density": 0.8, "gamma": 0.05}, {"density": 0.8, "gamma": 0.05, "scaling": 0.5}]),
    ("ties_global", [{"density": 0.2}, {"density": 0.2, "scaling": 0.5}]),
    ("model_stock", [{}, {}]),
    ("task_arithmetic", [{"scaling": 0.5}, {"scaling": 1.0}]),
    ("dare_ties", [{"density": 0.5}, {"density": 0.3}]),
    ("arm-ties", [{}, {}]),
]
BLOCK = 1000  # the larger tensors span several blocks


def same_folder(a: Path, b: Path) -> None:
    names = sorted(p.name for p in a.iterdir())
    assert names == sorted(p.name for p in b.iterdir())
    for n in names:
        assert (a / n).read_bytes() == (b / n).read_bytes(), n


def pass_bytes(base: Path, agents: list[Path]) -> tuple[int, dict[str, int], int]:
    """(bytes of one pass over the merged tensors, bytes per merged tensor, bytes of the copied tensors)."""
    pf = preflight(base, agents, None, method="ram")
    try:
        m = pf.match
        per = {j.name: j.info.nbytes + sum(a.tensors[j.name].nbytes for a in m.agents) for j in m.merge_jobs}
        numel = {j.name: j.numel for j in m.merge_jobs}
        copies = sum(j.info.nbytes for j in m.jobs if j.kind == "copy")
    finally:
        pf.close()
    return sum(per.values()), {k: (v, numel[k]) for k, v in per.items()}, copies  # type: ignore[return-value]


@pytest.mark.parametrize("fast", ["1", "0"], ids=["fast", "torch"])
@pytest.mark.parametrize(("method", "grid"), GRIDS, ids=[m for m, _ in GRIDS])
def test_merges_sharing_a_cache_write_what_merges_alone_write(example, tmp_path: Path, monkeypatch, fast: str,
                                                              method: str, grid: list[dict]) -> None:
    if fast == "1" and not kernels.HAVE_NUMBA:
        pytest.skip("numba not installed: no fast path to test")
    monkeypatch.setenv("RLMERGE_FAST", fast)
    base, agents = example
    cache = StatsCache()
    for i, params in enumerate(grid):
        kw = {"method": method, "params": params, "block_size": BLOCK}
        warm = rlmerge.merge(base, agents, tmp_path / f"warm{i}", cache=cache, **kw)
        alone = rlmerge.merge(base, agents, tmp_path / f"alone{i}", **kw)
        same_folder(warm.output, alone.output)
        assert warm.read_bytes <= alone.read_bytes
        if i and method in ("ram+", "model_stock", "ties_global") and params.get("preset") != "magnitude":
            # counts (and a whole-model window) cached
            assert warm.passes == ["merge"] and alone.passes == ["statistics", "merge"]
    if method == "model_stock":
        assert cache.hits["counts"] == len(grid) - 1
    if method == "ram+":  # the magnitude preset's Σ|τ| observer is counted again (not cached): its own pass
        assert cache.hits["counts"] == len(grid) - 1 - sum(p.get("preset") == "magnitude" for p in grid)


def test_ram_plus_candidates_read_one_statistics_pass_and_one_merge_pass_each(example, tmp_path: Path) -> None:
    base, agents = example
    once, _, copies = pass_bytes(base, agents)
    res = sweep(base, agents, candidates=["ram+ r=0.05,0.1,0.2,0.4 alpha=1,2"], memory="always")
    assert len(res.scored) == 8
    assert res.statistics_passes == 1 and res.merge_passes == 8
    assert sum(s.read_bytes for s in res.scored) == 9 * once + 8 * copies


@pytest.mark.skipif(not kernels.HAVE_NUMBA, reason="numba not installed: no fast path to test")
def test_ties_reads_a_round_less_with_cached_histograms_and_once_with_cached_thresholds(
        example, tmp_path: Path, monkeypatch) -> None:
    """Density 0.1, then 0.3 (round 0 from the cache), then 0.3 with another scaling (thresholds from the cache):
    a tensor larger than a block is read ROUNDS + 1, ROUNDS, then 1 time(s); one that fits, once. With TIES'
    default exact k (``tie_break: index``) the cache keeps the tie cut beside the window, so the third merge reads
    once as with ``keep-all``; its bytes are those of the same merge without a cache."""
    monkeypatch.setenv("RLMERGE_FAST", "1")
    base, agents = example
    _, per, copies = pass_bytes(base, agents)
    block = -(-BLOCK // kernels.TILE) * kernels.TILE  # the numba path's blocks are whole tiles
    big = {n: b for n, (b, numel) in per.items() if numel > block}
    small = sum(b for n, (b, numel) in per.items() if numel <= block)
    assert big and small
    for tie_break in ("keep-all", "index"):
        cache = StatsCache()
        reads = []
        for params in ({"density": 0.1}, {"density": 0.3}, {"density": 0.3, "scaling": 0.7}):
            res = rlmerge.merge(base, agents, tmp_path / f"{tie_break}{len(reads)}", method="ties",
                                params={**params, "tie_break": tie_break}, block_size=BLOCK, cache=cache)
            reads.append(res.read_bytes - copies - small)
        assert reads == [(ROUNDS + 1) * sum(big.values()), ROUNDS * sum(big.values()), sum(big.values())]
        assert cache.hits["hist0"] == len(per) and cache.hits["bounds"] == len(per)
        uncached = rlmerge.merge(base, agents, tmp_path / f"{tie_break}-uncached", method="ties",
                                 params={"density": 0.3, "scaling": 0.7, "tie_break": tie_break}, block_size=BLOCK)
        same_folder(uncached.output, res.output)


def test_a_cache_kept_in_a_sweep_folder_serves_the_next_run(example, tmp_path: Path) -> None:
    base, agents = example
    kw = {"method": "ram+", "params": {"r": 0.2}, "block_size": BLOCK}
    with SweepDir(tmp_path / "sweep") as folder:
        cache = StatsCache(folder)
        first = rlmerge.merge(base, agents, tmp_path / "a", cache=cache, **kw)
        cache.save()
    assert first.passes == ["statistics", "merge"]
    with SweepDir(tmp_path / "sweep", resume=True) as folder:
        again = rlmerge.merge(base, agents, tmp_path / "b", cache=StatsCache(folder), **kw)
    assert again.passes == ["merge"]
    same_folder(first.output, again.output)


def test_an_input_that_changed_is_counted_again(example, tmp_path: Path) -> None:
    base, agents = example
    cache = StatsCache()
    kw = {"method": "ram+", "block_size": BLOCK, "cache": cache}
    rlmerge.merge(base, agents, tmp_path / "a", **kw)
    assert rlmerge.merge(base, agents, tmp_path / "b", **kw).passes == ["merge"]
    f = agents[1] / "model.safetensors"
    st = f.stat()
    os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))  # rewritten in place, as far as anyone can tell
    assert rlmerge.merge(base, agents, tmp_path / "c", **kw).passes == ["statistics", "merge"]
    eps = rlmerge.merge(base, agents, tmp_path / "d", method="ram+", params={"epsilon": 1e-3}, cache=cache)
    assert eps.passes == ["statistics", "merge"]  # another ε: other counts


@pytest.mark.parametrize(("protocol", "implementation"), [(cached.StatisticsCache, StatsCache),
                                                          (cached.StatisticsView, CacheView)])
def test_the_sweeps_cache_is_what_the_merge_core_asks_for(protocol: type, implementation: type) -> None:
    """The engine knows the cache through engine/cached.py alone: every method its protocols declare (``Entries``'
    included) is the sweep's, with the same parameters, so a merge never calls a method the cache lacks."""
    members = {n for c in protocol.__mro__ if c.__module__.startswith("rlmerge.")
               for n, v in vars(c).items() if callable(v) and not n.startswith("_")}
    assert {"view"} <= members or {"get", "put", "used", "covers", "statistics"} <= members
    for name in sorted(members):
        mine, theirs = inspect.signature(getattr(implementation, name)), inspect.signature(getattr(protocol, name))
        assert list(mine.parameters) == list(theirs.parameters), name
