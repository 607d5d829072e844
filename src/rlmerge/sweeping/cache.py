"""Statistics computed once for many merges of the same inputs: what a sweep's candidates share.

Three kinds of entry, each keyed by the inputs' fingerprint (every input file's identity, ``io.partial.
input_identity``, and the jobs: names, sizes, tied double counts, missing tensors):

- **counts** per ε: each merged tensor's ``TensorStats`` (k-of-N counts, norms, Gram), and which backend counted it
  (numba's Gram sums are reassociated, so an entry serves only a route that counts the tensor the same way; the
  counts themselves are exact either way). RAM+'s ρ and λ for any preset, r, α or R come from these.
- **what a method's observer or its family's backend found**, as arrays per (kind, key, tensor): the entries of
  ``methods.Entries`` (``get``, ``put``, ``used``), which the method names and keys itself. The sparsify family
  keeps each tensor's round-0 histogram of |τ| (any density: a TIES / Breadcrumbs threshold then needs only its
  in-bin rounds) and its thresholds per selection (another scaling or other weights then read each tensor once).

``StatsCache`` and ``CacheView`` are what ``engine/cached.py`` declares (``StatisticsCache``, ``StatisticsView``):
the merge core knows them only as those protocols. A merge sees a ``CacheView``: a snapshot of what the cache held
when it started (what it adds is seen by the next merge, never by itself, so the route's reads stay what it
planned). ``route`` asks the view whether the statistics pass can be skipped (``covers``: the counts, and what the
observer says it can reuse), and a family's backend how often it reads a tensor (from what the view holds). The
entries are kilobytes (counts) to a few MB (histograms: N · 2,049 · 8 bytes per tensor); ``save`` and ``load``
keep them in a folder (``io.sweepdir``) so that ``--resume`` does not count again.
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
from ..methods import MethodSpec, Observer
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


def _h(*parts: Any) -> str:
    return hashlib.sha256(repr(parts).encode()).hexdigest()[:24]


@dataclass
class _Group:
    """Entries of one kind under one key, in insertion order; ``dirty`` until saved."""

    kind: str  # "counts", or a method's kind of entry (the sparsify family's: "hist0", "bounds", "kept")
    meta: dict[str, Any]
    items: dict[str, Any] = field(default_factory=dict)
    dirty: bool = False


class StatsCache:
    """Every entry a sweep has gathered (see the module docstring); ``view`` for one merge."""

    def __init__(self, store: Store | None = None) -> None:
        self.store = store
        self._groups: dict[str, _Group] = {}
        self.hits = {"counts": 0, "hist0": 0, "bounds": 0}  # entries served, by kind (benchmarks, tests)
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
        for fname in store.names(""):  # KIND-GROUP, as ``save`` names them
            kind, _, gid = fname.partition("-")
            arrays = store.read_arrays(fname)
            if arrays is None or not gid:
                continue
            try:
                g = _decode(kind, arrays)
            except (KeyError, ValueError, TypeError):
                continue  # unreadable (an older layout): counted again, then replaced
            self._groups[gid] = g


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

    def covers(self, spec: MethodSpec, p: Any, observer: Observer | None, jobs: Sequence[Job],
               numba: frozenset[str], *, observed: bool) -> bool:
        """Whether the statistics pass can be skipped: the counts are here and so is whatever the method's observer
        would make in that pass (``observed``: it would run there), as the observer says (``reusable``)."""
        if not self.has_counts(spec, p, jobs, numba):
            return False
        if observer is None or not observed:
            return True
        return observer.reusable(self, [j.name for j in jobs])

    # -- a method's own entries (methods.Entries) --------------------------------------------------------------
    def _gid(self, kind: str, key: str) -> str:
        return _h(self.key, kind, key) if key else _h(self.key, kind)

    def get(self, kind: str, key: str, name: str) -> np.ndarray | None:
        """The array a method put under (``kind``, ``key``) for tensor ``name`` before this merge started, or None."""
        gid = self._gid(kind, key)
        if not self._has(gid, name):
            return None
        return np.array(self.cache.get(gid, name))

    def put(self, kind: str, key: str, name: str, value: np.ndarray) -> None:
        self.cache.put(self._gid(kind, key), kind, {"key": key} if key else {}, name, np.array(value))

    def used(self, kind: str) -> None:
        """Count an entry a merge used instead of reading the weights (``StatsCache.hits``)."""
        self.cache.hits[kind] = self.cache.hits.get(kind, 0) + 1

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

    def fill_observer(self, obs: Observer | None, jobs: Sequence[Job]) -> None:
        """Give the method's observer what its statistics pass would have found (``reuse``)."""
        if obs is not None:
            obs.reuse(self, [j.name for j in jobs])

    def put_observer(self, obs: Observer | None) -> None:
        """Keep what a statistics pass's observer found (``keep``)."""
        if obs is not None:
            obs.keep(self)
