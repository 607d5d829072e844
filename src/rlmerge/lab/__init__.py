"""The agent lab: a tiny base model, three GRPO-trained agents, and a merge-and-score pipeline.

Optional extra `rlmerge[lab]` (TRL, datasets, transformers). Entry points: `rlmerge lab` and
`rlmerge eval` (see `rlmerge.cli.lab`) and `rlmerge.lab.pipeline.run_lab`.
"""
