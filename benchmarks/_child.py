"""One rlmerge merge in a fresh process (run.py measures its wall time and peak RSS); prints JSON."""

from __future__ import annotations

import json
import sys
import time

import rlmerge

if __name__ == "__main__":
    job = json.loads(sys.argv[1])
    kwargs = {"block_size": job["block_size"]} if job.get("block_size") else {}
    if job.get("dtype"):
        kwargs["dtype"] = job["dtype"]
    t0 = time.perf_counter()
    rlmerge.merge(job["base"], job["agents"], job["out"], method=job["method"], params=job["params"],
                  device=job.get("device", "cpu"), fsync=job.get("fsync", True), **kwargs)
    print(json.dumps({"seconds": time.perf_counter() - t0}))
