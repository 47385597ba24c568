"""The trainer's rollout inbox and intake against a real nats-server (streams/inbox.py,
workers/trainer/intake.py): what it uses and rejects, large groups in parts, acks after a crash,
the history it keeps, and fetches that lose their connection or outgrow a batch."""

import asyncio
import hashlib
import itertools
import json
import time

import nats.js.errors
import pytest

import streams.inbox as inbox_module
from echo.config import SamplingConfig
from echo.fleet.consumed import ConsumedSeqs
from echo.fleet.grants import GrantLedger
from echo.trust.scorer import Scorer, content_hash
from echo.wire.codec import encode_rollout, rollout_headers
from echo.wire.names import (
    HDR_BODY_PARTS,
    HDR_BODY_SHA256,
    HDR_BODY_SIZE,
    HDR_MSG_ID,
    HDR_SAMPLER_ID,
    HDR_VERSION,
    Storage,
)
from streams.client import open_run
from streams.inbox import FETCH_MAX, RolloutInbox
from streams.replay import read_rollouts
from streams.rollouts import (
    late_rollouts,
    publish_rollout,
    reader_name,
    reader_subscription,
    readers,
    rollout_body,
)
from streams.server import NatsServer, ServerConfig
from tests.conftest import eventually_async, tiny_config
from tests.groups import SCORER, TASK, TOKENIZER, granted, honest_group, with_completion
from workers.trainer.intake import Collector
from workers.trainer.judge import AlreadyTrained, Judge, Timeline


async def test_collector_uses_fresh_groups_and_rejects_the_rest_with_reasons(runs):
    run = await runs.open("c")
    inbox, ledger = await RolloutInbox.open(run), GrantLedger()
    subject = run.names.rollouts_subject("s1")
    await run.js.publish(subject, b"{broken", headers={HDR_MSG_ID: "bad1", HDR_SAMPLER_ID: "s1"})
    await publish_rollout(run, granted(ledger, honest_group(version=1, group_id="stale")))  # 5 - 1 > bound
    await publish_rollout(run, granted(ledger, honest_group(version=9, group_id="future")))
    await publish_rollout(run, granted(ledger, honest_group(version=5, group_id="wrongsize", texts=["a", "b", "c"])))
    spoofed = honest_group(version=5, group_id="spoofed")
    await run.js.publish(subject, encode_rollout(spoofed), headers={**rollout_headers(spoofed), HDR_VERSION: "4"})
    liar = granted(ledger, with_completion(honest_group(version=4, group_id="liar"), claimed_reward=0.0))
    await publish_rollout(run, liar)
    # Attacks by a sampler with publish rights: s1's group on s2's subject; the liar's completions
    # re-sent under a new id; a group trained on in an earlier step re-sent under a new id.
    impostor = honest_group(15, version=5, group_id="imp")
    await run.js.publish(run.names.rollouts_subject("s2"), encode_rollout(impostor), headers=rollout_headers(impostor))
    await publish_rollout(run, granted(ledger, honest_group(version=5, group_id="replay")))
    await publish_rollout(run, granted(ledger, honest_group(13, version=5, group_id="old")))
    ok = granted(ledger, honest_group(14, version=5, group_id="ok"))
    await publish_rollout(run, ok)
    await publish_rollout(run, ok)  # a retry: de-duplicated

    trained_earlier = content_hash(honest_group(13))
    collector = Collector(inbox, Judge(SCORER, Timeline(max_staleness=1), AlreadyTrained(content={trained_earlier})), ledger)
    collected = await collector.collect(2, version=5)
    assert [a.group.group_id for a in collected.used] == ["liar", "ok"]
    assert collected.used[0].rewards == [1.0, 0.1]  # the trainer's rewards, not the liar's
    assert collected.reward_mismatch == {"s1": 1}
    assert collected.dropped == {4: 1} and collected.dropped_ids == ["stale"]
    assert collected.rejected == {"bad_encoding": 1, "future_version": 1, "wrong_group_size": 1, "header_mismatch": 1,
                                  "subject_mismatch": 1, "replayed_content": 2}
    infos = await readers(run)
    assert [sum(i.num_pending for i in infos), sum(i.num_ack_pending for i in infos)] == [0, 10]  # all wait for the checkpoint
    # What waits holds a body only if its group is trained: junk costs the step no memory.
    assert sorted(len(d.msg.data) > 0 for d in inbox.held) == [False] * 8 + [True] * 2
    assert await inbox.ack_held() == 0  # every ack confirmed
    assert sum(i.num_ack_pending for i in await readers(run)) == 0  # confirmed
    # Nothing is lost: rejected messages stay in the stream for replay.
    records = [r async for r in read_rollouts(runs.url, "c")]
    assert len(records) == 10 and sum("error" in r for r in records) == 3
    assert len(collected.seqs) == 10 == len(collected.used) + len(collected.dropped_ids) + sum(
        collected.rejected.values())


