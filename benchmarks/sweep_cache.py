"""A sweep of RAM+ candidates against the same candidates as separate `rlmerge merge` runs, in one session.

Builds (or reuses) the Qwen2.5-0.5B-shaped set of benchmarks/dataset.py, then, each in a fresh process under
``/usr/bin/time -v`` (wall time, peak RSS):

    merge ×K     `rlmerge merge BASE A1 A2 A3 -o … --method ram+ --param r=… --param alpha=… --json --no-fsync`, one
                 per candidate (each runs its own statistics pass and merge pass and writes ~1 GB)
    sweep mem    rlmerge.sweep(…, memory="always"): every candidate built in memory, nothing written
    sweep disk   rlmerge.sweep(…, memory="never"): every candidate merged into the sweep folder, then removed

No scorer runs (the cost of scoring is the scorer's); the sweeps report their statistics and merge passes and the
bytes they read. The inputs sit in the page cache after the first run (3.8 GB on a 24 GB machine), so this
measures the passes' compute and memory traffic, not a disk. Each candidate's merge time (the sweep's
``merge_seconds``) is set against the floor of benchmarks/run.py measured in the same run: one read of the inputs
for a candidate built in memory (it writes nothing), a read and a write for one built on disk.

    .venv/bin/python benchmarks/sweep_cache.py [--workdir DIR] [--size 0.5b] [--grid "METHOD k=v,v …"]
                                               [--no-separate]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))
from dataset import make_set  # noqa: E402
from run import floor  # noqa: E402

SWEEP = """
import json, sys, time
import rlmerge
job = json.loads(sys.argv[1])
t0 = time.perf_counter()
res = rlmerge.sweep(job["base"], job["agents"], job["out"], candidates=[job["grid"]], memory=job["memory"],
                    dtype=job["dtype"])
print(json.dumps({"seconds": time.perf_counter() - t0, "statistics": res.statistics_passes,
                  "merges": res.merge_passes, "read_bytes": sum(s.read_bytes for s in res.scored),
                  "where": sorted({s.where for s in res.scored}), "n": len(res.scored),
                  "merge_seconds": [s.merge_seconds for s in res.scored]}))
"""
CLI = "import sys; from rlmerge.cli import entry; sys.argv[0] = 'rlmerge'; entry()"


def timed(args: list[str]) -> tuple[dict, float, float]:
    """(the child's JSON on stdout, wall seconds, peak RSS in GiB) of one child under /usr/bin/time -v."""
    env = {**os.environ, "PYTHONPATH": str(REPO / "src"), "HF_HUB_OFFLINE": "1"}
    out = subprocess.run(["/usr/bin/time", "-v", sys.executable, *args], capture_output=True, text=True, env=env)
    if out.returncode != 0:
        raise RuntimeError(out.stderr[-3000:])
    wall = re.search(r"Elapsed \(wall clock\) time \(h:mm:ss or m:ss\): (\S+)", out.stderr).group(1)
    parts = [float(x) for x in wall.split(":")]
    seconds = sum(p * 60 ** i for i, p in enumerate(reversed(parts)))
    rss = int(re.search(r"Maximum resident set size \(kbytes\): (\d+)", out.stderr).group(1)) / 2**20
    text = out.stdout.strip()
    doc = json.loads(text[text.index("{"):])  # `rlmerge merge --json` prints one indented object; the sweep, one line
    return doc, seconds, rss


def candidates(grid: str) -> list[tuple[str, dict[str, str]]]:
    from rlmerge.sweeping.candidates import parse_grid

    return [(c.method, dict(c.params)) for c in parse_grid(grid)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workdir", type=Path, default=REPO / "bench-data")
    ap.add_argument("--size", default="0.5b")
    ap.add_argument("--grid", default="ram+ r=0.05,0.1,0.2,0.4 alpha=1,2")
    ap.add_argument("--dtype", default="bfloat16",
                    help="the candidates' output dtype (default bfloat16, as measured in docs/sweep.md; float32 is "
                         "ram+'s own default)")
    ap.add_argument("--no-separate", action="store_true", help="skip the separate merges (only the sweeps)")
    args = ap.parse_args()
    base, agents = make_set(args.workdir / args.size, args.size)
    tmp = Path(tempfile.mkdtemp(prefix="rlmerge-bench-sweep-"))
    try:
        files = sorted(f for d in (base, *agents) for f in Path(d).glob("*.safetensors"))
        out_bytes = sum(f.stat().st_size for f in Path(base).glob("*.safetensors"))
        if args.dtype == "float32":
            out_bytes *= 2  # a bf16 set's output in float32
        read_s, write_s, _ = floor(files, out_bytes, tmp / "floor.bin")
        print(f"floor: read {sum(f.stat().st_size for f in files) / 1e9:.2f} GB in {read_s:.2f} s, write "
              f"{out_bytes / 1e9:.2f} GB in {write_s:.2f} s", flush=True)
        rows = []
        per: list[tuple[str, list[float], float]] = []  # (run, each candidate's merge seconds, its floor)
        total = [0.0, 0, 0.0]  # seconds, bytes read, peak RSS
        for i, (method, params) in enumerate([] if args.no_separate else candidates(args.grid)):
            flags = [x for k, v in params.items() for x in ("--param", f"{k}={v}")]
            out = tmp / f"merge{i}"
            doc, wall, rss = timed(["-c", CLI, "merge", str(base), *map(str, agents), "-o", str(out),
                                    "--method", method, *flags, "--dtype", args.dtype, "--json", "--no-fsync",
                                    "-q"])
            shutil.rmtree(out)
            total = [total[0] + wall, total[1] + doc["read_bytes"], max(total[2], rss)]
            print(f"merge {i}: {method} {params} {wall:.1f} s, {doc['read_bytes'] / 1e9:.2f} GB read", flush=True)
        if not args.no_separate:
            n = i + 1
            rows.append((f"{n} × rlmerge merge", total[0], f"{n} + {n}", total[1], total[2], "disk"))
        for memory in ("always", "never"):
            job = {"base": str(base), "agents": [str(a) for a in agents], "out": str(tmp / f"sweep-{memory}"),
                   "grid": args.grid, "memory": memory, "dtype": args.dtype}
            doc, wall, rss = timed(["-c", SWEEP, json.dumps(job)])
            rows.append((f"rlmerge.sweep, {doc['n']} candidates", wall, f"{doc['statistics']} + {doc['merges']}",
                         doc["read_bytes"], rss, "/".join(doc["where"])))
            per.append((f"rlmerge.sweep, memory={memory!r}", doc["merge_seconds"],
                        read_s if memory == "always" else read_s + write_s))
            print(f"sweep ({memory}): {wall:.1f} s", flush=True)
        print(f"\n{args.size} set, grid {args.grid!r}, {os.cpu_count()} CPUs\n")
        print("| run | wall s | statistics + merge passes | GB read | peak RSS GiB | candidates built |")
        print("|---|---:|---:|---:|---:|---|")
        for name, wall, passes, read, rss, where in rows:
            print(f"| {name} | {wall:.1f} | {passes} | {read / 1e9:.2f} | {rss:.2f} | {where} |")
        print("\n| run | merge s per candidate (first, then the others' median, min–max) | floor s | "
              "× floor (the others' median) |")
        print("|---|---|---:|---:|")
        for name, secs, fl in per:
            rest = sorted(secs[1:]) or secs
            med = rest[len(rest) // 2]
            print(f"| {name} | {secs[0]:.2f}, then {med:.2f} ({rest[0]:.2f}–{rest[-1]:.2f}) | {fl:.2f} | "
                  f"{med / fl:.1f}× |")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
