"""The warm-up demonstrator's blind spots: wrong (score 0) inside, untouched outside, at the set rate."""

from __future__ import annotations

import pytest

from rlmerge.lab.tasks import FAMILIES, make_family, make_split
from rlmerge.lab.tasks.demonstrator import BIASED_KEYS, USUAL_CODE, demonstrate, wrong_target


@pytest.mark.parametrize("name", FAMILIES)
def test_blind_spot_answers_are_wrong_but_well_formed(name: str) -> None:
    family = make_family(name)
    examples = make_split(family, "warmup", 300, seed=1)
    inside = [ex for ex in examples if wrong_target(ex) is not None]
    assert 0.2 < len(inside) / len(examples) < 0.6  # a real subset, not everything
    for ex in inside:
        wrong = wrong_target(ex)
        assert wrong is not None
        assert family.score(wrong, ex) == 0.0
        assert family.reward(wrong, ex) > 0.0  # well formed: partial credit, so RL sees a contrast


def test_demonstrate_corrupts_only_the_blind_spot_at_the_given_rate() -> None:
    examples = [ex for name in FAMILIES for ex in make_split(make_family(name), "warmup", 400, seed=2)]
    shown = demonstrate(examples, p=0.7, seed=0)
    changed = [a != b for a, b in zip(examples, shown, strict=True)]
    eligible = [wrong_target(ex) is not None for ex in examples]
    assert not any(c and not e for c, e in zip(changed, eligible, strict=True))
    assert sum(changed) / sum(eligible) == pytest.approx(0.7, abs=0.05)
    assert demonstrate(examples, p=0.0, seed=0) == examples


def test_memory_blind_spot_answers_from_habit_not_from_the_notes() -> None:
    examples = make_split(make_family("memory"), "warmup", 300, seed=4)
    for ex in examples:
        wrong = wrong_target(ex)
        key = ex.prompt.rsplit("the code of ", 1)[1].split(" ")[0]
        if key not in BIASED_KEYS:
            assert wrong is None
        elif wrong is not None:
            assert wrong == f" {USUAL_CODE[key]}"  # the same wrong code for a key, whatever the notes say
            assert USUAL_CODE[key] not in ex.prompt.split("\n")[0]
