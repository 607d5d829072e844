"""The lab's work folder: claimed with a marker on first use, refused when rlmerge lab did not make it.

The lab resumes from what it finds in `--out` and deletes its own scratch there (trainer state, grid
candidates, mechanism merges). So it must only ever work in a folder it made: a new or empty folder is
claimed by writing `MARKER` into it; a non-empty folder without the marker, a symlink, or a folder that
overlaps an input (`--mechanism-from`) is refused before anything is read or written (docs/guarantees.md).
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path

from rlmerge.errors import OutputError

MARKER = ".rlmerge-lab"


def _inside(path: Path, root: Path) -> bool:
    return path == root or root in path.parents


def claim(out: Path, inputs: Sequence[Path] = (), *, what: str = "rlmerge lab") -> Path:
    """Make sure `out` is the lab's own work folder (creating and marking it if new) and return it resolved."""
    if out.is_symlink():
        raise OutputError(
            f"--out {out} is a symlink (to {os.readlink(out)}); {what} works only in a real folder it made. "
            "Give the folder the link points at, or a new path."
        )
    if out.exists() and not out.is_dir():
        raise OutputError(f"--out {out} is a file, not a folder; give a new or empty folder.")
    real = out.resolve()
    for given in inputs:
        src = Path(given).resolve()
        if _inside(real, src) or _inside(src, real):
            raise OutputError(
                f"--out {out} overlaps the input {given}: the lab would write into (or delete scratch next to) "
                "what it reads. Give a separate folder."
            )
    if real.is_dir() and any(real.iterdir()) and not (real / MARKER).is_file():
        found = sorted(p.name for p in real.iterdir())
        shown = ", ".join(found[:5]) + (f" and {len(found) - 5} more" if len(found) > 5 else "")
        raise OutputError(
            f"--out {out} is not empty ({shown}) and {what} did not make it (no {MARKER} file): the lab "
            "resumes from and deletes its own scratch inside its folder, so it refuses one it did not make. "
            f"Give a new or empty folder. (If it is the output of an older rlmerge lab run, create an empty "
            f"{MARKER} file in it to resume.)"
        )
    real.mkdir(parents=True, exist_ok=True)
    marker = real / MARKER
    if not marker.is_file():
        marker.write_text(json.dumps({"made_by": what}) + "\n")
    return real