async def test_dynamic_sampling_sets_aside_groups_with_no_signal_up_to_its_bound_and_hands_their_slots_out_again(runs):
    """algorithm.dynamic_sampling: a group whose rewards are all equal is not trained, its slot is
    handed out again (the ledger counts it lost) and its prompt is not owed; past the step's bound
    (here 1) such groups are trained. Every message is counted once."""
    run = await runs.open("d")
    inbox, ledger = await RolloutInbox.open(run), GrantLedger()
    flat = [honest_group(20 + i, version=5, group_id=f"flat{i}", texts=["a", "b"]) for i in range(2)]  # rewards 0, 0
    signal = honest_group(14, version=5, group_id="signal")  # right and wrong: 1.0 and 0.1
    flat[0], signal, flat[1] = (granted(ledger, group) for group in (flat[0], signal, flat[1]))  # slots in this order
    for group in (flat[0], signal, flat[1]):
        await publish_rollout(run, group)
    collector = Collector(inbox, Judge(SCORER, Timeline(max_staleness=1), AlreadyTrained()), ledger, set_aside=1)
    async with asyncio.timeout(30):
        collected = await collector.collect(2, version=5)
    assert [a.group.group_id for a in collected.used] == ["signal", "flat1"]  # the bound reached: trained
    assert collected.filtered == 1 and collected.filtered_tokens == sum(len(c.token_ids) for c in flat[0].completions)
    assert ledger.take_lost() == [flat[0].slot] and not ledger.owed
    assert len(collected.seqs) == 3 == len(collected.used) + collected.filtered


@pytest.fixture
def small_messages_server(tmp_path):
    """A nats-server whose messages are at most 64 KB."""
    with NatsServer(tmp_path / "js", ServerConfig(max_payload="64KB")) as server:
        yield server


async def test_a_group_larger_than_a_message_travels_in_parts_and_bad_parts_are_refused(small_messages_server, runs):
    """A reasoning-length group does not fit in one message: the sampler publishes its body in
    parts on its own bodies subject, the trainer reads them back and checks subject, size and digest."""
    run = await runs.open("big", url=small_messages_server.url)
    inbox = await RolloutInbox.open(run)
    answer = TASK.prompt(12).answer
    ledger = GrantLedger()
    big = granted(ledger, honest_group(texts=["x" * 30_000 + f"\\boxed{{{answer}}}", "y" * 30_000 + "\\boxed{999}"],
                                       version=5, group_id="big"))
    assert len(encode_rollout(big)) > 4 * run.nc.max_payload
    # Pointers that do not add up: a part that does not match the digest; a part missing; a
    # thousand parts; and s2 naming a part that s1 published (the trainer reads the parts on the
    # subject's sampler's bodies subject only).
    forged = honest_group(version=5, group_id="forged")
    junk = await run.js.publish(run.names.bodies_subject("s1"), b"junk", headers={HDR_MSG_ID: "forged-0"})
    pointer = {**rollout_headers(forged), HDR_BODY_PARTS: str(junk.seq), HDR_BODY_SIZE: "4", HDR_BODY_SHA256: "0" * 64}
    await run.js.publish(run.names.rollouts_subject("s1"), b"", headers=pointer)
    await run.js.publish(run.names.rollouts_subject("s1"), b"", headers={
        **pointer, HDR_MSG_ID: "forged2", HDR_BODY_PARTS: "999999"})
    await run.js.publish(run.names.rollouts_subject("s1"), b"", headers={  # refused before reading a thousand parts
        **pointer, HDR_MSG_ID: "forged3", HDR_BODY_PARTS: ",".join(["1"] * 1000)})
    stolen = encode_rollout(honest_group(version=5, group_id="stolen", sampler_id="s2"))
    part = await run.js.publish(run.names.bodies_subject("s1"), stolen, headers={HDR_MSG_ID: "stolen-0"})
    await run.js.publish(run.names.rollouts_subject("s2"), b"", headers={
        **rollout_headers(honest_group(version=5, group_id="stolen", sampler_id="s2")),
        HDR_BODY_PARTS: str(part.seq), HDR_BODY_SIZE: str(len(stolen)),
        HDR_BODY_SHA256: hashlib.sha256(stolen).hexdigest()})
    await publish_rollout(run, big)
    scorer = Scorer(TASK, TOKENIZER, len(TOKENIZER), SamplingConfig(group_size=2, max_new_tokens=40_000, temperature=1.0))
    collector = Collector(inbox, Judge(scorer, Timeline(max_staleness=1)), ledger)
    collected = await collector.collect(1, version=5)
    assert [a.group for a in collected.used] == [big] and collected.used[0].rewards == [1.0, 0.1]
    assert collected.rejected == {"bad_body": 4}
    records = [r async for r in read_rollouts(small_messages_server.url, "big")]
    assert [r["group"]["group_id"] for r in records if "group" in r] == ["big"]
    assert sum("bad_body" in r.get("error", "") for r in records) == 4


