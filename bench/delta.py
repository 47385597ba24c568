"""Benchmark (issue 47): how small full-weight versions get as sparse deltas between versions.

Trains a full-weight swarm (`echo-rl up`, `lora.enabled = false`, weights published in bf16,
every version kept) on `make up`'s task, then takes each consecutive pair of its versions as a
trainer would publish them: the whole version's bytes against the delta's (echo/weights/delta.py; as
safetensors, and packed as published: zlib at level 1), the share of elements changed, the
seconds to make and pack the delta (the trainer's) and to unpack and apply it and check the
result's digest (a sampler's), and that the rebuilt weights are the version, bit for bit; and
what the run's trainer published for each version (its metrics: bytes, delta or whole, the publish phase's seconds).

    .venv/bin/python -m bench.delta --model smollm2 --steps 20 [--lr 1e-5] [--from-run DIR]

Writes bench/results/delta-<model>.json.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import safetensors.torch

from bench.common import write_results
from echo.config import validate_config
from echo.train.metrics import read_metrics
from echo.weights.delta import apply, changed_fraction, encode, pack, unpack
from echo.weights.digest import tensors_digest
from echo.weights.files import read_shards, weights_at
from echo.weights.shards import shards_tensors


def train(model: str, task: str, steps: int, lr: float, work: Path) -> Path:
    """A full-weight run's directory, every version kept."""
    cfg = validate_config({
        "run": {"id": "delta", "dir": str(work), "steps": steps, "eval_prompts": 0},
        "model": {"name": model}, "task": {"name": task}, "lora": {"enabled": False}, "sampler": {"count": 2},
        "trainer": {"lr": lr, "publish_dtype": "bfloat16", "keep_versions": steps + 1},
    })
    config = work / "delta.toml"
    config.write_text(cfg.to_toml())
    with open(work / "up.log", "wb") as log:
        subprocess.run([sys.executable, "-m", "workers.cli", "up", "--config", str(config), "--log-json"],
                       stdout=log, stderr=subprocess.STDOUT, check=True, cwd=Path(__file__).parent.parent)
    return cfg.run_dir


def measure_pair(before: dict, after: dict) -> dict:
    started = time.perf_counter()
    delta = encode(before, after)
    packed = pack(delta)
    encoded = time.perf_counter()
    whole = sum(t.numel() * t.element_size() for t in after.values())
    rebuilt = apply(before, unpack(packed, 2 * whole))
    same = tensors_digest(rebuilt) == tensors_digest(after)
    applied = time.perf_counter()
    return {"whole_bytes": whole, "delta_bytes": len(safetensors.torch.save(delta)), "delta_zlib_bytes": len(packed),
            "delta_share": len(packed) / whole,
            "changed_share": changed_fraction(delta, sum(t.numel() for t in after.values())),
            "encode_seconds": encoded - started, "apply_and_digest_seconds": applied - encoded, "bit_exact": same}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--task", default="math", help="make up's; the tiny model learns bench.letters:Letters")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--lr", type=float, default=1e-5, help="full-weight RL's size (LoRA's default is 10x more)")
    parser.add_argument("--from-run", type=Path, help="measure this finished run's kept versions (trained as this "
                        "bench trains: every version kept), not a new one")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        run_dir = args.from_run or train(args.model, args.task, args.steps, args.lr, Path(tmp))
        published = {m["version"]: {"published_bytes": m["weights"]["bytes"],
                                    "published_delta_of": m["weights"]["delta_of"],
                                    "publish_seconds": m["phase_seconds"]["publish"]} for m in read_metrics(run_dir)}
        pairs, before = [], shards_tensors(read_shards(weights_at(run_dir, 0)))
        for v in range(1, args.steps + 1):  # two versions in memory at a time
            after = shards_tensors(read_shards(weights_at(run_dir, v)))
            pairs.append({"version": v, **measure_pair(before, after), **published[v]})
            before = after
    report = {"model": args.model, "task": args.task, "steps": args.steps, "lr": args.lr, "publish_dtype": "bfloat16",
              "from_run": str(args.from_run) if args.from_run else None, "pairs": pairs}
    path = write_results(f"delta-{args.model}.json", report)
    print(f"{path}:")
    for p in pairs:
        print(f"v{p['version']:>3}: delta {p['delta_share']:.2%} of {p['whole_bytes'] / 2**20:.0f} MiB "
              f"(unpacked {p['delta_bytes'] / p['whole_bytes']:.2%}), changed {p['changed_share']:.2%}, "
              f"encode {p['encode_seconds']:.2f} s, apply {p['apply_and_digest_seconds']:.2f} s, "
              f"bit-exact {p['bit_exact']}")


if __name__ == "__main__":
    main()
