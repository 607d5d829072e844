"""The Ray backend (engine/distributed.py) on a real Ray cluster started in-process on this machine.

Oracles: `rlmerge.merge` run locally. A merge split by output shard over Ray tasks writes every file of the local
merge byte for byte, for any number of workers and any partition of the shards; a worker killed after writing its
shards (before reporting them) is retried and the bytes are still the local merge's; with no retries left the
merge fails cleanly and `resume=True` finishes it, again byte for byte. A sweep on Ray scores what it scores
locally, also when a candidate task's worker is killed.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

ray = pytest.importorskip("ray")

import rlmerge  # noqa: E402 - after the importorskip
from rlmerge.engine import distributed  # noqa: E402
from rlmerge.engine.distributed import FAULT_ENV, merge_on_ray  # noqa: E402
from rlmerge.errors import ConfigError, OutputError  # noqa: E402
from test_interrupt_resume import _wait, _wait_for  # noqa: E402 - a signalled child's helpers
from test_push import hub  # noqa: E402, F401 - the fake Hub, a fixture

SHARD = 20_000  # bytes: the tiny example's output in 3 shards
ROOT = Path(__file__).resolve().parents[1]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def _listener(answer: bytes | None) -> Iterator[int]:
    """A loopback port that accepts connections and sends ``answer`` (None: says nothing)."""
    srv = socket.create_server(("127.0.0.1", 0))
    held: list[socket.socket] = []

    def serve() -> None:
        with contextlib.suppress(OSError):
            while True:
                conn, _ = srv.accept()
                held.append(conn)
                if answer is not None:
                    conn.sendall(answer)

    threading.Thread(target=serve, daemon=True).start()
    try:
        yield srv.getsockname()[1]
    finally:
        srv.close()
        for c in held:
            c.close()


# Before any test that starts the in-process cluster: ``init`` connects only while Ray is not initialised.
@pytest.mark.parametrize("command", ["merge", "sweep"])
@pytest.mark.parametrize("listening", ["nothing", "a silent service", "another service"])
def test_an_unreachable_ray_address_fails_within_the_bound_naming_it(example, tmp_path: Path, monkeypatch, capsys,
                                                                    command: str, listening: str) -> None:
    """Ray itself retries an unreachable RAY_ADDRESS for minutes (20 tries of ~40 s); rlmerge gives up within
    ``CONNECT_TIMEOUT`` (1 s here) with a ConfigError naming the address, before anything is written."""
    from rlmerge.cli import main

    assert not ray.is_initialized()
    monkeypatch.setattr(distributed, "CONNECT_TIMEOUT", 1.0)
    base, agents = example
    answer = {"nothing": None, "a silent service": None, "another service": b"HTTP/1.1 400 Bad Request\r\n\r\n"}
    with contextlib.ExitStack() as stack:
        port = _free_port() if listening == "nothing" else stack.enter_context(_listener(answer[listening]))
        address = f"127.0.0.1:{port}"
        monkeypatch.setenv("RAY_ADDRESS", address)
        args = (["merge", str(base), *map(str, agents), "-o", str(tmp_path / "out"), "--backend", "ray", "-q"]
                if command == "merge" else
                ["sweep", str(base), *map(str, agents), "-o", str(tmp_path / "out"), "--backend", "ray",
                 "--candidate", "task_arithmetic scaling=1", "-q"])
        t0 = time.monotonic()
        rc = main(args)
        took = time.monotonic() - t0
    err = capsys.readouterr().err
    assert rc == 2, err
    assert took < 10, took  # the bound (1 s) plus the command's own checks
    assert f"cannot reach a Ray cluster at {address}" in err and "Traceback" not in err
    assert not ray.is_initialized()
    assert not (tmp_path / "out").exists()  # refused before the output was claimed


@pytest.mark.parametrize(("address", "says"), [("garbage", "'garbage' is not HOST:PORT"),
                                              ("ray://127.0.0.1:{port}", "cannot reach a Ray cluster at ray://"),
                                              ("[::1]:{port}", "cannot reach a Ray cluster at [::1]")])
def test_a_ray_address_that_is_no_cluster_is_a_config_error(example, tmp_path: Path, monkeypatch, capsys,
                                                            address: str, says: str) -> None:
    """Beyond the issue: a RAY_ADDRESS that is not an address, a Ray Client address and an IPv6 one."""
    from rlmerge.cli import main

    base, agents = example
    monkeypatch.setenv("RAY_ADDRESS", address.format(port=_free_port()))
    rc = main(["merge", str(base), *map(str, agents), "-o", str(tmp_path / "out"), "--backend", "ray", "-q"])
    err = capsys.readouterr().err
    assert rc == 2 and says in err and "Traceback" not in err, err
    assert not ray.is_initialized() and not (tmp_path / "out").exists()


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A local Ray cluster (2 CPUs) whose workers import this checkout; yields the fault-injection file's path."""
    trigger = tmp_path_factory.mktemp("fault") / "kill-next-worker"
    env = {"PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT / "tests")]), FAULT_ENV: str(trigger),
           "HF_HUB_OFFLINE": "1"}
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, runtime_env={"env_vars": env})
    yield trigger
    ray.shutdown()


