"""One command: make the synthetic set, measure the I/O floor, run rlmerge and mergekit on it, print a table.

    python benchmarks/run.py --size 0.5b                       # every method, mergekit where installed
    python benchmarks/run.py --size 1.5b --methods ram,ram+ --no-mergekit
    python benchmarks/run.py --size 7b --layers 4 --no-mergekit  # the 7B shape, trimmed
    python benchmarks/run.py --size 7b --methods ram+ --no-mergekit --out-dir /dev/shm/rlbench  # full 7B
    sudo python benchmarks/run.py --size 7b --layers 9 --methods ram+,ties --no-mergekit --cold  # cold reads

Each merge runs as a child process; its peak RSS comes from GNU time (``%M``). ``wall`` is the child's whole life
(interpreter start and imports included) and is what × mergekit compares; ``merge s`` is the time inside
``rlmerge.merge`` and is what × floor compares, the floor being one read of every input byte from the page
cache plus one write of the output's bytes as rlmerge's writer does it (on the disk at the end: rlmerge fsyncs;
with ``--no-fsync``, into the page cache), measured in the same run on the same files. rlmerge fsyncs its
output (``--no-fsync``: it does not, like mergekit); ``+ sync`` is what a ``sync`` after each process still had
to write, so ``× mergekit (on disk)`` compares the two tools with both outputs on disk.

mergekit runs in two numeric settings, side by side (``--mergekit-settings``): ``bf16`` (``dtype: bfloat16``, the
recipe most users write: mergekit computes in bf16) and ``fp32`` (``dtype: float32, out_dtype: bfloat16``,
rlmerge's numeric policy). The machine's free memory (MemAvailable) and load are printed at the start and the
end: mergekit holds whole tensors of every model and slows down on a machine short of free memory.

``--cold`` (root: it writes /proc/sys/vm/drop_caches) empties the page cache before the floor's read and before
every child instead of warming it, so every input is read from the disk once more: the floor is then a cold read
of every input plus the write of the output, and × floor compares with that.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

import numpy as np
from safetensors import safe_open

sys.path.insert(0, str(Path(__file__).parent))
from dataset import SIZES, make_set  # noqa: E402  (benchmarks/ is not a package)

from rlmerge.io import writer  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
TIME = "/usr/bin/time"  # GNU time: peak RSS of exactly one child (apt-get install time)


@dataclass(frozen=True)
class Case:
    """A row: rlmerge's method and parameters, and mergekit's equivalent (None: no counterpart)."""

    rlmerge: str
    params: dict
    mergekit: str | None
    mk_params: dict
    mk_model_params: dict


CASES: dict[str, Case] = {
    "ram": Case("ram", {}, "ram", {"epsilon": 1e-5}, {}),
    "ram+": Case("ram+", {"preset": "paper"}, "ramplus_tl", {"r": 0.1, "alpha": 0.2, "epsilon": 1e-5}, {}),
    "ram+tl": Case("ram+", {"preset": "tensor-local"}, "ramplus_tl", {"r": 0.1, "alpha": 0.2, "epsilon": 1e-5}, {}),
    "task_arithmetic": Case("task_arithmetic", {}, "task_arithmetic", {"normalize": False, "lambda": 1.0},
                            {"weight": 1.0}),
    "linear": Case("linear", {}, "linear", {"normalize": True}, {"weight": 1.0}),
    "ties": Case("ties", {"density": 0.5}, "ties", {}, {"weight": 1.0, "density": 0.5}),  # both: disjoint mean
    "breadcrumbs_ties": Case("breadcrumbs_ties", {"density": 0.9, "gamma": 0.01}, "breadcrumbs_ties", {},
                             {"weight": 1.0, "density": 0.9, "gamma": 0.01}),
    # random drops: the two tools draw different masks, so max |diff| only bounds the scale of the disagreement
    "dare_ties": Case("dare_ties", {"density": 0.5, "rescale": "l1"}, "dare_ties", {}, {"weight": 1.0, "density": 0.5}),
    "model_stock": Case("model_stock", {}, "model_stock", {}, {}),
    # mergekit's della rescales to each tensor's L1 norm (rescale: true); ours does with rescale: l1
    "della": Case("della", {"density": 0.7, "epsilon": 0.15, "rescale": "l1"}, "della", {},
                  {"weight": 1.0, "density": 0.7, "epsilon": 0.15}),
}


WARM: list[Path] = []  # the inputs, read before every child: each starts with them in the page cache
COLD = [False]  # --cold: every child (and the floor) starts with an empty page cache instead
DROP_CACHES = Path("/proc/sys/vm/drop_caches")


def drop_caches() -> None:
    """Write back what is dirty, then empty the page cache (every input is then read from the disk)."""
    os.sync()
    try:
        DROP_CACHES.write_text("3\n")
    except OSError as e:
        raise SystemExit(f"--cold: cannot write {DROP_CACHES} ({e}); run as root, or leave out --cold") from e


def warm_cache() -> None:
    """Read every input once, untimed: a previous child (mergekit takes up to 14 GB) may have pushed them out
    of the page cache, and the floor, like every timed run, reads them from it. With --cold: empty it instead."""
    if COLD[0]:
        drop_caches()
        return
    buf = memoryview(bytearray(64 << 20))
    for f in WARM:
        fd = os.open(f, os.O_RDONLY)
        off = 0
        while (got := os.preadv(fd, [buf], off)) > 0:
            off += got
        os.close(fd)


def run_child(cmd: list[str]) -> tuple[float, float, str, float]:
    """(wall seconds, peak RSS in GB, stdout, seconds a ``sync`` then took) of one child process.

    Peak RSS comes from /usr/bin/time: Linux's ru_maxrss of a child forked from this (large) process
    would start at this process's own RSS, as the high-water mark survives the exec. The sync after the child
    is what it still owed the disk: ~0 for rlmerge (it fsyncs its output), the whole output for a tool that
    leaves it in the page cache; the disk is synced before the child starts, so nothing else is counted.
    """
    warm_cache()
    os.sync()
    t0 = time.perf_counter()
    proc = subprocess.run([TIME, "-f", "RLBENCH_MAXRSS_KB=%M", *cmd], capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd[:3])} … failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    t0 = time.perf_counter()
    os.sync()
    sync = time.perf_counter() - t0
    kb = [ln for ln in proc.stderr.splitlines() if ln.startswith("RLBENCH_MAXRSS_KB=")][-1]
    return wall, int(kb.split("=")[1]) / 2**20, proc.stdout, sync


def floor(files: list[Path], out_bytes: int, scratch: Path) -> tuple[float, float, float, float]:
    """Seconds to read every input byte once (page cache warmed first); to write out_bytes once as rlmerge's writer
    does (space reserved, then writer.Writeback's pace and writer.durable: the output on the disk); and, into a
    second file, to write them into the page cache and to fsync that."""
    buf = np.empty(64 << 20, dtype=np.uint8)
    view = memoryview(buf)

    def read_all() -> float:
        t0 = time.perf_counter()
        for f in files:
            fd = os.open(f, os.O_RDONLY)
            off = 0
            while (got := os.preadv(fd, [view], off)) > 0:
                off += got
            os.close(fd)
        return time.perf_counter() - t0

    if COLD[0]:
        drop_caches()
    else:
        read_all()  # warm the page cache, as every merge after the first finds it
    read = read_all()
    os.sync()
    t0 = time.perf_counter()
    fd = os.open(scratch, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        os.posix_fallocate(fd, 0, out_bytes)
        written, writeback = 0, writer.Writeback()
        while written < out_bytes:
            written += os.write(fd, view[: min(out_bytes - written, len(view))])
            if writeback.due(written):
                writeback.advance(fd, written)
        writer.durable(fd)
    finally:
        os.close(fd)
    settled_s = time.perf_counter() - t0
    scratch.unlink()
    t0 = time.perf_counter()
    with open(scratch, "wb") as fh:
        left = out_bytes
        while left > 0:
            left -= fh.write(view[: min(left, len(view))])
        write = time.perf_counter() - t0
        fh.flush()
        os.fsync(fh.fileno())
    durable = time.perf_counter() - t0
    scratch.unlink()
    return read, settled_s, write, durable


# mergekit's two numeric settings: as most users write a recipe (bf16 in, bf16 compute, bf16 out), and
# rlmerge's own numeric policy (float32 compute, bf16 out). The first is mergekit's fast path; the second is
# what rlmerge's output is compared with (max |diff|).
MK_SETTINGS: dict[str, dict[str, str]] = {
    "bf16": {"dtype": "bfloat16"},
    "fp32": {"dtype": "float32", "out_dtype": "bfloat16"},
}


def machine() -> str:
    """The conditions a reader needs to trust a timing: free memory (MemAvailable) and the load averages."""
    avail = total = 0
    for ln in Path("/proc/meminfo").read_text().splitlines():
        if ln.startswith("MemAvailable:"):
            avail = int(ln.split()[1])
        elif ln.startswith("MemTotal:"):
            total = int(ln.split()[1])
    load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    return (f"{datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC, {os.cpu_count()} CPUs, load {load} (1/5/15 min), "
            f"MemAvailable {avail / 2**20:.1f} of {total / 2**20:.1f} GiB")


def mergekit_config(case: Case, base: Path, agents: list[Path], setting: str = "fp32") -> str:
    import yaml

    models = [{"model": str(a), **({"parameters": case.mk_model_params} if case.mk_model_params else {})}
              for a in agents]
    cfg = {"merge_method": case.mergekit, "base_model": str(base), "models": models,
           "parameters": case.mk_params, **MK_SETTINGS[setting]}
    if case.mergekit == "linear":  # mergekit's linear averages every model it is given, the base included
        del cfg["base_model"]
    return yaml.safe_dump(cfg, sort_keys=False)


def max_abs_diff(a: Path, b: Path) -> float:
    """Largest |a − b| over every tensor of two single-folder checkpoints, read a slice at a time."""
    def files(folder: Path) -> dict[str, Path]:
        index = folder / "model.safetensors.index.json"
        if index.is_file():
            wmap = json.loads(index.read_text())["weight_map"]
            return {k: folder / v for k, v in wmap.items()}
        with safe_open(folder / "model.safetensors", "pt") as f:
            return {k: folder / "model.safetensors" for k in f.keys()}  # noqa: SIM118 safe_open has no __iter__

    fa, fb = files(a), files(b)
    worst = 0.0
    for name, path in fa.items():
        if name not in fb:
            continue
        with safe_open(path, "pt") as x, safe_open(fb[name], "pt") as y:
            sx, sy = x.get_slice(name), y.get_slice(name)
            rows = sx.get_shape()[0] if sx.get_shape() else 1
            step = max(1, (1 << 22) // max(1, math.prod(sx.get_shape()[1:])))
            for r in range(0, rows, step):
                ta = sx[r:r + step].float() if sx.get_shape() else x.get_tensor(name).float()
                tb = sy[r:r + step].float() if sy.get_shape() else y.get_tensor(name).float()
                worst = max(worst, float((ta - tb).abs().max()))
    return worst


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", choices=sorted(SIZES), default="0.5b")
    ap.add_argument("--layers", type=int, default=None, help="trim the shape to this many layers")
    ap.add_argument("--methods", default=",".join(CASES))
    ap.add_argument("--dtype", default="bfloat16",
                    help="rlmerge's output dtype (default bfloat16, mergekit's out_dtype here); 'base' for rlmerge's "
                         "own default (ram+ then writes float32)")
    ap.add_argument("--workdir", type=Path, default=ROOT / "bench-data")
    ap.add_argument("--out-dir", type=Path, default=None,
                    help="where merge outputs (and the floor's scratch file) go; default: the workdir. "
                         "A tmpfs such as /dev/shm/x when the disk cannot hold the inputs and the output")
    ap.add_argument("--mergekit", type=Path, default=ROOT / ".venv-mergekit", help="mergekit venv")
    ap.add_argument("--no-mergekit", action="store_true")
    ap.add_argument("--mergekit-settings", default=",".join(MK_SETTINGS),
                    help="mergekit's numeric settings to run, comma-separated: bf16 (dtype: bfloat16, as users write "
                         "it; mergekit computes in bf16) and fp32 (dtype: float32, out_dtype: bfloat16: rlmerge's "
                         "numeric policy)")
    ap.add_argument("--block-size", type=int, default=None)
    ap.add_argument("--json", type=Path, default=None, help="also write the rows here")
    ap.add_argument("--repeat", type=int, default=1, help="runs per rlmerge row; the median is reported")
    ap.add_argument("--no-fsync", action="store_true",
                    help="rlmerge leaves its output to the OS to write back, as mergekit does (merge(fsync=False))")
    ap.add_argument("--cold", action="store_true",
                    help="empty the page cache (root) before the floor and every merge: cold reads, the floor's "
                         "write counted with its fsync")
    ap.add_argument("--torch-path", action="store_true",
                    help="also time each method on the torch kernels (RLMERGE_FAST=0): the before/after")
    args = ap.parse_args()
    args.mk_settings = [x for x in args.mergekit_settings.split(",") if x]
    if bad := sorted(set(args.mk_settings) - set(MK_SETTINGS)):
        ap.error(f"--mergekit-settings: unknown {bad}; choose from {sorted(MK_SETTINGS)}")

    from rlmerge.methods import REGISTRY

    print(f"machine: {machine()}", flush=True)

    tag = args.size + (f"-{args.layers}l" if args.layers else "")
    t0 = time.perf_counter()
    base, agents = make_set(args.workdir / tag, args.size, layers=args.layers)
    print(f"set {tag}: {base.parent} ({time.perf_counter() - t0:.0f} s to make or find)", flush=True)
    inputs = [m / "model.safetensors" for m in (base, *agents)]
    WARM[:] = inputs
    in_bytes, out_bytes = sum(f.stat().st_size for f in inputs), inputs[0].stat().st_size
    args.out_dir = args.out_dir or args.workdir
    args.out_dir.mkdir(parents=True, exist_ok=True)
    COLD[0] = args.cold
    read_s, settled_s, write_s, durable_s = floor(inputs, out_bytes, args.out_dir / "floor.tmp")
    # rlmerge fsyncs its output: the floor writes it as rlmerge's writer does, on the disk at the end (the page
    # cache's write alone moved 0.2–9.0 s for the same gigabyte here, with the host's faults on fresh pages,
    # docs/benchmarks.md); with --no-fsync, into the page cache as rlmerge then leaves it
    floor_s = read_s + (write_s if args.no_fsync else settled_s)
    print(f"floor{' (cold: read from the disk)' if args.cold else ''}: "
          f"read {in_bytes / 1e9:.2f} GB in {read_s:.2f} s + write {out_bytes / 1e9:.2f} GB in "
          f"{write_s if args.no_fsync else settled_s:.2f} s = {floor_s:.2f} s ("
          f"{'into the page cache' if args.no_fsync else 'on the disk, as rlmerge writes it'}; the same bytes into "
          f"the page cache: {write_s:.2f} s, with fsync {durable_s:.2f} s)", flush=True)
    mk_bin = args.mergekit / "bin" / "mergekit-yaml"
    use_mk = not args.no_mergekit and mk_bin.is_file()
    keys = [k for k in args.methods.split(",") if CASES[k].rlmerge in REGISTRY]
    for k in sorted(set(args.methods.split(",")) - set(keys)):
        print(f"skip {k}: rlmerge has no method {CASES[k].rlmerge!r} yet", flush=True)
    warm_up([CASES[k] for k in keys], args.workdir)
    rows = []
    for i, k in enumerate(keys):
        rows.append(bench_case(k, CASES[k], base, agents, args, floor_s, mk_bin if use_mk else None))
        # a mergekit output no later row compares with goes now: kept to the end they took 18 GB at 0.5B and
        # filled the disk (2026-12-05), and would take 15 GB each at 7B
        later = {mergekit_config(CASES[j], base, agents, st) for j in keys[i + 1:] if CASES[j].mergekit is not None
                 for st in args.mk_settings}
        for text, (theirs, *_) in MK_DONE.items():
            if text not in later:
                shutil.rmtree(theirs, ignore_errors=True)
    if args.torch_path:
        rows += [bench_case(k, CASES[k], base, agents, args, floor_s, None, torch_path=True) for k in keys]
    for theirs, *_ in MK_DONE.values():
        shutil.rmtree(theirs, ignore_errors=True)
    print(f"machine at the end: {machine()}", flush=True)
    print_table(rows, floor_s, tag, args.mk_settings if use_mk else [])
    if args.json:
        args.json.write_text(json.dumps({"set": tag, "machine": machine(), "floor_s": floor_s, "read_s": read_s,
                                         "write_settled_s": settled_s, "write_s": write_s,
                                         "write_fsync_s": durable_s, "fsync": not args.no_fsync, "cold": args.cold,
                                         "rows": rows},
                                        indent=2))


def bench_case(key: str, case: Case, base: Path, agents: list[Path], args: argparse.Namespace, floor_s: float,
               mk_bin: Path | None, *, torch_path: bool = False) -> dict:
    work = args.out_dir
    ours = work / f"out-{key}"
    shutil.rmtree(ours, ignore_errors=True)
    job = {"base": str(base), "agents": [str(a) for a in agents], "out": str(ours), "method": case.rlmerge,
           "params": case.params, "block_size": args.block_size, "fsync": not args.no_fsync, "dtype": args.dtype}
    env = ["env", "RLMERGE_FAST=0"] if torch_path else []
    runs = []
    for _ in range(max(1, args.repeat)):  # the machine is shared and noisy: median of the repeats
        shutil.rmtree(ours, ignore_errors=True)
        wall, rss, out, sync = run_child([*env, sys.executable, str(Path(__file__).parent / "_child.py"),
                                          json.dumps(job)])
        runs.append((wall, json.loads(out.strip().splitlines()[-1])["seconds"], rss, sync))
    wall, merge_s = statistics.median(r[0] for r in runs), statistics.median(r[1] for r in runs)
    sync = statistics.median(r[3] for r in runs)
    rss = max(r[2] for r in runs)
    key = f"{key} (torch path)" if torch_path else key
    row = {"method": key, "wall_s": wall, "merge_s": merge_s, "sync_s": sync, "rss_gb": rss,
           "x_floor": merge_s / floor_s}
    print(f"rlmerge {key}: wall {wall:.1f} s (+ sync {sync:.1f} s), merge {merge_s:.1f} s, peak RSS {rss:.2f} GB",
          flush=True)
    if mk_bin is not None and case.mergekit is not None:
        for setting in args.mk_settings:
            row.update(run_mergekit(case, setting, base, agents, work, mk_bin, ours, wall, sync))
    shutil.rmtree(ours, ignore_errors=True)
    return row


MK_DONE: dict[str, tuple[Path, float, float, float]] = {}  # mergekit config → (output, wall s, RSS GB, sync s)


def run_mergekit(case: Case, setting: str, base: Path, agents: list[Path], work: Path, mk_bin: Path, ours: Path,
                 wall: float, sync: float) -> dict:
    """One mergekit run per distinct config (ram+ and ram+tl share ramplus_tl); the row's fields for one
    numeric setting, keyed ``mk_<setting>_…``."""
    text = mergekit_config(case, base, agents, setting)
    if text not in MK_DONE:
        theirs = work / f"mk-{len(MK_DONE)}"
        shutil.rmtree(theirs, ignore_errors=True)
        cfg = work / f"mk-{len(MK_DONE)}.yml"
        cfg.write_text(text)
        mk_wall, mk_rss, _, mk_sync = run_child([str(mk_bin), str(cfg), str(theirs), "--no-copy-tokenizer",
                                                 "--no-write-model-card", "--quiet"])
        MK_DONE[text] = (theirs, mk_wall, mk_rss, mk_sync)
        print(f"mergekit {case.mergekit} ({setting}): wall {mk_wall:.1f} s (+ sync {mk_sync:.1f} s), peak RSS "
              f"{mk_rss:.2f} GB", flush=True)
    theirs, mk_wall, mk_rss, mk_sync = MK_DONE[text]
    k = f"mk_{setting}_"
    return {"mk_method": case.mergekit, k + "wall_s": mk_wall, k + "sync_s": mk_sync, k + "rss_gb": mk_rss,
            k + "x_wall": mk_wall / wall, k + "x_on_disk": (mk_wall + mk_sync) / (wall + sync),
            k + "max_abs_diff": max_abs_diff(ours, theirs)}


def warm_up(methods: list[Case], work: Path) -> None:
    """One tiny merge per method, so that no timed run pays numba's one-off compile (cached on disk)."""
    from rlmerge.synthetic import Shape, make_example

    base, agents = make_example(work / "warm-in", shape=Shape())
    for i, case in enumerate(methods):
        job = {"base": str(base), "agents": [str(a) for a in agents], "out": str(work / f"warm-out{i}"),
               "method": case.rlmerge, "params": case.params, "block_size": None}
        run_child([sys.executable, str(Path(__file__).parent / "_child.py"), json.dumps(job)])
    shutil.rmtree(work / "warm-in")
    for i in range(len(methods)):
        shutil.rmtree(work / f"warm-out{i}", ignore_errors=True)


def print_table(rows: list[dict], floor_s: float, tag: str, settings: list[str]) -> None:
    """wall: the process's life; + sync: what it left for the disk to write; × mergekit: mergekit's wall against
    rlmerge's (mergekit leaves its output in the page cache), and with both outputs on disk (wall + sync each),
    one group of columns per mergekit numeric setting, side by side."""
    # The floor's write moves with the machine (into the page cache 0.2–9.0 s for the same gigabyte, with the
    # host's faults on fresh pages, docs/benchmarks.md); a merge against task arithmetic in the same run, which
    # reads and writes the same bytes, holds still: what a method's own kernels add.
    ta = next((r["merge_s"] for r in rows if r["method"] == "task_arithmetic"), None)
    head = f"| method ({tag}) | wall s | + sync s | merge s | peak RSS GB | × floor ({floor_s:.2f} s) |"
    rule = "|---|---:|---:|---:|---:|---:|"
    if ta is not None:
        head += " × task_arithmetic (merge s) |"
        rule += "---:|"
    if settings:
        head += " mergekit |"
        rule += "---|"
    for st in settings:
        head += (f" mk {st} wall s | + sync s | mk {st} RSS GB | × mk {st} (wall) | × mk {st} (on disk) | "
                 f"max |diff| vs mk {st} |")
        rule += "---:|---:|---:|---:|---:|---:|"
    print("\n" + head + "\n" + rule)
    for r in rows:
        line = (f"| {r['method']} | {r['wall_s']:.1f} | {r['sync_s']:.1f} | {r['merge_s']:.1f} | {r['rss_gb']:.2f} | "
                f"{r['x_floor']:.1f}× |")
        if ta is not None:
            line += f" {r['merge_s'] / ta:.2f}× |"
        if settings:
            line += f" {r.get('mk_method', '—')} |"
        for st in settings:
            k = f"mk_{st}_"
            line += (f" {r[k + 'wall_s']:.1f} | {r[k + 'sync_s']:.1f} | {r[k + 'rss_gb']:.2f} | "
                     f"{r[k + 'x_wall']:.1f}× | {r[k + 'x_on_disk']:.1f}× | {r[k + 'max_abs_diff']:.3g} |"
                     ) if k + "wall_s" in r else " — | — | — | — | — | — |"
        print(line)

if __name__ == "__main__":
    main()
