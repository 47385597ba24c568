"""Hostile input from one sampler's credentials or a relay's position, bounded before it is used: a
group on a prompt the trainer did not name or in a precision the run does not allow (rollouts),
random hostile heartbeats and groups at decode and in every reader (the page, the trackers), idle
connections to the page, a flood of refused publishes in the hub's log (state), a prompt object
claiming gigabytes (weights). Each test failed on the code before the defence it checks
(docs/security.md, by asset)."""

from __future__ import annotations

import asyncio
import dataclasses
import io
import math
import random
import socket
import time
import tracemalloc
from collections import Counter
from urllib.request import Request, urlopen

import nats
import orjson
import pytest
from rich.console import Console

from echo.config import TaskConfig
from echo.fleet.grants import GrantLedger, slot_prompt
from echo.tasks import load_task
from echo.train.metrics import sampler_scalars, step_scalars
from echo.trust.scorer import completion_keys, content_hash, repeats
from echo.wire.codec import ProtocolError, decode, decode_rollout, encode_rollout
from echo.wire.messages import SamplerStatus
from echo.wire.names import (
    HDR_MSG_ID,
    HDR_SAMPLER_ID,
    HDR_SCHEMA,
    HDR_TASK,
    HDR_VERSION,
    SCHEMA_VERSION,
    RunNames,
    prompts_object_name,
)
from streams.inbox import RolloutInbox
from streams.objects import TransferError, _b64, object_info
from streams.prompts import PromptShards, publish_prompts
from streams.rollouts import publish_rollout
from streams.secure import SecureDir
from streams.server import LOG_FILES_KEPT, NatsServer, ServerConfig
from tests.conftest import eventually_async, tiny_config
from tests.groups import SCORER, honest_group, pack_rollout, unpack_rollout
from workers.operator.page import Latest, PageServer
from workers.operator.snapshot import fleet_summary, sampler_row
from workers.operator.status import render
from workers.trainer.intake import Collector
from workers.trainer.judge import Judge, Timeline
from workers.trainer.strikes import Quarantined
from workers.trainer.trackers import Trackers


async def test_the_trainer_names_every_prompt_and_what_is_trained_is_its_draw(runs):
    """s9 sent every group on prompt 7: 217 of 222 groups trained, a quarter of all trained in
    that window. A group claiming bfloat16 in an fp32 run widened the proof's band to 0.5 nats
    (84 of 84 shaded groups trained). Now each grant names its slots' prompts; a group on another
    prompt, on a slot not its sender's, or in a precision the run does not allow is refused, and
    a slot's prompt that does not get trained (the attacker letting the ones it dislikes go
    stale) is owed: granted again. What is trained is exactly the trainer's draw."""
    run = await runs.open("steer", "trainer")
    ledger = GrantLedger(seed=3)
    quarantine = Quarantined(run, after=1_000)  # counts strikes; never quarantines here
    collector = Collector(await RolloutInbox.open(run), Judge(SCORER, Timeline(max_staleness=1)), ledger,
                          quarantine=quarantine)
    drawn, trained, expected_rejections = Counter(), Counter(), Counter()

    async def deliver(sampler_id: str, attacking: bool) -> int:
        """Ask for two slots, send a group for each; how many of them will be trained."""
        slots, _ = ledger.grant(sampler_id, 2, 2, 1 << 20, time.monotonic())
        usable = 0
        for slot in slots:
            prompt = ledger.prompts[slot]
            drawn[prompt] += prompt == slot_prompt(3, slot)  # a fresh draw (else a lost slot's, owed)
            noise = ledger.noise_slot(slot)  # an owed prompt's: the slot it was first granted on
            group = honest_group(prompt, group_id=f"{sampler_id}-{slot}", sampler_id=sampler_id, slot=slot,
                                 version=5, noise_slot=None if noise == slot else noise)
            if attacking and prompt % 3:  # a prompt it dislikes: three ways of not doing it
                choice = slot % 3
                if choice == 0:
                    group = honest_group(7, group_id=f"{sampler_id}-{slot}", sampler_id=sampler_id, slot=slot,
                                         version=5, noise_slot=group.noise_slot)
                    expected_rejections["wrong_prompt"] += 1
                elif choice == 1:
                    group = group.replaced(dtype="bfloat16", completions=[
                        c.replaced(logprobs=(c.logprobs - 0.4).tolist()) for c in group.completions])
                    expected_rejections["dtype_not_allowed"] += 1
                else:
                    group = group.replaced(version=1)  # stale: dropped, no strike
            else:
                usable += 1
            await publish_rollout(run, group)
        return usable

    for round_ in range(12):
        usable = await deliver("s1", attacking=False) + await deliver("s9", attacking=round_ < 8)
        if round_ < 8:  # and groups on slots it does not hold: prompt 7 on a slot of its choice, s1's slot
            for slot in (10**6 + round_, max(s for s, holder in ledger.outstanding.items() if holder == "s1")):
                await publish_rollout(run, honest_group(7, group_id=f"forged-{slot}", sampler_id="s9", slot=slot,
                                                        version=5))
                expected_rejections["slot_not_held"] += 1
        async with asyncio.timeout(30):
            step = await collector.collect(usable, version=5)
        collector.trained(step)
        trained.update(a.group.prompt_index for a in step.used)
    assert not ledger.owed and not ledger.outstanding  # every lost prompt granted again and trained
    assert trained == drawn and trained[7] == drawn[7] <= 1  # the trainer's draw, whatever s9 did
    assert quarantine.strikes == {
        "s9": expected_rejections["wrong_prompt"] + expected_rejections["dtype_not_allowed"]}


