import random

import pytest

from echo.config import TaskConfig
from echo.tasks import Prompt
from echo.tasks.arithmetic import Arithmetic

TASK = Arithmetic(TaskConfig(format_reward=0.1))
PROMPT = Prompt(id="7 - 9", messages=[], answer="-2")


@pytest.mark.parametrize(
    "completion, reward, format_ok",
    [
        ("<answer>-2</answer>", 1.0, True),
        ("Let me think. <answer> -2 </answer>", 1.0, True),
        ("<answer>3</answer> no wait <answer>-2</answer>", 1.0, True),  # the last answer counts
        ("<answer>2</answer>", 0.1, True),
        ("-2", 0.0, False),
        ("<answer>minus two</answer>", 0.0, False),
        ("<answer>-2", 0.0, False),
        ("", 0.0, False),
    ],
)
def test_verifier(completion, reward, format_ok):
    score = TASK.score(completion, PROMPT)
    assert (score.reward, score.format_ok, score.correct) == (reward, format_ok, reward == 1.0)


def test_prompts_are_deterministic_and_answers_right():
    assert TASK.sample(random.Random(3)) == TASK.sample(random.Random(3))
    for p in (TASK.sample(random.Random(i)) for i in range(50)):
        x, op, y = p.id.split()
        assert int(p.answer) == (int(x) + int(y) if op == "+" else int(x) - int(y))
        assert TASK.score(f"<answer>{p.answer}</answer>", p).correct
