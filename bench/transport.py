"""Benchmark: rollout ingest through our code against bare nats-py on the same server, same run.

Ours: the sampler's `publish_rollout` (binary encoding, headers, publish acked by the stream),
the trainer's durable pull consumer, `decode_rollout` (every structural check: counts, lengths,
schema, finite log-probs <= 0, headers against the body) and an ack per message. Bare: the same
bytes published with `js.publish` and fetched with a pull consumer and acked, nothing decoded.
The two alternate `--rounds` times per shape (the machine's load falls on both alike); the ratio
is the median round's, with the range over rounds. Also the bytes per completion token of the
binary encoding against schema 7's JSON, and the latency from a publish to the trainer holding
the decoded group (one group in flight).

    .venv/bin/python -m bench.transport [--seconds 2] [--rounds 5]

Writes bench/results/transport.json.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import tempfile
import time
from array import array
from pathlib import Path

import orjson
from nats.js.api import AckPolicy, ConsumerConfig, StreamConfig

from bench.common import write_results
from echo.wire.codec import decode_rollout, encode_rollout
from echo.wire.messages import Completion, RolloutGroup
from streams.client import connect, open_run
from streams.rollouts import fetch_rollouts, publish_rollout, reader_subscription
from streams.server import NatsServer

SHAPES = [(8, 24), (16, 1024), (16, 16384)]  # completions x tokens per group


def make_group(completions: int, tokens: int, index: int) -> RolloutGroup:
    rng = random.Random(index)
    logprobs = array("f", [-rng.random() * 4 for _ in range(tokens)]).tolist()  # as a float32 model gives them
    return RolloutGroup(
        group_id=f"g{index}", sampler_id="s1", version=0, term=0, task="math", prompt_index=index, slot=1,
        prompt_token_ids=[rng.randrange(49_152) for _ in range(128)],
        completions=[Completion(token_ids=[rng.randrange(49_152) for _ in range(tokens)], logprobs=logprobs,
                                text="word " * (tokens * 3 // 5), claimed_reward=1.0, finish_reason="length")
                     for _ in range(completions)],
        temperature=1.0, engine="hf", dtype="float32", gen_seconds=0.0, created_at=0.0)


async def ours(url: str, run_id: str, groups: list[RolloutGroup], batch: int) -> float:
    run = await open_run(url, run_id, "bench")
    subscription = await reader_subscription(run, run.names.rollouts_subject("s1"))
    started = time.perf_counter()
    for group in groups:
        await publish_rollout(run, group)
    got = 0
    while got < len(groups):
        for msg in await fetch_rollouts(subscription, batch, timeout=5.0):
            decode_rollout(msg.data, msg.headers, msg.subject)
            await msg.ack()
            got += 1
    seconds = time.perf_counter() - started
    await run.close()
    return seconds


async def bare(url: str, stream: str, bodies: list[bytes], batch: int) -> float:
    nc = await connect(url, "bench-bare")
    js = nc.jetstream()
    await js.add_stream(StreamConfig(name=stream, subjects=[f"{stream}.>"]))
    sub = await js.pull_subscribe(f"{stream}.>", durable="bare", stream=stream,
                                  config=ConsumerConfig(ack_policy=AckPolicy.EXPLICIT, max_ack_pending=-1))
    started = time.perf_counter()
    for body in bodies:
        await js.publish(f"{stream}.s1", body, timeout=10)
    got = 0
    while got < len(bodies):
        for msg in await sub.fetch(batch, timeout=5.0):
            await msg.ack()
            got += 1
    seconds = time.perf_counter() - started
    await nc.close()
    return seconds


async def latency(url: str, run_id: str, groups: list[RolloutGroup]) -> list[float]:
    run = await open_run(url, run_id, "bench-latency")
    subscription = await reader_subscription(run, run.names.rollouts_subject("s1"))
    seconds = []
    for group in groups:
        started = time.perf_counter()
        await publish_rollout(run, group)
        while not (msgs := await fetch_rollouts(subscription, 1, timeout=5.0)):
            pass
        decode_rollout(msgs[0].data, msgs[0].headers, msgs[0].subject)
        seconds.append(time.perf_counter() - started)
        await msgs[0].ack()
    await run.close()
    return seconds


async def measure(url: str, completions: int, tokens: int, seconds_each: float, rounds_each: int) -> dict:
    probe = make_group(completions, tokens, 0)
    body = encode_rollout(probe)
    count = max(3, min(2000, int(seconds_each * 40_000_000 / len(body))))  # about seconds_each of bytes
    groups = [make_group(completions, tokens, i) if i < 4 else probe.model_copy(update={"group_id": f"g{i}"})
              for i in range(count)]
    bodies = [encode_rollout(g) for g in groups]
    batch = max(1, min(256, (32 << 20) // len(body)))  # a fetch well under the server's max_pending
    name = f"{completions}x{tokens}"
    rounds = []  # (ours, bare) seconds: alternated, so that the machine's load falls on both alike
    for r in range(rounds_each):
        rounds.append((await ours(url, f"ours{name}r{r}", groups, batch),
                       await bare(url, f"BARE{name.upper()}R{r}", bodies, batch)))
    ratios = sorted(bare_s / our_s for our_s, bare_s in rounds)
    our_s, bare_s = (statistics.median(column) for column in zip(*rounds))
    lat = await latency(url, f"lat{name}", groups[: min(20, count)])
    completion_tokens = completions * tokens
    return {
        "group": name, "groups": count, "rounds": rounds_each,
        "bytes_per_token": round(len(body) / completion_tokens, 2),
        "json_bytes_per_token": round(len(orjson.dumps(probe.model_dump())) / completion_tokens, 2),
        "ours_groups_per_s": round(count / our_s, 1), "bare_groups_per_s": round(count / bare_s, 1),
        "ours_tokens_per_s": round(count * completion_tokens / our_s),
        "ratio_to_bare": round(statistics.median(ratios), 2),  # the median round's
        "ratio_range": [round(ratios[0], 2), round(ratios[-1], 2)],
        "latency_ms_median": round(1000 * statistics.median(lat), 2),
    }


async def main_async(seconds_each: float, rounds_each: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp, NatsServer(Path(tmp) / "js") as server:
        results = [await measure(server.url, c, t, seconds_each, rounds_each) for c, t in SHAPES]
    return {"machine": "this one (2 cores), loopback nats-server 2.15.1, nats-py 2.16.0", "shapes": results}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seconds", type=float, default=2.0, help="about how long each side runs per shape and round")
    parser.add_argument("--rounds", type=int, default=5, help="ours and bare alternated this many times per shape")
    args = parser.parse_args()
    result = asyncio.run(main_async(args.seconds, args.rounds))
    out = write_results("transport.json", result)
    print(out.read_text())


if __name__ == "__main__":
    main()