async def test_a_step_that_crashed_between_its_checkpoint_and_its_acks_is_not_counted_twice(runs):
    """The checkpoint names the stream sequences its step consumed; when they come back (the
    trainer died before acking them), the next trainer skips them, and counts the rest."""
    run, ledger = await runs.open("redeliver", "test"), GrantLedger()
    for i in range(3):
        await publish_rollout(run, granted(ledger, honest_group(20 + i, version=5, group_id=f"g{i}")))
    first = Collector(await RolloutInbox.open(run, ack_wait_s=600.0), Judge(SCORER, Timeline(max_staleness=1)), ledger)
    step = await first.collect(2, version=5)  # checkpointed, then the crash: never acked
    assert [a.group.group_id for a in step.used] == ["g0", "g1"]
    await publish_rollout(run, granted(ledger, honest_group(23, version=5, group_id="g3")))
    # Opening the inbox offers g0 and g1 again at once (not after ack_wait), before newer messages.
    restarted = Collector(await RolloutInbox.open(run, ack_wait_s=600.0), Judge(SCORER, Timeline(max_staleness=1)),
                          ledger, consumed=ConsumedSeqs(above=step.seqs))
    again = await restarted.collect(2, version=5)
    assert [a.group.group_id for a in again.used] == ["g2", "g3"] and again.already_counted == 2
    assert set(again.seqs).isdisjoint(step.seqs)


async def test_the_trainer_keeps_the_rollout_history_its_config_allows_and_can_change_it(runs, tmp_path):
    cfg = tiny_config(tmp_path, nats={"rollouts_max_gb": 0.5, "rollouts_max_age_h": 2,
                                                 "sampler_quota_gb": 0.25})

    run = await runs.open("limits", "trainer", storage=cfg.nats.storage())
    limits = (await run.js.stream_info(run.names.rollouts_stream)).config
    assert (limits.max_bytes, limits.max_age) == (2**29, 7200)
    await run.close()
    run = await runs.open("limits", "trainer")  # restarted with the defaults: no limit
    limits = (await run.js.stream_info(run.names.rollouts_stream)).config
    assert limits.max_bytes == -1 and not limits.max_age


async def test_a_restarted_trainer_given_another_ack_wait_has_it(runs):
    """Held messages come back after ack_wait: a trainer restarted with a longer one must get
    it, not the consumer's first (its keep-alive runs at a third of the new one)."""

    run = await runs.open("ackwait", "trainer")
    subject = run.names.rollouts_subject("s1")
    await reader_subscription(run, subject, ack_wait_s=60.0)
    await reader_subscription(run, subject, ack_wait_s=600.0)
    info = await run.js.consumer_info(run.names.rollouts_stream, reader_name(run.names, subject))
    assert info.config.ack_wait == 600.0


