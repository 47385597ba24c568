"""Benchmark: where SmolLM2-135M-Instruct starts on reasoning-gym's datasets (echo/tasks/gym.py).

Each candidate (a dataset at an easy setting) is scored on its held-out prompts with greedy
decoding, the way `echo-rl eval` scores a base model. A task for the parity study (issue 32)
should start well above 0 and below 0.5: learnable, with room to learn. And well above
`constant`, the share of held-out problems that one fixed answer (the best of their five
commonest) gets right: on a task where a constant answer scores like the model, RL learns to
give that answer (gcd up to 40: "1" gets 0.56 of its held-out problems right, "2" 0.18, the
held-out score the study's first pilot collapsed to, docs/performance.md).

    .venv/bin/python -m bench.gym_base                       # every candidate, 50 prompts each
    .venv/bin/python -m bench.gym_base --only gcd:40 --prompts 160  # some of them, added to the results

Writes bench/results/gym_base.json.
"""

from __future__ import annotations

import argparse
import time
from collections import Counter

import orjson

from bench.common import results_dir, write_results
from echo.config import validate_config
from echo.engines import make_engine
from echo.tasks import load_task
from echo.train.heldout import held_out_score

CANDIDATES = {
    "basic_arithmetic": {"min_terms": 2, "max_terms": 2, "max_digits": 1, "operators": ["+", "-"],
                         "allow_parentheses": False, "allow_negation": False},
    "chain_sum": {"min_terms": 2, "max_terms": 2, "max_digits": 2},
    "products": {"min_terms": 2, "max_terms": 2, "max_digits": 1},
    "simple_equations": {"min_terms": 2, "max_terms": 2, "max_value": 20, "operators": ["+", "-"],
                         "operators_weights": [0.5, 0.5]},
    "gcd": {"max_value": 20},
    "lcm": {"max_value": 12},
    "prime_factorization": {"max_value": 50},
    "fraction_simplification": {"max_value": 20, "max_factor": 5, "styles": ["plain"]},
    "base_conversion": {"max_base": 10, "max_value": 32},
    "count_bits": {"max_n": 64},
    "leg_counting": {"min_animals": 1, "max_animals": 2, "max_instances": 3},
    "letter_counting": {"min_words": 3, "max_words": 5},
    "number_sorting": {"min_numbers": 3, "max_numbers": 4, "max_decimals": 0, "min_value": 0, "max_value": 50},
    "spell_backward": {"max_word_len": 5},
    "word_sequence_reversal": {"min_words": 3, "max_words": 4},
    "syllogism": {},
    "course_schedule": {"max_num_courses": 5},
    "largest_island": {"min_rows": 3, "max_rows": 5, "min_cols": 3, "max_cols": 5},
    "family_relationships": {"max_family_size": 5},
    "knights_knaves": {},
    # name:label for a second setting of a dataset
    "gcd:40": {"max_value": 40},
    "lcm:20": {"max_value": 20},
    "basic_arithmetic:add2": {"min_terms": 2, "max_terms": 2, "max_digits": 2, "operators": ["+"],
                              "allow_parentheses": False, "allow_negation": False},
    "chain_sum:1": {"min_terms": 2, "max_terms": 3, "max_digits": 1},
    "products:2x1": {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 2},
    "calendar_arithmetic": {},
}


def best_constant(task, prompts) -> tuple[str, float]:
    """The fixed answer, of the five commonest among `prompts`, that gets most of them right, and that share."""
    answers = Counter(str(task.problem(p)["answer"]) for p in prompts)
    scored = [(a, sum(task.score(f"<answer>{a}</answer>", p).correct for p in prompts) / len(prompts))
              for a, _ in answers.most_common(5)]
    return max(scored, key=lambda pair: pair[1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", nargs="*", help="candidates to score (default: all)")
    parser.add_argument("--prompts", type=int, default=50)
    parser.add_argument("--max-tokens", type=int, default=32)
    args = parser.parse_args()
    names = args.only or list(CANDIDATES)
    engine = None
    earlier = results_dir() / "gym_base.json"  # --only adds to (or redoes in) what was measured before
    results = orjson.loads(earlier.read_bytes())["candidates"] if args.only and earlier.exists() else {}
    for name in names:
        cfg = validate_config({"model": {"name": "smollm2"}, "sampling": {"max_new_tokens": args.max_tokens},
                               "task": {"name": f"reasoning_gym:{name.split(':')[0]}", "params": CANDIDATES[name]}})
        engine = engine or make_engine(cfg)  # one model: only the task changes
        task = load_task(cfg.task)
        prompts = task.held_out(args.prompts)
        started = time.monotonic()
        reward, correct = held_out_score(engine, task, prompts, args.max_tokens, batch=16)
        answer, constant = best_constant(task, prompts)
        results[name] = {"params": CANDIDATES[name], "prompts": len(prompts), "correct": round(correct, 4),
                         "reward": round(reward, 4), "constant": round(constant, 4), "constant_answer": answer,
                         "seconds": round(time.monotonic() - started, 1)}
        print(name, results[name], flush=True)
    write_results("gym_base.json", {"model": "smollm2", "decoding": "greedy", "max_new_tokens": args.max_tokens,
                               "candidates": results})


if __name__ == "__main__":
    main()
