"""Environments: multi-turn episodes. Pure, no I/O.

An environment serves prompts by index as a task does (`prompt`, `held_out`), and plays an
episode from one: `episode(prompt)` starts it, and each `step(action)` takes the model's turn (the
text of the tokens it sampled) and answers with the next observation (chat messages to append,
a user's or a tool's turn), a reward, and whether the episode is over. Deterministic for a given
prompt, so the trainer reruns what a sampler claims. An episode ends when the environment says
so, after `max_turns` model turns, or when its tokens reach `sampling.max_new_tokens`; its
reward is the sum of its steps' (each in [0, 1]). A single-turn task is the one-step case
(`SingleTurn`): its step scores the completion and ends the episode.

Token-in, token-out: the sampler builds an episode as one token sequence, the model's tokens as
sampled and each observation as `observation_tokens` renders it (the chat template's own
rendering of that turn after a model turn), appended as ids; it never re-tokenises what the model
produced. `rerun` is the trainer's check of an episode a sampler sent.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from echo.config import TaskConfig
from echo.tasks import Environment, Episode, Prompt, Step, Task, is_environment, load_task, safe_score
from echo.trust.noise import Draw
from echo.wire.messages import Completion, Observation


def load_environment(cfg: TaskConfig) -> Environment:
    """The config's task as an environment: one that plays episodes itself, or a task's one turn."""
    task = load_task(cfg)
    return task if is_environment(task) else SingleTurn(task)


class SingleTurn:
    """A task as a one-turn environment: its step scores the completion with the task's verifier."""

    environment, max_turns = True, 1  # one turn

    def __init__(self, task: Task):
        self.task, self.name = task, task.name

    def prompt(self, index: int) -> Prompt:
        return self.task.prompt(index)

    def held_out(self, n: int) -> list[Prompt]:
        return self.task.held_out(n)

    def episode(self, prompt: Prompt) -> Episode:
        return _Scored(self.task, prompt)


@dataclass
class _Scored:
    task: Task
    prompt: Prompt

    def step(self, action: str) -> Step:
        return Step([], getattr(safe_score(self.task, action, self.prompt), "reward", 0.0), done=True)


# Stands for the model's turn while the chat template renders the turn after it.
_SENTINEL = "\x00echo-turn\x00"


def observation_tokens(tokenizer, messages: list[dict]) -> list[int]:
    """The ids of `messages` (an observation) as the chat template renders them after a model turn
    that ended with its end-of-turn token, up to and including the opener of the model's next turn:
    what the template puts between that token and the model's next words. Rendered apart from the
    conversation, so the model's own tokens are never re-tokenised."""
    before = [{"role": "user", "content": _SENTINEL}, {"role": "assistant", "content": _SENTINEL}]
    text = tokenizer.apply_chat_template(before + messages, add_generation_prompt=True, tokenize=False)
    end_of_turn = text.index(tokenizer.eos_token, text.rindex(_SENTINEL)) + len(tokenizer.eos_token)
    return tokenizer(text[end_of_turn:], add_special_tokens=False)["input_ids"]


def action_text(tokenizer, completion: Completion, turn: int) -> str:
    """The text of the model's `turn` (its tokens decoded, special tokens left out)."""
    start, end = completion.model_turns()[turn]
    return tokenizer.decode(completion.token_ids[start:end].tolist(), skip_special_tokens=True)


def no_room(tokens: int, observation: list[int], max_tokens: int) -> bool:
    """Whether an episode of `tokens` so far has no room for `observation` and a model turn after it."""
    return tokens + len(observation) >= max_tokens


class Rerun(NamedTuple):
    reward: float  # the episode's, as the environment gives it for the sampler's actions
    reason: str | None  # why the episode is refused, or None


def rerun(env: Environment, tokenizer, prompt: Prompt, completion: Completion, max_tokens: int) -> Rerun:
    """Play the episode again from its prompt with the sampler's actions (the model's turns,
    decoded): every observation it claims must be the environment's, token for token, and it
    must end where the environment, the turn limit, a turn cut short or the token budget ends it."""
    episode, reward, turns = env.episode(prompt), 0.0, completion.model_turns()
    if len(turns) > env.max_turns:
        return Rerun(reward, "too_many_turns")
    for turn, observation in enumerate([*completion.observations, None]):
        try:
            step = episode.step(action_text(tokenizer, completion, turn))
        except MemoryError:  # the trainer's budget (workers/trainer/scoring.py), not a bug
            raise
        except Exception:  # a bug in an environment costs that group, not the run
            return Rerun(reward, "environment_error")
        reward += step.reward
        if observation is None:  # the model's last turn: the episode must be over
            over = (step.done or len(turns) == env.max_turns or completion.truncated
                    or no_room(len(completion.token_ids), observation_tokens(tokenizer, step.observation), max_tokens))
            return Rerun(reward, None if over else "episode_cut_short")
        if step.done:
            return Rerun(reward, "episode_went_on")
        claimed = completion.token_ids[observation.at : observation.at + observation.tokens]
        if not np.array_equal(claimed, observation_tokens(tokenizer, step.observation)):
            return Rerun(reward, "observation_mismatch")
    raise AssertionError("unreachable: the last turn returns")


