"""What a merge sees of a statistics cache: the one interface between the merge core and a sweep's cache.

Merges of the same inputs (a sweep's candidates, the lab's rows) share what one of them counted: the counts, and
what a method's observer or its family's backend found (``methods.Entries``). The merge core (merge.py, route.py,
distributed.py) and the families know that cache only through these protocols; ``rlmerge.sweeping.cache`` holds
its implementation (``StatsCache``, ``CacheView``: what is kept, under which key, and where it is saved).

- ``StatisticsCache``: what ``merge`` and ``merge_on_ray`` are handed; a merge asks it once for its view.
- ``StatisticsView``: one merge's look, a snapshot of what the cache held when the merge started (what the merge
  adds is for the next one, so the route's reads stay what it planned): whether the statistics pass can be skipped,
  the cached counts as this merge would have counted them, and where to put what the merge counted and observed.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

from ..io.checkpoint import Checkpoint
from ..methods import Entries, MethodSpec, Observer
from ..stats import Statistics
from ..stream.match import Job, Match


class StatisticsView(Entries, Protocol):
    """One merge's look at the cache (``StatisticsCache.view``); a method's own arrays through ``Entries``."""

    def has_counts(self, spec: MethodSpec, p: Any, jobs: Sequence[Job], numba: frozenset[str]) -> bool:
        """Every job's counts, counted the way this route would count them (``numba``: by the numba backend)."""
        ...

    def covers(self, spec: MethodSpec, p: Any, observer: Observer | None, jobs: Sequence[Job],
               numba: frozenset[str], *, observed: bool) -> bool:
        """Whether the statistics pass can be skipped: the counts, and what the observer would find in that pass
        (``observed``: it would run there), as the observer says (``Observer.reusable``)."""
        ...

    def statistics(self, spec: MethodSpec, p: Any, agents: list[str], order: Sequence[Job],
                   numba: frozenset[str]) -> Statistics:
        """A fresh ``Statistics`` from the cached counts, its tensors in ``order`` (the order the merge counts in)."""
        ...

    def put_counts(self, spec: MethodSpec, p: Any, stats: Statistics, numba: frozenset[str]) -> None:
        """Keep the counts of ``stats`` (``numba``: the tensors the numba backend counted)."""
        ...

    def fill_observer(self, obs: Observer | None, jobs: Sequence[Job]) -> None:
        """Give the method's observer what its statistics pass would have found (``Observer.reuse``)."""
        ...

    def put_observer(self, obs: Observer | None) -> None:
        """Keep what a statistics pass's observer found (``Observer.keep``)."""
        ...


class StatisticsCache(Protocol):
    """Statistics gathered by earlier merges, shared with this one (``rlmerge.sweeping.cache.StatsCache``)."""

    def view(self, match: Match, extras: Sequence[Checkpoint] = ()) -> StatisticsView:
        """The view of one merge of ``match`` (with side inputs ``extras``): its inputs decide the key."""
        ...
