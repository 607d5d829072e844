"""Coverage-guided fuzzing (atheris / libFuzzer) of the untrusted-input parsers.

    pip install atheris
    python tests/fuzz_atheris.py CORPUS/ -max_total_time=600  # any crash that is not an RLMergeError is a bug
    python tests/fuzz_atheris.py crash-<hash>                 # replay a crash file

Targets, chosen by the first input byte: a safetensors file (header parse + reading every tensor), a
sharded checkpoint's index.json, config.json, a YAML recipe (+ the method's parameters).
tests/test_fuzz.py runs this for a few seconds in CI when atheris is installed.
"""

from __future__ import annotations

import shutil
import sys
import tempfile
from pathlib import Path

import atheris
import numpy  # noqa: F401  imported before instrumenting: only rlmerge's own code is instrumented
import torch
import yaml  # noqa: F401

with atheris.instrument_imports(include=["rlmerge"]):
    from rlmerge.errors import RLMergeError
    from rlmerge.io.checkpoint import Checkpoint
    from rlmerge.methods import get_method
    from rlmerge.recipe import load_recipe

WORK = Path(tempfile.mkdtemp(prefix="rlmerge-atheris-"))
VALID_HEADER = (b'{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},'
                b'"b":{"dtype":"BF16","shape":[2,1],"data_offsets":[8,12]}}')


def _folder(files: dict[str, bytes]) -> Path:
    folder = WORK / "m"
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir()
    for name, data in files.items():
        (folder / name).write_bytes(data)
    return folder


def _safetensors(body: bytes) -> bytes:
    return len(body).to_bytes(8, "little") + body + bytes(12)


def _read_all(folder: Path) -> None:
    ckpt = Checkpoint(folder)
    try:
        for info in ckpt.tensors.values():
            ckpt.read_raw(info.name, 0, info.numel)
            if info.is_float and info.numel < 1 << 16:
                ckpt.read_f32(info.name, 0, info.numel, torch.empty(info.numel))
    finally:
        ckpt.close()


def one_input(data: bytes) -> None:
    if not data:
        return
    target, rest = data[0] % 4, data[1:]
    try:
        if target == 0:
            _read_all(_folder({"model.safetensors": _safetensors(rest)}))
        elif target == 1:
            _read_all(_folder({"s.safetensors": _safetensors(VALID_HEADER),
                               "model.safetensors.index.json": rest}))
        elif target == 2:
            _read_all(_folder({"model.safetensors": _safetensors(VALID_HEADER), "config.json": rest}))
        else:
            (WORK / "r.yaml").write_bytes(rest)
            rec = load_recipe(WORK / "r.yaml")
            get_method(rec.method).parse(rec.parameters)
    except RLMergeError:
        pass


def seeds() -> list[bytes]:
    """A starting corpus: one valid input per target (random bytes rarely make valid JSON or YAML)."""
    return [b"\x00" + VALID_HEADER,
            b"\x01" + b'{"metadata": {}, "weight_map": {"a": "s.safetensors", "b": "s.safetensors"}}',
            b"\x02" + b'{"architectures": ["Qwen2ForCausalLM"], "tie_word_embeddings": true}',
            b"\x03" + b"merge_method: ram+\nbase_model: ./b\nmodels:\n  - model: ./a\n"
                       b"    parameters: {weight: 0.5}\nparameters: {preset: paper, r: 0.1}\n"]


if __name__ == "__main__":
    for arg in sys.argv[1:]:  # an empty corpus folder starts from the seeds
        if not arg.startswith("-") and Path(arg).is_dir() and not any(Path(arg).iterdir()):
            for i, seed in enumerate(seeds()):
                (Path(arg) / f"seed{i}").write_bytes(seed)
    atheris.Setup(sys.argv, one_input)
    atheris.Fuzz()
