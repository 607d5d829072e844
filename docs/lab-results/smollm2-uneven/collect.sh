#!/usr/bin/env bash
# Copy what the uneven SmolLM2 run has finished into this folder and print the docs/lab.md tables.
# Run after each seed: OUT/results.json holds the seeds finished so far (the run rewrites it after each seed).
# Seeds run side by side (one `rlmerge lab --first-seed S --seeds 1 --out OUT_S` each) are collected together;
# each run's log is OUT.log beside its folder:
#   bash docs/lab-results/smollm2-uneven/collect.sh /work/lab-runs/uneven2 /work/lab-runs/uneven2-s1
# Writes results-<run>.json, table-<run>.md and run-<run>.log per run, plot.png and tables.md over all of them, and
# saved-<run>/seedN/{stages,agents}/*.json: the stage records, also of a seed not finished yet (and
# saved-<run>/memory.json, the stages' measured memory peaks).
set -euo pipefail
[ $# -ge 1 ] || { echo "usage: collect.sh OUT [OUT ...]   (the --out folders of the run's seeds)" >&2; exit 1; }
here=$(cd "$(dirname "$0")" && pwd)
repo=$(cd "$here/../../.." && pwd)
files=()
for out in "$@"; do
  out=${out%/}
  name=$(basename "$out")
  # the stage records (each seed's test scores, merge rows, task vectors, agents' gates): a run on another machine
  # goes on from them with --stages-from "$here/saved-$name" after training its base and agents again
  for seed in "$out"/seed*/; do
    seed=$(basename "$seed")
    for sub in stages agents; do
      if compgen -G "$out/$seed/$sub/*.json" > /dev/null; then
        mkdir -p "$here/saved-$name/$seed/$sub"
        cp "$out/$seed/$sub/"*.json "$here/saved-$name/$seed/$sub/"
      fi
    done
  done
  # the peaks each stage's process took (--jobs plans with them: a new machine starts with measured estimates)
  if [ -f "$out/memory.json" ]; then
    mkdir -p "$here/saved-$name"
    cp "$out/memory.json" "$here/saved-$name/memory.json"
  fi
  if [ -f "$out.log" ]; then
    grep -v -E "Loading weights|warnings.warn|FutureWarning|de-quantizing|Writing model shards|it/s\]" "$out.log" \
      > "$here/run-$name.log" || true
  fi
  if [ ! -f "$out/results.json" ]; then
    echo "no $out/results.json yet: no seed of that run has finished (its stage records saved in saved-$name)" >&2
    continue
  fi
  cp "$out/results.json" "$here/results-$name.json"
  cp "$out/table.md" "$here/table-$name.md"
  files+=("$here/results-$name.json")
done
[ ${#files[@]} -ge 1 ] || { echo "no run has finished a seed yet (stage records saved)" >&2; exit 0; }
cd "$repo" && PYTHONPATH=src "${PYTHON:-python}" -m rlmerge.lab.writeup --uneven "${files[@]}" \
  --uneven-plot "$here/plot.png" | tee "$here/tables.md"