class EpisodeBuilder:
    """A sampler's episode in the making: the context for the model's next turn, each turn it
    sampled added as it came (its ids and behaviour log-probs), the environment's answer
    appended as observation_tokens renders it. Over when the environment says so, after
    max_turns, when a turn ended without the end-of-turn token (cut at its token limit), or when
    no room is left in the `max_tokens` budget for another observation and a turn."""

    def __init__(self, env: Environment, tokenizer, prompt: Prompt, prompt_ids: list[int], max_tokens: int):
        self.env, self.tokenizer, self.prompt, self.prompt_ids = env, tokenizer, prompt, list(prompt_ids)
        self.max_tokens, self.episode = max_tokens, env.episode(prompt)
        self.ids: list[int] = []
        self.logprobs: list[float] = []
        self.observations: list[Observation] = []
        self.actions: list[str] = []
        self.reward, self.done, self.finish_reason = 0.0, False, "stop"
        # A mixture of experts' routing of prompt_ids + ids, where the engine records it: each
        # token's from the forward that first read it (a turn's tokens from that turn, the
        # observation and the turn's last token before it from the next turn's prefill).
        self.routing: np.ndarray | None = None

    @property
    def context(self) -> list[int]:
        return self.prompt_ids + self.ids

    @property
    def room(self) -> int:
        """Tokens the model's next turn may take."""
        return self.max_tokens - len(self.ids)

    def add_turn(self, ids: list[int], logprobs: list[float], routing: np.ndarray | None = None) -> None:
        """The model's turn (its tokens, log-probs and, where recorded, the routing of its
        context and tokens: CompletionOutput.routing), and the environment's answer."""
        if routing is not None:
            # what earlier turns routed, but the last token: this turn's prefill read it first
            kept = routing[:0] if self.routing is None else self.routing[:-1]
            self.routing = np.concatenate([kept, routing[len(kept) : len(self.context) + len(ids)]])
        self.ids += ids
        self.logprobs += logprobs
        action = self.tokenizer.decode(ids, skip_special_tokens=True)
        self.actions.append(action)
        try:
            step = self.episode.step(action)
        except Exception:  # a bug in an environment ends the episode, not the sampler (the trainer refuses it)
            self.done = True
            return
        self.reward += step.reward
        ended = not ids or ids[-1] != self.tokenizer.eos_token_id
        if ended:
            self.finish_reason = "length"
        if step.done or ended or len(self.actions) == self.env.max_turns:
            self.done = True
            return
        observation = observation_tokens(self.tokenizer, step.observation)
        if no_room(len(self.ids), observation, self.max_tokens):
            self.done = True
            return
        self.observations.append(Observation(at=len(self.ids), tokens=len(observation)))
        self.ids += observation
        self.logprobs += [0.0] * len(observation)

    def completion(self) -> Completion:
        if not self.done:
            raise ValueError("an episode still being played has no completion yet")
        return Completion(token_ids=self.ids, logprobs=self.logprobs, text="\n\n".join(self.actions),
                          claimed_reward=self.reward, finish_reason=self.finish_reason, observations=self.observations)


def play_episodes(engine, env: Environment, prompts: list[Prompt], prompt_ids: list[list[int]], n: int,
                  max_tokens: int, greedy: bool = False, seed: int | None = None,
                  keys: list[int] | None = None) -> list[list[Completion]]:
    """Each prompt's `n` episodes as completions (see play)."""
    return [[e.completion() for e in group] for group in play(engine, env, prompts, prompt_ids, n, max_tokens,
                                                              greedy, seed, keys)]


def play(engine, env: Environment, prompts: list[Prompt], prompt_ids: list[list[int]], n: int, max_tokens: int,
         greedy: bool = False, seed: int | None = None, keys: list[int] | None = None) -> list[list[EpisodeBuilder]]:
    """`n` episodes from each prompt, played turn by turn: each round, every episode still going
    takes its next model turn (all in one batch, each at most the tokens its budget has left;
    greedy for evaluation; round k drawn with `seed` + k, or with keyed noise where `keys`, one
    per prompt, are given: episode j of a group draws as its completion j, each token at its
    position in the episode), and the environment answers. Returns each prompt's episodes."""
    episodes = [[EpisodeBuilder(env, engine.tokenizer, prompt, ids, max_tokens) for _ in range(n)]
                for prompt, ids in zip(prompts, prompt_ids)]
    going = [(e, None if keys is None else keys[i], j) for i, group in enumerate(episodes) for j, e in enumerate(group)]
    round_ = 0
    while going:
        turns = engine.generate([e.context for e, _, _ in going], 1, greedy=greedy,
                                max_tokens=max(e.room for e, _, _ in going),
                                seed=None if seed is None else (seed + round_) % 2**32,
                                draws=None if keys is None else [Draw(key, j, len(e.ids)) for e, key, j in going])
        round_ += 1
        for (episode, _, _), (generation,) in zip(going, turns):
            keep = min(len(generation.token_ids), episode.room)  # a shorter budget than the batch's
            episode.add_turn(generation.token_ids[:keep], generation.logprobs[:keep], generation.routing)
        going = [g for g in going if not g[0].done]
    return episodes
