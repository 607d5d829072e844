"""verl FSDP actor checkpoints, read straight from the shards, against verl's own model_merger.

The checkpoints are real: tests/verl_driver.py trains a tiny Qwen2 for a few AdamW steps with FSDP2 (verl's
apply_fsdp2) on gloo/CPU and saves it with verl 0.9.1's FSDPCheckpointManager, once on 2 ranks (mesh
("fsdp",)) and once on 4 (mesh ("ddp", "fsdp") = 2 × 2, HSDP). verl's ``python -m verl.model_merger merge
--backend fsdp`` then converts each to a Hugging Face folder. Merging from the shards must give the same bytes
as merging those folders. verl runs in its own venv (``make verl``: it pins transformers<5.11), in one process
that imports it once and forks the ranks with torchrun's environment (``verl_driver.py --runs``).
"""

from __future__ import annotations

import json
import os
import pickle
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

import rlmerge
from conftest import TINY, load_output, numba_route
from rlmerge.engine.dryrun import dry_run
from rlmerge.errors import InputError
from rlmerge.io.open import open_all
from rlmerge.synthetic import Shape, make_example

REPO = Path(__file__).resolve().parents[1]
VERL = REPO / ".venv-verl" / "bin"
# vocab 131 and 2-row shards of 1-D tensors: slices of unequal length (torch.chunk's last one is shorter)
SHAPE = Shape("qwen2", vocab=131, hidden=32, layers=2, heads=4, kv_heads=2, intermediate=64, tie=True)


def _run(cmd: list[str], cwd: Path) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "RAY_DISABLE_IMPORT_WARNING": "1"}
    done = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]


def _train_and_convert(base: Path, runs: list[dict], folder: Path) -> None:
    """verl_driver.py --runs: each run's ranks forked from one process that imported verl once (as torchrun's ranks
    with their environment), then verl's model_merger on each (its command's own main)."""
    spec = folder / "runs.json"
    spec.write_text(json.dumps({"base": str(base), "runs": [{k: str(v) if isinstance(v, Path) else v
                                                             for k, v in r.items()} for r in runs]}))
    _run([str(VERL / "python"), str(REPO / "tests/verl_driver.py"), "--runs", str(spec)], folder)


@pytest.fixture(scope="module")
def verl_run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    if not (VERL / "python").exists():
        pytest.skip("verl's venv is missing: run `make verl` (make test does)")
    root = tmp_path_factory.mktemp("verl")
    base, _ = make_example(root / "in", shape=SHAPE, densities=())
    a = root / "a" / "global_step_3" / "actor"
    b = root / "b" / "global_step_2" / "actor"
    a.parent.mkdir(parents=True)
    b.parent.mkdir(parents=True)
    _train_and_convert(base, [{"actor": a, "nproc": 2, "fsdp": -1, "steps": 3, "seed": 0, "hf": root / "a-hf"},
                              {"actor": b, "nproc": 4, "fsdp": 2, "steps": 2, "seed": 1, "hf": root / "b-hf"}], root)
    return {"base": base, "a": a, "b": b, "a_hf": root / "a-hf", "b_hf": root / "b-hf"}


def test_shards_read_as_model_merger_writes_them(verl_run: dict[str, Path]) -> None:
    for key, actor in (("a", verl_run["a"].parent), ("b", verl_run["b"])):  # global_step_N and …/actor
        shards, hf = open_all([actor, verl_run[f"{key}_hf"]])
        assert shards.format == "verl" and hf.format == "safetensors"
        assert shards.tensors.keys() == hf.tensors.keys()  # lm_head, tied to the embeddings, dropped by both
        for name, info in hf.tensors.items():
            mine = shards.tensors[name]
            assert (mine.dtype, mine.shape) == (info.dtype, info.shape), name
            assert bytes(shards.read_raw(name, 0, info.numel)) == bytes(hf.read_raw(name, 0, info.numel)), name
            x = shards.read_f32(name, 1, info.numel, torch.empty(info.numel))
            assert torch.equal(x, hf.read_f32(name, 1, info.numel, torch.empty(info.numel))), name
        assert shards.config["num_hidden_layers"] == SHAPE.layers
        assert any("rounded to bfloat16" in n for n in shards.notes)
    assert len(open_all([verl_run["b"]])[0].files) == 2  # HSDP: only the first replica's 2 ranks are read