def same_folder(a: Path, b: Path, *, but: tuple[str, ...] = ()) -> None:
    names = sorted(p.name for p in a.iterdir())
    assert names == sorted(p.name for p in b.iterdir())
    for n in names:
        if n not in but:
            assert (a / n).read_bytes() == (b / n).read_bytes(), n


@pytest.mark.parametrize(("method", "params"), [("ram+", {"r": 0.1}), ("ties", {"density": 0.3}),
                                                ("ties_global", {"density": 0.2}), ("dare_ties", {"density": 0.5})],
                         ids=["ram+", "ties", "ties_global", "dare_ties"])
def test_a_merge_split_over_ray_tasks_writes_the_local_bytes(cluster, example, tmp_path: Path, method: str,
                                                            params: dict) -> None:
    base, agents = example
    # bf16 for every method (ram+ would write float32): three shards, and RAM+'s "λ kept" below 100 % in the card
    kw = {"method": method, "params": params, "shard_size": SHARD, "seed": 3, "dtype": "bfloat16"}
    local = rlmerge.merge(base, agents, tmp_path / "local", **kw)
    assert len(list(local.output.glob("model-*.safetensors"))) == 3
    for i, (workers, partition) in enumerate([(1, None), (2, [[0, 2], [1]]), (3, [[2], [1, 0]])]):
        res = merge_on_ray(base, agents, tmp_path / f"ray{i}", **kw, workers=workers, partition=partition)
        same_folder(local.output, res.output)
        assert res.passes == local.passes


def test_lora_adapters_over_ray_write_the_local_bytes(cluster, tmp_path: Path) -> None:
    """Agents that are PEFT adapters (every agent read as its τ, on the numba kernels) merge on Ray as locally."""
    pytest.importorskip("peft")
    from conftest import TINY
    from rlmerge.synthetic import make_example
    from test_inputs_lora import _adapter

    base, _ = make_example(tmp_path / "in", shape=TINY, densities=())
    adapters = [_adapter(base, tmp_path / "a0", 0, r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]),
                _adapter(base, tmp_path / "a1", 1, r=8, lora_alpha=16, target_modules=["q_proj", "gate_proj"])]
    for method in ("ram+", "ties"):
        kw = {"method": method, "shard_size": SHARD, "dtype": "bfloat16"}
        local = rlmerge.merge(base, adapters, tmp_path / f"local-{method}", **kw)
        res = merge_on_ray(base, adapters, tmp_path / f"ray-{method}", **kw, workers=2)
        same_folder(local.output, res.output)


def test_a_killed_worker_is_retried_and_a_merge_out_of_retries_resumes(cluster, example, tmp_path: Path) -> None:
    base, agents = example
    local = rlmerge.merge(base, agents, tmp_path / "local", method="ram+", shard_size=SHARD)
    cluster.write_text("")  # the next merge task's worker dies after writing its shards
    res = merge_on_ray(base, agents, tmp_path / "retried", method="ram+", shard_size=SHARD, workers=1)
    assert not cluster.exists()  # it did die
    same_folder(local.output, res.output)
    cluster.write_text("")
    with pytest.raises(OutputError, match="--resume"):
        merge_on_ray(base, agents, tmp_path / "resumed", method="ram+", shard_size=SHARD, workers=1, retries=0)
    assert not (tmp_path / "resumed").exists()  # nothing published
    res = merge_on_ray(base, agents, tmp_path / "resumed", method="ram+", shard_size=SHARD, workers=1, resume=True)
    same_folder(local.output, res.output)


