"""The trainer's peak resident memory under the largest group a sampler may send (issue 26).

A real nats-server and the trainer's real intake (RolloutInbox, Collector, Judge, Scorer) at a
reasoning shape (`--group-size` completions of up to `--max-new-tokens`). A sampler publishes
one small honest group (the baseline), then a group whose encoded body is exactly
`RolloutLimits.max_bytes` for that shape (every completion at the token limit, its text padded
to the most bytes a token may claim; sent in parts, decoded in full, judged and trained on),
then one claiming a byte more (refused before a part is read), then a small one. Reported: the
trainer process's peak resident memory after the baseline and after the rest (the publisher is
a process of its own).

    python -m bench.largest_body [--group-size 16] [--max-new-tokens 32768]
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import tempfile

from bench.common import write_results
from echo.config import SamplingConfig
from echo.model.loading import byte_tokenizer, encode_chat
from echo.tasks.math import Math
from echo.train.metrics import peak_rss_mb
from echo.trust.scorer import Scorer
from echo.wire.codec import RolloutLimits, encode_rollout, rollout_headers
from echo.wire.messages import Completion, RolloutGroup
from echo.wire.names import HDR_BODY_PARTS, HDR_BODY_SHA256, HDR_BODY_SIZE
from streams.client import open_run
from streams.inbox import RolloutInbox
from streams.rollouts import publish_rollout
from streams.server import NatsServer
from workers.trainer.intake import Collector
from workers.trainer.judge import Judge, Timeline


def peak_rss() -> int:
    return round(peak_rss_mb() * 2**20)


def group(task: Math, tokenizer, group_id: str, tokens: int, count: int, text_bytes: int) -> RolloutGroup:
    prompt = task.prompt(12)
    completions = [Completion(token_ids=[ord("a") + i] + [ord("x")] * (tokens - 1), logprobs=[-0.5] * tokens,
                              text="x" * text_bytes, claimed_reward=0.0, finish_reason="length")
                   for i in range(count)]  # distinct: a repeat would be refused before it is scored
    return RolloutGroup(group_id=group_id, sampler_id="s1", version=1, task="math", prompt_index=12, slot=1,
                        term=0, prompt_token_ids=encode_chat(tokenizer, prompt.messages),
                        completions=completions, temperature=1.0, engine="hf", dtype="float32",
                        gen_seconds=0.1, created_at=0.0)


def padded_to(limits: RolloutLimits, task: Math, tokenizer, tokens: int, count: int) -> RolloutGroup:
    """The group of `count` completions of `tokens` whose encoding is exactly limits.max_bytes."""
    short = len(encode_rollout(group(task, tokenizer, "largest", tokens, count, 0)))
    return group(task, tokenizer, "largest", tokens, count, (limits.max_bytes - short) // count)


async def publish(url: str, args, which: str) -> None:
    """In a process of its own (the sampler's memory is not the trainer's): `which` is "small",
    or "largest" (then one over the limit, then a small one so the trainer's step completes)."""
    tokenizer, task = byte_tokenizer(), Math({})
    limits = RolloutLimits(args.group_size, args.max_new_tokens)
    run = await open_run(url, "body", "sampler", create=False)
    if which == "largest":
        await publish_rollout(run, padded_to(limits, task, tokenizer, args.max_new_tokens, args.group_size))
        over = {**rollout_headers(group(task, tokenizer, "over", 1, 1, 1)), HDR_BODY_PARTS: "1",
                HDR_BODY_SIZE: str(limits.max_bytes + 1), HDR_BODY_SHA256: "0" * 64}
        await run.js.publish(run.names.rollouts_subject("s1"), b"", headers=over)
    await publish_rollout(run, group(task, tokenizer, f"small-{which}", 32, args.group_size, 32))
    await run.close()


def publish_now(url: str, args, which: str) -> None:
    asyncio.run(publish(url, args, which))


def publish_in_a_process(url: str, args, which: str) -> None:
    process = multiprocessing.get_context("spawn").Process(target=publish_now, args=(url, args, which))
    process.start()
    process.join()
    assert process.exitcode == 0, f"the publisher of {which} failed"


async def measure(url: str, args) -> dict:
    tokenizer, task = byte_tokenizer(), Math({})
    sampling = SamplingConfig(group_size=args.group_size, max_new_tokens=args.max_new_tokens, temperature=1.0)
    scorer = Scorer(task, tokenizer, vocab_size=len(tokenizer), sampling=sampling)
    run = await open_run(url, "body", "trainer")
    collector = Collector(await RolloutInbox.open(run), Judge(scorer, Timeline(max_staleness=1)))
    outcomes = []
    for which in ("small", "largest"):
        await asyncio.to_thread(publish_in_a_process, url, args, which)
        collected = await collector.collect(1 if which == "small" else 2, version=1)
        outcomes.append({"used": [a.group.group_id for a in collected.used], "rejected": dict(collected.rejected)})
        outcomes[-1]["peak_rss"] = peak_rss()
    await run.close()
    size = len(encode_rollout(padded_to(scorer.limits, task, tokenizer, args.max_new_tokens, args.group_size)))
    return {"group_size": args.group_size, "max_new_tokens": args.max_new_tokens,
            "largest_body_bytes": size, "limit_bytes": scorer.limits.max_bytes,
            "baseline_peak_gb": round(outcomes[0]["peak_rss"] / 2**30, 3),
            "peak_gb": round(outcomes[1]["peak_rss"] / 2**30, 3),
            "extra_peak_gb": round((outcomes[1]["peak_rss"] - outcomes[0]["peak_rss"]) / 2**30, 3),
            "outcomes": outcomes}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--group-size", type=int, default=16)
    p.add_argument("--max-new-tokens", type=int, default=32768)
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp, NatsServer(tmp) as server:
        report = asyncio.run(measure(server.url, args))
    print(write_results("largest_body.json", report), report)


if __name__ == "__main__":
    main()
