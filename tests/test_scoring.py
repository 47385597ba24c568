"""The trainer's verifiers in a child process with a budget per completion
(workers/trainer/scoring.py): a verifier bomb costs its group and a strike, never the run."""

from __future__ import annotations

from echo.config import TaskConfig
from tests.groups import BOMB, SAMPLING, SCORER, TOKENIZER, honest_group, symbolic_math
from workers.trainer.scoring import BUDGET_EXCEEDED, ScoringProcess


def scoring(task: str | TaskConfig = "math", budget_s: float = 3.0, memory_mb: float = 1024.0) -> ScoringProcess:
    config = task if isinstance(task, TaskConfig) else TaskConfig(name=task)
    return ScoringProcess(config, TOKENIZER, len(TOKENIZER), SAMPLING, budget_s, memory_mb)


async def test_a_verifier_bomb_costs_its_group_and_a_strike_and_the_next_group_is_scored_as_before(tmp_path):
    config, task, scorer = symbolic_math(tmp_path)
    honest = honest_group(of_task=task)
    async with scoring(config) as verifiers:
        assert await verifiers.score(honest) == scorer.score(honest)  # the same scored as in process
        bomb = honest_group(of_task=task, texts=BOMB, rewards=[0.1, 0.1], group_id="bomb")
        scored = await verifiers.score(bomb)
        assert (scored.reason, scored.lie, verifiers.restarts) == (BUDGET_EXCEEDED, True, 1)
        assert await verifiers.score(honest) == scorer.score(honest)  # a new child, the same scores


def test_where_the_truth_is_a_number_a_bomb_is_compared_not_evaluated():
    """The built-in math task's own problems: the bomb is a wrong answer, found in the trainer's
    process at once (the child's budget is for what must be evaluated)."""
    bomb = honest_group(texts=BOMB, rewards=[0.1, 0.1])
    scored = SCORER.score(bomb)
    assert scored.reason is None and scored.rewards == [0.1, 0.1]


MEMORY_MB = 256.0
HUNGRY = '''
from echo.tasks.math import Math


class Hungry(Math):
    def score(self, completion, prompt):
        if "hungry" in completion:
            bytearray(2 * 2**30)  # 2 GB: zeroed pages cost nothing until touched: only a limit refuses it
        return super().score(completion, prompt)
'''


async def test_a_verifier_past_its_memory_budget_costs_its_group(tmp_path):
    (tmp_path / "hungry.py").write_text(HUNGRY)
    honest = honest_group()
    async with scoring(f"{tmp_path / 'hungry.py'}:Hungry", budget_s=60.0, memory_mb=MEMORY_MB) as verifiers:  # 2 GB > 256 MB
        scored = await verifiers.score(honest_group(texts=["hungry \\boxed{1}", "\\boxed{2}"], rewards=[0.0, 0.0]))
        assert (scored.reason, scored.lie) == (BUDGET_EXCEEDED, True)
        assert await verifiers.score(honest) == SCORER.score(honest)
