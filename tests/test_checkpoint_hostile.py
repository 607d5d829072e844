"""Hostile and broken checkpoint files: each is refused with an InputError naming the file, no code runs."""

from __future__ import annotations

import ast
import json
import os
import pickle
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

import rlmerge
from conftest import assert_same_tensors, load_output
from rlmerge.cli import main
from rlmerge.errors import InputError
from rlmerge.io.checkpoint import MAX_HEADER_BYTES, Checkpoint

SRC = Path(rlmerge.__file__).parent


def _st(path: Path, tensors: dict[str, torch.Tensor] | None = None) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors or {"a": torch.arange(6, dtype=torch.float32), "b": torch.ones(4)},
              str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps({"architectures": ["Tiny"]}))
    return path


def _raw_header(header: dict | str, data: bytes = b"") -> bytes:
    body = (header if isinstance(header, str) else json.dumps(header)).encode()
    return len(body).to_bytes(8, "little") + body + data


def _refused(folder: Path, *words: str) -> InputError:
    with pytest.raises(InputError) as info:
        Checkpoint(folder)
    text = info.value.render()
    for w in words:
        assert w in text, text
    return info.value


def test_truncated_file_names_the_tensor(tmp_path: Path) -> None:
    f = _st(tmp_path / "m") / "model.safetensors"
    f.write_bytes(f.read_bytes()[:-3])  # the last tensor's data is cut short
    err = _refused(tmp_path / "m", "truncated", "model.safetensors")
    assert err.tensor in ("a", "b")


@pytest.mark.parametrize("keep", [0, 5, 8, 20])
def test_truncated_inside_the_header(tmp_path: Path, keep: int) -> None:
    f = _st(tmp_path / "m") / "model.safetensors"
    f.write_bytes(f.read_bytes()[:keep])
    _refused(tmp_path / "m", "model.safetensors")


def test_header_lies_about_offsets(tmp_path: Path) -> None:
    m = tmp_path / "m"
    m.mkdir()
    data = bytes(24)
    past_end = {"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
                "b": {"dtype": "F32", "shape": [10], "data_offsets": [8, 48]}}
    (m / "model.safetensors").write_bytes(_raw_header(past_end, data))
    _refused(m, "truncated", "'b'")
    overlap = {"a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]},
               "b": {"dtype": "F32", "shape": [2], "data_offsets": [8, 16]}}
    (m / "model.safetensors").write_bytes(_raw_header(overlap, data))
    _refused(m, "overlap")
    negative = {"a": {"dtype": "F32", "shape": [-2], "data_offsets": [8, 0]}}
    (m / "model.safetensors").write_bytes(_raw_header(negative, data))
    _refused(m, "lies")


def test_header_lies_about_dtype_or_shape(tmp_path: Path) -> None:
    m = tmp_path / "m"
    m.mkdir()
    data = bytes(16)
    for entry in ({"dtype": "F16", "shape": [4], "data_offsets": [0, 16]},  # 8 bytes of data, 16 claimed
                  {"dtype": "F32", "shape": [2, 3], "data_offsets": [0, 16]},
                  {"dtype": "F32", "shape": [4.0], "data_offsets": [0, 16]},  # a float is not a size
                  {"dtype": "Q4", "shape": [4], "data_offsets": [0, 16]},
                  {"dtype": "F32", "shape": [4], "data_offsets": [0, 16, 32]},
                  ["not", "an", "entry"]):
        (m / "model.safetensors").write_bytes(_raw_header({"w": entry}, data))
        err = _refused(m, "model.safetensors")
        assert err.tensor == "w", entry


def test_huge_header_is_refused_before_reading(tmp_path: Path) -> None:
    m = tmp_path / "m"
    m.mkdir()
    # Claims 2^62 bytes of header (and the file is short): nothing is allocated, the claim is refused.
    (m / "model.safetensors").write_bytes((2**62).to_bytes(8, "little") + b"{}")
    _refused(m, "header claims")
    (m / "model.safetensors").write_bytes((MAX_HEADER_BYTES + 8).to_bytes(8, "little") + b" " * 64)
    _refused(m, "header claims")


def test_duplicate_tensor_names(tmp_path: Path) -> None:
    m = tmp_path / "m"
    m.mkdir()
    e = '{"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}'
    (m / "model.safetensors").write_bytes(_raw_header(f'{{"w": {e}, "w": {e}}}', bytes(8)))
    _refused(m, "duplicate", "'w'")


def test_tensor_in_two_shards(tmp_path: Path) -> None:
    m = tmp_path / "m"
    m.mkdir()
    save_file({"w": torch.zeros(2)}, str(m / "s1.safetensors"))
    save_file({"w": torch.zeros(2)}, str(m / "s2.safetensors"))
    (m / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"w": "s1.safetensors",
                                                                                "v": "s2.safetensors"}}))
    _refused(m, "stored twice", "'w'")


def _sharded(folder: Path, target: str) -> None:
    save_file({"a": torch.zeros(2)}, str(folder / "model-00001-of-00002.safetensors"))
    index = {"weight_map": {"a": "model-00001-of-00002.safetensors", "b": target}}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))


