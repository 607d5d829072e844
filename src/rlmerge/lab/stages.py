"""Stages of a lab run saved as they finish, so that a rerun into the same --out resumes where it stopped.

A stage (a row's grid and test scores, the task-vector statistics, one model's test scores) is a function
whose result is JSON. `run_stage` runs it once and writes `{key, result, wall_s, cpu_s}` to its file; a later
call with the same key reads the file instead of running it again. The key says what decided the result (the
row's grid, the split sizes, a fingerprint of the checkpoints' files it read), so a stage whose inputs changed (an
agent retrained with other settings) runs again instead of being reused stale.

Times: wall seconds, and CPU seconds of this process and of the children it waited for (the coding verifier's
sandboxed programs), both measured around the stage itself; a reused stage reports the times recorded when
it ran.
"""

from __future__ import annotations

import hashlib
import json
import os
import resource
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any


def cpu_seconds() -> float:
    """User + system CPU seconds of this process (all threads) and of its waited-for children."""
    own = resource.getrusage(resource.RUSAGE_SELF)
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


class Clock:
    """Wall and CPU seconds since it was made (`elapsed()` → {"wall_s", "cpu_s"})."""

    def __init__(self) -> None:
        self.wall, self.cpu = time.time(), cpu_seconds()

    def elapsed(self) -> dict[str, float]:
        return {"wall_s": time.time() - self.wall, "cpu_s": cpu_seconds() - self.cpu}


def _normal(key: Mapping[str, Any]) -> Any:
    return json.loads(json.dumps(key, sort_keys=True, default=str))  # what the file will read back


def write_json(path: Path, data: Any) -> None:
    """Write JSON whole or not at all (a stopped run never leaves a half file that reads as finished)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".partial")
    tmp.write_text(json.dumps(data, indent=1, default=str))
    os.replace(tmp, path)


def _file_hash(path: Path) -> str:
    h = hashlib.sha256()  # (~1.7 GB/s here: a SmolLM2 base and three agents in ~0.6 s, a dozen times a seed)
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            h.update(chunk)
    return h.hexdigest()


def fingerprint(folders: Sequence[Path], marker: str) -> str:
    """A short hash of what the checkpoints a stage reads hold: each folder's name and its files' contents (the
    weights, config, tokenizer), not its finished-stage ``marker`` (which records when and how long it trained). A
    retrained agent with other weights changes it, so everything computed from the old one is redone; an agent
    trained again to the same bytes (GRPO here is deterministic: seeded, one thread) keeps it, so stages saved on
    another machine (docs/lab-results) are reused after the agents are trained again."""
    h = hashlib.sha256()
    for folder in folders:
        folder = Path(folder)
        h.update(folder.name.encode())
        for path in sorted(p for p in folder.iterdir() if p.is_file() and p.name != marker):
            h.update(path.name.encode())
            h.update(_file_hash(path).encode())
    return h.hexdigest()[:16]


def examples_digest(sets: Mapping[str, Sequence[Any]]) -> str:
    """A short hash of the examples a stage scores (each family's prompts and gold answers, in order): a split
    drawn differently (a changed rule, e.g. the disjoint validation split's) changes the key, so scores of other
    examples are never reused."""
    h = hashlib.sha256()
    for fam in sorted(sets):
        for ex in sets[fam]:
            h.update(json.dumps([fam, ex.prompt, ex.target]).encode())
    return h.hexdigest()[:16]


def run_stage(
    path: Path, key: Mapping[str, Any], fn: Callable[[], Any], log: Callable[[str], None] = print
) -> dict[str, Any]:
    """The stage's record ({key, result, wall_s, cpu_s, reused}): read from `path` when it holds this key,
    else computed by `fn()` and written there."""
    wanted = _normal(key)
    if path.is_file():
        record = json.loads(path.read_text())
        if record.get("key") == wanted:
            return {**record, "reused": True}
        log(f"{path.name}: inputs or settings changed since it was saved; running it again")
    clock = Clock()
    result = fn()
    record = {"key": wanted, "result": result, **clock.elapsed(), "finished": time.strftime("%Y-%m-%dT%H:%M:%SZ",
                                                                                             time.gmtime())}
    write_json(path, record)
    return {**json.loads(json.dumps(record, default=str)), "reused": False}
