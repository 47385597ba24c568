"""What the trainer's check of a multi-turn episode costs (issue 29): echo/tasks/episodes.py
`rerun` (the episode played again with the sampler's actions, every observation rendered and
compared token for token, every reward recomputed) per episode, beside the check of a
single-turn completion (its reward recomputed by the task's verifier) measured in the same run.

Episodes are built as a sampler builds them (EpisodeBuilder), with scripted turns of
`--turn-tokens` tokens of reasoning before each action, `--turns` turns each; for each
tokenizer: the tiny model's byte tokenizer and SmolLM2's.

    python -m bench.episode_check [--episodes 64] [--turns 6] [--turn-tokens 200]
"""

from __future__ import annotations

import argparse
import random
import time

from transformers import AutoTokenizer

from bench.common import write_results
from echo.config import TaskConfig
from echo.model.loading import byte_tokenizer, encode_chat, model_folder
from echo.tasks import safe_score
from echo.tasks.episodes import EpisodeBuilder, load_environment, rerun

THINKING = "Let me think about where the boxes and goals are and which way to push. "


def action(task: str, rng: random.Random, last: bool, answer: str) -> str:
    if task == "math":
        return f"\\boxed{{{answer}}}"
    if task == "sokoban_game":
        return f"<answer>{' '.join(rng.choice('UDLR') for _ in range(2))}</answer>"
    return f"\\boxed{{{answer}}}" if last else f"<calc>{rng.randint(1, 99)} * {rng.randint(1, 99)}</calc>"


def episodes(env, tokenizer, task: str, args) -> list[tuple]:
    rng, built = random.Random(0), []
    for index in range(args.episodes):
        prompt = env.prompt(index)
        episode = EpisodeBuilder(env, tokenizer, prompt, encode_chat(tokenizer, prompt.messages), args.max_tokens)
        for turn in range(args.turns):
            if episode.done:
                break
            text = (THINKING * args.turn_tokens)[: args.turn_tokens] + action(task, rng, turn == args.turns - 1,
                                                                              prompt.answer)
            ids = tokenizer(text, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
            episode.add_turn(ids, [-0.5] * len(ids))
        built.append((prompt, episode.completion()))
    return built


def seconds_each(items: list, check) -> float:
    started = time.perf_counter()
    for item in items:
        check(item)
    return (time.perf_counter() - started) / len(items)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--episodes", type=int, default=64)
    p.add_argument("--turns", type=int, default=6)
    p.add_argument("--turn-tokens", type=int, default=200)
    p.add_argument("--max-tokens", type=int, default=16384)
    args = p.parse_args()
    tokenizers = {"byte (tiny)": byte_tokenizer(), "smollm2": AutoTokenizer.from_pretrained(model_folder("smollm2"))}
    rows = []
    for tokenizer_name, tokenizer in tokenizers.items():
        math = load_environment(TaskConfig(name="math"))
        single = [(prompt, completion.text) for prompt, completion in episodes(math, tokenizer, "math", args)]
        baseline = seconds_each(single, lambda item: safe_score(math.task, item[1], item[0]))
        for task in ("sokoban_game", "math_tools"):
            env = load_environment(TaskConfig(name=task, params={"max_turns": args.turns}))
            built = episodes(env, tokenizer, task, args)
            per_episode = seconds_each(built, lambda item: rerun(env, tokenizer, item[0], item[1], args.max_tokens))
            turns = sum(len(c.model_turns()) for _, c in built) / len(built)
            tokens = sum(len(c.token_ids) for _, c in built) / len(built)
            rows.append({"tokenizer": tokenizer_name, "task": task, "turns_per_episode": round(turns, 2),
                         "tokens_per_episode": round(tokens), "replay_ms_per_episode": round(per_episode * 1e3, 3),
                         "replay_ms_per_turn": round(per_episode * 1e3 / turns, 3),
                         "single_turn_check_ms": round(baseline * 1e3, 3),
                         "replay_vs_single_turn_check": round(per_episode / baseline, 2)})
            print(rows[-1], flush=True)
    print(write_results("episode_check.json", {"episodes": args.episodes, "rows": rows}))


if __name__ == "__main__":
    main()