def _hostile_value(rng: random.Random):
    return rng.choice([
        2**64 - 1, 2**70, -(2**63), 2**53, -2, 10**400 if rng.random() < 0.1 else 0, 1e308, -1e308, 5e-324, 0.0, True, None,
        "x", "", "\x1b[2J\x1b[H", "\x1b]52;c;ZXZpbA==\x07", "\x1b]8;;https://evil.example\x07click\x1b]8;;\x07",
        "\x9b31m", "é" * 300, "a" * 10_000, [1, 2], {"x": 1.0}, {"1": 1e308}, {str(v): 1.0 for v in range(40)},
        {"\x1b[2J": 3}, {"digest_mismatch": 2**63}, "hf", "cuda:0", 1.5, 7,
        # the edges of what decode allows
        2**53 - 1, -1, 1e9, 1e12, "a" * 256, {str(10**14): 1e9}, {"digest_mismatch": 2**53 - 1}, 86_400,
    ])


FIELDS = ["version", "groups_published", "weight_failures", "updated_at", "state", "ttl_s", "engine", "device",
          "model", "relay", "cost_per_hour", "groups_per_s", "tokens_per_s", "call_s", "sync_s", "process"]


def test_thousands_of_hostile_heartbeats_stop_no_reader(tmp_path, monkeypatch):
    """`sync_s` keyed "x" stopped a trainer that logs to a tracker (max(..., key=int)); 1e308
    overflowed `status`'s mean, a version of 2**64 - 1 the page's JSON; ESC sequences reached the
    operator's terminal. Random heartbeats, each field honest or hostile, go through decode into
    the trackers' scalars (and every tracker), `status`'s rows and view, and the live page: those
    decode lets through are bounded, and nothing raises or prints a control character."""
    rng = random.Random(61)
    honest = {"schema_version": SCHEMA_VERSION, "sampler_id": "s9", "version": 3, "groups_published": 5,
              "weight_failures": {}, "updated_at": time.time(), "sync_s": {"2": 0.5, "3": 0.4}}
    passed, refused = [], Counter()
    for i in range(3000):
        raw = dict(honest, sampler_id=f"s{i}")
        for name in rng.sample(FIELDS, rng.randint(1, 2)):
            raw[name] = _hostile_value(rng)
        try:
            data = orjson.dumps(raw)
        except TypeError:  # 10**400: not JSON at all
            continue
        try:
            passed.append(decode(SamplerStatus, data))
        except ProtocolError as e:
            refused[e.reason] += 1
    assert len(passed) > 100 and sum(refused.values()) > 1000, (len(passed), refused)
    # What slipped past decode (a status built in code, not read) still costs only that sampler its scalars.
    slipped = SamplerStatus.model_construct(sampler_id="sx", version=0, groups_published=0, weight_failures={},
                                            updated_at=0.0, sync_s={"x": 1.0}, groups_per_s=0.0, tokens_per_s=0.0)
    scalars, left_out = sampler_scalars([*passed, slipped], version=2**53 - 1)
    assert left_out == ["sx"] and len(scalars) >= 2 * len(passed)
    monkeypatch.setenv("WANDB_MODE", "offline")
    cfg = tiny_config(tmp_path, run={"trackers": ["tensorboard", "wandb", "mlflow"]})
    cfg.run_dir.mkdir(parents=True)
    trackers = Trackers(cfg)
    try:
        for step in range(1, 4):
            trackers.log(step, step_scalars({"version": step, "reward_mean": 0.5}) | scalars)
        assert [t.name for t in trackers.live] == ["tensorboard", "wandb", "mlflow"]  # none failed on them
    finally:
        trackers.close()
    now = time.time()
    rows = [sampler_row(s, 2**53 - 1, {}, None, now) for s in passed]
    snap = {"run_id": "r", "at": now, "trainer": None, "samplers": rows, "stream": None,
            "storage": {"bytes": 0, "limit": None}, "relays": {}, "fleet": fleet_summary(rows)}
    out = io.StringIO()
    Console(file=out, width=200).print(render(snap, every=True), render(snap))  # each a line; summed up
    assert not any(ord(c) < 32 and c != "\n" or 0x7f <= ord(c) <= 0x9f for c in out.getvalue())
    orjson.loads(orjson.dumps(snap))  # the page's event and `status --json`


