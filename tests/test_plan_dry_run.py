"""`rlmerge plan`: headers only, every problem at once, bytes and passes exact, memory estimate vs a real peak."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import rlmerge
from conftest import TINY
from rlmerge.cli import main
from rlmerge.engine import dryrun
from rlmerge.errors import ConfigError, InputError, OutputError
from rlmerge.io.checkpoint import Checkpoint
from rlmerge.synthetic import write_checkpoint


def _data_bytes(folder: Path, name: str = "model.safetensors") -> int:
    """Bytes of tensor data in a safetensors file: its size minus the 8-byte length and the header."""
    raw = (folder / name).read_bytes()
    return len(raw) - 8 - int.from_bytes(raw[:8], "little")


@pytest.fixture
def no_weight_reads(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*a: object, **k: object) -> None:
        raise AssertionError("a weight was read")

    for name in ("read_f32", "read_raw", "_read_bytes"):
        monkeypatch.setattr(Checkpoint, name, refuse)


@pytest.mark.parametrize(("method", "passes"), [("ram+", ["statistics", "merge"]), ("ram", ["merge"])])
def test_bytes_and_passes_from_headers_only(example, tmp_path: Path, no_weight_reads, monkeypatch, method,
                                            passes) -> None:
    base, agents = example
    r = dryrun.dry_run(base, agents, tmp_path / "out", method=method, shard_size="16KB")
    assert r.ok and r.passes == passes
    models = sum(_data_bytes(m) for m in [base, *agents])  # every tensor of TINY is a float merged tensor
    assert r.read_bytes == models * len(passes)
    widen = 2 if method == "ram+" else 1  # ram+ writes float32 over the bf16 base
    assert r.write_bytes == _data_bytes(base) * widen
    # The prediction matches what the merge then does: its shard count and the tensor bytes it writes.
    monkeypatch.undo()  # weights may be read again
    rlmerge.merge(base, agents, tmp_path / "out", method=method, shard_size="16KB")
    shards = sorted((tmp_path / "out").glob("*.safetensors"))
    assert r.shards == len(shards) > 1
    assert r.write_bytes == sum(_data_bytes(s.parent, s.name) for s in shards)
    assert r.memory is not None and r.memory.block == max(t.numel() for t in load_file(
        str(base / "model.safetensors")).values())


def test_every_problem_at_once(example, tmp_path: Path, no_weight_reads) -> None:
    base, agents = example
    (tmp_path / "out").mkdir()  # 1. the output exists
    f = agents[0] / "model.safetensors"  # 2. a truncated agent
    f.write_bytes(f.read_bytes()[:-10])
    t = load_file(str(agents[1] / "model.safetensors"))  # 3. an agent with a resized vocabulary
    t["model.embed_tokens.weight"] = torch.zeros(TINY.vocab + 4, TINY.hidden, dtype=torch.bfloat16)
    write_checkpoint(agents[1], t, json.loads((agents[1] / "config.json").read_text()))
    r = dryrun.dry_run(base, agents, tmp_path / "out", method="ram+", params={"r": -1},  # 4. r out of range
                       dtype="int3", available=1)  # 5. an unknown dtype, 6. no memory
    kinds = sorted(type(p).__name__ for p in r.problems)
    assert kinds == ["ConfigError", "ConfigError", "ConfigError", "InputError", "InputError", "OutputError"], \
        [p.render() for p in r.problems]
    text = "\n".join(p.render() for p in r.problems)
    for needle in ("already exists", "truncated", "vocabulary was resized", "int3", "r = -1", "GiB"):
        assert needle in text, needle


def test_cli_plan_exit_codes_and_json(example, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    base, agents = example
    argv = ["plan", str(base), *map(str, agents), "-o", str(tmp_path / "out")]
    assert main([*argv, "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["ok"] and doc["passes"] == ["statistics", "merge"] and doc["peak_memory_bytes"] > 0
    (tmp_path / "out").mkdir()
    assert main(argv) == OutputError.exit_code
    assert "already exists" in capsys.readouterr().err
    assert main([*argv, "--force", "--dtype", "int3"]) == ConfigError.exit_code
    assert main([*argv, "--force", "--preset", "official", "--r", "0.2"]) == ConfigError.exit_code  # r is not R
    assert "r does not apply to preset 'official'" in capsys.readouterr().err
    assert main(["plan", str(base), str(tmp_path / "nope")]) == InputError.exit_code
    assert not list(tmp_path.glob(".out*"))  # a dry run writes nothing


def test_side_inputs_are_checked_too(example, tmp_path: Path, no_weight_reads) -> None:
    base, agents = example
    missing = [str(tmp_path / f"fisher{i}") for i in range(3)]
    r = dryrun.dry_run(base, agents, method="fisher", params={"fisher": ",".join(missing)})
    assert sorted(p.file for p in r.problems) == missing
    assert all(isinstance(p, InputError) for p in r.problems)


def test_plan_of_a_lora_adapter_bounds_its_bytes_and_budgets_its_factorization(example, tmp_path: Path,
                                                                              no_weight_reads, monkeypatch) -> None:
    """`--output-format peft`: the same passes and reads as the full merge; the bytes written are each linear
    layer's float32 factors (k × n and m × k, k = min(R, m, n)) plus, at most, every other merged tensor whole;
    the memory has the factorization on top. The merge then writes exactly the factors and no more than the bound."""
    base, agents = example
    hf = dryrun.dry_run(base, agents, tmp_path / "out", method="ties")
    r = dryrun.dry_run(base, agents, tmp_path / "out", method="ties", output_format="peft", rank="4")
    assert r.ok and r.write_at_most and r.shards == 1 and r.rank == "4"
    assert (r.passes, r.read_bytes) == (hf.passes, hf.read_bytes)
    tensors = load_file(str(base / "model.safetensors"))  # safetensors' own reader: not rlmerge's
    linear = {k: t.shape for k, t in tensors.items() if t.dim() == 2 and k.endswith(".weight")
              and not k.endswith(("embed_tokens.weight", "lm_head.weight"))}
    lora = sum(4 * (m + n) * min(4, m, n) for m, n in linear.values())
    whole = sum(t.numel() * t.element_size() for k, t in tensors.items() if k not in linear)  # bf16, as the base
    assert "lm_head.weight" not in tensors  # TINY ties: the embedding is saved under lm_head too
    tied = tensors["model.embed_tokens.weight"]
    assert r.write_bytes == lora + whole + tied.numel() * tied.element_size()
    assert r.memory is not None and hf.memory is not None
    largest = max(m * n for m, n in linear.values())
    assert r.memory.total - hf.memory.total >= 20 * largest  # the float32/float64 copies of one matrix, at least
    assert r.to_json()["write_bytes_at_most"] is True and r.to_json()["output_format"] == "peft"
    monkeypatch.undo()  # weights may be read again
    res = rlmerge.merge(base, agents, tmp_path / "out", method="ties", output_format="peft", rank="4")
    written = load_file(str(res.output / "adapter_model.safetensors"))
    assert sum(t.numel() * t.element_size() for k, t in written.items() if ".lora_" in k) == lora
    assert _data_bytes(res.output, "adapter_model.safetensors") <= r.write_bytes


def test_plan_refuses_what_an_adapter_merge_and_a_push_would_refuse_all_at_once(example, tmp_path: Path,
                                                                               no_weight_reads, capsys) -> None:
    """A bad rank, a bad --non-linear, --resume of an adapter and a push that cannot happen (the suite is offline):
    `plan` reports each, as `merge` refuses each, before any weight is read."""
    base, agents = example
    rc = main(["plan", str(base), *map(str, agents), "-o", str(tmp_path / "out"), "--output-format", "peft",
               "--rank", "0", "--non-linear", "drop", "--resume", "--push-to-hub", "org/merged", "--json"])
    doc = json.loads(capsys.readouterr().out)
    assert rc != 0 and not doc["ok"]
    said = "\n".join(doc["problems"])
    for expected in ("--rank", "--non-linear 'drop'", "an adapter is written in one go", "HF_HUB_OFFLINE is set"):
        assert expected in said, said
    assert doc["passes"] == [] and doc["read_bytes"] is None and doc["write_bytes"] is None  # not 0: not planned
    main(["plan", str(base), *map(str, agents), "-o", str(tmp_path / "out"), "--output-format", "peft", "--rank", "0"])
    text = capsys.readouterr().out
    assert "passes: none planned until the problems below are fixed" in text, text
    assert "read 0 B" not in text and "rank None" not in text, text
    for bad in ({"rank": "0"}, {"non_linear": "drop"}, {"push_to_hub": "org/merged"}):
        with pytest.raises(rlmerge.RLMergeError):
            rlmerge.merge(base, agents, tmp_path / "o2", output_format="peft", **bad)