def test_resume_fingerprint_covers_every_shard(verl_run: dict[str, Path]) -> None:
    """partial.fingerprint identifies a checkpoint by its ``files``: the first replica's model shards (by path and
    size; the resume check adds their identities), never the optimizer or extra-state files."""
    from rlmerge.io.partial import fingerprint

    ckpt = open_all([verl_run["b"]])[0]
    assert [f.name for f in ckpt.files] == ["model_world_size_4_rank_0.pt", "model_world_size_4_rank_1.pt"]
    other = open_all([verl_run["a"]])[0]
    assert fingerprint([ckpt], {}) != fingerprint([other], {})


@pytest.mark.parametrize("method", ["ram+", "ties"])
def test_merge_from_shards_equals_merge_of_model_merger_output(verl_run: dict[str, Path], tmp_path: Path,
                                                               method: str) -> None:
    v = verl_run
    fast, merged = numba_route(v["base"], [v["a"].parent, v["b"]], method)
    assert fast == merged  # the shards are read into the numba path's blocks (VerlCheckpoint.read_into)
    rlmerge.merge(v["base"], [v["a"].parent, v["b"]], tmp_path / "shards", method=method, block_size=100)
    rlmerge.merge(v["base"], [v["a_hf"], v["b_hf"]], tmp_path / "hf", method=method)
    got, ref = load_output(tmp_path / "shards"), load_output(tmp_path / "hf")
    assert got.keys() == ref.keys() and all(torch.equal(got[k].view(torch.uint8), ref[k].view(torch.uint8))
                                            for k in ref)
    assert not all(torch.equal(ref[k], load_output(v["base"])[k]) for k in ref)  # training changed something


def test_verl_checkpoint_as_base(verl_run: dict[str, Path], tmp_path: Path) -> None:
    v = verl_run
    rlmerge.merge(v["a"], [v["b"], v["base"]], tmp_path / "shards", method="ram")
    rlmerge.merge(v["a_hf"], [v["b_hf"], v["base"]], tmp_path / "hf", method="ram")
    got, ref = load_output(tmp_path / "shards"), load_output(tmp_path / "hf")
    assert all(torch.equal(got[k].view(torch.uint8), ref[k].view(torch.uint8)) for k in ref)
    assert (tmp_path / "shards" / "config.json").is_file()  # side files come from actor/huggingface/
    assert (tmp_path / "shards" / "tokenizer.json").read_bytes() == (v["a"] / "huggingface/tokenizer.json").read_bytes()


class _Marker:
    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self) -> tuple:
        return (os.makedirs, (self.path,))


def test_optimizer_and_extra_state_are_never_unpickled(verl_run: dict[str, Path], tmp_path: Path) -> None:
    actor = tmp_path / "global_step_3" / "actor"
    shutil.copytree(verl_run["a"], actor)
    marker = tmp_path / "code-ran"
    for f in actor.glob("*.pt"):
        if f.name.startswith(("optim_", "extra_state_")):
            f.write_bytes(pickle.dumps(_Marker(str(marker))))
    rlmerge.merge(verl_run["base"], [actor.parent], tmp_path / "out", method="ram")
    assert not marker.exists()
    rlmerge.inspect(verl_run["base"], [actor])
    assert not marker.exists()


def test_plan_and_inspect_open_the_same_inputs(verl_run: dict[str, Path], tmp_path: Path) -> None:
    v = verl_run
    report = dry_run(v["base"], [v["a"].parent, v["b"]], tmp_path / "out", method="ram+")
    assert report.ok and any("rounded to bfloat16" in w for w in report.warnings)
    rep = rlmerge.inspect(v["base"], [v["a"].parent, v["b"]])
    ref = rlmerge.inspect(v["base"], [v["a_hf"], v["b_hf"]])
    assert [r["changed"] for r in rep.doc["per_agent"]] == [r["changed"] for r in ref.doc["per_agent"]]


_CRAFT = """
import sys, torch, torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Partial
src, dst, kind = sys.argv[1:4]
dist.init_process_group("gloo", init_method="file://" + dst + ".store", rank=0, world_size=1)
mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("fsdp",))
state = torch.load(src, weights_only=True)
out = {}
for k, v in state.items():
    local = v._local_tensor if isinstance(v, DTensor) else v
    if kind == "lora" and k.endswith("q_proj.weight"):
        out[k.replace("q_proj.weight", "q_proj.lora_A.weight")] = local[:2]
    place = Replicate() if kind == "replicate" else Partial() if kind == "partial" else None
    out[k] = DTensor.from_local(local, mesh, [place]) if place is not None else local
torch.save(out, dst)
dist.destroy_process_group()
"""


@pytest.mark.parametrize(("kind", "match"), [("replicate", "placements"), ("partial", "placements"),
                                             ("lora", "LoRA run")])