def test_a_resumed_ray_merge_takes_its_statistics_from_a_cache_as_locally(cluster, example, tmp_path: Path) -> None:
    """The Ray driver runs the local merge's stages: a cache that holds the statistics skips the statistics pass
    (on a fresh merge and on a resumed one), and the output is the local merge's, byte for byte."""
    from rlmerge.sweeping.cache import StatsCache

    base, agents = example
    kw = {"method": "ram+", "shard_size": SHARD, "dtype": "bfloat16"}
    cache = StatsCache()
    local = rlmerge.merge(base, agents, tmp_path / "local", cache=cache, **kw)
    assert local.passes == ["statistics", "merge"]
    res = merge_on_ray(base, agents, tmp_path / "fresh", cache=cache, workers=2, **kw)
    assert res.passes == ["merge"]
    same_folder(local.output, res.output)
    cluster.write_text("")  # the next merge task's worker dies after writing its shards: the merge stops
    with pytest.raises(OutputError, match="--resume"):
        merge_on_ray(base, agents, tmp_path / "resumed", cache=cache, workers=1, retries=0, **kw)
    res = merge_on_ray(base, agents, tmp_path / "resumed", cache=cache, workers=1, resume=True, **kw)
    assert res.passes == ["merge"]
    same_folder(local.output, res.output)


class Norms:
    """One 'task': the negative distance of the merge to the first agent (a scorer Ray pickles to its workers)."""

    def __init__(self, agent: Path) -> None:
        from conftest import load_output

        self.target = load_output(agent)

    def __call__(self, built: rlmerge.Built) -> dict[str, float]:
        from conftest import load_output

        t = built.tensors if built.tensors is not None else load_output(built.path)
        return {"near": -sum(float((t[k].float() - v.float()).square().sum()) for k, v in self.target.items()
                             if v.is_floating_point() and k in t)}


def test_a_sweep_on_ray_scores_what_it_scores_locally(cluster, example, tmp_path: Path) -> None:
    base, agents = example
    grid = ["ram+ r=0.05,0.2", "ties density=0.3", "dare_ties density=0.5 seed=0,1"]
    local = rlmerge.sweep(base, agents, tmp_path / "local", candidates=grid, scorer=Norms(agents[0]), keep=1)
    on_ray = rlmerge.sweep(base, agents, tmp_path / "ray", candidates=grid, scorer=Norms(agents[0]), keep=1,
                           backend="ray", workers=2)
    assert [s.scores for s in on_ray.scored] == [s.scores for s in local.scored]
    assert on_ray.statistics_passes <= 1  # RAM+'s counts: counted once on the driver, shipped to the tasks
    assert [s.candidate.id for s in on_ray.ranking] == [s.candidate.id for s in local.ranking]
    cluster.write_text("")  # a candidate task's worker dies after scoring, before reporting: the task is retried
    retried = rlmerge.sweep(base, agents, candidates=grid, scorer=Norms(agents[0]), backend="ray", workers=2)
    assert not cluster.exists()
    assert [s.scores for s in retried.scored] == [s.scores for s in local.scored]
    same_folder(local.kept[0], on_ray.kept[0], but=("rlmerge.json", "README.md"))  # provenance names its folder


class FailingOnTies(Norms):
    def __call__(self, built: rlmerge.Built) -> dict[str, float]:
        if built.candidate.method == "ties":
            raise ValueError("no TIES today")
        return super().__call__(built)


def test_a_scorer_failure_in_a_ray_task_is_recorded_as_locally(cluster, example, tmp_path: Path) -> None:
    """The failure is the candidate's outcome on Ray too (build_and_score records it inside the task): the same
    errors, ranking and kept checkpoints as the local sweep."""
    base, agents = example
    grid = ["task_arithmetic scaling=0.5,1", "ties density=0.3"]
    local = rlmerge.sweep(base, agents, tmp_path / "local", candidates=grid, scorer=FailingOnTies(agents[0]), keep=3)
    on_ray = rlmerge.sweep(base, agents, tmp_path / "ray", candidates=grid, scorer=FailingOnTies(agents[0]), keep=3,
                           backend="ray", workers=2)
    assert [(s.scores, s.error) for s in on_ray.scored] == [(s.scores, s.error) for s in local.scored]
    assert [s.error for s in on_ray.failed] == ["ValueError: no TIES today"]
    assert [s.candidate.id for s in on_ray.ranking] == [s.candidate.id for s in local.ranking]
    assert [p.name for p in on_ray.kept] == ["best-1", "best-2"]


