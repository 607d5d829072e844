"""Engine invariants: block size, shard layout, input formats, dtypes, side files, loading in transformers."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import rlmerge
from conftest import TINY, as_bin, assert_same_tensors, load_output, numba_route
from reference import ram_reference
from rlmerge.engine.preflight import preflight
from rlmerge.methods import REGISTRY
from rlmerge.synthetic import Shape, make_example


def _shard_bytes(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.glob("*.safetensors"))}


@pytest.mark.parametrize("method", ["ram+", "ram", "task_arithmetic", "linear"])
def test_block_size_does_not_change_a_byte(example, tmp_path: Path, method: str) -> None:
    base, agents = example
    outs = []
    for bs in (97, 4099, 1 << 22):  # a small prime, a mid size, the default
        out = tmp_path / f"bs{bs}"
        rlmerge.merge(base, agents, out, method=method, block_size=bs, shard_size="20KB")
        outs.append(out)
    first = _shard_bytes(outs[0])
    assert len(first) > 1  # the 20 KB limit really produced several shards
    for o in outs[1:]:
        assert _shard_bytes(o) == first
        assert (o / "rlmerge.json").read_bytes() == (outs[0] / "rlmerge.json").read_bytes()


def test_shard_layouts_hold_the_same_tensors(example, tmp_path: Path) -> None:
    base, agents = example
    rlmerge.merge(base, agents, tmp_path / "one", method="ram+")
    rlmerge.merge(base, agents, tmp_path / "many", method="ram+", shard_size="30KB")
    assert (tmp_path / "one" / "model.safetensors").exists()
    assert not (tmp_path / "one" / "model.safetensors.index.json").exists()
    index = json.loads((tmp_path / "many" / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert files[0] == f"model-00001-of-{len(files):05d}.safetensors" and len(files) > 1
    sizes = {f: (tmp_path / "many" / f).stat().st_size for f in files}
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size()
                                                  for t in load_output(tmp_path / "many").values())
    assert all(s < 30_000 + 4096 for s in sizes.values())
    assert_same_tensors(load_output(tmp_path / "one"), load_output(tmp_path / "many"))


def test_sharded_and_bin_inputs_give_the_same_merge(example, tmp_path: Path) -> None:
    base, agents = example
    rlmerge.merge(base, agents, tmp_path / "ref", method="ram+")
    # Re-save every model sharded (via our own writer: a 1-agent linear merge with weight 1 is the identity)
    resharded = []
    for i, m in enumerate([base, *agents]):
        out = tmp_path / f"sh{i}"
        rlmerge.merge(m, [m], out, method="linear", shard_size="25KB")
        resharded.append(out)
    assert (resharded[0] / "model.safetensors.index.json").exists()
    rlmerge.merge(resharded[0], resharded[1:], tmp_path / "from_shards", method="ram+")
    assert_same_tensors(load_output(tmp_path / "ref"), load_output(tmp_path / "from_shards"))
    # pytorch_model.bin inputs
    bins = []
    for i, m in enumerate([base, *agents]):
        d = tmp_path / f"bin{i}"
        d.mkdir()
        torch.save(load_output(m), d / "pytorch_model.bin")
        (d / "config.json").write_text((m / "config.json").read_text())
        bins.append(d)
    rlmerge.merge(bins[0], bins[1:], tmp_path / "from_bin", method="ram+")
    assert_same_tensors(load_output(tmp_path / "ref"), load_output(tmp_path / "from_bin"))


def test_output_dtype_and_side_files(example, tmp_path: Path) -> None:
    base, agents = example
    res = rlmerge.merge(base, agents, tmp_path / "o", method="ram+", dtype="float32")
    out = tmp_path / "o"
    assert all(t.dtype == torch.float32 for t in load_output(out).values())
    assert_same_tensors(load_output(out), ram_reference(base, agents, preset="paper", out_dtype=torch.float32))
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["torch_dtype"] == "float32"
    for f in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert (out / f).read_bytes() == (base / f).read_bytes()
    prov = json.loads((out / "rlmerge.json").read_text())
    assert prov["method"] == "ram+" and prov["parameters"]["preset"] == "paper"
    assert prov["rlmerge_version"] == rlmerge.__version__
    assert [a["lambda"] for a in prov["agents"]] == res.lambdas
    assert len(prov["inputs"]) == 4 and all(len(i["files"][0]["header_sha256"]) == 64 for i in prov["inputs"])
    card = (out / "README.md").read_text()
    assert card.startswith("---\nlibrary_name: transformers\ntags:\n- merge\n- rlmerge\n- ram+\n---\n")
    assert f"{res.lambdas[0]:.4f}" in card
    assert not list(tmp_path.glob(".*rlmerge-partial"))


def test_non_float_tensors_copied_and_extra_agent_tensors_dropped(tmp_path: Path) -> None:
    from rlmerge.synthetic import write_checkpoint

    cfg = {"architectures": ["Tiny"], "tie_word_embeddings": False}
    b = write_checkpoint(tmp_path / "b", {"w": torch.zeros(4), "ids": torch.arange(5)}, cfg, tokenizer=False)
    # the agent holds the base's ids (one that changed them is refused: test_refusals.py)
    a = write_checkpoint(tmp_path / "a", {"w": torch.ones(4), "ids": torch.arange(5),
                                          "v_head.weight": torch.ones(3)}, cfg, tokenizer=False)
    res = rlmerge.merge(b, [a], tmp_path / "o", method="ram")
    got = load_output(tmp_path / "o")
    assert torch.equal(got["ids"], torch.arange(5)) and got["w"].tolist() == [1.0] * 4
    assert "v_head.weight" not in got
    assert any("v_head.weight" in w for w in res.warnings)
    assert json.loads((tmp_path / "o" / "rlmerge.json").read_text())["dropped_tensors"] == {"v_head.weight": [str(a)]}


def _with_empty(root: Path, dtypes: tuple[torch.dtype, ...]) -> tuple[Path, list[Path], list[str]]:
    """Two agents of TINY whose models hold a float tensor of no element (the base's, then each agent's, in
    ``dtypes``), and a Fisher file per agent for ``fisher``."""
    from safetensors.torch import load_file, save_file

    base, agents = make_example(root, shape=TINY, densities=(0.05, 0.5))
    fisher = []
    for i, (m, dtype) in enumerate(zip((base, *agents), dtypes)):
        f = m / "model.safetensors"
        t = load_file(f)
        t["z.empty"] = torch.zeros(0, 4, dtype=dtype)
        save_file(t, f, metadata={"format": "pt"})
        if i:
            (root / f"fisher{i}").mkdir()
            save_file({k: torch.ones_like(v, dtype=torch.float32) for k, v in t.items() if v.is_floating_point()},
                      root / f"fisher{i}" / "model.safetensors", metadata={"format": "pt"})
            fisher.append(str(root / f"fisher{i}"))
    return base, agents, fisher


@pytest.fixture(scope="module")
def with_empty(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[Path], list[str]]:
    return _with_empty(tmp_path_factory.mktemp("empty"), (torch.bfloat16,) * 3)


@pytest.mark.parametrize("method", sorted(REGISTRY))
def test_an_empty_float_tensor_is_written_by_every_method(with_empty, tmp_path: Path, method: str) -> None:
    # No block of it is streamed, so no statistics pass sees it: it is copied, in the dtype a merged tensor takes
    # (model_stock and arm-ties crashed on it; plan said ok).
    base, agents, fisher = with_empty
    params = {"fisher": fisher} if method == "fisher" else None
    pf = preflight(base, agents, tmp_path / "o", method=method, params=params)
    pf.close()
    assert not pf.problems, [p.render() for p in pf.problems]
    rlmerge.merge(base, agents, tmp_path / "o", method=method, params=params)
    got = load_output(tmp_path / "o")
    assert got["z.empty"].shape == (0, 4)
    assert got["z.empty"].dtype == got["model.norm.weight"].dtype  # the output rule of the merged tensors


def test_an_empty_float_tensor_an_agent_stores_in_another_dtype_is_no_change(tmp_path: Path) -> None:
    # copied, not merged: the agent's float32 copy of no element holds no value the merge would lose
    base, agents, _ = _with_empty(tmp_path / "in", (torch.bfloat16, torch.bfloat16, torch.float32))
    rlmerge.merge(base, agents, tmp_path / "o", method="ties", dtype="float32")
    got = load_output(tmp_path / "o")
    assert got["z.empty"].shape == (0, 4) and got["z.empty"].dtype == torch.float32


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_merged_folder_loads_and_generates_in_transformers(tmp_path: Path, arch: str) -> None:
    transformers = pytest.importorskip("transformers")
    shape = Shape(arch, vocab=128, hidden=32, layers=2, heads=4, kv_heads=2, intermediate=64, tie=arch == "qwen2")
    base, agents = make_example(tmp_path / "in", shape=shape)
    out = tmp_path / "merged"
    rlmerge.merge(base, agents, out, method="ram+", shard_size="40KB")
    model = transformers.AutoModelForCausalLM.from_pretrained(out)
    tok = transformers.AutoTokenizer.from_pretrained(out)
    assert model.dtype == torch.float32  # ram+ writes float32 over a bf16 base, and the config says so
    state = model.state_dict()
    for name, t in load_output(out).items():
        assert torch.equal(state[name], t), name
    if shape.tie:
        assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    ids = tok("hello", return_tensors="pt")
    gen = model.generate(**ids, max_new_tokens=4, do_sample=False)
    assert gen.shape == (1, ids["input_ids"].shape[1] + 4)
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False) == "user: hi\n"


def test_three_agents_of_tiny_shape_lambda_values_are_reported(tmp_path: Path) -> None:
    base, agents = make_example(tmp_path / "in", shape=TINY, densities=(0.05, 0.5))
    res = rlmerge.merge(base, agents, tmp_path / "o")
    assert len(res.lambdas) == 2 and all(1.0 <= x <= 1.2 for x in res.lambdas)


@pytest.mark.parametrize("method", ["ram+", "ties", "dare_ties", "della", "model_stock"])
def test_bin_inputs_take_the_numba_path_and_write_the_same_bytes(example, tmp_path: Path, method: str) -> None:
    # .bin checkpoints are read into the numba path's blocks (Checkpoint.read_into), no longer sent to torch.
    base, agents = example
    bins = [as_bin(m, tmp_path / f"bin{i}") for i, m in enumerate([base, *agents])]
    fast, merged = numba_route(bins[0], bins[1:], method)
    assert fast == merged and merged
    kw = {"method": method, "block_size": 3000}
    rlmerge.merge(base, agents, tmp_path / "st", **kw)
    rlmerge.merge(bins[0], bins[1:], tmp_path / "bin", **kw)
    assert_same_tensors(load_output(tmp_path / "bin"), load_output(tmp_path / "st"))
