"""The Ray backend (``pip install 'rlmerge[ray]'``): one large merge split by output shard, and the Ray plumbing.

Imported only when asked for (``rlmerge merge --backend ray``, a sweep's ``backend="ray"``); it is the only module
that imports Ray: the sweep's candidate tasks (sweeping/distributed.py) connect (``init``), submit (``run_tasks``)
and take ``ray`` from here.

- **One merge**: the local merge's stages (``merge.stages``: statistics, prepare, merge pass, finish), its two
  passes run by ``OnRay``: statistics mapped over groups of tensors (each task reads its tensors from shared
  storage and returns their counts: kilobytes), reduced on the driver in the order a local merge counts them; the
  driver prepares the method's constants (λ, thresholds) and ships them; each merge task writes whole shards into the
  partial folder (``io.shardfiles``) and returns their sizes and CRC-32s; the driver records the shards in order,
  writes the index, report and provenance, and publishes. Weights never pass through Ray's object store. The bytes
  are the local merge's for any number of workers and any partition (tests/test_distributed.py).
- **Faults**: a task whose worker dies is retried (``retries``) and replaces its own files; when retries run out
  the merge stops with the completed prefix of shards recorded, and ``resume=True`` finishes it.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import socket
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import ConfigError, InputError, OutputError, RLMergeError, raise_all
from ..io.hub import push
from ..io.partial import PartialDir, input_identity
from ..io.shardfiles import ShardFiles
from ..io.tokenizer_plan import SOURCES, pick_agent
from ..io.writer import DEFAULT_SHARD_SIZE, CheckpointWriter, layout_shards
from ..methods import Observer, Run
from ..stats import TensorStats
from ..stream.blocks import DEFAULT_BLOCK
from .backends import closing, make_backends
from .cached import StatisticsCache
from .merge import (
    Local,
    MergeResult,
    check_copies,
    local_statistics,
    new_run,
    stages,
    statistics_only,
)
from .preflight import Preflight, output_fingerprint, preflight
from .progress import Progress
from .reproduce import Reproduce, reproduce
from .route import Route, route

try:
    import ray
except ImportError as e:  # the ``ray`` extra is not installed
    raise ConfigError("the Ray backend needs Ray", hint="pip install 'rlmerge[ray]' (pinned: ray==2.60.0)") from e


CONNECT_TIMEOUT = 20.0  # seconds: the longest rlmerge waits for a Ray cluster's address to answer (``init``)
# An HTTP/2 client preface and an empty SETTINGS frame: a gRPC server (Ray's GCS, or its Ray Client server) answers
# with a SETTINGS frame of its own (frame type 4), so one round trip tells a Ray cluster from silence or another
# service without waiting on Ray's own reconnect loop (20 tries of ~40 s each in Ray 2.60).
_RAY_TRIES = "RAY_gcs_server_port_wait_time_s"  # Ray's own spelling: how many times it tries to reach the GCS
_H2_HELLO = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + bytes([0, 0, 0, 4, 0, 0, 0, 0, 0])


def init(address: str | None = None, *, timeout: float | None = None) -> None:
    """Connect to the Ray cluster at ``address`` (or ``RAY_ADDRESS``), or start one on this machine.

    An address that does not answer as a Ray cluster within ``timeout`` seconds is a ConfigError naming it (Ray
    itself would retry for minutes); ``timeout`` None: ``CONNECT_TIMEOUT``."""
    if ray.is_initialized():
        return
    where = address or os.environ.get("RAY_ADDRESS")
    if not where or where == "local":
        _ray_init(include_dashboard=False, log_to_driver=False)
        return
    reach(where, timeout=CONNECT_TIMEOUT if timeout is None else timeout)
    saved = os.environ.get(_RAY_TRIES)
    if saved is None:  # it answered: one connection attempt (Ray's ~40 s), not Ray's 20
        os.environ[_RAY_TRIES] = "1"
    try:
        _ray_init(address=address, log_to_driver=False)
    except (ConnectionError, TimeoutError, ValueError) as e:  # ValueError: e.g. ray:// without ray[client]
        raise _unreachable(where, str(e)) from e
    finally:
        if saved is None:
            os.environ.pop(_RAY_TRIES, None)


def _ray_init(**kwargs: Any) -> None:
    """``ray.init``, keeping the SIGTERM handler the program set.

    Ray's driver replaces it with one that calls ``sys.exit``: under the CLI a SIGTERM (kill, a scheduler's
    timeout) would then skip the interrupt path, leaving no message, exit 15 instead of 130, and the finished
    shards thrown away instead of kept for ``--resume``. A default or unknown handler is left as Ray sets it."""
    main = threading.current_thread() is threading.main_thread()
    previous = signal.getsignal(signal.SIGTERM) if main else None
    try:
        ray.init(**kwargs)
    finally:
        if previous not in (None, signal.SIG_DFL):
            signal.signal(signal.SIGTERM, previous)


def reach(address: str, *, timeout: float = CONNECT_TIMEOUT) -> None:
    """Raise ConfigError unless a Ray cluster (a gRPC server) answers at ``address`` within ``timeout`` seconds:
    ``HOST:PORT``, ``ray://HOST[:PORT]`` or ``auto`` (the cluster this machine last started)."""
    host, port = _endpoint(address)
    deadline = time.monotonic() + timeout
    try:
        with socket.create_connection((host, port), timeout=timeout) as sock:
            if os.environ.get("RAY_USE_TLS", "0").lower() in ("1", "true"):
                return  # a TLS handshake comes first: connecting is all that can be checked here
            sock.settimeout(max(0.05, deadline - time.monotonic()))
            sock.sendall(_H2_HELLO)
            head = b""
            while len(head) < 9 and (chunk := sock.recv(9 - len(head))):
                head += chunk
    except TimeoutError:
        raise _unreachable(address, f"no answer within {timeout:g} s") from None
    except OSError as e:
        raise _unreachable(address, e.strerror or str(e)) from None
    if len(head) < 9 or head[3] != 4:
        raise _unreachable(address, "something listens there, but it did not answer as a Ray cluster (gRPC)")


