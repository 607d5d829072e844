"""Make a real verl FSDP actor checkpoint: run under torchrun in the verl venv (.venv-verl, `make verl`).

Each rank loads the base in float32 (verl's actor default), shards it with verl's own ``apply_fsdp2`` over the
mesh verl's ``create_device_mesh`` builds (("fsdp",) or ("ddp", "fsdp"), built here on "cpu"), takes a few
AdamW steps on random tokens on gloo/CPU, and saves with verl's ``FSDPCheckpointManager`` (model, optimizer
and extra state, huggingface/ config and tokenizer, fsdp_config.json): the files a verl 0.9 PPO run
writes to global_step_N/actor.

    torchrun --nproc_per_node 2 tests/verl_driver.py BASE OUT/global_step_3/actor --steps 3 --fsdp-size 2

``--runs SPEC.json`` does several such runs and converts each with verl's model_merger, in one process: it imports
torch, transformers and verl once (~11 s of CPU per process here), then forks each run's ranks with the environment
torchrun gives them (RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT; env:// rendezvous, as
under torchrun), and runs ``python -m verl.model_merger merge --backend fsdp`` 's own ``main`` for each. Compared
with torchrun's ranks (4 ranks, HSDP 2 × 2): the same files, every rank's tensors equal with the same placements;
only extra_state's pickled RNG states differ (a forked rank's Python and numpy generators). The imports are paid
once instead of once per rank and per conversion: tests/test_inputs_verl.py's fixture took 67 s of subprocesses
(2-core AMD EPYC; 77 s in a fresh clone's CI), 16 s this way.

    {"base": BASE, "runs": [{"actor": OUT/global_step_3/actor, "nproc": 2, "fsdp": -1, "steps": 3, "seed": 0,
                             "hf": OUT/a-hf}, ...]}
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import socket
import sys
import traceback
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh


def train(base: str, actor: str, *, steps: int, lr: float, fsdp_size: int, seed: int) -> None:
    """One rank: load the base, shard it with verl's apply_fsdp2, take ``steps`` AdamW steps, save as verl does."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    dist.init_process_group("gloo")
    from omegaconf import OmegaConf
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from verl.utils.checkpoint.fsdp_checkpoint_manager import FSDPCheckpointManager
    from verl.utils.fsdp_utils import apply_fsdp2

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(base)
    # verl's create_device_mesh, on "cpu": its device lookup falls back to CUDA on a machine without GPUs
    w, f = dist.get_world_size(), fsdp_size
    mesh = (init_device_mesh("cpu", (w,), mesh_dim_names=("fsdp",)) if f < 0 or f >= w
            else init_device_mesh("cpu", (w // f, f), mesh_dim_names=("ddp", "fsdp")))
    apply_fsdp2(model, {"mesh": mesh, "reshard_after_forward": True}, {})
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    g = torch.Generator().manual_seed(seed + dist.get_rank())
    for _ in range(steps):
        ids = torch.randint(0, model.config.vocab_size, (2, 16), generator=g)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
    cfg = OmegaConf.create({"save_contents": ["model", "optimizer", "extra"],
                            "load_contents": ["model", "optimizer", "extra"]})
    mgr = FSDPCheckpointManager(model, opt, None, processing_class=tokenizer, checkpoint_config=cfg)
    mgr.save_checkpoint(actor, global_step=steps)
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _forked_run(base: str, run: dict) -> None:
    """``run``'s ranks as forked children of this process, with the environment torchrun gives its ranks."""
    nproc, port, pids = int(run["nproc"]), _free_port(), []
    for rank in range(nproc):
        pid = os.fork()
        if pid == 0:  # a rank: never returns into the parent's code
            code = 1
            try:
                os.environ.update({"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(nproc),
                                   "LOCAL_WORLD_SIZE": str(nproc), "MASTER_ADDR": "127.0.0.1",
                                   "MASTER_PORT": str(port)})
                train(base, run["actor"], steps=int(run["steps"]), lr=float(run.get("lr", 3e-3)),
                      fsdp_size=int(run["fsdp"]), seed=int(run["seed"]))
                code = 0
            except BaseException:
                traceback.print_exc()
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code)
        pids.append(pid)
    left, failed = set(pids), False
    while left:  # whichever rank ends first: a failed one is seen at once, not after the ranks waiting for it
        pid, status = os.wait()
        left.discard(pid)
        if os.waitstatus_to_exitcode(status) != 0 and not failed:
            failed = True
            for other in left:  # the others would wait for the failed rank's collectives (gloo: 30 minutes)
                with contextlib.suppress(ProcessLookupError):
                    os.kill(other, signal.SIGKILL)
    if failed:
        raise SystemExit(f"a rank of {run['actor']} failed")


def runs(spec_file: str) -> None:
    spec = json.loads(Path(spec_file).read_text())
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    # what the ranks and the conversions import, imported once here, before the ranks are forked
    import transformers  # noqa: F401
    import verl.model_merger.fsdp_model_merger  # noqa: F401
    import verl.utils.checkpoint.fsdp_checkpoint_manager  # noqa: F401
    import verl.utils.fsdp_utils  # noqa: F401
    from verl.model_merger.__main__ import main as model_merger

    for run in spec["runs"]:
        _forked_run(spec["base"], run)
    for run in spec["runs"]:
        if run.get("hf"):  # `python -m verl.model_merger merge --backend fsdp …`, its own main
            sys.argv = ["verl.model_merger", "merge", "--backend", "fsdp", "--local_dir", str(run["actor"]),
                        "--target_dir", str(run["hf"])]
            model_merger()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("base", nargs="?")
    ap.add_argument("actor", nargs="?")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--fsdp-size", type=int, default=-1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--runs", help="a JSON spec of runs to fork and convert in this process (see the docstring)")
    args = ap.parse_args()
    if args.runs:
        runs(args.runs)
    elif args.base and args.actor:
        train(args.base, args.actor, steps=args.steps, lr=args.lr, fsdp_size=args.fsdp_size, seed=args.seed)
    else:
        ap.error("give BASE and ACTOR (under torchrun), or --runs SPEC.json")


if __name__ == "__main__":
    main()
