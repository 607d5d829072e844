"""Make a real verl FSDP actor checkpoint: run under torchrun in the verl venv (.venv-verl, `make verl`).

Each rank loads the base in float32 (verl's actor default), shards it with verl's own ``apply_fsdp2`` over the
mesh verl's ``create_device_mesh`` builds (("fsdp",) or ("ddp", "fsdp"), built here on "cpu"), takes a few
AdamW steps on random tokens on gloo/CPU, and saves with verl's ``FSDPCheckpointManager`` (model, optimizer
and extra state, huggingface/ config and tokenizer, fsdp_config.json): the files a verl 0.9 PPO run
writes to global_step_N/actor.

    torchrun --nproc_per_node 2 tests/verl_driver.py BASE OUT/global_step_3/actor --steps 3 --fsdp-size 2
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("base")
    ap.add_argument("actor")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--fsdp-size", type=int, default=-1)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    dist.init_process_group("gloo")
    from omegaconf import OmegaConf
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from verl.utils.checkpoint.fsdp_checkpoint_manager import FSDPCheckpointManager
    from verl.utils.fsdp_utils import apply_fsdp2

    torch.manual_seed(args.seed)
    model = AutoModelForCausalLM.from_pretrained(args.base, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(args.base)
    # verl's create_device_mesh, on "cpu": its device lookup falls back to CUDA on a machine without GPUs
    w, f = dist.get_world_size(), args.fsdp_size
    mesh = (init_device_mesh("cpu", (w,), mesh_dim_names=("fsdp",)) if f < 0 or f >= w
            else init_device_mesh("cpu", (w // f, f), mesh_dim_names=("ddp", "fsdp")))
    apply_fsdp2(model, {"mesh": mesh, "reshard_after_forward": True}, {})
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    g = torch.Generator().manual_seed(args.seed + dist.get_rank())
    for _ in range(args.steps):
        ids = torch.randint(0, model.config.vocab_size, (2, 16), generator=g)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
    cfg = OmegaConf.create({"save_contents": ["model", "optimizer", "extra"],
                            "load_contents": ["model", "optimizer", "extra"]})
    mgr = FSDPCheckpointManager(model, opt, None, processing_class=tokenizer, checkpoint_config=cfg)
    mgr.save_checkpoint(args.actor, global_step=args.steps)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
