"""``--output-format peft`` (issue 25, part 3): the merged task vector as a PEFT LoRA adapter of the base.

Oracles: PEFT itself (the adapter loads with ``PeftModel.from_pretrained``; ``merge_and_unload`` gives the full merge
back at full rank), an independent float64 SVD of each matrix's Δ (at a lower rank the error is exactly the SVD tail,
and ``energy=F`` keeps the smallest rank reaching F), and rlmerge's own LoRA reader.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

import rlmerge
from conftest import TINY, load_output
from rlmerge.errors import ConfigError
from rlmerge.synthetic import Shape, make_example

peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[Path], Path]:
    """A float32 tied Qwen2 base, three agents, and their full task-arithmetic merge (float32)."""
    root = tmp_path_factory.mktemp("adapter")
    base, agents = make_example(root / "in", shape=TINY, dtype=torch.float32)
    rlmerge.merge(base, agents, root / "full", method="task_arithmetic", params={"scaling": 0.7}, dtype="float32")
    return base, agents, root / "full"


def _peft_merged(base: Path, adapter: Path) -> dict[str, torch.Tensor]:
    model = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    merged = peft.PeftModel.from_pretrained(model, adapter).merge_and_unload()
    assert merged.lm_head.weight.data_ptr() == merged.model.embed_tokens.weight.data_ptr()  # still tied
    return {k: v.detach() for k, v in merged.state_dict().items() if k != "lm_head.weight"}


def _adapter(models, tmp_path: Path, rank: str, **kw: object) -> tuple[Path, rlmerge.MergeResult]:
    base, agents, _ = models
    out = tmp_path / f"adapter-{rank}"
    res = rlmerge.merge(base, agents, out, method="task_arithmetic", params={"scaling": 0.7}, dtype="float32",
                        output_format="peft", rank=rank, **kw)
    return out, res


def test_full_rank_adapter_gives_the_full_merge_back_through_peft(models, tmp_path: Path) -> None:
    base, _, full = models
    out, res = _adapter(models, tmp_path, "full")
    cfg = json.loads((out / "adapter_config.json").read_text())
    assert cfg["peft_type"] == "LORA" and cfg["base_model_name_or_path"] == str(base.resolve())
    assert cfg["bias"] == "lora_only" and cfg["ensure_weight_tying"] is True
    assert "model.embed_tokens" in cfg["modules_to_save"] and "model.norm" in cfg["modules_to_save"]
    assert all(m["relative_error"] == 0 and m["rank"] == m["of"] for m in res.adapter["matrices"].values())
    got, want, b = _peft_merged(base, out), load_output(full), load_output(base)
    assert got.keys() == want.keys()
    for k, w in want.items():
        scale = float((w - b[k]).abs().max())
        assert float((got[k] - w).abs().max()) <= 2e-6 * scale + 1e-7, k
    assert sorted(p.name for p in out.iterdir()) == ["README.md", "adapter_config.json", "adapter_model.safetensors",
                                                    "rlmerge-report.json", "rlmerge.json", "tokenizer.json",
                                                    "tokenizer_config.json"]
    prov = json.loads((out / "rlmerge.json").read_text())
    assert prov["adapter"] == res.adapter and set(prov["files"]) == {p.name for p in out.iterdir()} - {"rlmerge.json"}


@pytest.mark.parametrize("rank", ["2", "energy=0.9"])
def test_lower_rank_error_is_the_svd_tail(models, tmp_path: Path, rank: str) -> None:
    base, _, full = models
    out, res = _adapter(models, tmp_path, rank)
    got, want, b = _peft_merged(base, out), load_output(full), load_output(base)
    mats = res.adapter["matrices"]
    assert len(mats) == 14 and set(mats) == {k for k, v in b.items() if v.dim() == 2 and "embed" not in k}
    for name, m in mats.items():
        delta = (want[name] - b[name]).double()
        sv = torch.linalg.svdvals(delta)
        sq = sv**2
        k = m["rank"]
        if rank == "2":
            assert k == 2
        else:  # the smallest k whose top-k share of ‖Δ‖² reaches 0.9
            share = torch.cumsum(sq, 0) / sq.sum()
            assert share[k - 1] >= 0.9 - 1e-9 and (k == 1 or share[k - 2] < 0.9)
        tail = float(sq[k:].sum().sqrt())
        measured = float((got[name].double() - want[name].double()).norm())
        assert measured == pytest.approx(tail, rel=1e-4, abs=1e-6 * float(sv[0]))
        assert m["relative_error"] == pytest.approx(tail / float(delta.norm()), rel=1e-6, abs=1e-9)
    for name in set(want) - set(mats):  # everything else whole: the full merge's values
        assert torch.allclose(got[name], want[name], rtol=0, atol=1e-7), name
    cfg = json.loads((out / "adapter_config.json").read_text())
    assert {m: v["rank"] for m, v in mats.items() if v["rank"] != cfg["r"]} == \
        {m + ".weight": r for m, r in cfg["rank_pattern"].items()}
    assert cfg["alpha_pattern"] == cfg["rank_pattern"] and cfg["lora_alpha"] == cfg["r"]


@pytest.mark.parametrize("tie", [False, True])
def test_rlmerge_reads_its_adapter_back_as_an_agent(tmp_path: Path, tie: bool) -> None:
    """The adapter, read as an agent by io/lora.py, merges to the full merge: an untied Llama (lm_head saved whole on
    its own), and a tied one (lm_head saved beside the embedding, as PEFT does with ensure_weight_tying: one tensor
    under two names, the copy dropped on reading)."""
    base, agents = make_example(tmp_path / "in", shape=Shape("llama", 128, 32, 2, 4, 2, 64, tie=tie),
                                dtype=torch.float32, densities=(0.1, 0.3))
    rlmerge.merge(base, agents, tmp_path / "full", method="ties", dtype="float32")
    rlmerge.merge(base, agents, tmp_path / "ad", method="ties", dtype="float32", output_format="peft")
    cfg = json.loads((tmp_path / "ad" / "adapter_config.json").read_text())
    assert ("lm_head" in cfg["modules_to_save"]) is not tie and cfg["ensure_weight_tying"] is tie
    if tie:  # PEFT's model saves the tied head beside the embedding: the file holds both names
        keys = safe_open(tmp_path / "ad" / "adapter_model.safetensors", "pt").keys()
        assert {k for k in keys if "lm_head" in k} == {"base_model.model.lm_head.weight"}
    rlmerge.merge(base, [tmp_path / "ad"], tmp_path / "again", method="task_arithmetic", dtype="float32")
    again, want, b = load_output(tmp_path / "again"), load_output(tmp_path / "full"), load_output(base)
    assert again.keys() == want.keys()
    for k, w in want.items():
        assert float((again[k] - w).abs().max()) <= 2e-6 * float((w - b[k]).abs().max()) + 1e-7, k
    if tie:  # without ensure_weight_tying the head is its own copy, which a tied base cannot hold: refused
        cfg["ensure_weight_tying"] = False
        (tmp_path / "ad" / "adapter_config.json").write_text(json.dumps(cfg))
        with pytest.raises(rlmerge.InputError, match="lm_head"):
            rlmerge.merge(base, [tmp_path / "ad"], tmp_path / "refused", method="task_arithmetic")


def test_non_linear_refuse_and_bad_options(models, tmp_path: Path) -> None:
    base, agents, _ = models
    with pytest.raises(ConfigError, match="which a LoRA adapter cannot hold"):
        rlmerge.merge(base, agents, tmp_path / "o", output_format="peft", non_linear="refuse")
    assert not (tmp_path / "o").exists() and not list(tmp_path.glob(".o.rlmerge-partial"))
    for bad in ({"rank": "0"}, {"rank": "energy=1.5"}, {"non_linear": "drop"}, {"resume": True}):
        with pytest.raises(ConfigError):
            rlmerge.merge(base, agents, tmp_path / "o", output_format="peft", **bad)
    with pytest.raises(ConfigError, match="--output-format 'gguf'"):
        rlmerge.merge(base, agents, tmp_path / "o", output_format="gguf")


def test_same_adapter_on_both_paths_and_any_block_size(models, tmp_path: Path, monkeypatch) -> None:
    base, agents, _ = models
    files = []
    for fast, block in ((True, 1 << 20), (False, 777)):
        monkeypatch.setenv("RLMERGE_FAST", "1" if fast else "0")
        out = tmp_path / f"{fast}"
        rlmerge.merge(base, agents, out, method="ram+", output_format="peft", rank="4", block_size=block)
        files.append((out / "adapter_model.safetensors").read_bytes())
    assert files[0] == files[1]


def test_adapter_options_without_peft_are_refused_in_plan_and_merge(models, tmp_path: Path, capsys) -> None:  # noqa: ANN001
    """--rank / --non-linear mean nothing to a full model: refused (even --rank abc), never silently ignored, by plan
    and merge alike, before anything is written."""
    from rlmerge.cli import main as cli_main

    base, agents, _ = models
    models_args = [str(base), *map(str, agents)]
    for flags in (["--rank", "abc"], ["--rank", "4"], ["--non-linear", "refuse"], ["--rank", "4", "--non-linear",
                                                                                    "save"]):
        for command in (["merge", *models_args, "-o", str(tmp_path / "o"), "-q"], ["plan", *models_args]):
            assert cli_main([*command, *flags]) == ConfigError.exit_code, (command[0], flags)
            said = capsys.readouterr().err
            verb = "apply" if len(flags) > 2 else "applies"
            assert f"{verb} to --output-format peft" in " ".join(said.split()) and flags[1] in said, said
    assert not (tmp_path / "o").exists()
    with pytest.raises(ConfigError, match="--rank 4 applies to --output-format peft"):
        rlmerge.merge(base, agents, tmp_path / "o", rank="4")
    assert cli_main(["plan", *models_args, "--output-format", "peft", "--rank", "4"]) == 0  # where they apply
