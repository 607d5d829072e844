"""The Ray backend on a two-node cluster: a head and a second node (separate raylets, loopback, one CPU each) started
on this machine with ``ray.cluster_utils.Cluster`` (what ``ray start --head`` and ``ray start --address`` start),
the folder shared because both nodes are this machine. Oracle: the local merge's bytes.
"""

from __future__ import annotations

from pathlib import Path

import pytest

ray = pytest.importorskip("ray")
cluster_utils = pytest.importorskip("ray.cluster_utils")

import rlmerge  # noqa: E402 - after the importorskip
from rlmerge.engine import distributed  # noqa: E402
from rlmerge.engine.distributed import merge_on_ray  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def two_nodes() -> str:
    c = cluster_utils.Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
    c.add_node(num_cpus=1)
    c.wait_for_nodes()
    ray.init(address=c.address, log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": str(ROOT / "src"), "HF_HUB_OFFLINE": "1"}})
    yield c.address
    ray.shutdown()
    c.shutdown()


def test_the_reachability_check_accepts_a_real_head(two_nodes: str) -> None:
    """``init``'s bounded check (one HTTP/2 round trip) passes a real Ray head, by its address and on loopback."""
    distributed.reach(two_nodes, timeout=5)
    distributed.reach(f"127.0.0.1:{two_nodes.rsplit(':', 1)[1]}", timeout=5)


def test_a_merge_over_two_nodes_writes_the_local_bytes(two_nodes, example, tmp_path: Path) -> None:
    assert len([n for n in ray.nodes() if n["Alive"]]) == 2
    base, agents = example
    for method in ("ram+", "ties"):
        kw = {"method": method, "shard_size": 20_000, "dtype": "bfloat16"}  # three shards for every method
        local = rlmerge.merge(base, agents, tmp_path / f"local-{method}", **kw)
        res = merge_on_ray(base, agents, tmp_path / f"ray-{method}", **kw, workers=2, partition=[[0, 2], [1]])
        names = sorted(p.name for p in local.output.iterdir())
        assert names == sorted(p.name for p in res.output.iterdir())
        for n in names:
            assert (local.output / n).read_bytes() == (res.output / n).read_bytes(), n
