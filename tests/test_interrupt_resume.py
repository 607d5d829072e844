"""Interrupted and failing runs: nothing finished-looking is left, work is resumable, inputs are untouched."""

from __future__ import annotations

import errno
import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import rlmerge
from conftest import interrupt_after
from rlmerge.cli import main
from rlmerge.errors import OutputError
from rlmerge.io import writer as writer_mod
from rlmerge.io.partial import LOCK, PROGRESS, PartialDir, partial_path

# A real CLI run that, in the child only, pauses before writing once HOLD_AFTER shards are complete and
# for as long as the file HOLD exists: the signal lands mid-merge however fast the merge itself is. With STUCK set,
# the first kernel call on a compute thread never returns (it touches STUCK first): a thread stuck for good. On
# SIGUSR1 the child prints every thread's stack (``_wait`` asks for it when a child does not end).
CHILD = """
import faulthandler, os, signal, sys, threading, time
faulthandler.register(signal.SIGUSR1, all_threads=True)
from rlmerge import kernels
from rlmerge.io import writer
_write = writer.CheckpointWriter.write
def _held(self, data):
    while os.path.exists(os.environ["HOLD"]) and len(self.partial.shards) >= int(os.environ["HOLD_AFTER"]):
        time.sleep(0.01)
    _write(self, data)
writer.CheckpointWriter.write = _held
_kernel = kernels.fused_range
def _stuck(*args):
    if os.environ.get("STUCK") and threading.current_thread().name.startswith("rlmerge-compute"):
        open(os.environ["STUCK"], "a").close()
        while True:
            time.sleep(0.01)
    return _kernel(*args)
kernels.fused_range = _stuck
from rlmerge.cli import main
sys.exit(main(sys.argv[1:]))
"""
ARGS = ["--method", "ram+", "--block-size", "256", "--shard-size", "16KB", "-q"]


def _cli(base: Path, agents: list[Path], out: Path, *extra: str, hold: Path, after: int = 0,
         stuck: Path | None = None) -> subprocess.Popen:
    env = {**os.environ, "HOLD": str(hold), "HOLD_AFTER": str(after), "HF_HUB_OFFLINE": "1",
           "STUCK": str(stuck or "")}
    cmd = [sys.executable, "-c", CHILD, "merge", str(base), *map(str, agents), "-o", str(out), *ARGS, *extra]
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _wait_for(cond, proc: subprocess.Popen, what: str, timeout: float = 60.0) -> None:
    end = time.monotonic() + timeout
    while not cond():
        if proc.poll() is not None:
            raise AssertionError(f"process ended (rc {proc.returncode}) before {what}: {proc.stderr.read()}")
        if time.monotonic() > end:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.01)


def _wait(proc: subprocess.Popen, timeout: float = 60.0) -> tuple[int, str]:
    """The child's exit code and stderr; a child still running after ``timeout`` fails the test with its stacks."""
    try:
        rc = proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGUSR1)
        time.sleep(1.0)
        proc.kill()
        raise AssertionError(f"still running {timeout:.0f} s after the signal:\n{proc.communicate()[1]}") from None
    return rc, proc.stderr.read()


def _shards_done(out: Path) -> int:
    try:
        return len(json.loads((partial_path(out) / PROGRESS).read_text())["shards"])
    except (OSError, ValueError, KeyError):
        return -1