def _endpoint(address: str) -> tuple[str, int]:
    """(host, port) that ``address`` names; Ray Client's default port 10001."""
    where = address
    if where == "auto":
        try:
            from ray._private.services import canonicalize_bootstrap_address_or_die
            where = canonicalize_bootstrap_address_or_die("auto")
        except (ImportError, ConnectionError) as e:
            raise _unreachable(address, str(e)) from None
    client = "://" in where
    host, sep, port = where.split("://", 1)[-1].rstrip("/").rpartition(":")
    if not sep:
        host, port = port, "10001" if client else ""
    if not host or not port.isdigit():
        raise ConfigError(f"the Ray address {address!r} is not HOST:PORT or ray://HOST:PORT",
                          hint="e.g. RAY_ADDRESS=10.0.0.5:6379 (the head's address from `ray start --head`)")
    return host.strip("[]"), int(port)


def _unreachable(address: str, why: str) -> ConfigError:
    return ConfigError(f"cannot reach a Ray cluster at {address}: {why}",
                       hint="start it (ray start --head), fix RAY_ADDRESS, or unset it to run Ray on this machine")


def run_tasks(refs: list[Any], on_done: Callable[[int, Any], None], *, limit: int | None,
         submit: Callable[[int], Any]) -> None:
    """Submit ``submit(i)`` for i in range(len(refs)) keeping at most ``limit`` in flight; ``on_done(i, value)`` as
    each finishes. A task's error (after its retries) cancels the rest and is raised as rlmerge's error."""
    pending: dict[Any, int] = {}
    nxt = 0
    try:
        while nxt < len(refs) or pending:
            while nxt < len(refs) and (limit is None or len(pending) < limit):
                pending[submit(nxt)] = nxt
                nxt += 1
            done, _ = ray.wait(list(pending), num_returns=1)
            i = pending.pop(done[0])
            on_done(i, ray.get(done[0]))
    except ray.exceptions.RayTaskError as e:
        _cancel(pending)
        cause = getattr(e, "cause", None)
        raise cause if isinstance(cause, RLMergeError) else OutputError(
            f"a Ray task failed: {cause or e}", hint="what finished is kept: rerun with --resume") from e
    except ray.exceptions.RayError as e:  # a worker or node died and the retries ran out
        _cancel(pending)
        raise OutputError(f"a Ray worker died and its task ran out of retries: {type(e).__name__}",
                          hint="what finished is kept: rerun with --resume") from e
    except BaseException:
        _cancel(pending)
        raise


