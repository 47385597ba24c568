"""Why a run learns or not (echo/train/diagnosis.py): the step's signal, the warning after steps with
none and the cause it names, the completions picked to show; and what a step decodes of them
(workers/trainer/accounting.py), bounded for files, trackers and pages."""

from __future__ import annotations

import math

import numpy as np

from echo.train.diagnosis import NoSignal, Trained, likely_cause, sample_picks, step_signal
from echo.wire.codec import decode, encode
from echo.wire.messages import TrainerStatus
from echo.wire.names import SAMPLE_CHARS, STATUS_SAMPLES
from tests.groups import TOKENIZER, honest_group
from workers.trainer.accounting import RecentSteps, readable, step_samples
from workers.trainer.intake import Collected
from workers.trainer.judge import Accepted
from workers.trainer.step import TrainerStep


def test_a_steps_signal_counts_groups_with_equal_rewards_and_completions_with_no_answer():
    groups = [Trained([0.0, 0.0], unanswered=2, lengths=[8, 8], truncated=2, close=1),
              Trained([1.0, 0.1], unanswered=0, lengths=[3, 5], truncated=0)]
    assert step_signal(groups) == {"zero_spread_share": 0.5, "no_answer_share": 0.5, "length_mean": 6.0,
                                   "length_max": 8, "truncated_share": 0.5, "close_share": 0.25}


def signal(zero=1.0, no_answer=0.0, truncated=0.0, reward=0.0) -> dict:
    return {"zero_spread_share": zero, "no_answer_share": no_answer, "truncated_share": truncated,
            "reward_mean": reward}


def test_the_warning_comes_once_after_steps_with_no_signal_and_again_only_after_a_step_with_some():
    watch = NoSignal(steps=3)
    seen = [watch.observe(signal(z)) for z in [1.0, 1.0, 1.0, 1.0, 0.5, 1.0, 1.0, 1.0]]
    assert seen == [False, False, True, False, False, False, False, True]
    assert not any(NoSignal(steps=0).observe(signal()) for _ in range(10))
    assert not NoSignal(steps=1).observe({"step": 1})  # a record from before the signal was measured


def test_the_cause_named_is_the_likeliest():
    boxed = "\\boxed{} answer"
    assert likely_cause(signal(no_answer=0.92, truncated=1.0), boxed, 8).startswith(
        "92% of completions have no \\boxed{} answer")
    assert "task.params.instruction" in likely_cause(signal(no_answer=0.92), boxed, 8)
    assert "sampling.max_new_tokens (8)" in likely_cause(signal(no_answer=0.2, truncated=0.9), boxed, 8)
    assert "scored 0" in likely_cause(signal(no_answer=0.2), boxed, 8)
    assert "scored 1" in likely_cause(signal(reward=1.0), boxed, 8)
    assert "sampling.temperature" in likely_cause(signal(reward=0.4), boxed, 8)


def test_with_no_answer_the_advice_reads_the_prompts_first():
    """Advice that fits the prompts: a verl parquet's chat prompts never asked for \\boxed{}, and the advice named a key
    that did nothing on them; the same words came where the prompts asked already, on a verifiers
    environment, and on a random model. Three causes, three answers."""
    boxed, none = "\\boxed{} answer", {**signal(no_answer=1.0), "close_share": 0.25}
    not_asked = likely_cause(none, boxed, 8, asked_share=0.0)
    assert "100% of the prompts never ask for it: add it with task.params.instruction" in not_asked
    not_followed = likely_cause(none, boxed, 8, asked_share=1.0)
    assert "though the prompts ask for it (25% wrote the right answer" in not_followed
    assert "does not follow the format zero-shot" in not_followed and "task.params.examples" in not_followed
    own = likely_cause(none, "answer its rubric reads", 8, asked_share=None, own_format=True)
    assert "the environment sets that form" in own and "task.params" not in own
    assert len({not_asked, not_followed, own}) == 3


