"""Shared fixtures: tiny checkpoints with known sparse task vectors, and a loader for merged outputs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path


def _numba_target() -> None:
    """Compile numba's kernels for one x86-64 target in every test run: the fused path's report sums (float32 tile
    sums compiled with ``reassoc``) follow the vector width LLVM picks for the host CPU, so the golden report hashes
    (tests/test_golden.py) would depend on the machine (measured: a host LLVM names "rocketlake" wrote other
    rlmerge-report.json bytes than the recording machine; both agree when compiling for haswell). Weights never
    depend on it. Only where the CPU has AVX2 (haswell's code would not run elsewhere); set NUMBA_CPU_NAME to
    override."""
    import platform

    if platform.machine() not in ("x86_64", "AMD64") or "NUMBA_CPU_NAME" in os.environ:
        return
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return
    if " avx2" in flags and " fma" in flags:
        os.environ["NUMBA_CPU_NAME"] = "haswell"


_numba_target()  # before anything imports numba (it reads the variable once)

import pytest  # noqa: E402 - after the numba target is set
import torch  # noqa: E402
from safetensors.torch import load_file  # noqa: E402

from rlmerge.synthetic import Shape, make_example  # noqa: E402

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
# Tiny tensors: torch's intra-op threads only add contention (measured: a bincount of 3,000 elements took 28 ms
# with 2 threads on a loaded 2-core machine, 0.02 ms with 1).
torch.set_num_threads(1)

# Small enough to be instant, with several tensors larger than the smallest block sizes tested.
TINY = Shape("qwen2", vocab=128, hidden=32, layers=2, heads=4, kv_heads=2, intermediate=64, tie=True)


@pytest.fixture
def example(tmp_path: Path) -> tuple[Path, list[Path]]:
    """bf16 base + three agents with the paper's densities (3.2 / 46.2 / 54.3 %)."""
    return make_example(tmp_path / "in", shape=TINY)


# A chat template for the tiny lab tokenizer, so that the lab's chat view (SmolLM2's) can prompt a tiny model.
CHAT_TEMPLATE = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}assistant:{% endif %}")


def lab_checkpoints(root: Path, *, scale: float = 0.02, warm_steps: int = 0,
                    chat_template: str | None = None) -> tuple[Path, list[Path]]:
    """A tiny lab model (``rlmerge.lab``) saved as ``root/base``, and two "fine-tunes" ``root/agent1``, ``agent2``:
    the base plus perturbations of size ``scale`` on ~30 % of the elements. ``warm_steps`` of the lab's supervised
    warm-up first (so that it answers some examples right); ``chat_template`` lets the chat view prompt it."""
    from rlmerge.lab.model import ModelShape, build_model, save_bf16, warm_up
    from rlmerge.lab.tokenizer import build_tokenizer

    tok = build_tokenizer()
    if chat_template is not None:
        tok.chat_template = chat_template
    model = build_model(tok, ModelShape(hidden=32, layers=2, heads=2, kv_heads=1, intermediate=64), 3)
    if warm_steps:
        warm_up(model, tok, steps=warm_steps, batch_size=16, seed=0, log_every=0, lr=1e-2)
    save_bf16(model, tok, root / "base")
    base_state = {k: v.clone() for k, v in model.state_dict().items()}
    agents = []
    for i in (1, 2):
        g = torch.Generator().manual_seed(i)
        model.load_state_dict({k: v + scale * torch.randn(v.shape, generator=g) * (torch.rand(v.shape, generator=g)
                                                                                < 0.3) for k, v in base_state.items()})
        save_bf16(model, tok, root / f"agent{i}")
        agents.append(root / f"agent{i}")
    return root / "base", agents


def load_output(folder: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a (possibly sharded) safetensors checkpoint folder."""
    index = folder / "model.safetensors.index.json"
    files = (sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.exists()
             else ["model.safetensors"])
    out: dict[str, torch.Tensor] = {}
    for f in files:
        out.update(load_file(str(folder / f)))
    return out



def as_bin(model: Path, folder: Path) -> Path:
    """``model`` saved again as ``folder/pytorch_model.bin`` with its config.json."""
    folder.mkdir(parents=True)
    torch.save(load_output(model), folder / "pytorch_model.bin")
    (folder / "config.json").write_text((model / "config.json").read_text())
    return folder

def numba_route(base: Path, agents: list[Path], method: str, **kw: object) -> tuple[frozenset[str], set[str]]:
    """(the merged tensors the numba backend merges, every merged tensor) of the merge ``preflight`` plans."""
    from rlmerge.engine.preflight import preflight

    pf = preflight(base, agents, None, method=method, **kw)
    try:
        assert not pf.problems, [p.render() for p in pf.problems]
        return pf.route.fast, {j.name for j in pf.match.merge_jobs}
    finally:
        pf.close()


def assert_same_tensors(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype, k
        assert a[k].shape == b[k].shape, k
        assert torch.equal(a[k].view(torch.uint8) if a[k].dtype != torch.bool else a[k],
                           b[k].view(torch.uint8) if b[k].dtype != torch.bool else b[k]), k


def interrupt_after(monkeypatch: pytest.MonkeyPatch, shards: int, exc: BaseException) -> None:
    """Patch CheckpointWriter.write to raise ``exc`` once ``shards`` shards are complete (a stopped merge)."""
    from rlmerge.io import writer as writer_mod

    orig = writer_mod.CheckpointWriter.write

    def write(w: writer_mod.CheckpointWriter, data: object) -> None:
        if len(w.partial.shards) >= shards:
            raise exc
        orig(w, data)

    monkeypatch.setattr(writer_mod.CheckpointWriter, "write", write)


MERGEKIT_PY = Path(__file__).resolve().parents[1] / ".venv-mergekit" / "bin" / "python"


def run_mergekit(jobs: list[dict], folder: Path, timeout: int) -> None:
    """Run mergekit on ``jobs`` (tests/mergekit_driver.py's format) in one process of its own interpreter."""
    (folder / "jobs.json").write_text(json.dumps(jobs))
    proc = subprocess.run([str(MERGEKIT_PY), str(Path(__file__).parent / "mergekit_driver.py"),
                           str(folder / "jobs.json")], capture_output=True, text=True, timeout=timeout,
                          env={"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "OMP_NUM_THREADS": "1",
                               "PATH": str(Path(sys.executable).parent)})
    assert proc.returncode == 0, proc.stderr[-3000:]
