"""Memory: answer a question whose answer is buried in a long context of distractor facts.

The context is a list of "the code of KEY is WORD ." facts mixed with filler sentences; the question
restates one fact up to its code ("the code of owl is") and the answer is that key's code word. Only the
exact word is correct. Codes are single words (not numbers) so that the task is pure retrieval: a tiny model
learns to copy one token from the matching fact within minutes, while multi-token numbers took it far
longer than the lab's budget.
"""

from __future__ import annotations

import random

from rlmerge.lab.tasks.base import Example, answer_part

KEYS = [
    "fox",
    "owl",
    "elk",
    "bee",
    "ant",
    "cod",
    "yak",
    "emu",
    "ram",
    "eel",
    "bat",
    "cow",
    "hen",
    "pig",
    "rat",
    "jay",
]
CODES = ["red", "blue", "gold", "pink", "grey", "jade", "ruby", "teal", "navy", "lime", "rose", "sand", "plum", "mint"]
FILLER = [
    "the sky is grey .",
    "it rained all day .",
    "the door was open .",
    "nobody came back .",
    "the tea went cold .",
    "a bell rang twice .",
]


class Memory:
    name = "memory"

    def __init__(self, n_facts: int = 6, n_filler: int = 3) -> None:
        self.n_facts = n_facts
        self.n_filler = n_filler

    def sample(self, rng: random.Random) -> Example:
        keys = rng.sample(KEYS, self.n_facts)
        codes = rng.sample(CODES, self.n_facts)
        lines = [f"the code of {k} is {c} ." for k, c in zip(keys, codes, strict=True)]
        lines += rng.sample(FILLER, min(self.n_filler, len(FILLER)))
        rng.shuffle(lines)
        # Codes in the order they appear in the notes (the warm-up demonstrator's bias uses the first).
        in_order = [line.split(" is ")[1][:-2] for line in lines if line.startswith("the code of")]
        ask = rng.randrange(self.n_facts)
        prompt = f"notes: {' '.join(lines)}\nquestion: the code of {keys[ask]} is"
        return Example(self.name, prompt, f" {codes[ask]}", {"answer": codes[ask], "codes": in_order})

    def reward(self, completion: str, example: Example) -> float:
        got = answer_part(completion)
        if got == example.check["answer"]:
            return 1.0
        # A code that appears in the notes is the right kind of answer, retrieved for the wrong key.
        return 0.1 if got in example.check["codes"] else 0.0

    def score(self, completion: str, example: Example) -> float:
        return float(answer_part(completion) == example.check["answer"])

    def words(self) -> list[str]:
        words = set(KEYS) | set(CODES) | {"notes", "question", "is", "the", "code", "of"}
        words |= {w for s in FILLER for w in s.split()}
        return sorted(words)
