"""The peer: TRL's GRPOTrainer on the work an echo-rl run does, so the two can stand side by side
(bench.parity's `peer-trl` preset runs it as the mode "trl" beside echo-rl's co-located,
sequential and async runs, and scores every run's versions with the same held-out code).

The same as an echo-rl run of the same config: the base model (echo.model.loading.load_model), the
LoRA adapter with the same initial values (echo.model.policy.make_policy after the run's seed), the
task's prompts in the co-located run's order (bench/colocated.py's step_prompts) and its reward
function, group size, completion length and temperature, AdamW at the same constant learning
rate and gradient clip, one update per batch of `trainer.groups_per_step` groups, the loss of
echo-rl's default preset (TRL's own defaults: loss_type "dapo", scale_rewards "group",
epsilon 0.2, no KL; tests/test_trl_losses.py checks the two losses agree), the same steps.

It writes what the co-located run writes: `metrics.jsonl` in the trainer's format (its
`wait_seconds` TRL's generation and scoring, `busy_seconds` its update) and each version's
adapter as safetensors shards in `weights/`, so the parity bench reads and scores it as any run.

    .venv/bin/python -m bench.peer_trl --config run.toml [--set section.key=value ...]
"""

from __future__ import annotations

import time

import torch

from bench.colocated import main, step_prompts
from echo.config import EchoConfig
from echo.model.loading import load_model
from echo.model.policy import make_policy
from echo.tasks import load_task
from echo.train.learner import set_threads
from echo.train.metrics import peak_rss_mb
from echo.weights.files import weights_file
from echo.weights.shards import weights_shards
from workers.trainer.accounting import metrics_line


def trl_config(cfg: EchoConfig):
    from trl import GRPOConfig

    groups, size = cfg.trainer.groups_per_step, cfg.sampling.group_size
    return GRPOConfig(
        output_dir=str(cfg.run_dir / "trl"), report_to="none", use_cpu=cfg.model.device == "cpu",
        max_steps=cfg.run.steps, seed=cfg.run.seed, logging_steps=1, save_strategy="no",
        # One update per batch of `groups` prompts x `size` completions, generated with the current weights.
        per_device_train_batch_size=groups * size, gradient_accumulation_steps=1, num_generations=size,
        num_iterations=1, shuffle_dataset=False,  # the prompts in the given order
        max_completion_length=cfg.sampling.max_new_tokens, temperature=cfg.sampling.temperature, top_p=1.0,
        top_k=0, learning_rate=cfg.trainer.lr, lr_scheduler_type="constant", warmup_steps=0,
        weight_decay=cfg.trainer.weight_decay, max_grad_norm=cfg.trainer.max_grad_norm,
        loss_type="dapo", scale_rewards="group", epsilon=cfg.algorithm.clip_low, epsilon_high=cfg.algorithm.clip_high,
        beta=cfg.algorithm.kl_coef, bf16=False, fp16=False,
        gradient_checkpointing=False,  # TRL's default recomputes activations: memory, not the speed compared here
    )


def run_trl(cfg: EchoConfig) -> None:
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOTrainer

    run_dir = cfg.run_dir
    (run_dir / "weights").mkdir(parents=True, exist_ok=True)
    (run_dir / "config.toml").write_text(cfg.to_toml())
    set_threads(cfg.trainer.threads)
    task = load_task(cfg.task)
    base, tokenizer = load_model(cfg.model.name, dtype=torch.float32)
    torch.manual_seed(cfg.run.seed)  # the adapter's initial values, as the echo-rl trainer draws them
    policy = make_policy(base, cfg.lora)
    prompts = {p.index: p for step in step_prompts(cfg, task) for p in step}
    rows = [{"prompt": p.messages, "index": p.index} for step in step_prompts(cfg, task) for p in step]

    def reward(completions, index, **_) -> list[float]:
        return [task.score(c[-1]["content"], prompts[i]).reward for c, i in zip(completions, index)]

    def write_weights(version: int) -> None:
        for shard, data in enumerate(weights_shards(policy, int(cfg.trainer.shard_mb * 2**20))):
            weights_file(run_dir, version, shard).write_bytes(data)

    class Timed(GRPOTrainer):
        """TRL's trainer, its generation and update timed apart."""

        generated = 0.0

        def _generate_and_score_completions(self, inputs):
            began = time.perf_counter()
            out = super()._generate_and_score_completions(inputs)
            self.generated += time.perf_counter() - began
            self.tokens = int(out["completion_mask"].sum())
            return out

    started = time.perf_counter()

    class Metrics(TrainerCallback):
        """Each step's line in the trainer's format, and the version's weights."""

        def __init__(self, path):
            self.file, self.last, self.generated = open(path, "wb"), started, 0.0

        def on_log(self, args, state, control, logs=None, **kwargs):
            if "reward" not in (logs or {}):
                return
            now, step = time.perf_counter(), state.global_step
            write_weights(step)
            generated, self.generated = trainer.generated - self.generated, trainer.generated
            busy = now - self.last - generated
            self.file.write(metrics_line({
                "step": step, "version": step, "reward_mean": logs["reward"], "reward_std": logs.get("reward_std", 0.0),
                "loss": logs.get("loss", 0.0), "entropy": logs.get("entropy", 0.0),
                "clip_fraction": logs.get("clip_ratio/region_mean", 0.0), "grad_norm": logs.get("grad_norm", 0.0),
                "tokens": trainer.tokens, "step_seconds": now - self.last, "wait_seconds": generated,
                "busy_seconds": busy, "utilisation": busy / (now - self.last), "wall_seconds": now - started,
                "generated_seconds": generated, "used": cfg.trainer.groups_per_step, "dropped_stale": 0,
                "dropped_tokens": 0, "staleness_used": {0: cfg.trainer.groups_per_step}, "rejected": {},
                "peak_rss_mb": peak_rss_mb(),
            }))
            self.file.flush()
            self.last = now

    write_weights(0)
    trainer = Timed(model=policy, reward_funcs=reward, args=trl_config(cfg), train_dataset=Dataset.from_list(rows),
                    processing_class=tokenizer, callbacks=[Metrics(run_dir / "metrics.jsonl")])
    trainer.train()


if __name__ == "__main__":
    main(run_trl)
