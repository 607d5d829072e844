#!/usr/bin/env bash
# Copy what the uneven SmolLM2 run has finished into this folder and print the docs/lab.md tables.
# Run after each seed: OUT/results.json holds the seeds finished so far (the run rewrites it after each seed).
#   bash docs/lab-results/smollm2-uneven/collect.sh /work/lab-runs/uneven /work/lab-runs/uneven.log
set -euo pipefail
out=${1:?usage: collect.sh OUT [LOG]   (the --out folder of the run, and its log)}
log=${2:-}
here=$(cd "$(dirname "$0")" && pwd)
repo=$(cd "$here/../../.." && pwd)
test -f "$out/results.json" || { echo "no $out/results.json yet: no seed has finished" >&2; exit 1; }
cp "$out/results.json" "$out/table.md" "$out/plot.png" "$here/"
for f in "$out"/pilot-seed*.md "$out"/pilot-seed*.json; do [ -f "$f" ] && cp "$f" "$here/pilot/"; done
if [ -n "$log" ]; then
  grep -v -E "Loading weights|warnings.warn|FutureWarning|de-quantizing|Writing model shards|it/s\]" "$log" \
    > "$here/run.log" || true
fi
cd "$repo" && PYTHONPATH=src "${PYTHON:-python}" -m rlmerge.lab.writeup --uneven "$here/results.json" \
  | tee "$here/tables.md"