async def test_a_backlog_of_long_groups_is_fetched_without_dropping_the_trainers_connection(runs):
    """40 groups of 16 x 16,384 tokens (2.9 MB each) waiting, fetched 64 at a time (a step's
    groups): 40 x 2.9 MB pending to one client is over the server's max_pending (64 MB), the
    server closed the trainer's connection and the lost batch came back only after ack_wait
    (600 s). The rollouts stream now holds no message over ROLLOUT_MESSAGE_MAX (a long group's
    body goes in parts, read one by one), and a fetch asks for no more than the server holds for
    one client."""
    run = await runs.open("backlog")
    inbox = await RolloutInbox.open(run, ack_wait_s=600.0)
    body = bytes(2_900_000)
    with pytest.raises(nats.js.errors.BadRequestError, match="message size exceeds maximum"):
        await run.js.publish(run.names.rollouts_subject("s1"), body, headers={HDR_MSG_ID: "inline"}, timeout=30)
    for i in range(40):
        part = await run.js.publish(run.names.bodies_subject("s1"), body, headers={HDR_MSG_ID: f"g{i}-0"}, timeout=30)
        await run.js.publish(run.names.rollouts_subject("s1"), b"", headers={
            HDR_MSG_ID: f"g{i}", HDR_BODY_PARTS: str(part.seq), HDR_BODY_SIZE: str(len(body)),
            HDR_BODY_SHA256: hashlib.sha256(body).hexdigest()})
    got: set[int] = set()
    async with asyncio.timeout(60):  # a tenth of ack_wait: the lost batch of a dropped connection never comes
        while len(got) < 40:
            for delivery in await inbox.fetch(64, timeout=5.0):
                assert await rollout_body(run.js, run.names, delivery.msg) == body
                got.add(delivery.seq)
    assert run.nc.stats["reconnects"] == 0


@pytest.mark.parametrize("groups_per_step", [4, 64])
async def test_a_fetch_lost_with_the_connection_comes_back_at_once_and_old_deliveries_are_not_acked(
        nats_server, runs, groups_per_step):
    """A dropped connection (here a broker restart) loses what was in flight with it: the lost
    batch came back only after ack_wait (600 s), and the acks of deliveries made before a restart
    went unanswered, three attempts of a second each, one message after another (17.6 s of
    recovery at 4 groups a step, 101.9 s at 32). The inbox resets its consumer on each new
    connection: every unacked message is offered again at once, and deliveries from before are
    not acked, whatever the step's size."""
    run = await runs.open("dropped")
    inbox = await RolloutInbox.open(run, ack_wait_s=600.0)
    for i in range(2 * groups_per_step):
        await run.js.publish(run.names.rollouts_subject("s1"), b"x", headers={HDR_MSG_ID: f"g{i}"})
    while len(inbox.held) < groups_per_step:  # a step's groups, held when the broker goes
        await inbox.fetch(groups_per_step - len(inbox.held), timeout=5.0)
    nats_server.stop()
    nats_server.start()
    again: set[int] = set()
    async with asyncio.timeout(60):  # a tenth of ack_wait
        while len(again) < 2 * groups_per_step:
            again.update(d.seq for d in await inbox.fetch(2 * groups_per_step, timeout=1.0) if d.connection > 0)
    assert again == set(range(1, 2 * groups_per_step + 1))
    attempts = []
    for delivery in inbox.held:
        delivery.msg.ack_sync = lambda timeout, d=delivery, ack=delivery.msg.ack_sync: attempts.append(d) or ack(timeout)
    # The deliveries before the reset (the step's, and those fetched with them that the inbox
    # handed out before it heard of the new connection): left to the reset, not tried.
    before = sum(d.connection == 0 for d in inbox.held)
    assert before >= groups_per_step and await inbox.ack_held() == before
    assert all(d.connection > 0 for d in attempts) and len(attempts) == 2 * groups_per_step
    assert (await inbox.counts()).pending == 0


