"""Run several mergekit recipes in ONE process (mergekit's import costs seconds): used by the parity tests.

Run with mergekit's own interpreter: ``.venv-mergekit/bin/python tests/mergekit_driver.py jobs.json``, where
jobs.json is a list of {"recipe": PATH, "out": PATH, "seed": INT | null, "errors": PATH (optional)}. Prints one
line per job. A job with "errors" records mergekit's refusal there (its exception, as text) instead of stopping.
"""

import json
import sys

import torch
import yaml
from mergekit.config import MergeConfiguration
from mergekit.merge import run_merge
from mergekit.options import MergeOptions


def main(path: str) -> None:
    torch.set_num_threads(1)
    with open(path) as f:
        jobs = json.load(f)
    for job in jobs:
        try:
            with open(job["recipe"]) as f:
                config = MergeConfiguration.model_validate(yaml.safe_load(f))
            options = MergeOptions(random_seed=job.get("seed"), quiet=True, copy_tokenizer=False,
                                   write_model_card=False)
            run_merge(config, job["out"], options=options)
        except Exception as e:  # noqa: BLE001  a refusal is an answer too when the job asks to record it
            if "errors" not in job:
                raise
            with open(job["errors"], "w") as f:
                f.write(f"{type(e).__name__}: {e}")
        print("done", job["out"], flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
