"""Benchmark: a practitioner's own chat data on SmolLM2-135M-Instruct (issue 82). A verl-format
parquet whose chat prompts ask a sum and nothing of the answer's form, trained by `echo-rl up`
three times from the same start: as it is; with an instruction on the last user turn asking for
\\boxed{}; and with the documented remedy (docs/operations.md, "Your dataset"): that instruction and
one worked example. Records each run's
reward by step, the share of completions with a \\boxed{} answer, and what `run.no_signal` said.

    .venv/bin/python -m bench.own_data [--steps 10]

Writes bench/results/own-data-smollm2.json.
"""

from __future__ import annotations

import argparse
import random
import subprocess
import sys
import tempfile
from pathlib import Path

import orjson

from bench.common import write_results

INSTRUCTION = "{prompt} Put your final answer in \\boxed{}."
EXAMPLE = ["What is 3 + 4?", "3 + 4 = 7. The answer is \\boxed{7}."]


def write_rows(path: Path, rows: int) -> None:
    """verl's schema: chat messages asking a sum, the truth in reward_model.ground_truth."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rng = random.Random(0)
    pairs = [(rng.randint(1, 50), rng.randint(1, 50)) for _ in range(rows)]
    pq.write_table(pa.Table.from_pylist([
        {"data_source": "sums", "prompt": [{"role": "user", "content": f"What is {a} + {b}?"}],
         "reward_model": {"style": "rule", "ground_truth": str(a + b)}} for a, b in pairs]), path)


def run(folder: Path, name: str, steps: int, data: Path, instruction: bool, example: bool) -> dict:
    options = ["--set", 'task.name="dataset"', "--set", f'task.params.path="{data}"', "--set", "run.eval_prompts=0",
               "--set", "sampling.max_new_tokens=48", "--set", "trainer.groups_per_step=4",
               "--set", "trainer.no_signal_steps=3", "--set", "run.seed=0"]
    if instruction:
        options += [f"task.params.instruction={INSTRUCTION}"]
    if example:
        options += [f"task.params.examples={orjson.dumps([EXAMPLE]).decode()}"]
    done = subprocess.run([sys.executable, "-m", "workers.cli", "up", "--model", "smollm2", "--steps", str(steps),
                           "--run-id", name, "--set", f'run.dir="{folder}"', *options],
                          capture_output=True, text=True, timeout=3600)
    if done.returncode:
        raise SystemExit(done.stderr[-3000:])
    metrics = [orjson.loads(line) for line in (folder / name / "metrics.jsonl").read_bytes().splitlines()]
    said = [line for line in (done.stdout + done.stderr).splitlines() if "run.no_signal" in line]
    return {"instruction": instruction, "example": example,
            "reward_by_step": [round(m["reward_mean"], 4) for m in metrics],
            "boxed_share_by_step": [round(1 - m["no_answer_share"], 4) for m in metrics],
            "first_nonzero_reward_step": next((m["step"] for m in metrics if m["reward_mean"] > 0), None),
            "no_signal": said[0].split("cause=", 1)[-1][:400] if said else None}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=10)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        write_rows(folder / "sums.parquet", 400)
        result = {"model": "smollm2", "steps": args.steps, "data": "400 verl-format chat rows 'What is a + b?'",
                  "instruction": INSTRUCTION, "example": EXAMPLE,
                  "as_given": run(folder, "as-given", args.steps, folder / "sums.parquet", False, False),
                  "instruction_only": run(folder, "instruction", args.steps, folder / "sums.parquet", True, False),
                  "remedy": run(folder, "remedy", args.steps, folder / "sums.parquet", True, True)}
    out = write_results("own-data-smollm2.json", result)
    print(out.read_text())


if __name__ == "__main__":
    main()