async def test_a_fetch_returns_no_more_than_its_batch_whatever_the_subscription_queued(runs):
    """nats-py's fetch returns every message its subscription has queued, those of a pull request
    it gave up on included: a step was handed 6 groups for its 4 (seen in CI). The inbox hands
    out at most a fetch's batch and keeps the rest for the next fetch."""
    run = await runs.open("queued")
    for i in range(6):
        await run.js.publish(run.names.rollouts_subject("s1"), b"x", headers={HDR_MSG_ID: f"g{i}"})
    inbox = await RolloutInbox.open(run, ack_wait_s=600.0)
    subscription = inbox.readers[run.names.rollouts_subject("s1")].subscription
    # A pull request for 6 whose client stopped waiting: they queue up in its subscription.
    await run.nc.publish(subscription._nms, json.dumps({"batch": 6, "no_wait": True}).encode(), subscription._deliver)
    await eventually_async(lambda: subscription.pending_msgs >= 6, 10, every=0.01)
    assert [d.seq for d in await inbox.fetch(4, timeout=1.0)] == [1, 2, 3, 4]
    assert [d.seq for d in await inbox.fetch(4, timeout=1.0)] == [5, 6]
    assert await inbox.ack_held() == 0 and (await inbox.counts()).pending == 0


async def test_samplers_are_read_in_turn_so_no_backlog_stands_in_front_of_another(runs):
    """A backlog of junk: one consumer read every sampler's subject in stream order, so a sampler that
    kept its quota full (of junk, or of groups too stale to train, which earn no strike) stood in
    front of every honest group published after it. Each sampler is now read through its own
    consumer, in turn: the honest samplers' groups come within the first round, whatever the
    backlog before them."""
    run = await runs.open("turns")
    flood = 3000
    await asyncio.gather(*(run.js.publish(run.names.rollouts_subject("flooder"), bytes(64), headers={HDR_MSG_ID: f"j{i}"})
                           for i in range(flood)))
    for sampler in ("s1", "s2"):
        await publish_rollout(run, honest_group(20, version=5, group_id=f"from-{sampler}", sampler_id=sampler))
    inbox = await RolloutInbox.open(run, ack_wait_s=600.0)
    first = await inbox.fetch(3, timeout=5.0)
    assert sorted(d.sampler_id for d in first) == ["flooder", "s1", "s2"]
    # Taken in turn while they last: the flooder then has the inbox to itself, a full fetch at a time.
    rest = []
    async with asyncio.timeout(60):
        while len(rest) < flood - 1:
            rest += await inbox.fetch(FETCH_MAX, timeout=5.0)
    assert {d.sampler_id for d in rest} == {"flooder"} and len(inbox.held) == flood + 2
    assert await inbox.ack_held() == 0
    counts = await inbox.counts()
    assert (counts.published, counts.pending, counts.ack_floor) == (flood + 2, 0, flood + 2)


async def _an_inbox_that_fetched_a_group_of_each(run, samplers: int) -> tuple[RolloutInbox, list]:
    """An inbox opened on a group from each of `samplers`, and those groups fetched."""
    for i in range(samplers):
        await run.js.publish(run.names.rollouts_subject(f"s{i}"), b"x", headers={HDR_MSG_ID: f"g{i}"})
    inbox = await RolloutInbox.open(run, ack_wait_s=600.0)
    got = []
    async with asyncio.timeout(120):
        while len(got) < samplers:
            got += await inbox.fetch(FETCH_MAX, timeout=5.0)
    return inbox, got


async def test_an_idle_inbox_asks_the_broker_nothing_and_still_fetches_the_next_group(runs, monkeypatch):
    """An idle inbox at scale: waiting for groups, the inbox listed every sampler's reader (and the stream's
    subjects) ten times a second, a scan of 1,000 consumers' states each time at 1,000 samplers.
    The stream's watch now says when a sampler publishes: an idle inbox sends the broker nothing,
    and a group published after is fetched. Nor does it look again every 0.1 s meanwhile: an idle
    trainer's wake-ups are paid each second a step waits on a large fleet (bench.load, 2026-12-07)."""
    run = await runs.open("idle")
    inbox, got = await _an_inbox_that_fetched_a_group_of_each(run, 300)  # two pages of the server's listing
    sent, rounds, pull = run.nc.stats["out_msgs"], [], RolloutInbox._pull
    monkeypatch.setattr(RolloutInbox, "_pull", lambda self: rounds.append(1) or pull(self))
    assert await inbox.fetch(1, timeout=1.0) == []
    assert run.nc.stats["out_msgs"] - sent <= 1  # a ping, at most
    assert len(rounds) <= 2  # when the wait began and when it ended
    await run.js.publish(run.names.rollouts_subject("s7"), b"y", headers={HDR_MSG_ID: "late"})
    assert [d.sampler_id for d in await inbox.fetch(1, timeout=10.0)] == ["s7"]
    assert await inbox.ack_held() == 0 and (await inbox.counts()).pending == 0


