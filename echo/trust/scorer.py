"""The trainer's own scoring of a rollout group, which the judge (workers/trainer/judge.py) weighs
with the staleness, the slot and the proof. Samplers are not trusted: a group must be
well-formed, its prompt must be the task's prompt at its index, and its rewards are recomputed
with the task's verifier from the completion tokens (a multi-turn task's episodes are played
again with the sampler's actions, every observation checked: echo/tasks/episodes.py rerun).
Pure logic, no I/O."""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from echo.config import SamplingConfig
from echo.model.loading import encode_chat
from echo.tasks import Task, is_environment, safe_score
from echo.tasks.episodes import rerun
from echo.wire.codec import RolloutLimits
from echo.wire.messages import RolloutGroup

# A completion drawn twice is plausible only if it was likely: the chance that two samples agree
# on any completion less likely than this is below it, per pair. An honest group of 16 has 120
# pairs, so a repeat this unlikely is refused in about one honest group in ten million; a
# replayed reasoning-length completion has a log-prob of hundreds of nats below it.
REPEAT_LOGPROB = -18.42  # ln(1e-8)


@dataclass(frozen=True)
class Scored:
    reason: str | None  # why the group is rejected, or None
    rewards: list[float]  # the trainer's rewards, one per completion
    reward_mismatch: bool = False  # the sampler claimed other rewards
    verifier_errors: int = 0  # completions whose verifier raised (reward 0)
    lie: bool = False  # rejected for claiming what the environment never said: a strike, as a forgery
    source: str = ""  # the prompt's data source (a dataset's), for rewards by source
    unanswered: int = 0  # completions in which the verifier found no answer (Score.format_ok false)
    close: int = 0  # of those, the ones with the true answer in their text: the form is what they miss


class Scorer:
    def __init__(self, task: Task, tokenizer, vocab_size: int, sampling: SamplingConfig,
                 routing: tuple[int, int, int] | None = None):
        self.task, self.tokenizer, self.vocab_size, self.sampling = task, tokenizer, vocab_size, sampling
        self.routing = routing  # the model's (layers, top_k, experts) where the run replays its routing

    @property
    def limits(self) -> RolloutLimits:
        """What the run's groups may hold on the wire."""
        return RolloutLimits(self.sampling.group_size, self.sampling.max_new_tokens, self.routing,
                             self.sampling.chunk_tokens)

    def malformed(self, group: RolloutGroup) -> str | None:
        """A reason to reject the group's shape, or None. Cheap: run before the staleness check."""
        if group.task != self.task.name:
            return "wrong_task"
        if len(group.completions) != self.sampling.group_size:
            return "wrong_group_size"
        if group.temperature != self.sampling.temperature:  # the log-probs would be of another distribution
            return "wrong_temperature"
        if group.dtype not in self.sampling.dtypes:  # a 16-bit claim widens the proof's band
            return "dtype_not_allowed"
        if any(len(c.token_ids) > self.sampling.max_new_tokens for c in group.completions):
            return "completion_too_long"
        tokens = [group.prompt_token_ids, *(c.token_ids for c in group.completions)]
        if any(ids.max() >= self.vocab_size for ids in tokens):  # uint32: none below 0
            return "token_out_of_vocab"
        eos = self.tokenizer.eos_token_id
        for c in group.completions:
            # A model turn stops at the end-of-sequence token: nothing of that turn may follow it,
            # every turn but the last ends with it (an episode goes on only after a finished
            # turn), and the last ends with it exactly when the completion says it stopped.
            turns = c.model_turns()
            for turn, (start, end) in enumerate(turns):
                stops = np.flatnonzero(c.token_ids[start:end] == eos)
                if stops.size and stops[0] + 1 != end - start:
                    return "tokens_after_eos"
                last = turn == len(turns) - 1
                if (not stops.size) and not last:
                    return "turn_not_finished"
                if last and (c.finish_reason == "stop") != bool(stops.size):
                    return "bad_finish_reason"
        return None

    def score(self, group: RolloutGroup, completion_done: Callable[[], None] = lambda: None) -> Scored:
        """Check the prompt is the task's and recompute the rewards, calling `completion_done`
        after each completion. Run on groups to be used (the trainer runs it with a budget:
        workers/trainer/scoring.py)."""
        prompt = self.task.prompt(group.prompt_index)
        if not np.array_equal(encode_chat(self.tokenizer, prompt.messages), group.prompt_token_ids):
            return Scored("prompt_mismatch", [])
        rewards, errors, unanswered, close = [], 0, 0, 0
        for completion in group.completions:
            if getattr(self.task, "trusted_observations", False):  # the run took the samplers' word (docs/operations.md)
                if len(completion.model_turns()) > self.task.max_turns:
                    return Scored("too_many_turns", [], lie=True)
                reward = min(max(completion.claimed_reward, 0.0), 1.0)
            elif is_environment(self.task):  # the episode played again with the sampler's actions
                again = rerun(self.task, self.tokenizer, prompt, completion, self.sampling.max_new_tokens)
                if again.reason:
                    return Scored(again.reason, [], lie=again.reason != "environment_error")
                reward = again.reward
            else:
                text = self.tokenizer.decode(completion.token_ids.tolist(), skip_special_tokens=True)
                score = safe_score(self.task, text, prompt)
                errors += score is None
                unanswered += score is not None and not score.format_ok
                close += score is not None and not score.format_ok and bool(prompt.answer) and prompt.answer in text
                reward = score.reward if score else 0.0
            rewards.append(reward)
            completion_done()
        claimed = getattr(self.task, "answers_on_samplers", True)  # else a sampler claims none
        mismatch = claimed and any(abs(r - c.claimed_reward) > 1e-6 for r, c in zip(rewards, group.completions))
        return Scored(None, rewards, mismatch, errors, source=prompt.source, unanswered=unanswered, close=close)


def completion_keys(group: RolloutGroup) -> list[int]:
    """Each completion's identity for its prompt (the same tokens for the same prompt index), in
    64 bits: a run trains millions of completions."""
    prompt = group.prompt_index.to_bytes(8, "little")
    return [int.from_bytes(hashlib.sha256(prompt + c.token_ids.tobytes()).digest()[:8], "little")
            for c in group.completions]


def repeats(group: RolloutGroup, *known: set[int]) -> bool:
    """Whether an unlikely completion (log-prob below REPEAT_LOGPROB) appears twice in the group or
    in one of `known` (the completion_keys trained on, or taken this step): resent, not sampled.
    A likely one may repeat (a short answer the policy has settled on)."""
    seen: set[int] = set()
    for key, completion in zip(completion_keys(group), group.completions):
        repeated = key in seen or any(key in keys for keys in known)
        if repeated and float(completion.logprobs.sum(dtype=np.float64)) < REPEAT_LOGPROB:
            return True
        seen.add(key)
    return False


def content_hash(group: RolloutGroup) -> str:
    """What a group says, whatever its id: the prompt and the completions' tokens, in any order.
    The same completions resent under a new group id have the same hash."""
    # The repr of lists, as when the groups held lists: a run's checkpointed hashes stay valid.
    completions = sorted(hashlib.sha256(repr(c.token_ids.tolist()).encode()).hexdigest() for c in group.completions)
    said = (group.prompt_index, group.prompt_token_ids.tolist(), completions)
    return hashlib.sha256(repr(said).encode()).hexdigest()[:32]
