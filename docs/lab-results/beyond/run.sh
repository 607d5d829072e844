#!/bin/bash
# Measures the research rows on the issue-17 tiny lab's agents (copied from /tmp/lab3-runs), no retraining.
export PYTHONPATH=/tmp/presets-lab/src HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1 OMP_NUM_THREADS=1
ROWS='Task arithmetic,RAM+,ARM-R,ARM-TIES,RAM+ magnitude-ρ,RAM+ sign-elect'
run() { /usr/bin/time -v /work/main/.venv/bin/rlmerge lab --size tiny --first-seed $2 --out tiny-$1 --rows "$ROWS" > tiny-$1.log 2>&1; }
run a 0 & run c 1 & run b 2 & run d 3 & wait
