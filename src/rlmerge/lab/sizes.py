"""The lab's sizes: the model, the GRPO settings of each agent, the split sizes and the rows of each run.

`rlmerge lab --size NAME` runs `SIZES[NAME]`; `with_steps` is the CLI's --grpo-steps / --warmup-steps.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace

from rlmerge.lab.grpo import GRPOSettings
from rlmerge.lab.merging import SMOLLM2_GRIDS, SMOLLM2_UNEVEN_GRIDS, TINY_GRIDS, MethodPlan
from rlmerge.lab.model import ModelShape
from rlmerge.lab.views import Kind


@dataclass(frozen=True)
class LabSize:
    name: str
    shape: ModelShape
    warmup_steps: int
    warmup_batch: int
    grpo: GRPOSettings
    n_val: int  # per family, for choosing each baseline's hyperparameters
    n_test: int  # per family, held out
    max_grid: int = 99  # cap on grid points per method (smoke keeps one)
    n_fisher: int = 64  # examples per agent for the diagonal Fisher
    kind: Kind = "word"  # word: the tiny lab's own models; chat: SmolLM2 (rlmerge.lab.smollm2)
    methods: tuple[MethodPlan, ...] = TINY_GRIDS
    unique_rows: bool = True  # the paper's unique-region probe (base + one agent's unique elements)
    # Per-family GRPO settings where they differ from `grpo` (uneven agents: docs/lab.md, section 3b).
    agent_grpo: Mapping[str, GRPOSettings] = field(default_factory=dict)
    # Validation and training prompts avoid the seed's test prompts (coding repeats prompts otherwise).
    disjoint: bool = False
    keep_merges: bool = True  # False: a row's chosen merge is deleted once its scores are saved (disk)
    # > 1: each trained agent must beat the base on its own family's validation split (n_val examples), else it
    # is trained again with another training seed, at most this many runs in all (pipeline.train_agents)
    agent_attempts: int = 1
    # the gate's rule (with agent_attempts > 1): None, the agent's validation accuracy above the base's; α, also a
    # one-sided exact sign test over the examples the two score differently (paired.sign_test) below α, so a run
    # one lucky example puts above the base does not pass
    gate_alpha: float | None = None
    # GB a stage's process is expected to peak at before one is measured (rlmerge.lab.jobs; --jobs admits stages
    # while their estimates fit the memory): by stage kind, "*" for the others
    stage_gb: Mapping[str, float] = field(default_factory=lambda: {"*": 1.0})
    # a new worker process for each stage with --jobs (rlmerge.lab.jobs.workers_for): its memory goes back to the
    # system when it ends; worth a worker's imports (~3-6 s) only where stages last minutes and hold GB
    fresh_process_per_stage: bool = False

    def grpo_for(self, family: str) -> GRPOSettings:
        return self.agent_grpo.get(family, self.grpo)

    @property
    def disjoint_from_test(self) -> int:
        """How many of the seed's test prompts the validation and training splits avoid (0: no rule)."""
        return self.n_test if self.disjoint else 0


SIZES: dict[str, LabSize] = {
    "smoke": LabSize(
        "smoke",
        ModelShape(hidden=64, layers=2, heads=2, kv_heads=1, intermediate=128),
        400,  # enough for some partial rewards, so GRPO's advantages (and the task vectors) are not all zero
        16,
        GRPOSettings(steps=3, prompts_per_step=4, generations=4, temperature=0.7),
        n_val=4,
        n_test=6,
        max_grid=1,
        n_fisher=4,
    ),
    "tiny": LabSize("tiny", ModelShape(), 700, 32, GRPOSettings(), n_val=48, n_test=128),
    "smollm2": (SMOLLM2 := LabSize(
        "smollm2",
        ModelShape(),  # unused: the base is SmolLM2's own architecture
        0,
        0,
        # SmolLM2-135M-Instruct (no warm-up: a pretrained base). A GRPO step of 8 completions of ~200 tokens
        # costs ~1 CPU-minute on one thread; lr from the pilot (docs/lab.md).
        GRPOSettings(steps=12, prompts_per_step=2, generations=4, lr=2e-5, temperature=0.7),
        n_val=8,
        n_test=32,
        n_fisher=16,
        kind="chat",
        methods=SMOLLM2_GRIDS,
        unique_rows=False,
        # measured on 2026-12-06 (24 GB machine; RSS of the --jobs workers every 20 s, docs/lab.md): the tool-use
        # GRPO run up to 16.7 GB resident (killed by the system beside the memory agent), the coding agent's at
        # most 4.6 GB, the memory agent's 7.5 GB; a merge row's or a model's test scores 2.0-2.2 GB
        stage_gb={"agent tool_use": 17.0, "agent": 8.0, "row": 3.0, "scores": 3.0, "*": 3.0},
        fresh_process_per_stage=True,
    )),
    # The same base with agents uneven by their training (issue 27): a low-lr tool-use agent (at lr ≥ 3e-5 its
    # policy collapsed onto one call in every pilot), a mid-lr coding agent, a high-lr memory agent; lr × steps
    # from the bf16-threshold arithmetic and the pilot's measured densities (docs/lab.md, section 3b).
    "smollm2-uneven": replace(
        SMOLLM2,
        name="smollm2-uneven",
        n_val=32,
        n_test=128,
        methods=SMOLLM2_UNEVEN_GRIDS,
        agent_grpo={
            # pilot round 11 (docs/lab.md 3b): the test's own 0/1 reward, 8 completions per prompt sampled at T 0.4
            # (where the base's calls are exactly right ~20 % of the time, 3 % at T 0.7): 26 -> 50 of 128 on
            # validation, +18.8 [+10.9, +26.6], where round 7's graded reward (4 x 4, 16 steps) gave +7.0
            "tool_use": replace(SMOLLM2.grpo, steps=24, prompts_per_step=2, generations=8, lr=2e-5,
                                temperature=0.4, reward="strict"),
            "coding": replace(SMOLLM2.grpo, steps=16, lr=3e-5),
            "memory": replace(SMOLLM2.grpo, steps=16, lr=6e-5),
        },
        disjoint=True,
        keep_merges=False,
        # seed 1's first coding and memory runs collapsed (test 39 -> 13 % and 72 -> 7 %) where seed 0's learned:
        # at these lr a run can lock onto a wrong answer within a few steps (docs/lab.md, section 3b). Five runs, not
        # three: the tool-use setting passed the sign-test gate in 2 of its first 5 runs (seed 0 run 1, seed 1 run 3;
        # seed 1 runs 1-2 and seed 2 runs 1-2 failed), so three runs left a failing agent kept too often. Not part of
        # an agent's settings: a resumed run goes on from its next attempt
        agent_attempts=5,
        # seed 1's tool-use agent passed "above the base" by one example of 32 (7 -> 8) and scored below the base
        # on test (29 -> 27 of 128); seed 0's passed 7 -> 14 (docs/lab.md, section 3b)
        gate_alpha=0.05,
    ),
}


def with_steps(size: LabSize, grpo_steps: int | None = None, warmup_steps: int | None = None) -> LabSize:
    """A size with overridden step counts (CLI --grpo-steps / --warmup-steps; every agent's steps)."""
    grpo = size.grpo if grpo_steps is None else replace(size.grpo, steps=grpo_steps)
    agents = {f: g if grpo_steps is None else replace(g, steps=grpo_steps) for f, g in size.agent_grpo.items()}
    return replace(size, grpo=grpo, agent_grpo=agents,
                   warmup_steps=size.warmup_steps if warmup_steps is None else warmup_steps)
