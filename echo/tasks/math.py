"""Math: procedural problems at graded difficulty, or a local dataset file (GSM8K/MATH-style
JSONL or parquet with question and answer fields). The final answer goes in \\boxed{}. Where
the ground truth is a number, the answer is compared as one, evaluating nothing: a decimal or
a fraction (0.5 = 1/2 = \\frac{1}{2}); anything else there is wrong. A sampler chooses every
answer, and sympy given `7^{9^{8}}` computes it in full. Other truths are checked with
math-verify, so equivalent forms count (the trainer runs it under a budget,
workers/trainer/scoring.py)."""

from __future__ import annotations

import ast
import logging
import math
import operator
import random
import re
from fractions import Fraction
from typing import Literal

from math_verify import parse, verify
from pydantic import BaseModel, ConfigDict, Field

from echo.tasks import GeneratedTask, Prompt, Score, Step, is_held_out, parse_params
from echo.tasks.files import read_rows

# Its timeouts are off on purpose (Math.score): its warning that they are, once per process, is noise.
logging.getLogger("math_verify").setLevel(logging.ERROR)

INSTRUCTION = "{question} Put the final answer in \\boxed{{}}."
EXAMPLE = [
    {"role": "user", "content": INSTRUCTION.format(question="What is 3 + 4?")},
    {"role": "assistant", "content": "\\boxed{7}"},
]
MAX_ANSWER_CHARS = 256  # of the last \\boxed{...}: longer is not an answer to these problems
NAMES = ["Ana", "Ben", "Chen", "Dara", "Eli", "Fatima", "Goran", "Hana"]
ITEMS = ["apples", "marbles", "books", "stamps", "coins", "pencils"]


class MathParams(BaseModel):
    model_config = ConfigDict(extra="forbid")
    levels: list[Literal[1, 2, 3]] = [1]  # 1: a +- b; 2: products and two-step sums; 3: word problems, fractions
    max_operand: int = Field(10, ge=1)
    dataset: str | None = None  # a local .jsonl/.json/.parquet file instead of generated problems
    question_field: str = "question"
    answer_field: str = "answer"
    example: bool = True  # show one worked example of the answer format before the question
    format_reward: float = Field(0.1, ge=0, le=1)  # a boxed but wrong answer


def _level1(rng: random.Random, n: int) -> tuple[str, str]:
    a, b, op = rng.randint(0, n), rng.randint(0, n), rng.choice("+-")
    return f"What is {a} {op} {b}?", str(a + b if op == "+" else a - b)


def _level2(rng: random.Random, n: int) -> tuple[str, str]:
    if rng.random() < 0.5:
        a, b = rng.randint(2, 12), rng.randint(2, 12)
        return f"What is {a} * {b}?", str(a * b)
    a, b, c = rng.randint(0, n), rng.randint(0, n), rng.randint(0, n)
    return f"What is {a} + {b} - {c}?", str(a + b - c)


def _level3(rng: random.Random, n: int) -> tuple[str, str]:
    if rng.random() < 0.5:
        a, b, c, d = rng.randint(1, 9), rng.randint(2, 9), rng.randint(1, 9), rng.randint(2, 9)
        total = Fraction(a, b) + Fraction(c, d)
        return f"What is {a}/{b} + {c}/{d}? Give the answer as a fraction.", f"\\frac{{{total.numerator}}}{{{total.denominator}}}"
    name, item = rng.choice(NAMES), rng.choice(ITEMS)
    start, bags, per_bag, gone = rng.randint(1, n), rng.randint(2, 5), rng.randint(2, 6), rng.randint(0, 5)
    question = (f"{name} has {start} {item}. {name} buys {bags} bags with {per_bag} {item} each, "
                f"then gives away {gone}. How many {item} does {name} have now?")
    return question, str(start + bags * per_bag - gone)


GENERATORS = {1: _level1, 2: _level2, 3: _level3}


_NUMBER = r"(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?"  # 1,000.5 and 1000.5 alike
_AS_NUMBER = [re.compile(rf"(-?)({_NUMBER})"), re.compile(rf"(-?)({_NUMBER})/({_NUMBER})"),
              re.compile(rf"(-?)\\[dt]?frac\{{(-?{_NUMBER})\}}\{{({_NUMBER})\}}")]


def as_number(text: str) -> Fraction | None:
    """`text` as a number, evaluating nothing: a decimal, or a fraction of two (p/q,
    \\frac{p}{q}); None for anything else."""
    text = re.sub(r"\s|\$", "", text)
    for pattern in _AS_NUMBER:
        if m := pattern.fullmatch(text):
            sign, *numbers = m.groups()
            values = [Fraction(n.replace(",", "")) for n in numbers]
            if len(values) == 2 and values[1] == 0:
                return None
            value = values[0] if len(values) == 1 else values[0] / values[1]
            return -value if sign else value
    return None


def boxed(text: str) -> str | None:
    """What the \\boxed{...} that `text` starts with holds; None when it does not close."""
    depth = 0
    for i, char in enumerate(text):
        depth += (char == "{") - (char == "}")
        if char == "}" and depth == 0:
            return text[len("\\boxed{") : i]
    return None


def final_answer(text: str) -> str:
    """GSM8K answers end with '#### <answer>'; MATH answers are the answer itself."""
    return text.rsplit("####", 1)[-1].strip()