def _cancel(pending: Mapping[Any, int]) -> None:
    for ref in pending:
        ray.cancel(ref, force=True)


FAULT_ENV = "RLMERGE_RAY_TEST_KILL"  # tests only: see fault_point
Record = tuple[str, int, int, "dict[str, Any] | None"]  # a shard a worker wrote: file, bytes, CRC-32, notes


def fault_point() -> None:
    """Fault injection for tests/test_distributed.py: when the file named by $RLMERGE_RAY_TEST_KILL exists, the
    worker removes it and dies at once (``os._exit``), as a killed worker would: its shards written, none reported.
    Unset (always, outside those tests), this does nothing."""
    path = os.environ.get(FAULT_ENV)
    if path:
        try:
            os.unlink(path)
        except FileNotFoundError:
            return
        os._exit(1)


# -- one merge, split by output shard ----------------------------------------------------------------------------
@dataclass(frozen=True)
class _Request:
    """What a task needs to open the inputs and match them as the driver did (paths resolved on the driver)."""

    base: str
    agents: tuple[str, ...]
    method: str
    params: dict[str, Any]
    dtype: str | None
    shard_bytes: int
    block_size: int
    device: str
    seed: int
    allow_missing: bool
    count_tied_twice: bool
    # where the output's vocabulary rows come from (base, union, an agent by its resolved path): moved rows are
    # merged in the tasks; the chat template and the tokenizer's files are the driver's to write
    tokenizer_source: str | None = None

    def open(self) -> Preflight:
        pf = preflight(self.base, list(self.agents), None, method=self.method, params=self.params, dtype=self.dtype,
                       shard_size=self.shard_bytes, block_size=self.block_size, device=self.device,
                       allow_missing=self.allow_missing, count_tied_twice=self.count_tied_twice, seed=self.seed,
                       tokenizer_source=self.tokenizer_source)
        try:
            raise_all(pf.problems)
        except RLMergeError:
            pf.close()
            raise
        return pf


def _sub(pf: Preflight, names: set[str]) -> Any:
    assert pf.match is not None
    return dataclasses.replace(pf.match, jobs=[j for j in pf.match.jobs if j.name in names])


@ray.remote
def _statistics_task(req: _Request, names: list[str]) -> tuple[dict[str, TensorStats], int]:
    """The counts of tensors ``names`` (a statistics pass over them alone): kilobytes back to the driver."""
    pf = req.open()
    try:
        sub = _sub(pf, set(names))
        extras = [x for x in pf.extras if x is not None]
        chosen = route(sub, pf.spec, pf.params, device=req.device, block_size=req.block_size, extras=extras)
        stats, _, nbytes = statistics_only(sub, pf.spec, pf.params, chosen, block_size=req.block_size,  # type: ignore
                                           device=req.device, seed=req.seed, extras=extras)
        return stats.tensors, nbytes
    finally:
        pf.close()


