"""Replay a run's rollout stream, for debugging: every stored group in order, with its headers.

Given a run directory, it reads the run where its config says it lives (a hub), or, for an `up`
run whose embedded server has stopped, from a server started on the run's own JetStream store,
so a finished run can be inspected after the fact; given --nats, it reads that server."""

from __future__ import annotations

import asyncio
import sys
import tomllib
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import AsyncIterator, Callable, Iterator
from urllib.parse import urlparse

import orjson
from nats.js.api import DeliverPolicy
from nats.js.errors import NotFoundError

from echo.wire.codec import ProtocolError, decode_rollout
from echo.wire.messages import Completion, RolloutGroup
from echo.wire.names import HDR_SAMPLER_ID, RunNames
from streams.client import BROKER_ERRORS, PATIENCE_S, connect, no_run
from streams.credentials import Credentials, credentials_of
from streams.rollouts import rollout_body
from streams.secure import SERVER_CONF, SecureDir
from streams.server import NatsServer, ServerConfig, listening


async def stored_groups(url: str, run_id: str, credentials: Credentials | None = None,
                        ) -> AsyncIterator[tuple[object, RolloutGroup | ProtocolError]]:
    """Each stored rollout message, oldest first, with its decoded group or why it is malformed.
    `credentials`: on a secured broker, an observer's (or the trainer's)."""
    names = RunNames(run_id)
    nc = await connect(url, "replay", credentials, give_up_s=PATIENCE_S)
    try:
        js = nc.jetstream()
        try:
            info = await js.stream_info(names.rollouts_stream)
        except (NotFoundError, *BROKER_ERRORS) as e:
            raise no_run(run_id, e) from None
        if info.state.messages == 0:
            return
        # The stream named: an observer may not look streams up by subject.
        sub = await js.subscribe(names.all_rollouts, stream=names.rollouts_stream, ordered_consumer=True,
                                 deliver_policy=DeliverPolicy.ALL)
        while True:
            msg = await sub.next_msg(timeout=10)
            try:
                data = await rollout_body(js, names, msg)
                yield msg, decode_rollout(data, msg.headers, msg.subject)
            except ProtocolError as e:
                yield msg, e
            if msg.metadata.num_pending == 0:
                break
        await sub.unsubscribe()
    finally:
        await nc.close()


async def read_rollouts(url: str, run_id: str, credentials: Credentials | None = None) -> AsyncIterator[dict]:
    """Each stored rollout message as {seq, subject, headers, group | error}, oldest first."""
    async for msg, group in stored_groups(url, run_id, credentials):
        record = {"seq": msg.metadata.sequence.stream, "subject": msg.subject, "headers": msg.headers}
        if isinstance(group, ProtocolError):
            record["error"] = str(group)
        else:
            record["group"] = group.model_dump()
        yield record


@dataclass(frozen=True)
class Keep:
    """Which records `echo-rl replay` prints: every condition given must hold."""

    seqs: tuple[int, int] | None = None  # stream sequences, both ends included
    since: float | None = None  # the group's created_at (Unix seconds), both ends included
    until: float | None = None
    version: int | None = None
    sampler: str | None = None
    task: str | None = None
    rewards: tuple[float, float] | None = None  # the group's mean claimed reward
    rejected_only: bool = False

    def __call__(self, record: dict) -> bool:
        group = record.get("group")
        if self.seqs and not self.seqs[0] <= record["seq"] <= self.seqs[1]:
            return False
        if self.rejected_only:
            return group is None
        if self.sampler and (record["headers"] or {}).get(HDR_SAMPLER_ID) != self.sampler:
            return False
        if (self.since, self.until, self.version, self.task, self.rewards) == (None,) * 5:
            return True
        if group is None:  # a malformed message has no trustworthy fields
            return False
        mean = sum(c["claimed_reward"] for c in group["completions"]) / len(group["completions"])
        return ((self.since is None or group["created_at"] >= self.since)
                and (self.until is None or group["created_at"] <= self.until)
                and (self.version is None or group["version"] == self.version)
                and (self.task is None or group["task"] == self.task)
                and (self.rewards is None or self.rewards[0] <= mean <= self.rewards[1]))


PROMPT_SHOWN = 300  # characters of a group's prompt a table line shows