def _files(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


def _digest(folders: list[Path]) -> dict[str, tuple[str, int]]:
    """Content hash and mtime of every file under the inputs: to prove they were not touched."""
    return {str(p): (hashlib.sha256(p.read_bytes()).hexdigest(), p.stat().st_mtime_ns)
            for f in folders for p in sorted(f.rglob("*")) if p.is_file()}


def test_sigterm_lock_and_resume_with_real_processes(example, tmp_path: Path) -> None:
    base, agents = example
    ref = tmp_path / "ref"
    rlmerge.merge(base, agents, ref, method="ram+", shard_size="16KB")
    assert len(list(ref.glob("*.safetensors"))) >= 3  # several shards, so one can be complete mid-run
    out = tmp_path / "out"
    hold = tmp_path / "hold"
    hold.touch()
    p1 = _cli(base, agents, out, hold=hold, after=1)  # pauses once one shard is complete
    _wait_for(lambda: _shards_done(out) >= 1, p1, "a completed shard")
    # A second run into the same output is refused while the first holds the lock.
    p2 = _cli(base, agents, out, hold=hold)
    assert p2.wait(60) == OutputError.exit_code, p2.stderr.read()
    assert "another rlmerge run" in p2.stderr.read()
    p1.send_signal(signal.SIGTERM)
    rc, stderr = _wait(p1)
    assert rc == 130, stderr
    stderr = " ".join(stderr.split())
    assert "--resume" in stderr, stderr
    assert not out.exists()  # nothing that looks like a finished model
    assert partial_path(out).is_dir() and _shards_done(out) >= 1
    assert main(["merge", str(base), *map(str, agents), "-o", str(out), *ARGS, "--resume"]) == 0
    assert _files(out) == _files(ref)  # byte-identical to an uninterrupted run
    assert not partial_path(out).exists() and not (out / LOCK).exists()


def test_sigterm_before_any_shard_leaves_nothing(example, tmp_path: Path) -> None:
    base, agents = example
    out = tmp_path / "out"
    hold = tmp_path / "hold"
    hold.touch()
    p = _cli(base, agents, out, "--shard-size", "5GB", hold=hold)  # pauses before its first write
    _wait_for(lambda: (partial_path(out) / PROGRESS).exists(), p, "the partial folder")
    p.send_signal(signal.SIGTERM)
    rc, stderr = _wait(p)
    assert rc == 130 and "nothing was written" in stderr, (rc, stderr)
    assert sorted(x.name for x in tmp_path.iterdir()) == ["hold", "in"]


def test_sigterm_does_not_wait_for_a_stuck_compute_thread(example, tmp_path: Path, monkeypatch) -> None:
    # A kernel call that never returns (a compile or a page fault that hangs) must not keep an interrupted run
    # alive: the cleanup waits for it a bounded time and the process exits without joining it.
    base, agents = example
    out, hold, stuck = tmp_path / "out", tmp_path / "hold", tmp_path / "stuck"
    monkeypatch.setenv("RLMERGE_THREADS", "2")  # blocks of more than one tile are cut across compute threads
    p = _cli(base, agents, out, "--block-size", "8192", hold=hold, stuck=stuck)
    _wait_for(stuck.exists, p, "a kernel call on a compute thread")
    p.send_signal(signal.SIGTERM)
    rc, stderr = _wait(p)
    assert rc == 130 and "nothing was written" in stderr, (rc, stderr)
    assert sorted(x.name for x in tmp_path.iterdir()) == ["in", "stuck"]


def test_an_error_while_stopping_does_not_hide_the_interrupt(example, tmp_path: Path, monkeypatch,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    base, agents = example
    out = tmp_path / "out"
    interrupt_after(monkeypatch, 0, KeyboardInterrupt())

    def broken_exit(w: writer_mod.CheckpointWriter, *exc: object) -> None:
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(writer_mod.CheckpointWriter, "__exit__", broken_exit)
    assert main(["merge", str(base), *map(str, agents), "-o", str(out), *ARGS]) == 130
    message = " ".join(capsys.readouterr().err.split())
    assert "interrupted" in message and "while stopping: OSError" in message and "Input/output error" in message
    assert not out.exists() and not partial_path(out).exists()


@pytest.mark.parametrize("method", ["ram", "ram+"])
def test_resume_is_byte_identical_and_verifies_kept_shards(example, tmp_path: Path, monkeypatch, method) -> None:
    base, agents = example
    # bf16: RAM+'s "λ kept" is below 100 % there, and the card must count the kept shards' tensors too
    kw = {"method": method, "shard_size": "16KB", "block_size": 300, "dtype": "bfloat16"}
    rlmerge.merge(base, agents, tmp_path / "ref", **kw)
    out = tmp_path / "out"
    with monkeypatch.context() as m:
        interrupt_after(m, 2, KeyboardInterrupt())
        with pytest.raises(KeyboardInterrupt) as info:
            rlmerge.merge(base, agents, out, **kw)
    assert "--resume" in info.value.rlmerge_hint
    kept = _shards_done(out)
    assert kept == 2 and not out.exists()
    # Damage the second kept shard: resume must notice (checksum) and rewrite it.
    second = partial_path(out) / json.loads((partial_path(out) / PROGRESS).read_text())["shards"][1]["file"]
    data = bytearray(second.read_bytes())
    data[-1] ^= 0xFF
    second.write_bytes(bytes(data))
    # Other settings cannot resume this partial output, and the kept work survives the refusal.
    with pytest.raises(OutputError, match="other inputs or settings"):
        rlmerge.merge(base, agents, out, **{**kw, "shard_size": "20KB"}, resume=True)
    assert _shards_done(out) == kept
    res = rlmerge.merge(base, agents, out, **{**kw, "block_size": 1000}, resume=True)  # block size is free
    assert _files(out) == _files(tmp_path / "ref")
    assert res.output == out


RESUMED = ["--method", "ram", "--block-size", "300", "--shard-size", "16KB", "--seed", "7"]


def _touch(path: Path) -> None:
    st = path.stat()
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))


