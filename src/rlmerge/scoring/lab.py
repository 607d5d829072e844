"""``lab:FAMILY``: the agent lab's verifiable tasks (tool_use, coding, memory), greedy answers checked by the family's
strict verifier on ``limit`` examples of the ``split`` split of seed ``seed``, in the view ``kind``
(``rlmerge.lab.views``: ``word`` for the tiny lab's models, ``chat`` for an instruct model such as SmolLM2); with
``disjoint_from_test`` > 0 the examples avoid the prompts of the seed's first that many test examples
(``rlmerge.lab.tasks.held_out_split``).
Accuracy in %, with each example's result (ids: the example's index in the split)."""

from __future__ import annotations

from dataclasses import dataclass

from ..sweeping.scores import TaskScore
from .options import Options
from .subject import Subject


@dataclass
class LabTask:
    family: str
    options: Options

    def __post_init__(self) -> None:
        if self.family == "coding":  # it runs the candidates' programs: refused before anything is merged
            from ..sandbox import ensure_isolation

            ensure_isolation()

    @property
    def names(self) -> list[str]:
        return [f"lab:{self.family}"]

    needs = "model"

    def score(self, subject: Subject) -> dict[str, TaskScore]:
        from ..lab.evaluate import score_each
        from ..lab.tasks import held_out_split

        model, tokenizer = subject.model()
        o = self.options
        examples = held_out_split(self.family, o.split, o.limit, o.seed, o.disjoint_from_test)
        each = score_each(model, tokenizer, examples, o.kind)
        return {self.names[0]: TaskScore.accuracy(each, [str(i) for i in range(len(each))])}
