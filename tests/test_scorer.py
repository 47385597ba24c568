"""The trainer's checks on groups it did not generate itself: a table of bad rollouts."""

import pytest

from echo.tasks import Score
from echo.tasks.math import Math
from echo.trust.scorer import REPEAT_LOGPROB, Scorer, completion_keys, content_hash, repeats
from tests.groups import SAMPLING, SCORER, TASK, TOKENIZER, honest_group, unlikely, with_completion

EOS = TOKENIZER.eos_token_id


def test_an_honest_group_passes_with_the_verifiers_rewards():
    group = honest_group()
    assert SCORER.malformed(group) is None
    scored = SCORER.score(group)
    assert scored.reason is None and not scored.reward_mismatch
    assert scored.rewards == [1.0, 0.1]


@pytest.mark.parametrize(
    "group, reason",
    [
        (honest_group(task="sokoban"), "wrong_task"),
        (honest_group(texts=["a", "b", "c"]), "wrong_group_size"),
        (honest_group(texts=["x" * 40, "y"]), "completion_too_long"),
        (with_completion(token_ids=[5, 10_000], logprobs=[-1.0, -1.0]), "token_out_of_vocab"),
        (honest_group().replaced(prompt_token_ids=[5000, 5]), "token_out_of_vocab"),
        (honest_group(temperature=0.5), "wrong_temperature"),
        (with_completion(token_ids=[65, EOS, 66], logprobs=[-1.0] * 3), "tokens_after_eos"),
        (with_completion(token_ids=[65, 66], logprobs=[-1.0] * 2), "bad_finish_reason"),  # "stop" without EOS
        (with_completion(finish_reason="length"), "bad_finish_reason"),  # ran out of tokens, yet holds EOS
    ],
)
def test_malformed_groups_are_refused_with_a_reason(group, reason):
    assert SCORER.malformed(group) == reason


def test_completions_with_no_answer_the_verifier_reads_are_counted():
    scored = SCORER.score(honest_group(texts=["I think it is 24", "\\boxed{24}"]))
    assert scored.unanswered == 1 and scored.rewards[0] == 0.0


def test_a_prompt_that_is_not_the_tasks_is_refused():
    other = honest_group(index=13)
    assert SCORER.score(other.model_copy(update={"prompt_index": 12})).reason == "prompt_mismatch"


def test_claimed_rewards_are_replaced_and_the_lie_counted():
    liar = with_completion(with_completion(claimed_reward=0.0), i=1, claimed_reward=1.0)  # right called wrong, and back
    scored = SCORER.score(liar)
    assert scored.reward_mismatch and scored.rewards == [1.0, 0.1]


def test_rewards_come_from_the_tokens_not_the_claimed_text():
    group = with_completion(text="\\boxed{nonsense}")
    assert SCORER.score(group).rewards == [1.0, 0.1]


def test_a_verifier_that_raises_costs_the_completion_not_the_run():
    class Broken(Math):
        def score(self, completion, prompt):
            raise RuntimeError("bug in a user's task")

    scorer = Scorer(Broken({}), TOKENIZER, len(TOKENIZER), SAMPLING)
    scored = scorer.score(honest_group())
    assert scored.rewards == [0.0, 0.0] and scored.verifier_errors == 2


def test_a_reward_outside_0_1_counts_as_a_verifier_error():
    class Generous(Math):
        def score(self, completion, prompt):
            return Score(2.0, True, True)

    scored = Scorer(Generous({}), TOKENIZER, len(TOKENIZER), SAMPLING).score(honest_group())
    assert scored.rewards == [0.0, 0.0] and scored.verifier_errors == 2


def test_the_same_completions_under_a_new_id_have_the_same_content_hash():
    group = honest_group()
    reordered = group.model_copy(update={"group_id": "other", "completions": group.completions[::-1]})
    assert content_hash(reordered) == content_hash(group)
    assert content_hash(with_completion(token_ids=[65, EOS], logprobs=[-1.0, -1.0])) != content_hash(group)
    assert content_hash(honest_group(index=13)) != content_hash(group)


def test_an_unlikely_completion_may_not_repeat_a_likely_one_may():
    prompt = TASK.prompt(12)
    long_answer = f"so it is \\boxed{{{prompt.answer}}}"  # 15 tokens or so
    twice = unlikely(unlikely(honest_group(texts=[long_answer, long_answer]), 0), 1)
    assert sum(c.logprobs.sum() for c in twice.completions[:1]) < REPEAT_LOGPROB
    assert repeats(twice)  # drawn twice though it had a chance below 1e-8: resent
    short = honest_group(texts=["\\boxed{4}", "\\boxed{4}"])  # -0.5 a token: a likely answer
    assert not repeats(short)
    once = unlikely(honest_group(texts=[long_answer, "\\boxed{999}"]), 0)
    assert not repeats(once) and repeats(once, set(completion_keys(twice)))  # trained before: resent
    other_prompt = unlikely(honest_group(13, texts=[long_answer, "\\boxed{999}"]), 0)
    assert not repeats(other_prompt, set(completion_keys(twice)))  # the same words for another prompt