@ray.remote
def _merge_task(req: _Request, shard_ids: list[int], expected: list[str], prepared: Any, observer: Any,
                tensor_stats: dict[str, TensorStats], collect: bool, output: str, tmp: str, metadata: dict[str, str],
                fsync: bool) -> tuple[list[Record], dict[str, TensorStats], int, Observer | None]:
    """Write shards ``shard_ids`` into the partial folder ``tmp`` (the local merge pass over their tensors):
    ((file, bytes, CRC-32, notes on its tensors) of each, counts, bytes read, the method's observer after merging
    them: what it found there (a trim's kept counts, for the merge table's kept column) goes to the driver's,
    ``Observer.absorb``)."""
    pf = req.open()
    try:
        assert pf.match is not None and pf.spec is not None
        shards = layout_shards(pf.match.jobs, req.shard_bytes)
        if [s.filename for s in shards] != expected:
            raise InputError("the inputs this worker opened are laid out otherwise than the driver's",
                             file=req.base, hint="every node must see the same input files at the same paths")
        mine = [shards[i] for i in shard_ids]
        sub = _sub(pf, {j.name for s in mine for j in s.jobs})
        run = new_run(sub, pf.spec, pf.params, seed=req.seed, extras=[x for x in pf.extras if x is not None])
        run.stats.tensors.update(tensor_stats)
        run.prepared = prepared
        if observer is not None:  # the driver's, after its statistics (else a fresh one, as it would ship)
            run.observer = observer
        chosen = route(sub, pf.spec, pf.params, device=req.device, block_size=req.block_size, extras=run.extras)
        fast, torch_backend = make_backends(chosen, run, block_size=req.block_size, device=req.device)
        files = ShardFiles(Path(output), Path(tmp))
        writer = CheckpointWriter(files, sub.jobs, metadata=metadata, fsync=fsync, shards=mine,  # type: ignore
                                  background=fast is not None)
        with closing(fast):
            with Progress(quiet=True) as progress, writer:
                Local(fast, torch_backend, writer, progress).merge(run, chosen, collect=collect)
                writer.complete()
            fault_point()
        return files.records, (run.stats.tensors if collect else {}), run.read_bytes, run.observer
    finally:
        pf.close()


def merge_on_ray(base: str | os.PathLike[str], agents: Sequence[str | os.PathLike[str]],
                 output: str | os.PathLike[str], *, method: str = "ram+", params: Mapping[str, Any] | None = None,
                 dtype: str | None = None, shard_size: str | int = DEFAULT_SHARD_SIZE,
                 block_size: int = DEFAULT_BLOCK, device: str = "cpu", force: bool = False, resume: bool = False,
                 allow_missing: bool = False, count_tied_twice: bool = False, seed: int = 0,
                 recipe: Mapping[str, Any] | None = None, fsync: bool = True, workers: int | None = None,
                 partition: Sequence[Sequence[int]] | None = None, retries: int = 3, address: str | None = None,
                 cache: StatisticsCache | None = None, quiet: bool = True, defaults: Sequence[str] = (),
                 notes: Sequence[str] = (), tokenizer_source: str | None = None, chat_template: str | None = None,
                 push_to_hub: str | None = None, private: bool = False, revision: str | None = None,
                 output_format: str = "hf", rank: Any = None, non_linear: str | None = None) -> MergeResult:
    """``rlmerge.merge`` with its passes run as Ray tasks (see the module docstring); the same output bytes.
    ``tokenizer_source``, ``chat_template``, ``push_to_hub`` (``private``, ``revision``): as ``rlmerge.merge``'s
    (the driver checks them before any weight is read, writes the tokenizer's files and uploads the finished
    output; the tasks merge the vocabulary rows the tokenizer plan moved).

    ``workers``: tasks at once (default: every one), and the number of tensor groups the statistics are mapped
    over (default: the cluster's CPUs). ``partition``: groups of shard indices, one merge task each (default: one
    shard per task); every shard exactly once.
    ``output_format``, ``rank``, ``non_linear``: checked as ``rlmerge.merge`` checks them (an adapter's option without
    ``output_format="peft"`` is refused the same way); a LoRA adapter itself is written on the local backend only.
    """
    t0 = time.perf_counter()
    pf = preflight(base, agents, output, method=method, params=params, dtype=dtype, shard_size=shard_size,
                   block_size=block_size, device=device, force=force, resume=resume, allow_missing=allow_missing,
                   count_tied_twice=count_tied_twice, seed=seed, tokenizer_source=tokenizer_source,
                   chat_template=chat_template, push_to_hub=push_to_hub, revision=revision, recipe=recipe,
                   output_format=output_format, rank=rank, non_linear=non_linear)
    try:
        raise_all(pf.problems)
        if pf.adapter is not None:
            raise ConfigError("a LoRA adapter (--output-format peft) is written on the local backend only",
                              hint="merge without --backend ray")
        assert pf.match is not None and pf.spec is not None and pf.base is not None
        if pf.at is not None:
            raise ConfigError("a recipe whose parameters vary by layer or module (gradients, filters) runs on the "
                              "local backend only", hint="merge it without --backend ray")
        check_copies(pf.match)
        init(address)
        listed = [a for a in pf.agents if a is not None]
        source = tokenizer_source
        if source is not None and source not in SOURCES:  # an agent: named to the tasks as they will list it
            source = str(listed[pick_agent(source, listed)].path)  # (found: preflight checked the choice)
        req = _Request(str(pf.base.path), tuple(str(a.path) for a in listed), method, dict(params or {}), dtype,
                       pf.shard_bytes, pf.block_size, device, seed, allow_missing, count_tied_twice, source)
        again = reproduce(pf, base, agents, given=params, recipe=recipe, dtype=dtype, seed=seed,
                          allow_missing=allow_missing, count_tied_twice=count_tied_twice,
                          tokenizer_source=tokenizer_source, chat_template=chat_template)
        with PartialDir(output, force=force, resume=resume, inputs=pf.models) as partial:
            result = _merge(pf, partial, req, recipe=recipe, fsync=fsync, workers=workers, partition=partition,
                            retries=retries, cache=cache, defaults=list(defaults), notes=list(notes), again=again)
    finally:
        pf.close()
    if push_to_hub is not None:  # as a local merge: only the finished, published output is uploaded
        result.url = push(result.output, push_to_hub, private=private, revision=revision,
                          message=f"Upload a {result.method} merge made with rlmerge")
    result.seconds = time.perf_counter() - t0
    return result


