started 2026-12-04T08:29:27Z
.venv/bin/rlmerge lab --size smollm2 --out /tmp/lab3-runs/smollm2
resumed 2026-12-04T09:58:23Z (tool_use and coding agents reused, memory retrained with 2 solved examples)
