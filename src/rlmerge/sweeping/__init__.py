"""The sweep: many merges of the same inputs, scored, ranked, the best kept (``rlmerge.sweep``, ``rlmerge sweep``).

Above the merge core (``engine/``), which it calls and which never imports it: ``candidates.py`` and ``space.py``
(what to try), ``search.py`` (Optuna), ``build.py`` (one candidate, merged and scored), ``cache.py`` (the
statistics its merges share, ``engine/cached.py``'s interface), ``scores.py``, ``noise.py`` and ``results.py``
(what the scores say and where they are kept), ``sweep.py`` (the loop) and ``distributed.py`` (candidates as Ray
tasks). The package is named for the activity, as ``scoring/`` is: ``rlmerge.sweep`` is the public function.
"""
