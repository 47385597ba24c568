"""Episodes a second for a `verifiers` multi-turn environment against the same game written as
a native echo-rl environment (issue 67): what playing an environment through verifiers' own
rollout code (echo/tasks/verifiers_env.py) costs a sampler and the trainer.

The game, both ways: guess a number from 1 to 9, told higher or lower after each guess, over when
guessed (reward 1) or after `--turns` turns. Measured in one run, each way:
- played: `--episodes` episodes through the samplers' episode loop (echo/tasks/episodes.py
  play_episodes) with the tiny model, groups of 8, keyed noise: episodes a second;
- replayed: the same episodes checked as the trainer checks them (`rerun`): milliseconds each.
The two ways run interleaved `--repeats` times after a warm-up, each figure the median of its
runs; the verifiers figures are given as ratios to the native ones.

    python -m bench.envs [--episodes 64] [--turns 4] [--max-tokens 256] [--repeats 3]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

from bench.common import write_results
from echo.config import EchoConfig, TaskConfig
from echo.engines import make_engine
from echo.tasks import Prompt, Step, load_task
from echo.tasks.episodes import play_episodes, rerun

# The game to `verifiers`' interface. The tests play it with a calculator (a turn that calls it
# gets its result, one that does not guesses), and `seeded=False` for a game no rerun can check.
GUESS_ENV = '''
import random

import verifiers as vf
from datasets import Dataset


class Guess(vf.ToolEnv):
    """Guess the number: a turn that calls a tool gets its result, one that does not is a guess,
    told higher or lower; over when guessed."""

    async def no_tools_called(self, state) -> bool:  # ToolEnv's stop, not one here: a turn without a call guesses
        return False

    async def env_response(self, messages, state, **kwargs):
        if getattr(messages[-1], "tool_calls", None):
            return await super().env_response(messages, state, **kwargs)
        guess = self.parser.parse_answer(messages) or ""
        said = "higher" if guess.isdigit() and int(guess) < int(state["answer"]) else "lower"
        return [vf.UserMessage(content=f"{guess!r}: {said}")]

    @vf.stop
    async def guessed(self, state) -> bool:
        return bool(state["trajectory"]) and self.parser.parse_answer(
            state["trajectory"][-1]["completion"]) == state["answer"]


def add(a: int, b: int) -> int:
    """a + b"""  # short: the tools' system message, in bytes, and the episode share the tiny model's 1024
    return a + b


def load_environment(games: int = 100, calculator: bool = True, seeded: bool = True):
    rows = [{"question": f"Game {i}: guess my number, 1 to 9, in <answer></answer>.", "answer": str(1 + i % 9)}
            for i in range(games)]
    parser = vf.XMLParser(["answer"])

    def guessed_it(completion, answer) -> float:
        return float(parser.parse_answer(completion) == answer)

    # max_turns -1: none of its own, so echo-rl's task.params.max_turns sets it.
    env = Guess(tools=[add] if calculator else [], max_turns=-1, dataset=Dataset.from_list(rows), parser=parser,
                rubric=vf.Rubric(funcs=[guessed_it], parser=parser))
    if not seeded:  # an answer that changes from play to play: no replay can check it
        async def env_response(messages, state, **kwargs):
            return [vf.UserMessage(content=str(random.random()))]
        env.env_response = env_response
    return env
'''


class NativeGuess:
    """The same game to echo-rl's own Environment interface (docs/operations.md), on the verifiers
    task's prompts: with the same keyed noise the model plays the same turns in both."""

    name, environment = "guess", True

    def __init__(self, theirs, max_turns: int):
        self.theirs, self.max_turns = theirs, max_turns

    def prompt(self, index: int) -> Prompt:
        prompt = self.theirs.prompt(index)  # its answer: the game's row, "train/<row>"
        return Prompt(index, prompt.messages, str(1 + int(prompt.answer.rpartition("/")[2]) % 9))

    def held_out(self, n: int) -> list[Prompt]:
        return []

    def episode(self, prompt: Prompt):
        return Game(prompt.answer)


class Game:
    def __init__(self, secret: str):
        self.secret = secret

    def step(self, action: str) -> Step:
        start, end = action.rfind("<answer>"), action.rfind("</answer>")
        guess = action[start + 8 : end].strip() if 0 <= start < end else ""
        if guess == self.secret:
            return Step([], 1.0, done=True)
        said = "higher" if guess.isdigit() and int(guess) < int(self.secret) else "lower"
        return Step([{"role": "user", "content": f"{guess!r}: {said}"}], 0.0, done=False)


def measure(env, engine, args) -> dict:
    prompts = [env.prompt(i) for i in range(args.episodes // 8)]
    ids = [engine.encode_chat(p.messages) for p in prompts]
    started = time.perf_counter()
    played = play_episodes(engine, env, prompts, ids, 8, args.max_tokens, keys=list(range(1, len(prompts) + 1)))
    seconds = time.perf_counter() - started
    episodes = [(p, c) for p, group in zip(prompts, played) for c in group]
    started = time.perf_counter()
    checked = [rerun(env, engine.tokenizer, p, c, args.max_tokens) for p, c in episodes]
    replay_s = (time.perf_counter() - started) / len(episodes)
    assert all(r.reason is None for r in checked), [r.reason for r in checked if r.reason]
    return {"episodes": len(episodes), "reward": sum(c.claimed_reward for _, c in episodes) / len(episodes),
            "tokens": sum(len(c.token_ids) for _, c in episodes), "episodes_per_s": round(len(episodes) / seconds, 3),
            "turns_per_episode": round(sum(len(c.model_turns()) for _, c in episodes) / len(episodes), 2),
            "replay_ms_per_episode": round(replay_s * 1e3, 3)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--episodes", type=int, default=64)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    engine = make_engine(EchoConfig())  # the tiny model, on the CPU
    with tempfile.TemporaryDirectory() as folder:
        (Path(folder) / "bench_guess_env.py").write_text(GUESS_ENV)
        sys.path.insert(0, folder)
        theirs = load_task(TaskConfig(name="verifiers:bench_guess_env",
                                      params={"max_turns": args.turns, "calculator": False}))
        envs = {"native": NativeGuess(theirs, args.turns), "verifiers": theirs}
        measure(envs["native"], engine, argparse.Namespace(**{**vars(args), "episodes": 8}))  # the engine warmed up
        # Interleaved, the median of each: the load of a shared box moves between the two alike.
        runs = [(name, measure(env, engine, args)) for _ in range(args.repeats) for name, env in envs.items()]
        rows = {name: {key: statistics.median(r[key] for n, r in runs if n == name) for key in runs[0][1]}
                for name in envs}
    ratios = {"episodes_per_s": round(rows["verifiers"]["episodes_per_s"] / rows["native"]["episodes_per_s"], 3),
              "replay_ms_per_episode": round(rows["verifiers"]["replay_ms_per_episode"]
                                             / rows["native"]["replay_ms_per_episode"], 2)}
    # The same turns both ways: the difference in time is the environment's.
    ratios["environment_ms_per_episode"] = round(1e3 / rows["verifiers"]["episodes_per_s"]
                                                 - 1e3 / rows["native"]["episodes_per_s"], 2)
    print(rows, ratios)
    print(write_results("envs.json", {"model": "tiny", "turns": args.turns, "max_tokens": args.max_tokens,
                                      "repeats": args.repeats,
                                      "rows": rows, "verifiers_vs_native": ratios}))


if __name__ == "__main__":
    main()
