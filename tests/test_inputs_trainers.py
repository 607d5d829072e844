"""What else users pass: a TRL ``checkpoint-N/``, an OpenRLHF save, a DeepSpeed ZeRO ``global_stepN/``.

- TRL: the real SFTTrainer (TRL 1.16, the lab extra) trains the tiny base for 2 steps and writes checkpoint-2/
  (model.safetensors beside optimizer.pt, scheduler.pt, rng_state.pth, trainer_state.json, training_args.bin).
- OpenRLHF (0.11.2) does not install here: it requires flash-attn 2.8.3 (a CUDA build) and deepspeed 0.19.6. Its
  save is reproduced with the calls its ``DeepspeedStrategy.save_model`` makes: ``save_pretrained(out,
  state_dict=…)``, ``config.to_json_file``, ``tokenizer.save_pretrained``; the critic goes to ``out_critic``
  (``CriticModel``: the base's ``model.*`` plus a ``score`` value head, no lm_head).
- DeepSpeed ZeRO: the layout ``save_checkpoint`` writes (``latest``, ``zero_to_fp32.py``, ``global_stepN/`` with
  ``zero_pp_rank_*_mp_rank_*_model_states.pt`` and ``*_optim_states.pt``): refused without unpickling anything.
"""

from __future__ import annotations

import json
import os
import pickle
from pathlib import Path

import pytest
import torch

import rlmerge
from conftest import TINY, load_output
from reference import ram_reference
from rlmerge.errors import InputError
from rlmerge.synthetic import make_example

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    trl = pytest.importorskip("trl", reason="TRL is in the lab extra (make setup installs it)")
    from datasets import Dataset

    root = tmp_path_factory.mktemp("trainers")
    base, _ = make_example(root / "in", shape=TINY, densities=())
    tok = transformers.AutoTokenizer.from_pretrained(base)
    model = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.bfloat16)
    data = Dataset.from_dict({"text": [f"task {i}: answer {i * 7 % 10}" for i in range(16)]})
    args = trl.SFTConfig(output_dir=str(root / "trl"), max_steps=2, save_steps=2, per_device_train_batch_size=4,
                         learning_rate=3e-3, report_to=[], use_cpu=True, logging_steps=1, seed=0,
                         dataset_num_proc=None, max_length=32)
    trl.SFTTrainer(model=model, args=args, train_dataset=data, processing_class=tok).train()
    return {"base": base, "trl": root / "trl" / "checkpoint-2", "openrlhf": _openrlhf_save(base, root / "orl")}


def _openrlhf_save(base: Path, out: Path) -> Path:
    """An OpenRLHF actor and critic save, made with the calls its save_model makes (see the module docstring)."""
    tok = transformers.AutoTokenizer.from_pretrained(base)
    model = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.bfloat16)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    ids = torch.randint(0, TINY.vocab, (2, 12), generator=torch.Generator().manual_seed(5))
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    model.save_pretrained(out, state_dict=model.state_dict())
    model.config.to_json_file(str(out / "config.json"))
    tok.save_pretrained(out)
    critic = out.parent / (out.name + "_critic")  # args.ckpt.output_dir + "_critic"
    state = {k: v for k, v in model.state_dict().items() if k.startswith("model.")}
    state["score.weight"] = torch.zeros(1, TINY.hidden, dtype=torch.bfloat16)
    from safetensors.torch import save_file

    critic.mkdir()
    save_file(state, str(critic / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((out / "config.json").read_text())
    (critic / "config.json").write_text(json.dumps({**cfg, "architectures": ["CriticModel"],
                                                    "normalize_reward": False}))
    return out


def test_trl_checkpoint_and_openrlhf_save_merge_like_the_dense_reference(trained: dict[str, Path],
                                                                         tmp_path: Path) -> None:
    ckpt = trained["trl"]
    assert {"optimizer.pt", "trainer_state.json", "model.safetensors"} <= {p.name for p in ckpt.iterdir()}
    agents = [ckpt, trained["openrlhf"]]
    rlmerge.merge(trained["base"], agents, tmp_path / "out", method="ram")
    ref = ram_reference(trained["base"], agents, preset=None)
    got = load_output(tmp_path / "out")
    assert got.keys() == ref.keys() and all(torch.equal(got[k], ref[k]) for k in ref)
    assert not all(torch.equal(ref[k], load_output(trained["base"])[k]) for k in ref)  # the trainers changed it


def test_openrlhf_critic_with_value_head_is_refused(trained: dict[str, Path], tmp_path: Path) -> None:
    critic = trained["openrlhf"].parent / (trained["openrlhf"].name + "_critic")
    with pytest.raises(rlmerge.RLMergeError, match="CriticModel"):
        rlmerge.merge(trained["base"], [trained["trl"], critic], tmp_path / "out")


class _Marker:
    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self) -> tuple:
        return (os.makedirs, (self.path,))


@pytest.mark.parametrize("point_at", ["tag", "parent"])
def test_deepspeed_zero_checkpoint_is_refused_with_the_command(example, tmp_path: Path, point_at: str) -> None:
    base, _ = example
    ckpt = tmp_path / "ckpt"
    tag = ckpt / "global_step7"
    tag.mkdir(parents=True)
    marker = tmp_path / "code-ran"
    for name in ("zero_pp_rank_0_mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_optim_states.pt",
                 "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt"):
        (tag / name).write_bytes(pickle.dumps(_Marker(str(marker))))
    (ckpt / "latest").write_text("global_step7")
    (ckpt / "zero_to_fp32.py").write_text("# copied by DeepSpeed\n")
    with pytest.raises(InputError, match="DeepSpeed ZeRO") as info:
        rlmerge.merge(base, [tag if point_at == "tag" else ckpt], tmp_path / "out")
    hint = info.value.hint or ""
    assert f"python {ckpt / 'zero_to_fp32.py'} {ckpt} CONVERTED --tag global_step7 --safe_serialization" in hint
    assert "base's dtype" in hint and not marker.exists()
