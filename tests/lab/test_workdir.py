"""The lab works only in a folder it made: never in a user's folder, through a symlink, or inside its input."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import pytest

from rlmerge.errors import OutputError
from rlmerge.lab.workdir import MARKER, claim


def _tree(root: Path) -> dict[str, str]:
    """Every path under root (links not followed) with a hash of its bytes, to prove nothing changed."""
    found = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            p = Path(dirpath, name)
            rel = str(p.relative_to(root))
            if p.is_symlink() or p.is_dir():
                found[rel] = "link" if p.is_symlink() else "dir"
            else:
                found[rel] = hashlib.sha256(p.read_bytes()).hexdigest()
    return found


def test_a_new_folder_is_claimed_and_can_be_resumed(tmp_path: Path) -> None:
    out = tmp_path / "runs" / "lab"
    assert claim(out) == out.resolve()
    assert (out / MARKER).is_file()
    (out / "seed0").mkdir()
    assert claim(out) == out.resolve()  # a second run resumes in it


def test_an_empty_existing_folder_is_claimed(tmp_path: Path) -> None:
    claim(tmp_path)
    assert (tmp_path / MARKER).is_file()


def test_a_users_folder_is_refused_and_left_as_it_was(tmp_path: Path) -> None:
    models = tmp_path / "models"
    (models / "my-agent").mkdir(parents=True)
    (models / "my-agent" / "model.safetensors").write_bytes(b"weights")
    (models / "notes.txt").write_text("keep me")
    before = _tree(models)
    with pytest.raises(OutputError, match=r"not empty \(my-agent, notes.txt\).*did not make it"):
        claim(models)
    assert _tree(models) == before  # not even the marker was written


def test_a_symlink_is_refused(tmp_path: Path) -> None:
    target = tmp_path / "elsewhere"
    target.mkdir()
    link = tmp_path / "out"
    link.symlink_to(target)
    with pytest.raises(OutputError, match="is a symlink"):
        claim(link)
    assert list(target.iterdir()) == []


def test_a_file_is_refused(tmp_path: Path) -> None:
    f = tmp_path / "out"
    f.write_text("x")
    with pytest.raises(OutputError, match="is a file"):
        claim(f)
    assert f.read_text() == "x"


@pytest.mark.parametrize("where", ["inside", "around", "same"])
def test_an_output_overlapping_the_input_is_refused(tmp_path: Path, where: str) -> None:
    seed = tmp_path / "lab" / "seed0"
    (seed / "base").mkdir(parents=True)
    out = {"inside": seed / "mech", "around": tmp_path / "lab", "same": seed}[where]
    before = _tree(tmp_path)
    with pytest.raises(OutputError, match="overlaps the input"):
        claim(out, [seed])
    assert _tree(tmp_path) == before


def test_the_cli_refuses_before_training(tmp_path: Path) -> None:
    pytest.importorskip("trl", reason="the lab extra (rlmerge[lab]) is not installed")
    from rlmerge.cli import main

    (tmp_path / "precious.txt").write_text("keep me")
    assert main(["lab", "--size", "smoke", "--out", str(tmp_path)]) == OutputError.exit_code
    assert sorted(p.name for p in tmp_path.iterdir()) == ["precious.txt"]


def test_the_cli_refuses_before_training_where_model_code_cannot_be_isolated(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("trl", reason="the lab extra (rlmerge[lab]) is not installed")
    from rlmerge.cli import main
    from rlmerge.sandbox import BWRAP_ENV, UNSAFE_ENV

    monkeypatch.setenv(BWRAP_ENV, str(tmp_path / "no-such-bwrap"))  # as on a machine without bubblewrap
    monkeypatch.delenv(UNSAFE_ENV, raising=False)
    for args in (["--out", str(tmp_path / "lab")], ["--mechanism-from", str(tmp_path / "seed0"),
                                                    "--out", str(tmp_path / "mechanism")]):
        assert main(["lab", "--size", "smoke", *args]) == 2
        assert "apt-get install bubblewrap" in " ".join(capsys.readouterr().err.split())
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # nothing trained, no folder claimed
