"""Tool use: emit one well-formed JSON function call (name + arguments) for a request, given tool schemas.

The prompt lists three tool signatures (the right one and two distractors, in random order) and a
request phrased by one of several templates. The answer must pick the tool the request asks for and copy
the argument values out of the request, under the schema's argument names.
"""

from __future__ import annotations

import json
import random

from rlmerge.lab.tasks.base import Example, answer_part

CITIES = ["paris", "tokyo", "lima", "oslo", "cairo", "delhi", "rome", "quito"]
UNITS = ["usd", "eur", "yen", "gbp"]
TOPICS = ["cats", "rockets", "jazz", "tea", "chess", "rivers"]
PEOPLE = ["ana", "bob", "eve", "max", "kim", "leo"]
FOODS = ["pizza", "sushi", "tacos", "soup"]

# tool name -> (argument names, value pools, request templates). Numbers are drawn when the pool is "num".
TOOLS: dict[str, tuple[list[str], list[list[str] | str], list[str]]] = {
    "get_weather": (
        ["city"],
        [CITIES],
        ["what is the weather in {0}", "is it raining in {0}", "forecast for {0}"],
    ),
    "convert": (["amount", "unit"], ["num", UNITS], ["convert {0} to {1}", "how much is {0} in {1}"]),
    "search": (["query"], [TOPICS], ["find articles about {0}", "look up {0}", "search the web for {0}"]),
    "send_email": (["to", "subject"], [PEOPLE, TOPICS], ["email {0} about {1}", "write to {0} on {1}"]),
    "set_timer": (["minutes"], ["num"], ["set a timer for {0} minutes", "wake me in {0} minutes"]),
    "order_food": (["dish", "count"], [FOODS, "num"], ["order {1} {0}", "i want {1} portions of {0}"]),
    "call": (["person"], [PEOPLE], ["phone {0}", "ring {0} now"]),
    "translate": (
        ["text", "lang"],
        [TOPICS, ["fr", "de", "es"]],
        ["translate {0} into {1}", "say {0} in {1}"],
    ),
}


def _signature(name: str) -> str:
    return f"{name}({', '.join(TOOLS[name][0])})"


class ToolUse:
    name = "tool_use"

    def sample(self, rng: random.Random) -> Example:
        tool = rng.choice(sorted(TOOLS))
        arg_names, pools, templates = TOOLS[tool]
        values: list[str | int] = [rng.randint(2, 99) if pool == "num" else rng.choice(pool) for pool in pools]
        shown = rng.sample([t for t in sorted(TOOLS) if t != tool], 2) + [tool]
        rng.shuffle(shown)
        request = rng.choice(templates).format(*values)
        prompt = f"tools: {' | '.join(_signature(t) for t in shown)}\nrequest: {request}\ncall:"
        call = {"name": tool, "arguments": dict(zip(arg_names, values, strict=True))}
        return Example(self.name, prompt, " " + json.dumps(call), {"call": call})

    @staticmethod
    def _parse(completion: str) -> dict | None:
        try:
            call = json.loads(answer_part(completion))
        except ValueError:
            return None
        if not isinstance(call, dict) or set(call) != {"name", "arguments"}:
            return None
        return call if isinstance(call["arguments"], dict) else None

    @staticmethod
    def _same_args(got: dict, want: dict) -> bool:
        # "12" and 12 are the same argument value for a tool that will read the call.
        return {k: str(v) for k, v in got.items()} == {k: str(v) for k, v in want.items()}

    def reward(self, completion: str, example: Example) -> float:
        call = self._parse(completion)
        if call is None:
            return 0.0
        want = example.check["call"]
        name_ok = call["name"] == want["name"]
        args_ok = self._same_args(call["arguments"], want["arguments"])
        return 0.2 + 0.3 * name_ok + 0.5 * (name_ok and args_ok)

    def graded_reward(self, completion: str, example: Example) -> float:
        """`reward` with the arguments credited one by one, for a policy that rarely gets a whole call right.

        0.1 for a well-formed call, 0.3 for the right tool and, with the right tool only, 0.6 × the share of
        argument slots right: expected arguments given with their value, over the larger of the expected and
        given counts (an extra argument costs). An exact call earns 1. (SmolLM2 samples at temperature 0.7 get
        3 % of calls exactly right, so `reward`'s all-or-nothing argument part almost never varies within a
        GRPO group.) The tool gates the argument credit: without the gate a made-up tool name with the right
        arguments out-earned the right tool with wrong ones, and a pilot agent learned to invent names
        (docs/lab.md, section 3b).
        """
        call = self._parse(completion)
        if call is None:
            return 0.0
        want = example.check["call"]
        got, expected = call["arguments"], want["arguments"]
        if call["name"] != want["name"]:
            return 0.1
        right = sum(k in got and str(got[k]) == str(v) for k, v in expected.items())
        return 0.4 + 0.6 * right / max(len(expected), len(got))

    def score(self, completion: str, example: Example) -> float:
        call = self._parse(completion)
        want = example.check["call"]
        ok = call is not None and call["name"] == want["name"] and self._same_args(call["arguments"], want["arguments"])
        return float(ok)

    def words(self) -> list[str]:
        pools = [CITIES, UNITS, TOPICS, PEOPLE, FOODS, ["fr", "de", "es"]]
        words = {w for pool in pools for w in pool} | set(TOOLS) | {"tools", "request", "call", "name", "arguments"}
        for arg_names, _, templates in TOOLS.values():
            words |= set(arg_names)
            words |= {w for t in templates for w in t.replace("{0}", " ").replace("{1}", " ").split()}
        return sorted(words)