def table_line(record: dict, decode: Callable[[list[int]], str] | None = None) -> str:
    """One line per record, then each completion's claimed reward (its sampler's) and text: decoded from its tokens with
    `decode` (the run's tokenizer; a multi-turn episode turn by turn, the model's words and the
    environment's), else the text its sampler claimed. Shown as repr: escaped, one line each."""
    group = record.get("group")
    if group is None:
        return f"{record['seq']:>7}  {record['subject']}  REJECTED  {record['error']}"
    rewards = [c["claimed_reward"] for c in group["completions"]]
    tokens = sum(len(c["token_ids"]) for c in group["completions"])
    line = (f"{record['seq']:>7}  {group['sampler_id']:<10} v{group['version']:<5} {group['task']:<10} "
            f"{group['group_id']}  {len(rewards)} completions  {tokens} tokens  "
            f"claimed reward {sum(rewards) / len(rewards):.3f}")
    lines = [line]
    if decode is not None and group.get("prompt_token_ids") is not None:  # its end: where the question is
        lines.append(f"    prompt: {decode(group['prompt_token_ids'])[-PROMPT_SHOWN:]!r}")
    for i, completion in enumerate(group["completions"]):
        if decode is None or not completion["observations"]:
            text = repr(decode(completion["token_ids"])) if decode else f"claimed {completion['text']!r}"
            claimed = completion["claimed_reward"]
            lines.append(f"    [{i}] claimed reward {claimed:.3f} {completion['finish_reason']}: {text}")
            continue
        turns = Completion.model_validate(completion)
        claimed = completion["claimed_reward"]
        lines.append(f"    episode {i}: claimed reward {claimed:.3f}, {len(turns.model_turns())} turns")
        ids, observations = completion["token_ids"], [*completion["observations"], None]
        for (start, end), observation in zip(turns.model_turns(), observations):
            lines.append(f"      model: {decode(ids[start:end])!r}")
            if observation is not None:
                at = observation["at"]
                lines.append(f"      environment: {decode(ids[at : at + observation['tokens']])!r}")
    return "\n".join(lines)


async def _dump(url: str, run_id: str, out, keep: Keep, table: bool, credentials: Credentials | None,
                decode: Callable[[list[int]], str] | None) -> tuple[int, int]:
    """(records written, records read)."""
    count = read = 0
    async for record in read_rollouts(url, run_id, credentials):
        read += 1
        if keep(record):
            out.write((table_line(record, decode) if table else orjson.dumps(record).decode()) + "\n")
            count += 1
    return count, read


@contextmanager
def run_broker(run: str | Path, nats_url: str | None,
               credentials: Credentials | None = None) -> Iterator[tuple[str, str, Credentials | None]]:
    """(broker URL, run id, credentials) of a run: the given server and run id; or, for a run
    directory, where its config says the run lives, with the config's credentials unless others
    are given. An `up` run whose embedded server has stopped (a finished run) is read from a
    server started on its own store; a secured one's store keeps the run in its accounts, so that
    server gets the run's own secured config, and the run's observer reads it."""
    if nats_url:
        yield nats_url, str(run), credentials
        return
    run_dir = Path(run)
    cfg = tomllib.loads((run_dir / "config.toml").read_text())
    run_id, nats = cfg["run"]["id"], cfg.get("nats", {})
    secure = SecureDir(run_dir / "secure")
    secured = (secure.dir / SERVER_CONF).exists()
    credentials = credentials or (secure.credentials("observer") if secured else
                                  credentials_of(nats.get("creds", ""), nats.get("tls_ca", "")))
    url = nats.get("url", "")
    address = urlparse(url.split(",")[0])  # its first server
    if (run_dir / "nats").is_dir() and not listening(address.hostname or "127.0.0.1", address.port or 4222):
        with NatsServer(run_dir / "nats", ServerConfig(include=secure.dir / SERVER_CONF if secured else None)) as server:
            yield server.url, run_id, credentials
        return
    yield url, run_id, credentials


def replay(run: str | Path, nats_url: str | None, out_path: str | None, keep: Keep = Keep(), table: bool = False,
           credentials: Credentials | None = None, decode: Callable[[list[int]], str] | None = None) -> int:
    out = open(out_path, "w") if out_path else sys.stdout
    try:
        with run_broker(run, nats_url, credentials) as (url, run_id, credentials):
            written, read = asyncio.run(_dump(url, run_id, out, keep, table, credentials, decode))
        if not written:  # a filter that matched nothing says so, not an empty output
            print(f"echo-rl replay: none of the stream's {read} records matched", file=sys.stderr)
            return 1
        return 0
    finally:
        if out_path:
            out.close()