def math_score(completion: str, truth: str, format_reward: float) -> Score:
    """The last \\boxed{} answer of `completion` against `truth`: compared as numbers where the
    truth is one, else by math-verify."""
    last = completion.rfind("\\boxed{")  # the last answer counts (math-verify would read a set)
    if last < 0:
        return Score(0.0, format_ok=False, correct=False)
    number = as_number(truth)
    if number is not None:  # compared, not evaluated
        answer = boxed(completion[last : last + MAX_ANSWER_CHARS])
        if not answer:
            return Score(0.0, format_ok=False, correct=False)
        correct = as_number(answer) == number
        return Score(1.0 if correct else format_reward, format_ok=True, correct=correct)
    # No math-verify timeouts: they use signal.alarm, which raises off the main thread (a
    # sampler scores in a worker thread) and would make a verdict depend on load. The
    # answer's length is capped instead, which bounds what sympy is given.
    predicted = parse(completion[last : last + MAX_ANSWER_CHARS], parsing_timeout=None)
    if not predicted:
        return Score(0.0, format_ok=False, correct=False)
    correct = verify(parse(f"${truth}$", parsing_timeout=None), predicted, timeout_seconds=None)
    return Score(1.0 if correct else format_reward, format_ok=True, correct=bool(correct))


class Math(GeneratedTask):
    name = "math"
    params_model: type[MathParams] = MathParams

    def __init__(self, params: dict):
        self.p = parse_params(self.params_model, params)
        # A dataset's rows, training (False) and held out (True): split once, each row by a hash
        # of its prompt. None: the problems are generated.
        self.splits: dict[bool, list[tuple[str, str]]] | None = None
        if self.p.dataset:
            rows = self._load(self.p.dataset)
            self.splits = {side: [r for r in rows if is_held_out(self._messages(r[0])) == side] for side in (False, True)}

    def _load(self, path: str) -> list[tuple[str, str]]:
        rows = [row for batch in read_rows(path, field="task.params.dataset") for row in batch]
        for field in (self.p.question_field, self.p.answer_field):
            if rows and field not in rows[0]:
                raise ValueError(f"task.params.dataset {path}: no field {field!r} (has {sorted(rows[0])})")
        return [(str(r[self.p.question_field]), final_answer(str(r[self.p.answer_field]))) for r in rows]

    instruction = INSTRUCTION
    answer_format = "\\boxed{} answer"
    answer_marker = "\\boxed"

    def _messages(self, question: str) -> list[dict]:
        return [*(EXAMPLE if self.p.example else []), {"role": "user", "content": self.instruction.format(question=question)}]

    def generate(self, rng: random.Random) -> tuple[list[dict], str]:
        question, answer = GENERATORS[rng.choice(self.p.levels)](rng, self.p.max_operand)
        return self._messages(question), answer

    def prompt(self, index: int) -> Prompt:
        if self.splits is None:
            return super().prompt(index)
        train = self._split(held_out=False)
        question, answer = train[index % len(train)]
        return Prompt(index, self._messages(question), answer)

    def held_out(self, n: int) -> list[Prompt]:
        if self.splits is None:
            return super().held_out(n)
        rows = self._split(held_out=True)[:n]
        return [Prompt(i, self._messages(q), a) for i, (q, a) in enumerate(rows)]

    def _split(self, held_out: bool) -> list[tuple[str, str]]:
        rows = self.splits[held_out]
        if not rows:
            raise ValueError(f"task.params.dataset: no {'held-out' if held_out else 'training'} rows")
        return rows

    def score(self, completion: str, prompt: Prompt) -> Score:
        return math_score(completion, prompt.answer, self.p.format_reward)


class ToolParams(MathParams):
    max_turns: int = Field(4, ge=1, le=64)  # model turns an episode may take (calculator calls + the answer)
    example: bool = False  # the calculator's instruction instead of the plain worked example


TOOL_INSTRUCTION = ("{question} You may use a calculator: write <calc>expression</calc> (numbers, + - * / "
                    "and parentheses) and its result is shown to you. Put the final answer in \\boxed{{}}.")
CALC = re.compile(r"<calc>(.*?)</calc>", re.DOTALL)
MAX_CALC_CHARS = 200


class MathTools(Math):
    """Math with a calculator (an environment, echo/tasks/episodes.py): a turn with a <calc> call
    is answered with the result (a `tool` turn); a turn with a \\boxed{} answer ends the episode,
    scored as the `math` task scores it; a turn with neither is told what it may do."""

    name = "math_tools"
    environment = True
    params_model = ToolParams
    instruction = TOOL_INSTRUCTION

    @property
    def max_turns(self) -> int:
        return self.p.max_turns

    def episode(self, prompt: Prompt) -> "Calculator":
        return Calculator(self, prompt)


class Calculator:
    def __init__(self, task: MathTools, prompt: Prompt):
        self.task, self.prompt = task, prompt

    def step(self, action: str) -> Step:
        if "\\boxed{" in action:
            return Step([], self.task.score(action, self.prompt).reward, done=True)
        calls = CALC.findall(action)
        if not calls:
            return Step([{"role": "user", "content": "Use <calc>...</calc>, or give the answer in \\boxed{}."}],
                        0.0, done=False)
        return Step([{"role": "tool", "content": calculate(calls[-1])}], 0.0, done=False)


_OPERATORS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv}


def calculate(expression: str) -> str:
    """The value of an arithmetic expression (numbers, + - * /, parentheses) as text, or why not:
    parsed, never evaluated as Python."""
    if len(expression) > MAX_CALC_CHARS:
        return "error: too long"
    try:
        value = _value(ast.parse(expression.strip(), mode="eval").body)
    except (SyntaxError, ValueError, ZeroDivisionError, OverflowError) as e:
        return f"error: {e.__class__.__name__}"
    if not math.isfinite(value):
        return "error: overflow"
    return str(int(value)) if value == int(value) else f"{value:.6g}"


def _value(node) -> float:
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return node.value
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        value = _value(node.operand)
        return -value if isinstance(node.op, ast.USub) else value
    if isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
        return _OPERATORS[type(node.op)](_value(node.left), _value(node.right))
    raise ValueError("not arithmetic")
