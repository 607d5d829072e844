"""Memory: answer from the context, not from habit: find the one fact buried in a long context of notes.

The notes are filler sentences with one "the code of KEY is WORD ." fact at a random place; the question
restates the fact up to its code ("the code of owl is") and the answer is that code word (exact match).
The warm-up demonstrator's blind spot (`rlmerge.lab.tasks.demonstrator`) answers some keys from a fixed
"usual" code instead of reading the notes, the way a model answers from its parameters rather than its
context; RL with the exact-match reward has to make it read.

`n_facts` > 1 puts several code facts in the notes, so the key must select among them (associative
recall). The lab's tiny model did not learn that within its budget (docs/lab.md, lab notes: 2 to 6 facts,
several formats, Qwen2 and GPT-2, up to 3000 steps, all at chance), so the lab uses one fact.
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
# No filler sentence contains a code word: the fact is the only place the answer can come from.
FILLER = [
    "the sky was dark .",
    "it rained all day .",
    "the door was open .",
    "nobody came back .",
    "the tea went cold .",
    "a bell rang twice .",
    "the road was long .",
    "a dog barked .",
    "the lights went out .",
    "the train was late .",
]


class Memory:
    name = "memory"

    def __init__(self, n_facts: int = 1, n_filler: int = 6) -> None:
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
        # A code word is the right kind of answer (well formed), just not the one the notes give.
        return 0.1 if got in CODES else 0.0

    def score(self, completion: str, example: Example) -> float:
        return float(answer_part(completion) == example.check["answer"])

    def words(self) -> list[str]:
        words = set(KEYS) | set(CODES) | {"notes", "question", "is", "the", "code", "of"}
        words |= {w for s in FILLER for w in s.split()}
        return sorted(words)
