"""Statistics computed once for many merges of the same inputs: what a sweep's candidates share.

Three kinds of entry, each keyed by the inputs' fingerprint (every input file's identity, ``io.partial.
input_identity``, and the jobs: names, sizes, tied double counts, missing tensors):

- **counts** per ε: each merged tensor's ``TensorStats`` (k-of-N counts, norms, Gram), and which backend counted it
  (numba's Gram sums are reassociated, so an entry serves only a route that counts the tensor the same way; the
  counts themselves are exact either way). RAM+'s ρ and λ for any preset, r, α or R come from these.
- **round-0 histograms** per tensor: the first digit of every agent's |τ| (``methods._select``), the same for any
  density; a TIES / Breadcrumbs threshold then needs only its in-bin refinement rounds.
- **thresholds** per tensor and selection (pruning, densities, γ): a second candidate with the same selection
  (another scaling, other weights) reads each tensor once.

A merge sees a ``CacheView``: a snapshot of what the cache held when it started (what it adds is seen by the next
merge, never by itself, so the route's reads stay what it planned). ``route`` asks the view whether the statistics
pass can be skipped (``covers``) and how often the selecting backend must read a tensor. The entries are
kilobytes (counts) to a few MB (histograms: N · 2,049 · 8 bytes per tensor); ``save`` and ``load`` keep them in
a folder (``io.sweepdir``) so that ``--resume`` does not count again.
"""

from __future__ import annotations

import copy
import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from ..io.checkpoint import Checkpoint
from ..io.partial import input_identity
from ..methods import MethodSpec
from ..methods.sparsify.observer import GtaObserver
from ..stats import Statistics, TensorStats
from ..stream.match import Job, Match

_FIELDS = ("kofn", "sumsq", "dots", "overlap", "sign_agree")  # the TensorStats arrays a merge's counts fill


class Store(Protocol):
    """Where a cache's entries live between runs (``io.sweepdir.SweepDir.arrays``)."""

    def read_arrays(self, name: str) -> dict[str, np.ndarray] | None: ...
    def write_arrays(self, name: str, arrays: dict[str, np.ndarray]) -> None: ...
    def names(self, prefix: str) -> list[str]: ...


def inputs_key(match: Match, extras: Sequence[Checkpoint] = ()) -> str:
    """The inputs' fingerprint: every file's identity and the jobs the match made of them."""
    jobs = [[j.name, j.numel, j.weight, list(j.present)] for j in match.merge_jobs]
    doc = json.dumps({"identity": input_identity([match.base, *match.agents, *extras]), "jobs": jobs},
                     sort_keys=True, default=str)
    return hashlib.sha256(doc.encode()).hexdigest()[:32]


def selection_key(obs: GtaObserver) -> str:
    """What a tensor's |τ| window depends on besides the data: the pruning and each agent's density and γ."""
    return repr((obs.preset.prune, tuple(float(d) for d in obs.density), tuple(float(g) for g in obs.gamma)))


def _h(*parts: Any) -> str:
    return hashlib.sha256(repr(parts).encode()).hexdigest()[:24]


@dataclass
class _Group:
    """Entries of one kind under one key, in insertion order; ``dirty`` until saved."""

    kind: str  # "counts", "hist0", "bounds"
    meta: dict[str, Any]
    items: dict[str, Any] = field(default_factory=dict)
    dirty: bool = False