# (case, what the resuming command changes, what it is refused with; None: it resumes)
RESUME_CASES = [
    ("same command", [], None, None),
    ("the block size (free)", ["--block-size", "1000"], None, None),
    ("another method", ["--method", "task_arithmetic"], None, "other inputs or settings"),
    ("another shard size", ["--shard-size", "20KB"], None, "other inputs or settings"),
    ("another seed", ["--seed", "8"], None, "other inputs or settings"),
    ("an input changed since", [], lambda agents: _touch(agents[1] / "model.safetensors"),
     "changed since the interrupted run began (its modification time)"),
]


@pytest.mark.parametrize(("case", "change", "edit", "refused"), RESUME_CASES, ids=[c[0] for c in RESUME_CASES])
def test_plan_resume_reports_what_merge_resume_refuses(example, tmp_path: Path, monkeypatch, capsys, case: str,
                                                       change: list[str], edit, refused: str | None) -> None:
    # plan --resume said ok where merge --resume refused: the comparison was only in PartialDir.start
    base, agents = example
    out = tmp_path / "out"
    models = [str(base), *map(str, agents)]
    with monkeypatch.context() as m:
        interrupt_after(m, 2, KeyboardInterrupt())
        assert main(["merge", *models, "-o", str(out), *RESUMED, "-q"]) == 130
    capsys.readouterr()
    if edit is not None:
        edit(agents)
    plan = main(["plan", *models, "-o", str(out), *RESUMED, *change, "--resume"])
    plan_err = " ".join(capsys.readouterr().err.split())
    merge = main(["merge", *models, "-o", str(out), *RESUMED, *change, "--resume", "-q"])
    merge_err = " ".join(capsys.readouterr().err.split())
    if refused is None:
        assert (plan, merge) == (0, 0), (plan_err, merge_err)
        assert out.is_dir()
        return
    assert (plan, merge) == (4, 4), (plan_err, merge_err)
    for err in (plan_err, merge_err):
        assert refused in err and f"(file {partial_path(out)})" in err and "--force" in err, err
    assert _shards_done(out) == 2 and not out.exists()  # the kept work survives both


def test_resume_without_partial_starts_fresh(example, tmp_path: Path) -> None:
    base, agents = example
    rlmerge.merge(base, agents, tmp_path / "a", method="ram")
    rlmerge.merge(base, agents, tmp_path / "b", method="ram", resume=True)
    assert _files(tmp_path / "a") == _files(tmp_path / "b")


def test_force_discards_a_partial_output(example, tmp_path: Path, monkeypatch) -> None:
    base, agents = example
    out = tmp_path / "out"
    with monkeypatch.context() as m:
        interrupt_after(m, 2, KeyboardInterrupt())
        with pytest.raises(KeyboardInterrupt):
            rlmerge.merge(base, agents, out, method="ram", shard_size="16KB", block_size=300)
    with pytest.raises(OutputError, match="interrupted merge left"):
        rlmerge.merge(base, agents, out, method="ram", shard_size="16KB")
    rlmerge.merge(base, agents, out, method="ram", shard_size="16KB", force=True)
    rlmerge.merge(base, agents, tmp_path / "ref", method="ram", shard_size="16KB")
    assert _files(out) == _files(tmp_path / "ref") and not partial_path(out).exists()


@pytest.mark.parametrize("shard_size", ["5GB", "16KB"], ids=["one shard", "several shards"])
def test_disk_full_is_a_clear_error_and_inputs_are_untouched(example, tmp_path: Path, monkeypatch,
                                                            capsys: pytest.CaptureFixture[str], shard_size) -> None:
    base, agents = example
    opts = ["-q", "--method", "ram", "--shard-size", shard_size]
    args = [str(base), *map(str, agents), "-o", str(tmp_path / "out"), *opts]
    before = _digest([base, *agents])
    real_reopen = PartialDir.reopen  # how the writer opens a shard to fill it

    written = [0]  # bytes on the "disk", over all files

    class FullDisk:
        def __init__(self, f):
            self.f = f

        def write(self, data):
            written[0] += memoryview(data).nbytes
            if written[0] > 30_000:
                raise OSError(errno.ENOSPC, "No space left on device")
            return self.f.write(data)

        def __getattr__(self, name):
            return getattr(self.f, name)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.f.close()

    with monkeypatch.context() as m:  # the disk is full after 30 kB of shards
        m.setattr(PartialDir, "reopen", lambda self, name: FullDisk(real_reopen(self, name)))
        code = main(["merge", *args])
    assert code == OutputError.exit_code == 4
    assert "the disk is full" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()
    assert _digest([base, *agents]) == before
    if shard_size == "5GB":
        assert not partial_path(tmp_path / "out").exists()  # no shard was complete: nothing kept
        return
    assert _shards_done(tmp_path / "out") >= 1  # completed shards are kept; after freeing space, resume
    assert main(["merge", *args, "--resume"]) == 0
    assert main(["merge", str(base), *map(str, agents), "-o", str(tmp_path / "ref"), *opts]) == 0
    assert _files(tmp_path / "out") == _files(tmp_path / "ref")


