import re

import pytest

from echo.config import TaskConfig
from echo.tasks import Prompt
from echo.tasks.arithmetic import Arithmetic

TASK = Arithmetic(TaskConfig(format_reward=0.1))
PROMPT = Prompt(index=0, messages=[], answer="-2")


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
    assert TASK.prompt(3) == TASK.prompt(3)
    assert len({TASK.prompt(i).messages[-1]["content"] for i in range(50)}) > 25
    for p in (TASK.prompt(i) for i in range(50)):
        question = re.search(r"What is (\d+) ([+-]) (\d+)\?", p.messages[-1]["content"])
        x, op, y = int(question[1]), question[2], int(question[3])
        assert int(p.answer) == (x + y if op == "+" else x - y)
        assert TASK.score(f"<answer>{p.answer}</answer>", p).correct