def test_unhandled_shards_are_refused_naming_the_tensor(verl_run: dict[str, Path], tmp_path: Path, kind: str,
                                                       match: str) -> None:
    actor = tmp_path / "actor"
    (actor / "huggingface").mkdir(parents=True)
    shutil.copy(verl_run["a"] / "huggingface" / "config.json", actor / "huggingface" / "config.json")
    src = verl_run["a"] / "model_world_size_2_rank_0.pt"
    subprocess.run([sys.executable, "-c", _CRAFT, str(src), str(actor / "model_world_size_1_rank_0.pt"), kind],
                   check=True, capture_output=True, timeout=120)
    with pytest.raises(InputError, match=match) as info:
        open_all([actor])
    assert info.value.tensor and info.value.hint


@pytest.fixture(scope="module")
def tiny_base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_example(tmp_path_factory.mktemp("tiny"), shape=TINY, densities=())[0]


@pytest.mark.parametrize("kind", ["complex", "sparse", "sparse_csr", "meta"])
@pytest.mark.parametrize("command", ["merge", "plan"])
def test_complex_sparse_or_meta_tensors_in_a_rank_file_are_refused_naming_them(tiny_base: Path, tmp_path: Path,
                                                                                capsys, command: str,
                                                                                kind: str) -> None:
    """A single-rank verl save (a plain state dict in model_world_size_1_rank_0.pt) holding one complex, sparse or
    meta tensor: a ValueError or NotImplementedError traceback before; now exit 3 naming the file and tensor."""
    from rlmerge.cli import main

    actor = tmp_path / "global_step_1" / "actor"
    (actor / "huggingface").mkdir(parents=True)
    shutil.copy(tiny_base / "config.json", actor / "huggingface" / "config.json")
    state = {k: v.float() for k, v in load_output(tiny_base).items()}
    name = "model.layers.0.mlp.up_proj.weight"
    rank = actor / "model_world_size_1_rank_0.pt"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch: "Sparse CSR tensor support is in beta state"
        state[name] = {"complex": lambda t: t.to(torch.complex64), "sparse": lambda t: t.to_sparse(),
                       "sparse_csr": lambda t: t.to_sparse_csr(),
                       "meta": lambda t: torch.empty(t.shape, device="meta")}[kind](state[name])
        torch.save(state, rank)
        rc = main([command, str(tiny_base), str(actor.parent), "-o", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert rc == 3, err
    assert f"(file {rank}, tensor {name!r})" in err and "Traceback" not in err
    assert {"complex": "complex64", "sparse": "sparse_coo", "sparse_csr": "sparse_csr", "meta": "meta"}[kind] in err
    assert "verl.model_merger" in err and not (tmp_path / "out").exists()


def test_missing_rank_and_megatron_are_refused(verl_run: dict[str, Path], tmp_path: Path) -> None:
    actor = tmp_path / "global_step_3" / "actor"
    shutil.copytree(verl_run["a"], actor)
    (actor / "model_world_size_2_rank_1.pt").unlink()
    with pytest.raises(InputError, match="rank 1 is missing"):
        open_all([actor.parent])
    mega = tmp_path / "mega" / "global_step_5"
    (mega / "actor" / "dist_ckpt").mkdir(parents=True)
    with pytest.raises(InputError, match="Megatron") as info:
        open_all([mega])
    assert "python -m verl.model_merger merge --backend megatron" in (info.value.hint or "")


def test_verl_shards_beside_a_lora_adapter_on_the_numba_path(verl_run: dict[str, Path], tmp_path: Path,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    # With an adapter among the agents the numba path reads every agent as τ; the verl reader rounds its float32
    # shards through its own scratch buffer, which must not be the buffer it is asked to fill.
    from test_inputs_lora import _adapter

    v = verl_run
    adapter = _adapter(v["base"], tmp_path / "adapter", 0, r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])
    agents = [v["a"], adapter]
    fast, merged = numba_route(v["base"], agents, "ram+")
    assert fast == merged
    rlmerge.merge(v["base"], agents, tmp_path / "numba", method="ram+", block_size=100)
    monkeypatch.setenv("RLMERGE_FAST", "0")
    rlmerge.merge(v["base"], agents, tmp_path / "torch", method="ram+")
    got, ref = load_output(tmp_path / "numba"), load_output(tmp_path / "torch")
    assert got.keys() == ref.keys() and all(torch.equal(got[k].view(torch.uint8), ref[k].view(torch.uint8))
                                            for k in ref)
