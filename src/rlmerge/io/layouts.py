"""What a folder is, from its file names alone, and the reader that opens it.

Recognised (docs/inputs.md has the layouts, the commands and the limits):

- a Hugging Face model folder (``model.safetensors``, an index, ``pytorch_model.bin``): TRL's
  ``checkpoint-N/`` and OpenRLHF's saves are such folders (their optimizer and trainer files are ignored);
- a verl FSDP actor checkpoint: ``…/global_step_N/actor`` (or ``…/global_step_N``) holding
  ``model_world_size_W_rank_R.pt`` shards (io/verl.py);
- a PEFT LoRA adapter: ``adapter_config.json`` + ``adapter_model.safetensors`` (or ``.bin``), an agent over the
  base given with it (io/lora.py).

Refused, with the command that converts them: a verl Megatron checkpoint (``actor/dist_ckpt``) and a DeepSpeed
ZeRO checkpoint (``global_stepN/…_model_states.pt``). No file is opened to decide; nothing is unpickled here.
"""

from __future__ import annotations

import re
from pathlib import Path

from ..errors import InputError

HF_WEIGHTS = ("model.safetensors.index.json", "model.safetensors", "pytorch_model.bin.index.json",
              "pytorch_model.bin")
ADAPTER_WEIGHTS = ("adapter_model.safetensors", "adapter_model.bin")
VERL_RANK = re.compile(r"^model_world_size_(\d+)_rank_(\d+)\.pt$")
DEEPSPEED_STATES = re.compile(r"^(zero_pp_rank_\d+_)?mp_rank_\d+_model_states\.pt$|_optim_states\.pt$")


def _has(folder: Path, names: tuple[str, ...]) -> bool:
    return any((folder / n).is_file() for n in names)


def _verl_actor(folder: Path) -> Path | None:
    """``folder`` itself or its ``actor/`` when either holds verl FSDP shards or verl's fsdp_config.json."""
    for cand in (folder, folder / "actor"):
        if not cand.is_dir():
            continue
        if (cand / "fsdp_config.json").is_file() or any(VERL_RANK.match(p.name) for p in cand.iterdir()):
            return cand
    return None


def detect(path: Path) -> tuple[str, Path]:
    """("hf" | "verl" | "lora", folder to open); raises InputError for a layout that must be converted first."""
    if _has(path, HF_WEIGHTS) and _has(path, ("adapter_config.json",)):
        raise InputError("the folder holds both full model weights and a LoRA adapter (adapter_config.json)",
                         file=str(path), hint="move one of them to its own folder and pass that folder")
    if _has(path, HF_WEIGHTS):
        return "hf", path
    if (path / "adapter_config.json").is_file():
        if not _has(path, ADAPTER_WEIGHTS):
            raise InputError("adapter_config.json without adapter_model.safetensors or adapter_model.bin",
                             file=str(path), hint="copy the adapter's weights into the folder")
        return "lora", path
    _refuse_megatron(path)
    actor = _verl_actor(path)
    if actor is not None:
        return "verl", actor
    _refuse_deepspeed(path)
    return "hf", path  # Checkpoint says that no weights were found


def _refuse_megatron(path: Path) -> None:
    for actor in (path, path / "actor"):
        if (actor / "dist_ckpt").is_dir():
            raise InputError(
                "a verl Megatron checkpoint (dist_ckpt/): rlmerge reads verl's FSDP shards, not Megatron's",
                file=str(actor / "dist_ckpt"),
                hint=f"convert it first: python -m verl.model_merger merge --backend megatron --local_dir {actor} "
                     "--target_dir MERGED (add --tie-word-embedding when the base ties its embeddings), then pass "
                     "MERGED; or, if actor/huggingface holds the weights (checkpoint contents hf_model), pass "
                     f"{actor / 'huggingface'}")


def _refuse_deepspeed(path: Path) -> None:
    states = [p.name for p in path.iterdir() if DEEPSPEED_STATES.search(p.name)] if path.is_dir() else []
    tags = [p.name for p in path.iterdir() if p.is_dir() and p.name.startswith("global_step")] if path.is_dir() else []
    if not states and not ((path / "latest").is_file() and tags):
        return
    if states:  # the tag folder itself: the script and `latest` live in its parent
        parent, tag = path.parent, path.name
    else:
        parent, tag = path, (path / "latest").read_text(errors="replace").strip() or sorted(tags)[-1]
    raise InputError(
        f"a DeepSpeed ZeRO checkpoint ({', '.join(sorted(states)[:2]) or tag}): its weights are partitioned "
        "optimizer state, which rlmerge does not unpickle", file=str(path),
        hint=f"convert it: python {parent / 'zero_to_fp32.py'} {parent} CONVERTED --tag {tag} --safe_serialization; "
             "it writes float32 master weights, which against a bf16 base make nearly every element look changed: "
             "save CONVERTED in the base's dtype (with the run's config.json and tokenizer, e.g. from_pretrained("
             "CONVERTED, dtype=torch.bfloat16).save_pretrained(...)) and pass that folder")
