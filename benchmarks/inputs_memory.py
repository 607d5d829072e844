"""Peak RSS of merges whose agents are a verl FSDP checkpoint (W = 2) or a PEFT LoRA adapter, 0.5B shape.

Builds (once, reused) the Qwen2.5-0.5B-shaped synthetic set of benchmarks/dataset.py (bf16 base, "coder" and
"tool-use" agents), a verl actor checkpoint of "coder" written by verl's own FSDPCheckpointManager on 2 gloo
ranks (tests/verl_driver.py with --steps 0, so its float32 shards round back to coder's bf16 bytes), and a
rank-16 PEFT adapter on every linear layer. Then runs five merges (RAM+ unless --method says otherwise, two
agents) in child processes under ``/usr/bin/time -v`` and prints each one's peak RSS and wall time:

    safetensors    base + [coder, tool-use]                      (the numba path, for comparison)
    verl W=2       base + [global_step_0/actor of coder, tool-use]   (the numba path)
    verl, torch    the same on the torch path (RLMERGE_FAST=0): the baseline of this run
    LoRA r=16      base + [adapter, tool-use]                    (the numba path, the agents as τ)
    LoRA, torch    the same on the torch path (RLMERGE_FAST=0): the baseline of this run

    .venv/bin/python benchmarks/inputs_memory.py [--workdir DIR] [--block-size N] [--method M] [--only lora|verl]

Needs .venv-verl (``make verl``). Not part of the test suite: it writes ~6 GB and takes minutes on 2 cores.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))
from dataset import make_set  # noqa: E402


def _verl(agent: Path, actor: Path) -> None:
    if (actor / "fsdp_config.json").is_file():
        return
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    subprocess.run([str(REPO / ".venv-verl/bin/torchrun"), "--standalone", "--nproc_per_node", "2",
                    str(REPO / "tests/verl_driver.py"), str(agent), str(actor), "--steps", "0"], check=True, env=env)


def _lora(base: Path, out: Path) -> None:
    if (out / "adapter_model.safetensors").is_file():
        return
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.bfloat16)
    cfg = LoraConfig(r=16, lora_alpha=32, init_lora_weights=False,
                     target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
    pm = get_peft_model(model, cfg)
    with torch.no_grad():
        for name, p in pm.named_parameters():
            if "lora_B" in name:
                p.mul_(1e-3)
    pm.save_pretrained(out)


def _measure(label: str, argv: list[str], env: dict[str, str] | None = None) -> tuple[float, float]:
    done = subprocess.run(["/usr/bin/time", "-v", *argv], capture_output=True, text=True,
                          env={**os.environ, **(env or {})})
    if done.returncode != 0:
        raise SystemExit(f"{label} failed:\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}")
    rss = int(re.search(r"Maximum resident set size \(kbytes\): (\d+)", done.stderr).group(1)) / 2**20
    wall = re.search(r"Elapsed \(wall clock\) time \(h:mm:ss or m:ss\): ([\d:.]+)", done.stderr).group(1)
    parts = [float(x) for x in wall.split(":")]
    secs = sum(p * 60 ** i for i, p in enumerate(reversed(parts)))
    print(f"{label:14s} peak RSS {rss:.2f} GiB   wall {secs:6.1f} s   ({' '.join(argv[1:5])} …)")
    return rss, secs


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--workdir", type=Path, default=REPO / "bench-data" / "inputs")
    ap.add_argument("--block-size", type=int, default=None)
    ap.add_argument("--method", default="ram+", help="the merge method (its defaults)")
    ap.add_argument("--only", choices=("lora", "verl"), help="the safetensors merge and this input's two only")
    args = ap.parse_args()
    root = args.workdir
    base, (coder, tools) = make_set(root / "set", "0.5b", densities=(0.032, 0.462))
    actor = root / "verl" / "global_step_0" / "actor"
    _verl(coder, actor)
    adapter = root / "lora-r16"
    _lora(base, adapter)
    rlmerge = str(Path(sys.executable).parent / "rlmerge")
    extra = ["--block-size", str(args.block_size)] if args.block_size else []
    outs = root / "out"
    shutil.rmtree(outs, ignore_errors=True)
    outs.mkdir()
    walls = {}
    runs = (("safetensors", coder, None), ("verl W=2", actor, None), ("verl, torch", actor, {"RLMERGE_FAST": "0"}),
            ("LoRA r=16", adapter, None), ("LoRA, torch", adapter, {"RLMERGE_FAST": "0"}))
    for label, agent, env in runs:
        if args.only and label != "safetensors" and not label.lower().startswith(args.only):
            continue
        out = outs / label.split()[0].strip(",") / ("torch" if env else "default")
        _, walls[label] = _measure(label, [rlmerge, "merge", str(base), str(agent), str(tools), "-o", str(out),
                                           "--method", args.method, "-q", *extra], env)
    ref = load_file(outs / "safetensors" / "default" / "model.safetensors")
    for d in ("default", "torch") if args.only != "lora" else ():
        got = load_file(outs / "verl" / d / "model.safetensors")
        same = ref.keys() == got.keys() and all(torch.equal(ref[k], got[k]) for k in ref)
        print(f"verl merge ({d} path) byte-identical to the safetensors merge: {same}")
    if args.only != "verl":
        got, ref = (load_file(outs / "LoRA" / d / "model.safetensors") for d in ("default", "torch"))
        same = got.keys() == ref.keys() and all(torch.equal(got[k], ref[k]) for k in ref)
        print(f"LoRA merge: numba path byte-identical to the torch path: {same}")
    for what, numba in (("verl", "verl W=2"), ("LoRA", "LoRA r=16")):
        if numba in walls:
            print(f"{what}: torch path / numba path wall = {walls[f'{what}, torch'] / walls[numba]:.1f}x")
    shards = sum(f.stat().st_size for f in actor.glob("model_world_size_*"))
    lora = (adapter / "adapter_model.safetensors").stat().st_size / 2**20
    print(f"inputs: one bf16 model {(coder / 'model.safetensors').stat().st_size / 2**30:.2f} GiB; verl model shards "
          f"{shards / 2**30:.2f} GiB (float32); adapter {lora:.1f} MiB")


if __name__ == "__main__":
    main()
