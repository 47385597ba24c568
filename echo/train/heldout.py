"""A policy's score on a task's held-out prompts, as `echo-rl eval`, the trainer's evaluation
and the parity bench take it: the same numbers wherever they are shown."""

from __future__ import annotations

from echo.process.logs import Progress
from echo.tasks import is_environment
from echo.tasks.episodes import play


def held_out_score(engine, task, prompts, max_tokens: int, batch: int = 8, samples: int = 0,
                   seed: int = 0) -> tuple[float, float]:
    """(mean reward, share correct) of the engine's current weights on `prompts`: greedy, or with
    `samples`, over that many completions sampled for each prompt, drawn with `seed` (the same
    draws for every version scored): the policy's expected reward. A multi-turn task's episodes
    are played to their end; one is correct when it earned the whole reward (1)."""
    scores, n, greedy = [], max(samples, 1), samples == 0
    with Progress("held-out", len(prompts), " prompts") as progress:
        for call, start in enumerate(range(0, len(prompts), batch)):
            chunk = prompts[start : start + batch]
            ids = [engine.encode_chat(p.messages) for p in chunk]
            draw = None if greedy else seed + call
            if is_environment(task):
                episodes = play(engine, task, chunk, ids, n, max_tokens, greedy=greedy, seed=draw)
                scores += [(e.reward, e.reward >= 1.0 - 1e-9) for played in episodes for e in played]
            else:
                outputs = engine.generate(ids, n, greedy=greedy, seed=draw)
                scores += [(s.reward, s.correct) for out, p in zip(outputs, chunk)
                           for s in (task.score(o.text, p) for o in out)]
            progress.advance(len(chunk))
    return sum(r for r, _ in scores) / len(scores), sum(c for _, c in scores) / len(scores)
