started 2026-12-04T10:24:38Z: base, coding and memory agents copied from smollm2/, tool_use retrained with 2 solved examples
.venv/bin/rlmerge lab --size smollm2 --out /tmp/lab3-runs/smollm2-b
