"""What writing a merge's output into fresh page-cache pages costs here, against the pages dropped as they are
written back (io/writer.settle), docs/benchmarks.md.

Writes ``--gib`` GiB of random bytes in 8 MiB calls into a reserved file (posix_fallocate, as the writer does),
asking for writeback every 32 MiB (writer.Writeback) either as rlmerge did before (``fresh``: the pages stay
in the page cache until the file is deleted) or as it does now (``settled``: each chunk, once written back, leaves
the page cache: writer.settle); then fsync. The two alternate ``--rounds`` times, in either order, with a pause of
``--pause`` seconds before each (on a VM whose balloon reports free pages to the host, pages free for a while go
back to the host). Printed per way: wall seconds, the CPU seconds of the ``write`` calls, of the whole thread.

    PYTHONPATH=src python benchmarks/write_pages.py --dir /work/scratch
"""

from __future__ import annotations

import argparse
import os
import time
import zlib
from pathlib import Path

import numpy as np

from rlmerge.io import writer

CALL = 8 << 20


def write(path: Path, nbytes: int, settle: bool) -> tuple[float, float, float]:
    """(wall, CPU in ``write``, thread CPU) of writing ``nbytes`` to ``path`` as the writer does."""
    buf = np.random.default_rng(0).integers(0, 255, CALL, dtype=np.uint8)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        os.posix_fallocate(fd, 0, nbytes)
        in_write, wall, cpu = 0.0, time.perf_counter(), time.thread_time()
        written, writeback = 0, writer.Writeback(drop=settle)
        while written < nbytes:
            t = time.thread_time()
            os.write(fd, buf)
            in_write += time.thread_time() - t
            zlib.crc32(buf)
            written += CALL
            if writeback.due(written):
                writeback.advance(fd, written)
        os.fsync(fd)
        return time.perf_counter() - wall, in_write, time.thread_time() - cpu
    finally:
        os.close(fd)
        path.unlink()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", type=Path, required=True, help="a folder on the disk the outputs go to")
    ap.add_argument("--gib", type=float, default=1.0)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--pause", type=float, default=3.0)
    a = ap.parse_args()
    nbytes = int(a.gib * (1 << 30)) // CALL * CALL
    got: dict[str, list[tuple[float, float, float]]] = {"fresh": [], "settled": []}
    for r in range(a.rounds):
        for way in ("fresh", "settled") if r % 2 else ("settled", "fresh"):
            time.sleep(a.pause)
            got[way].append(write(a.dir / "write_pages.bin", nbytes, way == "settled"))
    for way, runs in got.items():
        cols = zip(*runs)
        print(f"{way:8s} " + "; ".join(f"{label} {', '.join(f'{v:.2f}' for v in col)}"
                                       for label, col in zip(("wall s", "write CPU s", "thread CPU s"), cols)))


if __name__ == "__main__":
    main()