async def test_the_page_serves_past_a_thousand_idle_connections_and_only_at_its_address():
    """1,020 idle half-requests (one thread each, no timeout) made `GET /` time out; any Host
    was answered, so a site that rebinds its DNS name to 127.0.0.1 could read the snapshot. The
    page now serves from the event loop with a cap on connections and a read timeout, and
    answers only requests addressed to it."""
    latest = Latest()
    await latest.update({"trainer": None, "samplers": []})
    server = PageServer(latest, read_timeout_s=2.0)
    port = await server.start("127.0.0.1", 0)
    idle = []
    try:
        for _ in range(1_020):
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(b"GET / HTTP/1.1\r\nHost: 127.0.0.1")  # never finished
            idle.append(writer)
        await asyncio.sleep(0.2)

        def get(host: str) -> tuple[int, bytes]:
            request = Request(f"http://127.0.0.1:{port}/", headers={"Host": host})
            try:
                with urlopen(request, timeout=20) as page:
                    return page.status, page.read()
            except Exception as e:  # noqa: BLE001 - urllib's HTTPError carries the code
                return getattr(e, "code", 0), b""

        status, body = await asyncio.to_thread(get, f"127.0.0.1:{port}")
        assert status == 200 and b"echo-rl status" in body
        assert (await asyncio.to_thread(get, f"localhost:{port}"))[0] == 200
        assert (await asyncio.to_thread(get, f"evil.example:{port}"))[0] == 421  # DNS rebinding
        # The idle ones are closed after the read timeout.
        await eventually_async(lambda: not server.open, 30, every=0.1)
    finally:
        for writer in idle:
            writer.close()
        await server.close()


def test_nothing_on_a_loopback_page_answers_another_port():
    """The Host check compares the port too (another local service's page may share the name)."""
    from workers.operator.page import allowed_hosts

    assert allowed_hosts("127.0.0.1", 8080) == {"127.0.0.1:8080", "localhost:8080", "[::1]:8080"}
    assert allowed_hosts("0.0.0.0", 8080) is None  # any interface: IP literals and this machine's names
    assert socket.gethostname()


async def test_a_flood_of_refused_publishes_leaves_the_hubs_log_within_its_limit(tmp_path):
    """Each refused publish is a ~240-byte line of the hub's log: 581 MB in 40 s of flood, with
    no limit, on the disk that holds the run's store. The server now rotates its log at
    `log_file_limit` and keeps LOG_FILES_KEPT files (the limit is small here; 16 MB in a run)."""
    secure = SecureDir(tmp_path / "secure")
    secure.init("sec", ["localhost", "127.0.0.1"], ["s1"])
    limit = 256 << 10
    log_file = tmp_path / "logs" / "hub.log"
    log_file.parent.mkdir()
    with NatsServer(tmp_path / "js", ServerConfig(include=secure.dir / "server.conf", log_file=log_file, log_file_limit=limit)) as hub:
        async def quiet(error):  # one error a refused publish
            pass

        attacker = await nats.connect(hub.url, error_cb=quiet, **secure.credentials("sampler-s1").connect_options())
        try:
            for i in range(30_000):  # about 7 MB of violations: 28 times the limit
                await attacker.publish(f"echo.sec.state.x{i % 100}", b"")
                if i % 1000 == 999:
                    await attacker.flush()
        finally:
            await attacker.close()
        await eventually_async(lambda: len(list(log_file.parent.iterdir())) >= LOG_FILES_KEPT, 30, every=0.1,
                               why=lambda _: [f.stat().st_size for f in log_file.parent.iterdir()])  # rotated, pruned
        await asyncio.sleep(1.0)  # the rest of the flood written
        files = list(log_file.parent.iterdir())
        assert "Publish Violation" in "".join(f.read_text() for f in files)
        assert len(files) == LOG_FILES_KEPT and all(f.stat().st_size <= limit + 4096 for f in files), [
            (f.name, f.stat().st_size) for f in files]  # 7 MB written, at most 4 x 256 KB kept