def _merge(pf: Preflight, partial: PartialDir, req: _Request, *, recipe: Mapping[str, Any] | None, fsync: bool,
           workers: int | None, partition: Sequence[Sequence[int]] | None, retries: int,
           cache: StatisticsCache | None, defaults: list[str], notes: list[str],
           again: Reproduce | None = None) -> MergeResult:
    """The local merge's stages (``merge.stages``), the passes run by ``OnRay``."""
    match, spec, p = pf.match, pf.spec, pf.params
    assert match is not None and spec is not None
    extras = [x for x in pf.extras if x is not None]
    metadata, fp = output_fingerprint(match, spec, p, seed=req.seed, recipe=recipe, device=req.device,
                                      shard_bytes=req.shard_bytes, extras=extras)
    writer = CheckpointWriter(partial, match.jobs, shard_size=req.shard_bytes, metadata=metadata, fingerprint=fp,
                              fsync=fsync, identity=input_identity([match.base, *match.agents, *extras]))
    on_ray = OnRay(req, partial, writer, _partition(partition, len(writer.shards)), metadata, fsync,
                   workers=workers, retries=retries)
    view = cache.view(match, extras) if cache is not None else None
    run = new_run(match, spec, p, seed=req.seed, extras=extras, cache=view)
    with writer:
        chosen = route(match, spec, p, device=req.device, block_size=req.block_size, extras=extras,
                       resumed=writer.resumed > 0, cached=view)
        result = stages(run, chosen, writer, on_ray, output=partial.output, recipe=recipe, defaults=defaults,
                        notes=notes, again=again)
    result.read_bytes = run.read_bytes  # the tasks count what they read, the copied tensors too
    result.write_bytes = match.write_bytes
    return result


