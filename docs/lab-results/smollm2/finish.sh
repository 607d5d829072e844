#!/usr/bin/env bash
# Finish the SmolLM2 write-up once `rlmerge lab --size smollm2 --out OUT` has written OUT/results.json:
# copy results and logs here, and print the docs/lab.md section 3 tables (paper's Table 1 layout).
set -euo pipefail
out=${1:?usage: finish.sh OUT [NAME]   (the --out folder of the smollm2 run; NAME names the copies)}
name=${2:-$(basename "$out")}
here=$(cd "$(dirname "$0")" && pwd)
repo=$(cd "$here/../../.." && pwd)
test -f "$out/results.json" || { echo "no $out/results.json yet: the run has not finished" >&2; exit 1; }
cp "$out/results.json" "$here/$name-results.json"
cp "$out/table.md" "$here/$name-table.md"
cp "$out/plot.png" "$here/$name-plot.png"
for log in "$out"/../smollm2*.log; do
  [ -f "$log" ] && grep -v -E "Loading weights|warnings.warn|FutureWarning|de-quantizing|Writing model shards" "$log" \
    > "$here/$(basename "$log")" || true
done
cd "$repo" && PYTHONPATH=src python -m rlmerge.lab.writeup --real "$here/$name-results.json" | tee "$here/$name-tables.md"