async def test_while_samplers_publish_the_inbox_fetches_from_the_publishers_alone_and_never_lists_its_readers(
        runs, monkeypatch):
    """Readers at scale: the readers were listed at every round while the stream moved on, and with
    1,000 samplers it always does (a group every few hundred milliseconds): 4 pages of about
    700 bytes a reader, ten and more times a second, a fifth of the trainer's CPU (py-spy). A
    round now fetches from the readers the watch announced groups for: no listing, a fetch
    request a group or fewer, no look at the other readers (a round's scan of every reader's
    subscription for late messages was a tenth of the trainer's CPU at 1,000 samplers), and
    every group fetched once."""
    run = await runs.open("busy")
    samplers = 600  # three pages of the server's consumer listing
    inbox, got = await _an_inbox_that_fetched_a_group_of_each(run, samplers)
    listings, looked = [], []
    monkeypatch.setattr(inbox_module, "readers", lambda run: listings.append(time.monotonic()) or readers(run))
    monkeypatch.setattr(inbox_module, "late_rollouts", lambda sub: looked.append(sub) or late_rollouts(sub))
    sent, published = run.nc.stats["out_msgs"], 0

    async def publish_on():  # a group every 10 ms, from the samplers in turn
        nonlocal published
        for i in itertools.count():
            await run.js.publish(run.names.rollouts_subject(f"s{i % samplers}"), b"y", headers={HDR_MSG_ID: f"h{i}"})
            published += 1
            await asyncio.sleep(0.01)

    publishing = asyncio.ensure_future(publish_on())
    try:
        began = time.monotonic()
        while time.monotonic() - began < 2.0:
            got += await inbox.fetch(1, timeout=1.0)  # one at a time: a round each, before
    finally:
        publishing.cancel()
    # Each publish is one message out; each fetch of one reader a request, and its no-wait probe.
    assert listings == [] and looked == [] and run.nc.stats["out_msgs"] - sent <= 3 * published + 1
    published = (await run.js.stream_info(run.names.rollouts_stream)).state.messages
    async with asyncio.timeout(60):  # every group published is fetched, once
        while len(got) < published:
            got += await inbox.fetch(FETCH_MAX, timeout=1.0)
    assert sorted(d.seq for d in got) == list(range(1, published + 1))




async def test_groups_evicted_before_their_fetch_cost_one_wait_not_one_a_round(nats_server, monkeypatch):
    """The watch announces a group when it is stored; the stream's limits may remove it before
    the inbox fetches it (here its size: `nats.rollouts_max_gb`). A fetch on a reader whose
    every announced message is gone waits out PULL_TIMEOUT_S and finds nothing; one that finds
    fewer than were announced found the rest gone. Either marks them gone, so no later round
    waits for them."""
    monkeypatch.setattr(inbox_module, "PULL_TIMEOUT_S", 1.0)
    run = await open_run(nats_server.url, "evicted", "test", storage=Storage(rollouts_max_bytes=8 << 10))
    try:
        inbox = await RolloutInbox.open(run, ack_wait_s=600.0)
        for i, sampler in enumerate(["s1"] + 10 * ["s2"]):  # s1's group, then s2's, evicting it and their own
            await run.js.publish(run.names.rollouts_subject(sampler), bytes(2000), headers={HDR_MSG_ID: f"g{i}"})
        await eventually_async(lambda: sum(map(len, inbox.announced.values())) >= 11, 30)
        kept = (await run.js.stream_info(run.names.rollouts_stream)).state
        assert kept.first_seq > 2 and kept.last_seq == 11  # s1's group and s2's first ones gone
        got = await inbox.fetch(FETCH_MAX, timeout=5.0)
        assert [d.seq for d in got] == list(range(kept.first_seq, 12)) and inbox.announced == {}
        began = time.monotonic()
        assert await inbox.fetch(1, timeout=0.1) == [] and time.monotonic() - began < inbox_module.PULL_TIMEOUT_S
    finally:
        await run.close()