@pytest.mark.parametrize("how", ["chmod", "monkeypatch"])
def test_read_only_output_folder(example, tmp_path: Path, monkeypatch, how: str) -> None:
    base, agents = example
    ro = tmp_path / "ro"
    ro.mkdir()
    before = _digest([base, *agents])
    if how == "chmod":
        if os.geteuid() == 0:
            pytest.skip("root ignores permission bits; the monkeypatch variant covers this")
        ro.chmod(0o555)
    else:
        real_mkdir = Path.mkdir

        def mkdir(self: Path, *a, **k) -> None:
            if ro in self.parents:
                raise OSError(errno.EROFS, "Read-only file system", str(self))
            real_mkdir(self, *a, **k)

        monkeypatch.setattr(Path, "mkdir", mkdir)
    with pytest.raises(OutputError, match="cannot write: Read-only|cannot write: Permission") as info:
        rlmerge.merge(base, agents, ro / "out", method="ram")
    assert info.value.exit_code == 4
    ro.chmod(0o755)
    assert list(ro.iterdir()) == [] and _digest([base, *agents]) == before


def test_output_inside_an_input_is_refused(example, tmp_path: Path) -> None:
    base, agents = example
    before = _digest([base, *agents])
    for out in (agents[0] / "merged", base, tmp_path):
        with pytest.raises(OutputError, match="overlaps the input"):
            rlmerge.merge(base, agents, out, method="ram", force=True)
    assert _digest([base, *agents]) == before


def test_same_recipe_twice_gives_identical_folders_and_inputs_stay_untouched(example, tmp_path: Path) -> None:
    base, agents = example
    before = _digest([base, *agents])
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(f"merge_method: ram+\nbase_model: {base}\nmodels:\n"
                      + "".join(f"  - model: {a}\n" for a in agents) + "parameters: {preset: paper, r: 0.1}\n")
    for out, block in (("a", "100"), ("b", "7777")):  # the block size is free: it is not part of the recipe
        assert main(["merge", "--recipe", str(recipe), "-o", str(tmp_path / out), "-q", "--shard-size", "16KB",
                     "--block-size", block]) == 0
    assert _files(tmp_path / "a") == _files(tmp_path / "b")  # shards, index, rlmerge.json, README.md, config
    assert _digest([base, *agents]) == before


def test_output_appearing_during_the_merge_is_not_replaced(example, tmp_path: Path, monkeypatch) -> None:
    base, agents = example
    out = tmp_path / "out"
    orig = writer_mod.CheckpointWriter.finish

    def finish(w: writer_mod.CheckpointWriter, manifest: dict) -> Path:
        out.mkdir()  # someone else's finished output lands just before ours is published
        (out / "theirs").write_text("keep me")
        return orig(w, manifest)

    with monkeypatch.context() as m:
        m.setattr(writer_mod.CheckpointWriter, "finish", finish)
        with pytest.raises(OutputError, match="appeared while this run was merging"):
            rlmerge.merge(base, agents, out, method="ram")
    assert (out / "theirs").read_text() == "keep me" and _shards_done(out) == 1  # our work is kept too
    (out / "theirs").unlink()
    out.rmdir()
    rlmerge.merge(base, agents, out, method="ram", resume=True)
    rlmerge.merge(base, agents, tmp_path / "ref", method="ram")
    assert _files(out) == _files(tmp_path / "ref")


def test_a_shard_that_cannot_fit_fails_before_it_is_computed(example, tmp_path: Path, monkeypatch,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    """Each shard's space is reserved (fallocate) when it is opened: no space means exit 4 at once."""
    from rlmerge import kernels

    base, agents = example
    ran = []
    real = kernels.fused_range
    monkeypatch.setattr(kernels, "fused_range", lambda *a: ran.append(1) or real(*a))

    def no_space(fd: int, offset: int, length: int) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(writer_mod.os, "posix_fallocate", no_space)
    code = main(["merge", str(base), *map(str, agents), "-o", str(tmp_path / "out"), "-q", "--method", "ram"])
    assert code == OutputError.exit_code
    assert "the disk is full" in capsys.readouterr().err
    assert not ran and not (tmp_path / "out").exists() and not list(tmp_path.glob(".out*"))
