"""A sweep's candidates as Ray tasks (``pip install 'rlmerge[ray]'``, ``backend="ray"``).

The driver counts the statistics each kind of candidate needs first (``build.warm``) and ships the cache once
(counts are kilobytes, round-0 histograms a few MB); each task builds one candidate (in memory where it fits, else
in the sweep folder, which every node must mount) and scores it, one per GPU when the device is CUDA, one per CPU
otherwise. Results are recorded as they come back, so a stopped sweep resumes after them. Connecting, submitting
and the tests' fault injection are the Ray merge's (engine/distributed.py), and so is Ray itself: that module is
the only one that imports it (a missing extra is a ConfigError there).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from ..engine.distributed import fault_point, init, ray, run_tasks  # Ray, as the Ray merge imported it
from .build import Context, Scored, Scorer, build_and_score, warm
from .cache import StatsCache
from .candidates import Candidate


@ray.remote
def _candidate_task(ctx: Context, c: Candidate, scorer: Scorer | None, cache: StatsCache) -> Scored:
    scored = build_and_score(ctx, c, scorer, cache)
    fault_point()
    return scored


def slots(ctx: Context) -> int:
    """How many candidates the cluster scores at once: its GPUs when the device is CUDA, else its CPUs."""
    gpu = str(ctx.options.get("device", "cpu")).startswith("cuda")
    return max(1, int(ray.cluster_resources().get("GPU" if gpu else "CPU", 1)))


def score_on_ray(ctx: Context, todo: Sequence[Candidate], scorer: Scorer | None, cache: StatsCache,
                 record: Callable[[Scored], None], *, workers: int | None = None, retries: int = 2,
                 address: str | None = None) -> None:
    """Build and score ``todo`` as Ray tasks (at most ``workers`` at once); ``record`` each as it finishes."""
    init(address)
    warm(ctx, todo, cache)
    shared = ray.put(cache.detached())
    gpu = str(ctx.options.get("device", "cpu")).startswith("cuda")
    task = _candidate_task.options(max_retries=retries, **({"num_gpus": 1} if gpu else {"num_cpus": 1}))
    run_tasks(list(todo), lambda i, s: record(s), limit=workers,
              submit=lambda i: task.remote(ctx, todo[i], scorer, shared))