def test_whether_a_prompt_asks_for_the_answer_is_read_from_the_task_and_the_prompt(tmp_path):
    """asks_for_answer: a dataset's by its reward's marker, the built-in math task's own prompts ask
    (its worked example), a verifiers environment sets its own form."""
    from echo.config import TaskConfig
    from echo.tasks import asks_for_answer, load_task
    from echo.tasks.verifiers_env import VerifiersEnv

    math = load_task(TaskConfig(name="math"))
    assert asks_for_answer(math, math.prompt(0).messages) is True
    rows = tmp_path / "rows.jsonl"
    rows.write_text('{"prompt": [{"role": "user", "content": "What is 2 + 2?"}], "answer": "4"}\n' * 20)
    plain = load_task(TaskConfig(name="dataset", params={"path": str(rows)}))
    assert asks_for_answer(plain, plain.prompt(0).messages) is False
    told = load_task(TaskConfig(name="dataset", params={"path": str(rows), "instruction": "{prompt} Box it: \\boxed{}."}))
    assert asks_for_answer(told, told.prompt(0).messages) is True
    assert asks_for_answer(load_task(TaskConfig(name="dataset", params={"path": str(rows), "reward": "regex:(\\d+)"})),
                           plain.prompt(0).messages) is None
    assert VerifiersEnv.sets_own_format and VerifiersEnv.answer_marker is None


def test_the_picks_alternate_best_and_worst_through_the_groups():
    assert sample_picks([[0.0, 1.0, 0.5], [0.3, 0.0, 0.9], [0.2, 0.1]], 3) == [(0, 1), (1, 1), (2, 0)]
    assert sample_picks([[0.0, 1.0]], 2) == [(0, 1), (0, 0)]
    assert sample_picks([], 2) == [] and sample_picks([[0.0]], 0) == []


def test_samples_are_decoded_by_the_trainer_and_bounded():
    group = honest_group(texts=["\\boxed{24}", "no"])
    group = group.replaced(completions=[group.completions[0].replaced(text="what the sampler says"),
                                        group.completions[1]])
    step = TrainerStep(7, 0.0, collected=Collected(used=[Accepted(group, [1.0, 0.0], "c")]))
    rows = step_samples(step, TOKENIZER, 2)
    assert [(r["step"], r["reward"], r["completion"]) for r in rows] == [(7, 1.0, "\\boxed{24}"), (7, 0.0, "no")]
    assert rows[0]["sampler"] == group.sampler_id
    assert rows[0]["prompt"].endswith("What is 8 - 10? Put the final answer in \\boxed{}.\nassistant\n")
    hostile = "\x1b[2J\x00\u202e" + "x" * (3 * SAMPLE_CHARS) + "\nend\t."
    shown = readable(hostile)
    assert len(shown) == SAMPLE_CHARS and shown.endswith("\nend\t.")
    assert all(ord(ch) >= 32 or ch in "\n\t" for ch in shown) and "\x1b" not in readable("\x1b[2Jhi")
    assert readable("\u202eabc") == "\ufffdabc" and np.all([readable(t) == t for t in ["é✓ 漢字", "a\nb"]])


def test_the_trainers_status_carries_a_few_samples_and_only_finite_headline_values():
    """What the page reads: at most STATUS_SAMPLES completions whatever run.samples_per_step asks,
    and a diverged step's NaN loss left out rather than the status made unreadable."""
    recent = RecentSteps(4, 1, 20, "owner/model\x1b[2J", "dataset (train.parquet)")
    record = {"step": 3, "busy_seconds": 1.0, "wait_seconds": 1.0, "reward_mean": 0.5, "rejected": {},
              "publish_seconds": 0.1, "accounting": {}, "wall_seconds": 9.0, "loss": math.nan, "kl": 0.01,
              "lr": 1e-4, "staleness_used": {}}
    sample = {"step": 3, "group": "g1", "sampler": "s1", "version": 2, "reward": 1.0, "finish_reason": "stop",
              "prompt": "p", "completion": "c"}
    status = recent.add(record, 3, {}, None, [sample] * 10)
    assert len(status.samples) == STATUS_SAMPLES and status.scalars == {"reward_mean": 0.5, "kl": 0.01, "lr": 1e-4}
    assert status.model == "owner/model[2J" and status.eta_s == 2.0 * 17
    assert decode(TrainerStatus, encode(status)) == status