@dataclass
class OnRay:
    """A merge's two passes as Ray tasks (``merge.Passes``): the statistics mapped over groups of tensors (on the
    driver when the method's observer is fed in that pass), the merge pass one task per group of output shards,
    each running the local merge pass over its shards' tensors. What they count and write comes back in the order a
    local merge makes it, so ``merge.stages`` goes on as it does locally."""

    req: _Request
    partial: PartialDir
    writer: CheckpointWriter
    groups: list[list[int]]  # output shards, one merge task per group
    metadata: dict[str, str]
    fsync: bool
    workers: int | None = None
    retries: int = 3

    def statistics(self, run: Run, chosen: Route) -> None:
        if chosen.observed:  # the observer is fed in the pass: on the driver
            local_statistics(run, chosen, block_size=self.req.block_size, device=self.req.device)
            return
        jobs = run.match.merge_jobs
        groups = _tensor_groups(jobs, self.workers or max(1, int(ray.cluster_resources().get("CPU", 1))))
        parts: dict[str, TensorStats] = {}

        def finished(i: int, value: Any) -> None:
            tensors, nbytes = value
            parts.update(tensors)
            run.read_bytes += nbytes

        task = _statistics_task.options(max_retries=self.retries, num_cpus=1)
        run_tasks(groups, finished, limit=self.workers, submit=lambda i: task.remote(self.req, groups[i]))
        numba = chosen.stats_fast
        order = [j for j in jobs if j.name in numba] + [j for j in jobs if j.name not in numba]
        run.stats.tensors = {j.name: parts[j.name] for j in order}  # reduced in a fixed order: a local merge's

    def merge(self, run: Run, chosen: Route, *, collect: bool) -> None:
        writer, kept = self.writer, self.writer.resumed
        todo = [g for g in ([i for i in g if i >= kept] for g in self.groups) if g]
        refs = (ray.put(run.prepared), ray.put(run.observer))
        expected = [s.filename for s in writer.shards]
        done: dict[int, Record] = {}
        counted: dict[str, TensorStats] = {}
        nxt = [kept]

        def finished(i: int, value: Any) -> None:
            records, tensors, nbytes, theirs = value
            if run.observer is not None and theirs is not None:
                run.observer.absorb(theirs)  # what a task's observer found while merging (a trim's kept counts)
            for shard, rec in zip(todo[i], records):
                done[shard] = rec
            counted.update(tensors)
            run.read_bytes += nbytes
            while nxt[0] in done:  # recorded in order: an interrupted merge keeps a prefix of shards
                writer.adopt(*done[nxt[0]])
                nxt[0] += 1

        task = _merge_task.options(max_retries=self.retries, num_cpus=1)

        def submit(i: int) -> Any:
            names = {j.name for k in todo[i] for j in writer.shards[k].jobs}
            return task.remote(self.req, todo[i], expected, refs[0], refs[1],
                               {n: ts for n, ts in run.stats.tensors.items() if n in names}, collect,
                               str(self.partial.output), str(self.partial.tmp), self.metadata, self.fsync)

        run_tasks(todo, finished, limit=self.workers, submit=submit)
        if collect:
            run.stats.tensors = {j.name: counted[j.name] for j in run.match.merge_jobs}  # job order, as locally


def _tensor_groups(jobs: Sequence[Any], n: int) -> list[list[str]]:
    """``jobs`` cut into at most ``n`` runs of consecutive tensors of about equal bytes."""
    total = sum(j.info.nbytes for j in jobs) or 1
    groups: list[list[str]] = [[]]
    acc = 0
    for j in jobs:
        if groups[-1] and acc >= total * len(groups) / n:
            groups.append([])
        groups[-1].append(j.name)
        acc += j.info.nbytes
    return [g for g in groups if g]


def _partition(partition: Sequence[Sequence[int]] | None, n: int) -> list[list[int]]:
    if partition is None:
        return [[i] for i in range(n)]
    groups = [sorted(int(i) for i in g) for g in partition]
    flat = sorted(i for g in groups for i in g)
    if flat != list(range(n)) or any(not g for g in groups):
        raise ConfigError(f"partition {list(map(list, partition))} must hold every shard 0 … {n - 1} exactly once, "
                          "in non-empty groups")
    return groups