def test_cli_merge_backend_ray_writes_the_local_bytes(cluster, example, tmp_path: Path) -> None:
    from rlmerge.cli import main

    base, agents = example
    args = [str(base), *map(str, agents), "--method", "ties", "--param", "density=0.3", "--shard-size", str(SHARD),
            "-q"]
    assert main(["merge", *args, "-o", str(tmp_path / "local")]) == 0
    assert main(["merge", *args, "-o", str(tmp_path / "ray"), "--backend", "ray", "--workers", "2"]) == 0
    same_folder(tmp_path / "local", tmp_path / "ray")


def test_a_search_on_ray_asks_a_batch_per_worker_and_scores_each_trial_as_locally(cluster, example,
                                                                                 tmp_path: Path) -> None:
    """Trials asked on the driver, a batch of ``workers`` at a time, scored as Ray tasks, told as they finish: exactly
    N, the same trials in a second run (a batch is asked whole, so the order results return in does not matter),
    each candidate's score the local one."""
    pytest.importorskip("optuna")
    base, agents = example
    kw = {"candidates": ["ram+ r=0.01..0.5:log alpha=0.5..3", "ties density=0.1..0.9 scaling=0.5..1.5"],
          "search": "tpe", "trials": 5, "seed": 2, "backend": "ray", "workers": 2}
    a = rlmerge.sweep(base, agents, tmp_path / "a", scorer=Norms(agents[0]), **kw)
    b = rlmerge.sweep(base, agents, tmp_path / "b", scorer=Norms(agents[0]), **kw)
    docs = [json.loads((tmp_path / x / "results.json").read_text()) for x in ("a", "b")]
    assert [len(d["trials"]) for d in docs] == [5, 5] and docs[0]["search"]["batch"] == 2
    assert {t["state"] for t in docs[0]["trials"]} == {"complete"}
    assert [(t["candidate"], t["params"]) for t in docs[0]["trials"]] == \
        [(t["candidate"], t["params"]) for t in docs[1]["trials"]]
    local = rlmerge.sweep(base, agents, None, candidates=[s.candidate for s in a.scored], scorer=Norms(agents[0]))
    assert [s.scores for s in local.scored] == [s.scores for s in a.scored] == [s.scores for s in b.scored]
    res = rlmerge.sweep(base, agents, tmp_path / "a", scorer=Norms(agents[0]), resume=True, **{**kw, "trials": 7})
    assert len(json.loads((tmp_path / "a" / "results.json").read_text())["trials"]) == 7 and res.scored


def test_references_on_ray_are_scored_on_the_driver_and_compared_as_locally(cluster, example, tmp_path: Path) -> None:
    """--references with --backend ray: the inputs are scored here, on the driver (this scorer object sees them; the
    candidates are scored by copies of it in Ray tasks), and results.json's comparison is the local sweep's."""
    from test_sweep_references import GRID, Known

    base, agents = example
    on_ray, local = Known(), Known()
    res = rlmerge.sweep(base, agents, tmp_path / "ray", candidates=GRID, scorer=on_ray, memory="always",
                        references=True, backend="ray", workers=2)
    rlmerge.sweep(base, agents, tmp_path / "local", candidates=GRID, scorer=local, memory="always", references=True)
    assert on_ray.inputs == local.inputs == ["base", "coder", "tool-use", "memory"] and on_ray.candidates == []
    assert len(local.candidates) == 2 and [s.candidate.label for s in res.ranking][0] == "task_arithmetic scaling=1"
    docs = [json.loads((tmp_path / f / "results.json").read_text()) for f in ("ray", "local")]
    assert docs[0]["versus_inputs"] == docs[1]["versus_inputs"]
    assert [{k: v for k, v in r.items() if k != "score_seconds"} for r in docs[0]["references"]] == \
        [{k: v for k, v in r.items() if k != "score_seconds"} for r in docs[1]["references"]]


