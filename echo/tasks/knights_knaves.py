"""Knights and Knaves: knights always tell the truth, knaves always lie. Each of N inhabitants
(2 to 8) says one thing about the others; exactly one assignment of knight/knave is consistent
with everything said (checked by brute force over all 2^N), and the model must find it."""

from __future__ import annotations

import itertools
import random
import re

from pydantic import BaseModel, ConfigDict, Field, field_validator

from echo.tasks import GeneratedTask, Prompt, Score, parse_params

NAMES = ["Alice", "Bob", "Carol", "Dave", "Erin", "Frank", "Grace", "Heidi"]

# A statement is (kind, a, b) about people a and b; each kind is its text and its truth value.
KINDS = {
    "knight": ("{a} is a knight.", lambda x, a, b: x[a]),
    "knave": ("{a} is a knave.", lambda x, a, b: not x[a]),
    "same": ("{a} and {b} are the same kind.", lambda x, a, b: x[a] == x[b]),
    "different": ("{a} and {b} are different kinds.", lambda x, a, b: x[a] != x[b]),
    "both": ("{a} and {b} are both knights.", lambda x, a, b: x[a] and x[b]),
    "some_knave": ("At least one of {a} and {b} is a knave.", lambda x, a, b: not (x[a] and x[b])),
    "implies": ("If {a} is a knight, then {b} is a knave.", lambda x, a, b: not x[a] or not x[b]),
}


class KnightsKnavesParams(BaseModel):
    model_config = ConfigDict(extra="forbid")
    people: list[int] = Field([3], min_length=1)  # puzzle sizes to draw from, each 2..8
    format_reward: float = Field(0.1, ge=0, le=1)  # everyone named once, but wrong
    partial_credit: float = Field(0.0, ge=0, le=1)  # weight of the fraction of people right

    @field_validator("people")
    @classmethod
    def _sizes(cls, people: list[int]) -> list[int]:
        if any(not 2 <= n <= 8 for n in people):
            raise ValueError("each size must be between 2 and 8")
        return people


def consistent(assignment: tuple[bool, ...], statements: list[tuple[str, int, int]]) -> bool:
    """True if every knight's statement is true and every knave's false."""
    return all(KINDS[kind][1](assignment, a, b) == assignment[speaker] for speaker, (kind, a, b) in enumerate(statements))


def solutions(n: int, statements: list[tuple[str, int, int]]) -> list[tuple[bool, ...]]:
    return [x for x in itertools.product([True, False], repeat=n) if consistent(x, statements)]


def make_puzzle(rng: random.Random, n: int) -> tuple[tuple[bool, ...], list[tuple[str, int, int]]]:
    """A random assignment and one statement per person, redrawn until the solution is unique."""
    while True:
        truth = tuple(rng.random() < 0.5 for _ in range(n))
        statements = []
        for speaker in range(n):
            while True:  # a statement the speaker can make: true for a knight, false for a knave
                a, b = rng.sample([p for p in range(n) if p != speaker] + ([speaker] if n == 2 else []), 2)
                kind = rng.choice(list(KINDS))
                if KINDS[kind][1](truth, a, b) == truth[speaker]:
                    statements.append((kind, a, b))
                    break
        if solutions(n, statements) == [truth]:
            return truth, statements


def encode_answer(names: list[str], truth: tuple[bool, ...]) -> str:
    return ",".join(f"{name}:{'knight' if k else 'knave'}" for name, k in zip(names, truth))


class KnightsKnaves(GeneratedTask):
    name = "knights_knaves"

    def __init__(self, params: dict):
        self.p = parse_params(KnightsKnavesParams, params)

    def generate(self, rng: random.Random) -> tuple[list[dict], str]:
        n = rng.choice(self.p.people)
        truth, statements = make_puzzle(rng, n)
        names = NAMES[:n]
        said = "\n".join(
            f'{names[s]} says: "{KINDS[kind][0].format(a=names[a], b=names[b])}"' for s, (kind, a, b) in enumerate(statements)
        )
        question = (
            "On an island, knights always tell the truth and knaves always lie. "
            f"You meet {n} inhabitants: {', '.join(names)}.\n{said}\n"
            "Who is a knight and who is a knave? Answer inside <answer></answer> with one line per person, "
            "like `Alice: knight`."
        )
        return [{"role": "user", "content": question}], encode_answer(names, truth)

    answer_format = "<answer></answer> block"
    answer_marker = "<answer>"

    def score(self, completion: str, prompt: Prompt) -> Score:
        truth = dict(pair.split(":") for pair in prompt.answer.split(","))
        found = re.findall(r"<answer>(.*?)</answer>", completion, re.DOTALL)
        if not found:
            return Score(0.0, format_ok=False, correct=False)
        claims: dict[str, str] = {}
        for name, kind in re.findall(r"\b([A-Z][a-z]+)\b\W*(?:is\s+an?\s+|:\s*)(knight|knave)", found[-1], re.IGNORECASE):
            if name in truth:
                if name in claims and claims[name] != kind.lower():
                    return Score(0.0, format_ok=False, correct=False)  # contradicts itself
                claims[name] = kind.lower()
        if claims.keys() != truth.keys():
            return Score(0.0, format_ok=False, correct=False)
        right = sum(claims[name] == kind for name, kind in truth.items())
        if right == len(truth):
            return Score(1.0, format_ok=True, correct=True)
        reward = max(self.p.format_reward, self.p.partial_credit * right / len(truth))
        return Score(reward, format_ok=True, correct=False)