async def _claim_size(run, name: str, size: int) -> None:
    """What a relay serving the weights bucket could say of an object: its info, claiming `size`."""
    info = await object_info(run.js, run.names.weights_bucket, name)
    forged = dataclasses.replace(info, size=size, chunks=size // (128 << 10))
    await run.js.publish(f"$O.{run.names.weights_bucket}.M.{_b64(name.encode())}", orjson.dumps(forged.as_dict()),
                         headers={"Nats-Rollup": "sub"})


async def test_a_prompt_object_claiming_gigabytes_allocates_nothing(tmp_path, monkeypatch, runs):
    """A relay serving prompts can state any object size: the sampler allocated 4 GiB (RSS 56 ->
    4,152 MB), again at each retry, before `size_mismatch`. A shard is now expected at the size
    its manifest gives (the manifest is the digest the run's config names), the manifest itself
    at most PROMPTS_MANIFEST_MAX_BYTES: refused before a byte is allocated."""
    monkeypatch.setenv("ECHO_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr("streams.prompts.FETCH_WAIT_S", 0.5)
    rows = [{"prompt": [{"role": "user", "content": f"What is {i} + {i}?"}], "answer": str(2 * i)} for i in range(50)]
    (tmp_path / "rows.jsonl").write_bytes(b"\n".join(orjson.dumps(r) for r in rows))
    task = load_task(TaskConfig(name="dataset", params={"path": str(tmp_path / "rows.jsonl")}))
    run = await runs.open("relayed")
    digest = await publish_prompts(run, *task.published_prompts())
    manifest = orjson.loads(task.published_prompts()[0])
    for name, kind in ((prompts_object_name(manifest["shards"][0]), "size_mismatch"),
                       (prompts_object_name(digest), "too_large")):
        await _claim_size(run, name, 4 << 30)
        tracemalloc.start()
        try:
            with pytest.raises(TransferError, match=kind):
                await PromptShards(run, digest).prompt(3)
            assert tracemalloc.get_traced_memory()[1] < 64 << 20  # peak: nothing near the 4 GiB claimed
        finally:
            tracemalloc.stop()


GROUP_FIELDS = ["version", "term", "task", "prompt_index", "slot", "temperature", "gen_seconds", "created_at",
                "engine", "dtype"]


def test_thousands_of_hostile_groups_are_refused_at_decode_or_judged_without_raising():
    """A group's numbers reach the trainer's arithmetic: a prompt index of 2**70 passed decode,
    then `completion_keys` (8 bytes of it) raised OverflowError in the collector, which nothing
    caught. Random groups, each field honest or hostile: those decode lets through are judged
    (malformed, hashed, keyed, their seconds summed) without an exception."""
    rng = random.Random(62)
    honest = unpack_rollout(encode_rollout(honest_group(version=5)))
    subject = RunNames("r").rollouts_subject("s1")
    judged, refused = 0, Counter()
    for i in range(3000):
        raw = dict(honest, group_id=f"g{i}")
        for name in rng.sample(GROUP_FIELDS, rng.randint(1, 2)):
            raw[name] = _hostile_value(rng)
        try:
            data = pack_rollout(raw)
        except (TypeError, ValueError, OverflowError):  # not JSON, or no rollout message at all
            continue
        headers = {HDR_SCHEMA: str(SCHEMA_VERSION), HDR_VERSION: str(raw["version"]), HDR_SAMPLER_ID: "s1",
                   HDR_TASK: str(raw["task"]), HDR_MSG_ID: raw["group_id"]}  # what its body says, as a sampler sends
        try:
            group = decode_rollout(data, headers, subject)
        except ProtocolError as e:
            refused[e.reason] += 1
            continue
        SCORER.malformed(group)
        completion_keys(group), content_hash(group), repeats(group, set())
        assert math.isfinite(group.gen_seconds + group.created_at)
        judged += 1
    assert judged > 100 and refused["bad_schema"] > 500, (judged, refused)
