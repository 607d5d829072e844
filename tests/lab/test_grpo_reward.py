"""The reward function handed to TRL: its call signature and values on hand-written completions."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("trl", reason="the lab extra (rlmerge[lab]) is not installed")

from rlmerge.lab.grpo import reward_function  # noqa: E402 - after the importorskip


def test_reward_function_reads_the_check_column_and_extra_kwargs() -> None:
    reward = reward_function("memory")
    check = json.dumps({"answer": "teal", "codes": ["red", "teal"]})
    # TRL passes every dataset column plus trainer_state / log_* keyword arguments.
    values = reward(["p", "p", "p"], [" teal", " red", " zzz"], check=[check] * 3, trainer_state=None)
    assert values == pytest.approx([1.0, 0.1, 0.0])
    assert reward.__name__ == "memory_reward"


def test_coding_reward_runs_the_program() -> None:
    reward = reward_function("coding")
    check = json.dumps({"stdout": "9"})
    values = reward(["p"] * 3, [" print(9)", " print(8)", " import os"], check=[check] * 3)
    assert values == pytest.approx([1.0, 0.2, 0.0])