class StatsCache:
    """Every entry a sweep has gathered (see the module docstring); ``view`` for one merge."""

    def __init__(self, store: Store | None = None) -> None:
        self.store = store
        self._groups: dict[str, _Group] = {}
        self.hits = {"counts": 0, "hist0": 0, "bounds": 0}  # entries served (benchmarks, tests)
        if store is not None:
            self._load(store)

    def detached(self) -> StatsCache:
        """A copy of the entries without the store (what a Ray task gets: it adds to its own copy only)."""
        out = StatsCache()
        out._groups = copy.deepcopy(self._groups)
        return out

    def view(self, match: Match, extras: Sequence[Checkpoint] = ()) -> CacheView:
        return CacheView(self, inputs_key(match, extras))

    # -- groups ---------------------------------------------------------------------------------------------
    def _group(self, gid: str, kind: str, meta: dict[str, Any]) -> _Group:
        g = self._groups.get(gid)
        if g is None:
            g = self._groups[gid] = _Group(kind, meta)
        return g

    def get(self, gid: str, name: str) -> Any:
        g = self._groups.get(gid)
        return None if g is None else g.items.get(name)

    def put(self, gid: str, kind: str, meta: dict[str, Any], name: str, value: Any) -> None:
        g = self._group(gid, kind, meta)
        g.items[name] = value
        g.dirty = True

    def keys(self) -> set[tuple[str, str]]:
        return {(gid, name) for gid, g in self._groups.items() for name in g.items}

    # -- persistence ------------------------------------------------------------------------------------
    def save(self) -> None:
        """Write every changed group to the store (one file per group, replaced whole)."""
        if self.store is None:
            return
        for gid, g in self._groups.items():
            if g.dirty:
                self.store.write_arrays(f"{g.kind}-{gid}", _encode(g))
                g.dirty = False

    def _load(self, store: Store) -> None:
        for kind in ("counts", "hist0", "bounds"):
            for fname in store.names(kind + "-"):
                arrays = store.read_arrays(fname)
                if arrays is None:
                    continue
                try:
                    g = _decode(kind, arrays)
                except (KeyError, ValueError, TypeError):
                    continue  # unreadable (an older layout): counted again, then replaced
                self._groups[fname.removeprefix(kind + "-")] = g


def _encode(g: _Group) -> dict[str, np.ndarray]:
    names = list(g.items)
    out: dict[str, np.ndarray] = {"meta": np.array(json.dumps({**g.meta, "names": names}))}
    if g.kind == "counts":
        for f in _FIELDS:
            out[f] = np.stack([getattr(g.items[n], f) for n in names]) if names else np.zeros(0)
        out["numel"] = np.array([g.items[n].numel for n in names], dtype=np.int64)
        out["weight"] = np.array([g.items[n].weight for n in names], dtype=np.int64)
    else:
        out["values"] = np.stack([g.items[n] for n in names]) if names else np.zeros(0)
    return out


def _decode(kind: str, arrays: dict[str, np.ndarray]) -> _Group:
    meta = json.loads(str(arrays["meta"]))
    names = meta.pop("names")
    g = _Group(kind, meta)
    for i, name in enumerate(names):
        if kind == "counts":
            ts = TensorStats(int(arrays["numel"][i]), int(meta["n_agents"]), int(arrays["weight"][i]))
            for f in _FIELDS:
                setattr(ts, f, np.array(arrays[f][i], dtype=getattr(ts, f).dtype))
            g.items[name] = ts
        else:
            g.items[name] = np.array(arrays["values"][i])
    return g