def test_a_ray_merge_takes_the_tokenizer_choices_and_pushes_as_a_local_one(
        cluster, tmp_path: Path, monkeypatch, hub) -> None:  # noqa: F811 - the fixture imported above
    """--tokenizer-source (union: the vocabulary rows move, merged in the tasks; an agent named by a path relative
    to the driver's folder) and --chat-template on Ray write the local merge's files byte for byte; --push-to-hub
    uploads the finished output from the driver."""
    import huggingface_hub.constants as hc

    from test_push import TOKEN
    from test_tokenizers import vocab_models

    models = vocab_models(tmp_path / "vocab")
    agents = [models["tools"], models["memory"], models["coder"]]
    monkeypatch.chdir(tmp_path / "vocab")
    for i, (source, template) in enumerate([("union", str(models["tools"])), ("./memory", None)]):
        kw = {"method": "ram", "tokenizer_source": source, "chat_template": template, "shard_size": SHARD}
        local = rlmerge.merge(models["base"], agents, tmp_path / f"local{i}", **kw)
        res = merge_on_ray(models["base"], agents, tmp_path / f"ray{i}", **kw, workers=2)
        same_folder(local.output, res.output)
        vocab = json.loads((res.output / "config.json").read_text())["vocab_size"]
        assert vocab == (101 if source == "union" else 99)  # rows moved: the tasks merged the chosen vocabulary
    monkeypatch.setattr(hc, "ENDPOINT", hub.url)
    monkeypatch.setattr(hc, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(hc, "HF_HUB_DISABLE_XET", True)
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    res = merge_on_ray(models["base"], agents, tmp_path / "pushed", method="ram", workers=2, push_to_hub="org/m",
                       tokenizer_source="base")
    (commit,) = hub.commits
    assert commit["files"] == {p.name: p.read_bytes() for p in res.output.iterdir()}
    assert res.url == f"{hub.url}/org/m/tree/main"


def test_cli_merge_backend_ray_refuses_only_an_adapter_output(cluster, example, tmp_path: Path, capsys) -> None:
    from rlmerge.cli import main

    base, agents = example
    args = [str(base), *map(str, agents), "-q", "--backend", "ray"]
    assert main(["merge", *args, "-o", str(tmp_path / "a"), "--output-format", "peft", "--rank", "4"]) == 2
    assert "LoRA adapter" in capsys.readouterr().err and not (tmp_path / "a").exists()
    # an adapter's option without an adapter: the local backend's message (it applies to peft), not "local only"
    assert main(["merge", *args, "-o", str(tmp_path / "r"), "--rank", "4"]) == 2
    said = capsys.readouterr().err
    assert "--rank 4 applies to --output-format peft" in said and "local backend" not in said, said
    assert not (tmp_path / "r").exists()
    with pytest.raises(ConfigError, match="local backend only"):  # the library call says the same as the CLI
        merge_on_ray(base, agents, tmp_path / "p", method="ram", output_format="peft", rank=4)
    assert not (tmp_path / "p").exists()
    assert main(["merge", *args, "-o", str(tmp_path / "t"), "--tokenizer-source", "base"]) == 0
    assert main(["merge", str(base), *map(str, agents), "-q", "-o", str(tmp_path / "l"), "--tokenizer-source",
                 "base"]) == 0
    same_folder(tmp_path / "l", tmp_path / "t")


# A real CLI child whose merge, once Ray is initialised in it, waits for as long as the file HOLD exists (after
# touching READY): the parent's SIGTERM lands while Ray's driver runs in the process.
HELD_AFTER_INIT = """
import os, sys, time
from rlmerge.engine import distributed
_init = distributed.init
def _held(*args, **kwargs):
    _init(*args, **kwargs)
    open(os.environ["READY"], "w").close()
    while os.path.exists(os.environ["HOLD"]):
        time.sleep(0.01)
distributed.init = _held
from rlmerge.cli import main
sys.exit(main(sys.argv[1:]))
"""


def test_sigterm_after_ray_started_takes_the_interrupt_path(example, tmp_path: Path) -> None:
    """Ray's driver swaps the SIGTERM handler for one that calls sys.exit (exit 15, no message, finished shards
    discarded); rlmerge keeps its own, so a SIGTERM under `--backend ray` stops as one under the local backend."""
    base, agents = example
    ready, hold, out = tmp_path / "ready", tmp_path / "hold", tmp_path / "out"
    hold.touch()
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env.update(READY=str(ready), HOLD=str(hold), HF_HUB_OFFLINE="1",
               PYTHONPATH=os.pathsep.join([str(ROOT / "src"), env.get("PYTHONPATH", "")]))
    p = subprocess.Popen([sys.executable, "-c", HELD_AFTER_INIT, "merge", str(base), *map(str, agents), "-o",
                          str(out), "--backend", "ray", "-q"], env=env, stderr=subprocess.PIPE, text=True)
    try:
        _wait_for(ready.exists, p, "Ray's start", timeout=120)
        p.send_signal(signal.SIGTERM)
        rc, stderr = _wait(p)
    finally:
        if p.poll() is None:
            p.kill()
    assert rc == 130 and "interrupted: nothing was written" in stderr, (rc, stderr)
    assert not out.exists()
