"""Why a run learns or not, from what each step trained on. Pure: the trainer feeds it each step.

GRPO learns only from groups whose completions scored differently: a group of equal rewards has
advantage 0 everywhere, so a step of such groups moves nothing (loss 0) and says so nowhere else.
Per step: the share of such groups (TRL's frac_reward_zero_std), the share of completions in
which the verifier found no answer, completion lengths and the share cut at the length limit.
After `steps` steps in a row with no group to learn from, one warning naming the likely cause.
And a few completions per step, to read: the best and the worst of the step's groups in turn.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

MOSTLY = 0.5  # a cause is named when at least this share of completions shows it
# Rewards whose spread is below this are equal: what differs is float rounding, not signal.
# (8 float32 rewards of 0.1 have a mean that is not 0.1 and a std of ~1e-8: divided by it, every
# completion got -0.0074, and a batch with no signal moved the adapter by a full Adam step.)
EQUAL_REWARDS_STD = 1e-6


def no_signal(rewards: Sequence[float]) -> bool:
    """A group whose rewards are equal (within EQUAL_REWARDS_STD): advantage 0 everywhere."""
    return len(rewards) < 2 or statistics.stdev(rewards) <= EQUAL_REWARDS_STD


@dataclass(frozen=True)
class Trained:
    """One trained group as the diagnosis reads it."""

    rewards: list[float]  # the trainer's
    unanswered: int  # completions with no answer the verifier could read
    lengths: list[int]  # tokens per completion
    truncated: int  # completions stopped by the length limit
    close: int = 0  # of the unanswered, those with the true answer in their text


def step_signal(groups: list[Trained]) -> dict[str, float]:
    """The step's signal, as its metrics record holds it."""
    completions = [n for g in groups for n in g.lengths]
    count = max(len(completions), 1)
    return {
        "zero_spread_share": sum(no_signal(g.rewards) for g in groups) / max(len(groups), 1),
        "no_answer_share": sum(g.unanswered for g in groups) / count,
        "length_mean": sum(completions) / count,
        "length_max": max(completions, default=0),
        "truncated_share": sum(g.truncated for g in groups) / count,
        "close_share": sum(g.close for g in groups) / count,
    }


INSTRUCTION = "task.params.instruction"  # a dataset's: '{prompt} ...' on a text prompt or a chat's last user turn


def likely_cause(record: dict, answer_format: str, max_new_tokens: int, asked_share: float | None = None,
                 own_format: bool = False) -> str:
    """What most likely keeps every group's rewards equal, and what to change. With no answer in
    most completions, the advice reads the prompts first: `asked_share`, the share of the step's
    prompts that ask for the answer's form (None: the task cannot tell); `own_format`, whether the
    task sets that form itself (an environment's prompt and parser)."""
    no_answer = record["no_answer_share"]
    if no_answer >= MOSTLY:
        missing = f"{no_answer:.0%} of completions have no {answer_format}"
        if own_format:
            return (f"{missing}: the environment sets that form (its system prompt and parser), not echo-rl: read "
                    "its rollouts in samples.jsonl, and use a model that follows its instructions")
        if asked_share is not None and asked_share < MOSTLY:
            return (f"{missing}, and {1 - asked_share:.0%} of the prompts never ask for it: add it with "
                    f"{INSTRUCTION} (e.g. '{{prompt}} Put your final answer in \\boxed{{}}.')")
        close = record.get("close_share", 0.0)
        if asked_share is not None:
            return (f"{missing} though the prompts ask for it ({close:.0%} wrote the right answer, not in that "
                    "form): this model does not follow the format zero-shot; show it a solved example "
                    "(task.params.examples), as the built-in math task does, or use a larger instruct model")
        return (f"{missing}: ask for it in the prompt ({INSTRUCTION}); if the prompts ask already, show a solved "
                "example (task.params.examples), or use a larger instruct model")
    if record["truncated_share"] >= MOSTLY:
        return (f"{record['truncated_share']:.0%} of completions stopped at sampling.max_new_tokens "
                f"({max_new_tokens}) before an answer: raise it")
    if record["reward_mean"] <= 0.0:
        return "every completion scored 0: the task is beyond this model now; an easier dataset or a larger model"
    if record["reward_mean"] >= 1.0:
        return "every completion scored 1: the task is too easy for this model; nothing is left to learn"
    return ("each group's completions scored alike: raise sampling.temperature or sampling.group_size, or use a "
            "reward with partial credit")


@dataclass
class NoSignal:
    """Warns once when `steps` steps in a row had no group to learn from; again only after a
    step with signal ended the streak. 0 steps: never."""

    steps: int
    streak: int = 0
    warned: bool = field(default=False)

    def observe(self, record: dict) -> bool:
        """True when this step's record is the one to warn at."""
        if record.get("zero_spread_share", 0.0) < 1.0:  # a record from before it was measured: unknown
            self.streak, self.warned = 0, False
            return False
        self.streak += 1
        if self.steps and self.streak >= self.steps and not self.warned:
            self.warned = True
            return True
        return False


def sample_picks(rewards: list[list[float]], count: int) -> list[tuple[int, int]]:
    """(group, completion) of `count` completions to show: the best of the first group, the worst
    of the second, and so on through the groups; ties go to the first."""
    picks = []
    for i in range(min(count, sum(len(r) for r in rewards))):
        group = i % len(rewards)
        scores = np.asarray(rewards[group])
        picks.append((group, int(scores.argmax() if i % 2 == 0 else scores.argmin())))
    return list(dict.fromkeys(picks))