def test_index_pointing_outside_the_folder(tmp_path: Path) -> None:
    outside = _st(tmp_path / "elsewhere") / "model.safetensors"
    m = tmp_path / "m"
    m.mkdir()
    for target in ("../elsewhere/model.safetensors", str(outside), "sub/../../elsewhere/model.safetensors"):
        _sharded(m, target)
        _refused(m, "outside the model folder")
    # A symlink inside the folder that resolves outside it is refused too.
    (m / "model-00002-of-00002.safetensors").symlink_to(outside)
    _sharded(m, "model-00002-of-00002.safetensors")
    _refused(m, "outside the model folder")


def test_symlinked_weights_and_side_files_out_of_the_folder(tmp_path: Path) -> None:
    outside = _st(tmp_path / "elsewhere")
    m = tmp_path / "m"
    m.mkdir()
    (m / "model.safetensors").symlink_to(outside / "model.safetensors")
    _refused(m, "outside the model folder")
    # A tokenizer file pointing at, say, a secret would be copied into the output: refused.
    m2 = _st(tmp_path / "m2")
    secret = tmp_path / "secret.txt"
    secret.write_text("password")
    (m2 / "tokenizer.json").symlink_to(secret)
    _refused(m2, "outside the model folder", "tokenizer.json")


def test_hub_cache_symlinks_into_blobs_are_allowed(tmp_path: Path) -> None:
    repo = tmp_path / "models--org--name"
    blob = _st(tmp_path / "src") / "model.safetensors"
    (repo / "blobs").mkdir(parents=True)
    shutil.copy(blob, repo / "blobs" / "abc123")
    snap = repo / "snapshots" / "rev1"
    snap.mkdir(parents=True)
    (snap / "model.safetensors").symlink_to(Path("../../blobs/abc123"))
    assert set(Checkpoint(snap).tensors) == {"a", "b"}


class _Mkdir:
    """Unpickling this calls os.mkdir(marker): the marker existing means code from the file ran."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple:
        return (os.mkdir, (str(self.marker),))


@pytest.mark.filterwarnings("ignore:Detected pickle protocol")  # torch's note on the raw pickle's protocol
@pytest.mark.parametrize("container", ["torch.save", "legacy torch.save", "raw pickle"])
def test_pickle_that_runs_code_is_refused(tmp_path: Path, container: str) -> None:
    m = tmp_path / "m"
    m.mkdir()
    marker = tmp_path / "PWNED"
    payload = {"w": torch.zeros(2), "x": _Mkdir(marker)}
    if container != "raw pickle":
        torch.save(payload, m / "pytorch_model.bin", _use_new_zipfile_serialization=container == "torch.save")
    else:
        (m / "pytorch_model.bin").write_bytes(pickle.dumps(payload))
    _refused(m, "weights_only=True", "pytorch_model.bin")
    assert not marker.exists()
    # The payload is live: an unguarded pickle.load does run it (so the check above can fail).
    probe = tmp_path / "probe"
    pickle.loads(pickle.dumps(_Mkdir(probe)))
    assert probe.exists()


@pytest.mark.parametrize("zipfile", [True, False], ids=["zip", "legacy"])
def test_bin_checkpoint_merges_like_safetensors(example, tmp_path: Path, zipfile: bool) -> None:
    base, agents = example
    from safetensors.torch import load_file

    as_bin = tmp_path / "base-bin"
    shutil.copytree(base, as_bin)
    (as_bin / "model.safetensors").unlink()
    torch.save(load_file(str(base / "model.safetensors")), as_bin / "pytorch_model.bin",
               _use_new_zipfile_serialization=zipfile)  # legacy: the pre-1.6 format, which cannot be mmapped
    rlmerge.merge(base, agents, tmp_path / "st", method="ram")
    rlmerge.merge(as_bin, agents, tmp_path / "bin", method="ram")
    assert_same_tensors(load_output(tmp_path / "bin"), load_output(tmp_path / "st"))


def test_no_code_execution_paths_in_the_source() -> None:
    """No trust_remote_code, no pickle, and every torch.load passes weights_only=True."""
    loads = 0
    for f in SRC.rglob("*.py"):
        text = f.read_text()
        assert "trust_remote_code" not in text, f
        tree = ast.parse(text)
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                names = [a.name for a in node.names] + [getattr(node, "module", None) or ""]
                assert not any(n.split(".")[0] in ("pickle", "dill", "cloudpickle") for n in names), f
            if isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "load":
                kw = {k.arg: k.value for k in node.keywords}
                if isinstance(node.func.value, ast.Name) and node.func.value.id == "torch":
                    loads += 1
                    assert isinstance(kw.get("weights_only"), ast.Constant) and kw["weights_only"].value is True, f
    assert loads >= 1  # the .bin reader is found by this scan


def test_cli_exit_code_for_a_broken_input(example, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    base, agents = example
    f = agents[1] / "model.safetensors"
    f.write_bytes(f.read_bytes()[:-100])
    code = main(["merge", str(base), *map(str, agents), "-o", str(tmp_path / "out"), "-q"])
    assert code == InputError.exit_code == 3
    assert str(f) in capsys.readouterr().err.replace("\n", "")
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".out*"))


def test_hub_downloads_never_fetch_code(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A hub id is fetched with file patterns that match weights, JSON and tokenizer files, never Python."""
    import fnmatch

    import huggingface_hub

    from rlmerge.io.open import resolve

    seen: dict = {}

    def fake_download(repo: str, **kw: object) -> str:
        seen.update(kw, repo=repo)
        return str(tmp_path)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_download)
    assert resolve("org/model@v1") == (tmp_path, "v1")
    patterns = seen["allow_patterns"]
    for code in ("modeling_evil.py", "configuration_x.py", "sub/__init__.py", "setup.cfg", "run.sh"):
        assert not any(fnmatch.fnmatch(code, p) for p in patterns), code
    for data in ("model-00001-of-00002.safetensors", "config.json", "tokenizer.model", "chat_template.jinja"):
        assert any(fnmatch.fnmatch(data, p) for p in patterns), data