class CacheView:
    """One merge's look at the cache: what it held when the merge started, and where to add what it learns."""

    def __init__(self, cache: StatsCache, key: str) -> None:
        self.cache, self.key = cache, key
        self._seen = cache.keys()  # the snapshot: entries added during this merge are for the next one

    def _counts_id(self, eps: float, exact_gram: bool, numba: bool) -> str:
        return _h(self.key, "counts", float(eps), exact_gram, numba)

    def _has(self, gid: str, name: str) -> bool:
        return (gid, name) in self._seen

    # -- what the route asks ----------------------------------------------------------------------------
    def has_counts(self, spec: MethodSpec, p: Any, jobs: Sequence[Job], numba: frozenset[str]) -> bool:
        """Every job's counts, counted the way this route would count them."""
        eps = spec.epsilon(p)
        return all(self._has(self._counts_id(eps, spec.exact_gram, j.name in numba), j.name) for j in jobs)

    def covers(self, spec: MethodSpec, p: Any, observer: Any, jobs: Sequence[Job], numba: frozenset[str],
               *, observed: bool) -> bool:
        """Whether the statistics pass can be skipped: the counts are here and so is whatever the method's observer
        would make in that pass (``observed``: it would run there) — the |τ| windows of a selection."""
        if not self.has_counts(spec, p, jobs, numba):
            return False
        if observer is None or not observed:
            return True
        if not isinstance(observer, GtaObserver) or observer.needs_l1 or not observer.needs_selection:
            return False  # other observers (slerp, Fisher norms, arm-ties thresholds, L1 sums): counted again
        names = [""] if observer.preset.prune == "magnitude-global" else [j.name for j in jobs]
        return all(self.window(observer, n) is not None for n in names)

    def window(self, obs: GtaObserver, name: str) -> np.ndarray | None:
        """[2, N] float32: the cached |τ| window of tensor ``name`` ("": the whole model) for ``obs``'s selection.
        None for an exact-k selection (TIES' tie_break = index): the window alone does not say which of the values
        tied at its threshold are kept, so such a selection runs its rounds (from the cached round-0 histogram)."""
        if getattr(obs, "exact", False):
            return None
        gid = _h(self.key, "bounds", selection_key(obs))
        if not self._has(gid, name):
            return None
        return np.array(self.cache.get(gid, name), dtype=np.float32)

    def hist0(self, name: str) -> np.ndarray | None:
        """[N, BINS[0] + 1] int64: the cached round-0 histogram of tensor ``name``'s |τ|."""
        gid = _h(self.key, "hist0")
        if not self._has(gid, name):
            return None
        return np.array(self.cache.get(gid, name), dtype=np.int64)

    def used(self, kind: str) -> None:
        """Count an entry a merge used instead of reading the weights (``StatsCache.hits``)."""
        self.cache.hits[kind] += 1

    # -- what the engine reads and adds -----------------------------------------------------------------
    def statistics(self, spec: MethodSpec, p: Any, agents: list[str], order: Sequence[Job],
                   numba: frozenset[str]) -> Statistics:
        """A fresh ``Statistics`` from the cached counts, its tensors in ``order`` (the order a merge would count
        them in: its float64 sums over tensors then add up the same way)."""
        eps = spec.epsilon(p)
        stats = Statistics(list(agents), eps)
        for j in order:
            ts = self.cache.get(self._counts_id(eps, spec.exact_gram, j.name in numba), j.name)
            stats.tensors[j.name] = copy.deepcopy(ts)
        self.cache.hits["counts"] += 1
        return stats

    def put_counts(self, spec: MethodSpec, p: Any, stats: Statistics, numba: frozenset[str]) -> None:
        eps = spec.epsilon(p)
        for name, ts in stats.tensors.items():
            if ts.thresholds:  # inspect's extra counters: not a merge's
                continue
            flag = name in numba
            self.cache.put(self._counts_id(eps, spec.exact_gram, flag), "counts",
                           {"n_agents": stats.n_agents, "epsilon": eps, "exact_gram": spec.exact_gram,
                            "numba": flag}, name, copy.deepcopy(ts))

    def put_window(self, obs: GtaObserver, name: str, window: np.ndarray) -> None:
        key = selection_key(obs)
        self.cache.put(_h(self.key, "bounds", key), "bounds", {"selection": key}, name,
                       np.array(window, dtype=np.float32))

    def put_hist0(self, name: str, counts: np.ndarray) -> None:
        self.cache.put(_h(self.key, "hist0"), "hist0", {}, name, np.array(counts, dtype=np.int64))

    def fill_observer(self, obs: Any, jobs: Sequence[Job]) -> None:
        """Give a selection's observer the cached windows (what its statistics pass would have found)."""
        if not isinstance(obs, GtaObserver):
            return
        kept = _h(self.key, "kept", selection_key(obs))
        for name in ("", *(j.name for j in jobs)):
            w = self.window(obs, name)
            if w is not None:
                obs.bounds[name] = w
                self.used("bounds")
                if self._has(kept, name):  # what the trim kept: the merge's `kept` column
                    obs.kept[name] = np.array(self.cache.get(kept, name), dtype=np.int64)

    def put_observer(self, obs: Any) -> None:
        """Keep the windows a statistics pass found (per tensor, or "" for the whole model)."""
        if isinstance(obs, GtaObserver) and obs.needs_selection and not obs.needs_l1:
            for name, w in obs.bounds.items():
                self.put_window(obs, name, w)
            key = selection_key(obs)
            for name, k in obs.kept.items():
                self.cache.put(_h(self.key, "kept", key), "kept", {"selection": key}, name, np.array(k, dtype=np.int64))