# -- every command that reads a model holds it to the same rules -------------------------------------------------
def _pickle_that_runs_code(m: Path, tmp: Path) -> None:
    from safetensors.torch import load_file

    state = load_file(str(m / "model.safetensors"))
    (m / "model.safetensors").unlink()
    torch.save({**state, "x": _Mkdir(tmp / "PWNED")}, m / "pytorch_model.bin")


def _weights_linked_outside(m: Path, tmp: Path) -> None:
    shutil.move(m / "model.safetensors", tmp / "elsewhere.safetensors")
    (m / "model.safetensors").symlink_to(tmp / "elsewhere.safetensors")


def _side_file_linked_outside(name: str):
    def setup(m: Path, tmp: Path) -> None:  # a working file, so that a loader that follows the link succeeds
        shutil.move(m / name, tmp / f"secret-{name}")
        (m / name).symlink_to(tmp / f"secret-{name}")
    return setup


def _index_pointing_outside(m: Path, tmp: Path) -> None:
    from safetensors import safe_open

    (tmp / "elsewhere").mkdir()
    shutil.move(m / "model.safetensors", tmp / "elsewhere" / "model.safetensors")
    with safe_open(str(tmp / "elsewhere" / "model.safetensors"), "pt") as f:
        names = list(f.keys())
    index = {"metadata": {}, "weight_map": {n: "../elsewhere/model.safetensors" for n in names}}
    (m / "model.safetensors.index.json").write_text(json.dumps(index))


def _truncated(m: Path, tmp: Path) -> None:
    data = (m / "model.safetensors").read_bytes()
    (m / "model.safetensors").write_bytes(data[:len(data) // 2])


HOSTILE = [
    ("a pickle that runs code", _pickle_that_runs_code),
    ("weights linked outside the folder", _weights_linked_outside),
    ("tokenizer.json linked outside", _side_file_linked_outside("tokenizer.json")),
    ("config.json linked outside", _side_file_linked_outside("config.json")),
    ("an index pointing outside", _index_pointing_outside),
    ("truncated weights", _truncated),
]
COMMANDS = {
    "merge": lambda b, m, o, d: ["merge", b, m, "-o", o, "-q"],
    "plan": lambda b, m, o, d: ["plan", b, m, "-o", o],
    "inspect": lambda b, m, o, d: ["inspect", b, m, "-q", "--save", f"{o}.json"],
    "sweep": lambda b, m, o, d: ["sweep", b, m, "-o", o, "--candidate", "task_arithmetic scaling=1", "-q"],
    "fisher": lambda b, m, o, d: ["fisher", m, "--data", d, "-o", o, "--examples", "1"],
    "eval": lambda b, m, o, d: ["eval", m, "--tasks", "memory", "--n", "1"],
}


@pytest.mark.filterwarnings("ignore:Detected pickle protocol")
@pytest.mark.parametrize(("case", "setup"), HOSTILE, ids=[c[0] for c in HOSTILE])
@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_every_command_refuses_a_hostile_model_alike(example, tmp_path: Path, capsys, command: str, case: str,
                                                     setup) -> None:
    """merge, plan, inspect and sweep read models through rlmerge's readers; fisher and eval handed the folder
    to transformers, which follows a link out of it (a tokenizer or config read from elsewhere, exit 0) and
    raised tracebacks at pickles and torn files. All now open it with rlmerge's readers first: exit 3, no code
    from the file runs, nothing is written."""
    if command in ("fisher", "eval"):
        pytest.importorskip("transformers")
    base, agents = example
    model = tmp_path / "model"
    shutil.copytree(agents[0], model)
    setup(model, tmp_path)
    data = tmp_path / "data.jsonl"
    data.write_text(json.dumps({"text": "hello world"}) + "\n")
    out = tmp_path / "out"
    code = main([str(a) for a in COMMANDS[command](base, model, out, data)])
    err = capsys.readouterr().err
    assert code == 3, err
    assert "Traceback" not in err and str(model) in err
    assert not (tmp_path / "PWNED").exists()
    assert not out.exists() and not (tmp_path / "out.json").exists()
