"""Attacks by a client holding exactly one sampler's seed and certificate on a secured
hub, each against the real server and the real trainer code. Every test here failed on the code
before the defence it checks."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import io
import random
import time
import uuid
from types import SimpleNamespace

import nats
import pytest
from nats.js.api import ConsumerConfig
from nats.js.errors import KeyNotFoundError
from rich.console import Console

import echo.trust.scorer as scorer_module
import workers.trainer.judge as judge_module
from echo.config import ConfigError
from echo.fleet.grants import DeliveryBound, GrantLedger
from echo.train.checkpoint import TrainerState, load_trained_completions, remember_trained
from echo.trust.scorer import completion_keys
from echo.wire.codec import encode, rollout_headers
from echo.wire.messages import GrantRequest, SamplerStatus, TrainerStatus, WeightsAnnouncement
from echo.wire.names import (
    BODY_PART_MAX,
    BUDGET_KEY,
    CONFIG_KEY,
    HDR_BODY_PARTS,
    HDR_BODY_SHA256,
    HDR_BODY_SIZE,
    HDR_MSG_ID,
    QUARANTINE_KEY,
    ROLLOUT_MESSAGE_MAX,
    SCHEDULE_KEY,
    SLOTS_KEY,
    TRAINER_KEY,
    TRAINER_STATUS_KEY,
    Storage,
)
from streams.client import open_run
from streams.grants import request_grant, slots_granted
from streams.inbox import FETCH_MAX, RolloutInbox
from streams.layout import registry_stream
from streams.lease import RENEW_S, AnotherTrainer, current_term, take_lease
from streams.quarantine import change_quarantine, read_quarantine
from streams.registry import put_status, read_heartbeats, read_statuses, read_trainer_status
from streams.rollouts import fetch_rollouts, publish_rollout
from streams.secure import SAMPLER_LIMITS, SecureDir
from streams.server import NatsServer, ServerConfig
from streams.watch import BAD_VALUES, LatestValue
from streams.weights import WeightsPublisher, fetch_weights
from tests.conftest import TINY_BASE, Runs, assert_accounting_holds, collect_and_account, eventually_async, tiny_config
from tests.groups import (
    BOMB,
    SAMPLING,
    SCORER,
    TASK,
    TOKENIZER,
    granted,
    honest_group,
    pack_rollout,
    symbolic_math,
    unlikely,
)
from workers.background import Background
from workers.cli import main
from workers.operator.snapshot import snapshot
from workers.operator.status import render
from workers.trainer.coordinator import Coordinator
from workers.trainer.granter import AsyncGranter
from workers.trainer.intake import Collector
from workers.trainer.judge import Accepted, AlreadyTrained, Case, Judge, Taken, Timeline
from workers.trainer.scoring import ScoringProcess
from workers.trainer.strikes import Quarantined


async def _revision(kv, key: str) -> int:
    try:
        return (await kv.get(key)).revision
    except KeyNotFoundError:
        return 0


class Hub(Runs):
    """The secured hub of run "sec" (`secured`) and the clients a test opens on it: the trainer's,
    an attacker's with one sampler's credentials, an observer's; each closed when the test ends."""

    def __init__(self, server: NatsServer, secure: SecureDir):
        super().__init__(server.url)
        self.server, self.secure = server, secure


@pytest.fixture
def hub(secured):
    return Hub(*secured)


async def _serving_trainer(hub: Hub, tmp_path):
    """The trainer of run "sec": its lease, version 0 published, granting work at version 0."""
    trainer = await hub.open("sec", "trainer", credentials=hub.secure.credentials("trainer"))
    lease = await take_lease(trainer)
    trainer_weights = WeightsPublisher(lease)
    announcement = await trainer_weights.publish(0, [b"v0" * 100], TINY_BASE)
    granter = AsyncGranter(trainer, lease.term, tiny_config(tmp_path, run={"id": "sec"}), TrainerState(), GrantLedger())
    await granter.start()
    hub.later(granter.subscription.unsubscribe)
    await granter.ask(0)
    return trainer, lease, announcement, granter


async def test_the_trainer_answers_a_grant_request_only_in_an_inbox_and_copies_no_header(hub, tmp_path):
    """Reply reflection through the trainer: a grant request on the sampler's own subject whose
    reply names the weights bucket, with `Nats-Rollup: all`, made the trainer (nats-py's respond
    copies the request's headers) purge every version; one naming another sampler's rollout
    subject put the trainer's answer there under the attacker's headers."""
    secure = hub.secure
    trainer, lease, announcement, granter = await _serving_trainer(hub, tmp_path)
    names = trainer.names
    attacker = await hub.connect(**secure.credentials("sampler-s1").connect_options())
    request = encode(GrantRequest(want=1, term=lease.term, version=0))
    rollup = {"Nats-Rollup": "all", "Echo-Sampler-Id": "s2"}
    for target in (f"$O.{names.weights_bucket}.M.x", names.rollouts_subject("s2"), f"$KV.{names.state_bucket}.x"):
        await attacker.publish(names.grants_subject("s1"), request, reply=target, headers=rollup)
    # The trainer answers one sampler's requests in order: once this answer is in, it has
    # handled the reflected ones.
    answer = await attacker.request(names.grants_subject("s1"), request, timeout=5, headers={"X-Mine": "1"})
    assert not answer.headers, answer.headers  # none of the request's headers came back
    assert await fetch_weights(trainer, announcement) == [bytearray(b"v0" * 100)]  # the bucket is whole
    assert (await trainer.js.stream_info(names.rollouts_stream)).state.messages == 0
    assert await _revision(trainer.state, "x") == 0


async def test_no_answer_a_sampler_asks_for_lands_in_the_runs_state(hub, tmp_path):
    """Reply reflection through the JetStream API: a request the sampler may make (a direct get;
    $JS.hub.API.INFO before it lost that), a publish on its own rollout subject, a grant request) whose reply names a key of the run's
    state had the server, the stream or the trainer write its answer there: every sampler and the
    trainer exited on the next read, restarts failed the same way, and an answer on the trainer's
    lease key fenced it out. The samplers' account imports what they may ask for from the run's
    account: an answer goes back into theirs, where no stream of the run listens."""
    secure = hub.secure
    trainer, lease, announcement, granter = await _serving_trainer(hub, tmp_path)
    names = trainer.names
    attacker = await hub.connect(**secure.credentials("sampler-s1").connect_options())
    keys = [(trainer.state, names.state_bucket, key) for key in (
        QUARANTINE_KEY, TRAINER_KEY, SCHEDULE_KEY, BUDGET_KEY, TRAINER_STATUS_KEY, CONFIG_KEY, "x")]
    keys.append((trainer.registry, names.registry_bucket, "s0"))  # another sampler's heartbeat (its own it writes)
    grant = encode(GrantRequest(want=1, term=lease.term, version=0))
    revisions = {(kv, key): await _revision(kv, key) for kv, _, key in keys}
    for _, bucket, key in keys:
        for api in ("$JS.hub.API", "$JS.API"):
            await attacker.publish(f"{api}.INFO", b"", reply=f"$KV.{bucket}.{key}")
            await attacker.publish(f"{api}.STREAM.INFO.{names.weights_stream}", b"", reply=f"$KV.{bucket}.{key}")
            await attacker.publish(f"{api}.DIRECT.GET.{names.control_stream}", b'{"seq": 1}',
                                   reply=f"$KV.{bucket}.{key}")
        await attacker.publish(names.rollouts_subject("s1"), b"junk", reply=f"$KV.{bucket}.{key}")  # its ack
        await attacker.publish(names.grants_subject("s1"), grant, reply=f"$KV.{bucket}.{key}")
    # Each is answered in its turn: once these answers are in, the ones above were given.
    await attacker.request(f"$JS.hub.API.DIRECT.GET.{names.control_stream}", b'{"seq": 1}', timeout=5)
    await attacker.request(names.grants_subject("s1"), grant, timeout=5)
    assert {(kv, key): await _revision(kv, key) for kv, _, key in keys} == revisions
    assert await slots_granted(trainer) > 0  # the grants it asked for were made: the count is the trainer's
    lease.check()  # still the run's trainer


async def test_a_malformed_value_in_the_runs_state_is_read_as_absent_and_fences_the_trainer_out(
        hub, tmp_path, capsys):
    """Whatever writes junk into the run's state (it was a reflected server answer; any client of
    the run's account could), no reader crashes: each takes the value for absent, says and counts
    it; the trainer whose lease it overwrote stops at once, and the next one takes the run in an
    term after every one announced."""
    server, secure = hub.server, hub.secure
    trainer, lease, announcement, granter = await _serving_trainer(hub, tmp_path)
    await change_quarantine(trainer, lambda samplers: samplers.update({"s9": "caught"}))
    renewing = asyncio.create_task(lease.renew_forever())
    junk = b'{"type":"io.nats.jetstream.api.v1.account_info_response"}'
    try:
        for key in (QUARANTINE_KEY, TRAINER_KEY, SCHEDULE_KEY, BUDGET_KEY, TRAINER_STATUS_KEY, SLOTS_KEY, CONFIG_KEY):
            await trainer.state.put(key, junk)
        await trainer.registry.put("s1", junk)
        counted = BAD_VALUES[QUARANTINE_KEY]
        assert await read_quarantine(trainer) == {} and BAD_VALUES[QUARANTINE_KEY] == counted + 1
        assert await current_term(trainer) is None
        assert await read_trainer_status(trainer) is None and await slots_granted(trainer) == 0
        assert await read_heartbeats(trainer, ["s1"]) == {"s1": (0, None)}  # no sign of life, and shown as bad_heartbeat
        assert [(s.sampler_id, s.state) for s in await read_statuses(trainer)] == [("s1", "bad_heartbeat")]
        args = ["quarantine", "list", "--nats", server.url, "--run-id", "sec",
                "--creds", str(secure.seed_file("observer")), "--tls-ca", str(secure.ca_file)]
        assert await asyncio.to_thread(main, args) == 0 and capsys.readouterr().out.splitlines()[-1] == "{}"
        with pytest.raises(AnotherTrainer):  # its lease overwritten: fenced out, at once
            await asyncio.wait_for(renewing, 5 * RENEW_S)
        successor = await take_lease(trainer, lapse_s=0.5)  # the unreadable lease lapses like a dead one's
        assert successor.term == announcement.term + 1
    finally:
        renewing.cancel()


async def test_a_rollup_on_the_samplers_own_heartbeat_key_wipes_nothing(hub, tmp_path):
    """One publish on the sampler's own heartbeat key with `Nats-Rollup: all` wiped the state
    bucket (config, trainer lease, slot count, quarantine): the trainer was fenced out and its
    successor started again at term 1. Heartbeats now live in a bucket of their own that
    refuses rollups, purges and deletes, and the state bucket holds nothing a sampler writes."""
    secure = hub.secure
    trainer, lease, announcement, granter = await _serving_trainer(hub, tmp_path)
    names = trainer.names
    await trainer.state.put(CONFIG_KEY, b'{"task": {"name": "math"}}')
    await trainer.registry.put("s0", b"another sampler's heartbeat")
    attacker = await hub.connect(**secure.credentials("sampler-s1").connect_options())
    js = attacker.jetstream(domain="hub", timeout=2.0)
    for subject in (f"$KV.{names.registry_bucket}.s1", f"$KV.{names.state_bucket}.samplers.s1"):
        for rollup in ("all", "sub"):
            with pytest.raises((nats.errors.TimeoutError, nats.js.errors.APIError)):
                await js.publish(subject, b"{}", headers={"Nats-Rollup": rollup})
    with pytest.raises(nats.js.errors.APIError):  # nor may it purge its own key
        await js.publish(f"$KV.{names.registry_bucket}.s1", b"",
                         headers={"KV-Operation": "PURGE", "Nats-Rollup": "sub"})
    with pytest.raises(nats.js.errors.APIError):  # nor roll up what it wrote on its own subject
        await js.publish(names.rollouts_subject("s1"), b"x", headers={"Nats-Rollup": "all"})
    for stream in (names.rollouts_stream, names.bodies_stream):  # what samplers write: no one purges it
        with pytest.raises(nats.js.errors.APIError):
            await trainer.js.purge_stream(stream)
    assert (await trainer.state.get(CONFIG_KEY)).value == b'{"task": {"name": "math"}}'
    assert await current_term(trainer) == lease.term and await slots_granted(trainer) == 0
    assert (await trainer.registry.get("s0")).value == b"another sampler's heartbeat"


async def test_a_heartbeat_past_its_size_is_refused_by_the_broker_and_by_every_reader(hub, tmp_path):
    """A heartbeat bomb: an 8 MB heartbeat on the sampler's own registry key cost the scheduler ~1.5 s to
    decode every 5 s (79 -> 56 steps a minute) and `echo-rl status` 9 s. The registry bucket
    refuses a message past STATUS_MAX_BYTES, and a reader checks the size before it decodes."""
    secure = hub.secure
    trainer, lease, announcement, granter = await _serving_trainer(hub, tmp_path)
    attacker = await hub.open("sec", "s1", credentials=secure.credentials("sampler-s1"), create=False)
    huge = SamplerStatus.model_construct(sampler_id="s1", version=0, groups_published=0, weight_failures={},
                                         updated_at=time.time(), sync_s={str(v): 1.0 for v in range(400_000)})
    assert len(encode(huge)) > 4 << 20  # MBs (8 MB is the payload any message may have)
    with pytest.raises(nats.js.errors.APIError, match="message size exceeds maximum"):
        await put_status(attacker, huge)
    # A bucket from before the limit: every reader still checks the size before decoding.
    await trainer.js.update_stream(dataclasses.replace(registry_stream(trainer.names), max_msg_size=-1))
    await trainer.registry.put("s1", encode(huge))
    assert await read_heartbeats(trainer, ["s1"]) == {"s1": (0, None)}
    assert [(s.sampler_id, s.state) for s in await read_statuses(trainer)] == [("s1", "bad_heartbeat")]
    assert BAD_VALUES["s1"] >= 1


async def test_status_shows_a_samplers_own_words_as_written(hub, tmp_path):
    """A heartbeat is the sampler's word: markup in it ([link=...], styles) reached the operator's
    terminal as markup. `echo-rl status` prints it literally."""
    secure = hub.secure
    trainer, lease, announcement, granter = await _serving_trainer(hub, tmp_path)
    sampler = await hub.open("sec", "s1", credentials=secure.credentials("sampler-s1"), create=False)
    observer = await hub.open("sec", "observer", credentials=secure.credentials("observer"), create=False)
    words = "[link=https://evil.example]update your drivers[/link][blink]"
    await put_status(sampler, SamplerStatus(sampler_id="s1", version=0, groups_published=0, weight_failures={},
                                            updated_at=time.time(), engine=words, device=words, relay=words))
    out = io.StringIO()
    Console(file=out, width=400).print(render(await snapshot(observer)))
    assert out.getvalue().count(words) == 3, out.getvalue()


async def test_a_message_past_the_runs_limits_is_refused_before_it_is_validated_or_read(hub, tmp_path):
    """One 60 MB message of 1,000,000 completions froze the trainer's event loop for 15.8 s and
    took it from 0.43 to 2.1 GB (every completion was validated before their count was checked
    against the group size); a 256 MB body in parts took it to 4.3 GB before it was refused. A
    message's counts and the size a body claims are now checked against the run's config first
    (and the stream stores no message past ROLLOUT_MESSAGE_MAX):
    the reasons below are the counts' and the size's, where the old order met the bad
    log-probs, or the missing parts, first."""
    secure = hub.secure
    trainer = await hub.open("sec", "trainer", credentials=secure.credentials("trainer"))
    attacker = await hub.open("sec", "s1", credentials=secure.credentials("sampler-s1"), create=False)
    raw = honest_group(version=5, group_id="many").model_dump()
    junk = {"token_ids": [1], "logprobs": [0.5], "text": "", "claimed_reward": 0.0, "finish_reason": "length"}
    headers = rollout_headers(honest_group(version=5, group_id="many"))
    raw["completions"] = [junk] * 50_000  # with log-probs above 0: bad_schema, had it been validated first
    with pytest.raises(nats.js.errors.BadRequestError, match="message size exceeds maximum"):  # the stream's limit
        await attacker.js.publish(trainer.names.rollouts_subject("s1"), pack_rollout(raw),
                                  headers={**headers, HDR_MSG_ID: "many50000"})
    raw["completions"] = [junk] * 100
    await attacker.js.publish(trainer.names.rollouts_subject("s1"), pack_rollout(raw),
                              headers={**headers, HDR_MSG_ID: "many100"})
    pointer = {**rollout_headers(honest_group(version=5, group_id="huge")),
               HDR_BODY_PARTS: ",".join(map(str, range(1, 65))), HDR_BODY_SIZE: str(64 * 8 * 2**20),
               HDR_BODY_SHA256: "0" * 64}
    await attacker.js.publish(trainer.names.rollouts_subject("s1"), b"", headers=pointer)  # no part exists
    ledger = GrantLedger()
    await publish_rollout(attacker, granted(ledger, honest_group(version=5, group_id="fine")))
    collector = Collector(await RolloutInbox.open(trainer), Judge(SCORER, Timeline(max_staleness=1)), ledger)
    collected = await collector.collect(1, version=5)
    assert [a.group.group_id for a in collected.used] == ["fine"]
    # 100 completions (within the message's size): refused by their count; 512 MB claimed: by its size.
    assert collected.rejected == {"too_large": 1, "wrong_group_size": 1}, collected.rejected


async def test_a_sampler_cannot_make_consumers(hub, tmp_path):
    """1000 named durable consumers on the weights bucket's stream (the server's limit) made every
    sampler's fetch fail, and stayed after the swarm restarted; ephemeral ones told to stay for a
    year would do the same. A sampler now reads weights, announcements and state by direct gets
    and may make no consumer at all."""
    secure = hub.secure
    trainer, lease, announcement, granter = await _serving_trainer(hub, tmp_path)
    names = trainer.names
    attacker = await hub.connect(**secure.credentials("sampler-s1").connect_options())
    js = attacker.jetstream(domain="hub", timeout=1.0)
    for stream in (names.weights_stream, names.control_stream, f"KV_{names.state_bucket}"):
        before = (await trainer.js.stream_info(stream)).state.consumer_count  # the trainer's own
        for config in (ConsumerConfig(durable_name="squat"), ConsumerConfig(name="squat"),
                       ConsumerConfig(inactive_threshold=365 * 86400.0)):
            with pytest.raises((nats.errors.TimeoutError, asyncio.TimeoutError)):  # no permission: no answer
                await js.add_consumer(stream, config)
        assert (await trainer.js.stream_info(stream)).state.consumer_count == before
    sampler = await hub.open("sec", "s1", credentials=secure.credentials("sampler-s1"), create=False)
    assert await fetch_weights(sampler, announcement) == [bytearray(b"v0" * 100)]  # its own reads still work
    announcements = await LatestValue(sampler.local_js, names.control_stream, names.weights_subject,
                                      WeightsAnnouncement, on_error=print).start()
    async with asyncio.timeout(10):
        assert (await announcements.wait_newer(0))[1] == announcement
    await announcements.stop()


async def test_a_group_resending_trained_completions_is_refused(hub, tmp_path):
    """Earlier trained completions resent with one of them doubled (true log-probs, current
    version): the group's content hash is new, and 10 of 10 such groups were trained. A
    completion that is unlikely (as every sampled reasoning-length one is) may not appear twice
    in a group, nor again for a prompt it was trained on, by this trainer or one resumed from its
    checkpoint; a likely short answer may."""
    secure = hub.secure
    trainer = await hub.open("sec", "trainer", credentials=secure.credentials("trainer"))
    attacker = await hub.open("sec", "s1", credentials=secure.credentials("sampler-s1"), create=False)
    long_answer = f"so it is \\boxed{{{TASK.prompt(12).answer}}}"
    ledger = GrantLedger()
    first = granted(ledger, unlikely(unlikely(honest_group(texts=[long_answer, "no idea \\boxed{999}"],
                                                           version=5, group_id="first"), 0), 1))
    collector = Collector(await RolloutInbox.open(trainer), Judge(SCORER, Timeline(max_staleness=1)), ledger)
    await publish_rollout(attacker, first)
    async with asyncio.timeout(30):
        step = await collector.collect(1, version=5)
    collector.trained(step)  # trained, and checkpointed
    state = TrainerState()
    remember_trained(tmp_path, state, [a.content for a in step.used], [k for a in step.used for k in a.keys])

    doubled = first.replaced(group_id="doubled", completions=[first.completions[0]] * 2)
    swapped = first.replaced(group_id="swapped", completions=[first.completions[0], honest_group().completions[1]])
    likely = honest_group(texts=["\\boxed{4}", "\\boxed{4}"], version=5, group_id="likely")
    for group in (doubled, swapped, likely):
        await publish_rollout(attacker, granted(ledger, group))
    async with asyncio.timeout(30):
        collected = await collector.collect(1, version=5)
    assert [a.group.group_id for a in collected.used] == ["likely"]
    assert collected.rejected == {"repeated_completion": 2}, collected.rejected
    assert collected.rejected_tokens == sum(len(c.token_ids) for g in (doubled, swapped) for c in g.completions)
    # A trainer resumed from the checkpoint remembers them too.
    resumed = Judge(SCORER, Timeline(max_staleness=1),
                    AlreadyTrained(completions=load_trained_completions(tmp_path, state.trained_completions)))
    again = swapped.replaced(group_id="again")
    assert (await resumed.new(Case(again, 5, again.prompt_index))).reason == "repeated_completion"


async def test_a_verifier_bomb_costs_the_bomber_its_group_and_a_strike_and_the_step_goes_on(hub, tmp_path):
    """A verifier bomb: one group whose completions are each `\\boxed{K^{9^{8}}}` for a different K, with
    true log-probs: math-verify evaluated every power tower in full on the trainer's event loop
    (no step for over 515 s, SIGTERM unheard). A number is now compared, not evaluated; where the
    truth is not one (here), the verifiers run in a child process with a budget per completion:
    the group is rejected and struck, the honest group behind it trained."""
    secure = hub.secure
    trainer = await hub.open("sec", "trainer", credentials=secure.credentials("trainer"))
    attacker = await hub.open("sec", "s1", credentials=secure.credentials("sampler-s1"), create=False)
    config, task, scorer = symbolic_math(tmp_path)
    ledger = GrantLedger()
    bomb = honest_group(of_task=task, texts=BOMB, rewards=[0.1, 0.1], group_id="bomb", version=5)
    await publish_rollout(attacker, granted(ledger, bomb))
    await publish_rollout(attacker, granted(ledger, honest_group(of_task=task, group_id="honest", version=5)))
    quarantine = Quarantined(trainer, after=3)
    async with ScoringProcess(config, TOKENIZER, len(TOKENIZER), SAMPLING, budget_s=3.0,
                              memory_mb=1024.0) as scoring:
        judge = Judge(scorer, Timeline(max_staleness=1), scoring=scoring)
        collector = Collector(await RolloutInbox.open(trainer), judge, ledger, quarantine=quarantine)
        async with asyncio.timeout(120):  # a hang guard: the budget is 3 s a completion
            step = await collector.collect(1, version=5)
    assert [a.group.group_id for a in step.used] == ["honest"]
    assert step.rejected == {"verifier_budget": 1} and quarantine.strikes == {"s1": 1}


async def test_a_step_hashes_each_groups_completions_twice_however_many_it_accepted(monkeypatch):
    """Hashing at scale (the trainer's CPU a token at the reasoning shape): to find a completion resent
    within the step, each group judged hashed again the completions of every group accepted
    before it, O(groups^2) hashes of their tokens a step (64 groups of 16 x 4k tokens: 0.4 s of
    the trainer's CPU a step, on this box), and the checkpoint hashed them all once more. Each group's are
    hashed when judged and when accepted, and the step's record and checkpoint reuse those."""
    hashed = []

    def counted(group):
        hashed.append(group.group_id)
        return completion_keys(group)

    monkeypatch.setattr(judge_module, "completion_keys", counted)
    monkeypatch.setattr(scorer_module, "completion_keys", counted)
    judge, step, taken = Judge(SCORER, Timeline(max_staleness=1)), [], Taken()
    for i in range(32):
        group = honest_group(i, group_id=f"g{i}")
        case = Case(group, 0, group.prompt_index, taken)
        assert await judge.new(case) is None
        step.append(Accepted(group, [1.0, 0.0], case.content))
        taken.add(step[-1:])
    judge.trained.add(step)  # the step trained them
    assert len(hashed) == 2 * 32, len(hashed)
    assert judge.trained.completions == {k for a in step for k in completion_keys(a.group)}
    resent = step[5].group.replaced(group_id="resent")
    assert (await judge.new(Case(resent, 0, resent.prompt_index, taken))).reason == "replayed_content"
    again = step[7].group  # its own id again, within the step
    assert (await judge.new(Case(again, 0, again.prompt_index, taken))).reason == "duplicate_group_id"
    # A group the proof refused is no longer taken: the same forgery resent is judged (and struck) again.
    fresh, pending = Judge(SCORER, Timeline(max_staleness=1)), Taken()
    pending.add(step[:2])
    pending.remove(step[:1])
    forged = step[0].group
    assert await fresh.new(Case(forged, 0, forged.prompt_index, pending)) is None
    kept = step[1].group.replaced(group_id="kept-again")
    assert (await fresh.new(Case(kept, 0, kept.prompt_index, pending))).reason == "replayed_content"


async def test_a_sampler_keeping_back_its_low_reward_groups_is_struck_and_quarantined(hub, tmp_path):
    """Selective delivery: with s1's credentials, a sampler generates every slot it is granted but delivers
    only the groups whose mean reward is at least 0.5: training then sees its survivors, a bias
    no forgery check sees. Before, nothing counted it. Each slot it passes over now ends
    undelivered, its prompt granted again; past trainer.undelivered_share of its last
    undelivered_window slots it is struck, and past quarantine_after strikes quarantined. An
    honest sampler beside it, delivering every slot, has none undelivered. (Kept back and never
    passed over, its slots stall it: released after the stall limit, then one slot at a time, and
    a strike when it does it again: test_grants.py's hoarder.)"""
    secure = hub.secure
    cfg = tiny_config(tmp_path, run={"id": "sec"}, trainer={
        "groups_per_step": 4, "max_staleness": 3, "quarantine_after": 1,
        "undelivered_window": 16, "undelivered_share": 0.125})
    trainer = await hub.open("sec", "trainer", credentials=secure.credentials("trainer"))
    attacker = await hub.open("sec", "s1", credentials=secure.credentials("sampler-s1"), create=False)
    async with Background() as background:
        lease = await take_lease(trainer)
        quarantine = Quarantined(trainer, after=cfg.trainer.quarantine_after)
        await quarantine.start(background)
        bound = DeliveryBound(cfg.trainer.undelivered_window, cfg.trainer.undelivered_share)
        ledger = GrantLedger(seed=cfg.run.seed, bound=bound)
        granter = AsyncGranter(trainer, lease.term, cfg, TrainerState(), ledger, quarantine)
        await granter.start()
        await granter.ask(0)
        judge = Judge(SCORER, Timeline(max_staleness=cfg.trainer.max_staleness, term=lease.term))
        collector = Collector(await RolloutInbox.open(trainer), judge, ledger, quarantine=quarantine)
        withheld: list[tuple[int, int]] = []  # (slot, prompt)
        granted_prompts: list[tuple[int, int]] = []

        done = asyncio.Event()  # the samplers go on till the trainer's last step: it may still be collecting

        async def sample(run, sampler_id: str, keeps_back: bool) -> None:
            process = uuid.uuid4().hex
            while not done.is_set():
                version = granter.version
                grant = await request_grant(run, sampler_id, GrantRequest(
                    want=1, term=lease.term, version=version, process=process))
                if not (grant and grant.slots):
                    await asyncio.sleep(0.02)
                    continue
                for slot, prompt, noise in zip(grant.slots, grant.prompts, grant.keyed_slots()):
                    granted_prompts.append((slot, prompt))
                    answer = f"\\boxed{{{TASK.prompt(prompt).answer}}}"
                    draws = random.Random(noise)  # its keyed sampling: each completion right half the time
                    texts = [f"draw {noise}.{j}: " + (answer if draws.random() < 0.5 else "\\boxed{-1}")
                             for j in range(2)]
                    group = honest_group(prompt, texts=texts, sampler_id=sampler_id, slot=slot, version=version,
                                         term=lease.term, group_id=uuid.uuid4().hex,
                                         noise_slot=None if noise == slot else noise)
                    if keeps_back and sum(c.claimed_reward for c in group.completions) < 1:
                        withheld.append((slot, prompt))
                    else:
                        await publish_rollout(run, group)

        samplers = [asyncio.create_task(sample(attacker, "s1", keeps_back=True)),
                    asyncio.create_task(sample(trainer, "s2", keeps_back=False))]
        async with asyncio.timeout(120):  # a hang guard: before, nothing stopped it
            version = 0
            while "s1" not in quarantine:
                collected = await collector.collect(cfg.trainer.groups_per_step, version, on_wait=granter.on_wait)
                assert not collected.rejected or set(collected.rejected) == {"quarantined"}, collected.rejected
                collector.trained(collected)
                version += 1
                await granter.ask(version)
            done.set()
            await asyncio.gather(*samplers)
        await granter.subscription.unsubscribe()
    assert set(quarantine.strikes) == {"s1"} and "slots_undelivered" in quarantine.samplers["s1"]
    s1, s2 = ledger.deliveries["s1"], ledger.deliveries["s2"]
    assert s1.undelivered > 2 * bound.most and s1.undelivered <= len(withheld)
    assert s2.ended > 0 and s2.undelivered == 0
    # The trainer still chooses the prompts: each one let go was granted again (or is owed).
    for slot, prompt in withheld:
        if slot not in ledger.outstanding:  # ended, not still held at the end
            assert prompt in {p for p, _ in ledger.owed} or any(p == prompt and s > slot for s, p in granted_prompts), (slot, prompt)


@pytest.fixture
def two_samplers(tmp_path):
    """A secured hub for run "sec" with samplers s1 and s2 from the start: a connection the hub
    accepts while it reloads its accounts (add_sampler) may be closed by that reload."""
    secure = SecureDir(tmp_path / "secure")
    secure.init("sec", ["localhost", "127.0.0.1"], ["s1", "s2"])
    with NatsServer(tmp_path / "jetstream", ServerConfig(include=secure.dir / "server.conf")) as server:
        yield server, secure


async def test_one_samplers_connections_and_subscriptions_are_bounded(two_samplers):
    """1000 connections and 200,000 subscriptions on one sampler's credentials were allowed. Each
    sampler is an account of its own, and the server bounds an account's (SAMPLER_LIMITS); the
    other samplers' are their own."""
    await _connections_and_subscriptions_are_bounded(*two_samplers)


async def test_one_sampler_keeps_no_more_than_its_quota_and_evicts_only_its_own(two_samplers):
    """8 MB messages in a loop on its own rollout subject stored 3.4 GB in 45 s: no per-sampler
    limit. Each sampler now keeps at most its quota in each rollout stream (in messages of a
    bounded size); past it its own oldest go, counted as evicted when unread, and no other
    sampler's group is lost."""
    server, secure = two_samplers
    quota = 32 << 20
    trainer = await open_run(server.url, "sec", "trainer", credentials=secure.credentials("trainer"),
                             storage=Storage(sampler_max_bytes=quota))
    honest = await open_run(server.url, "sec", "s2", credentials=secure.credentials("sampler-s2"), create=False)
    attacker = await open_run(server.url, "sec", "s1", credentials=secure.credentials("sampler-s1"), create=False)
    names = trainer.names
    try:
        ledger = GrantLedger()
        collector = Collector(await RolloutInbox.open(trainer), Judge(SCORER, Timeline(max_staleness=1)), ledger)
        await publish_rollout(honest, granted(ledger, honest_group(30, version=5, group_id="before", sampler_id="s2")))
        for i in range(400):  # 80 MB
            await attacker.js.publish(names.rollouts_subject("s1"), bytes(200_000), headers={HDR_MSG_ID: f"r{i}"})
            if i % 10 == 0:
                await attacker.js.publish(names.bodies_subject("s1"), bytes(2 << 20), headers={HDR_MSG_ID: f"b{i}"})
            if i == 200:
                await publish_rollout(honest, granted(ledger, honest_group(31, version=5, group_id="amid",
                                                                           sampler_id="s2")))
        rollouts, bodies = (await trainer.js.stream_info(names.rollouts_stream)), await trainer.js.stream_info(names.bodies_stream)
        assert rollouts.state.bytes <= quota + (1 << 20) and rollouts.state.messages <= quota // ROLLOUT_MESSAGE_MAX + 2
        assert bodies.state.bytes <= quota and bodies.state.messages <= quota // BODY_PART_MAX
        totals, accounting = await collect_and_account(collector, {}, 2)
        # Both honest groups trained, the attacker's read in turn with them (each refused); its
        # oldest 272 went unread, counted as evicted.
        assert accounting["trained"] == 2 and accounting["rejected"] <= 3 and accounting["evicted"] == 272, accounting
        assert_accounting_holds(accounting)
    finally:
        for run in (attacker, honest, trainer):
            await run.close()


async def test_a_flood_fills_only_the_room_the_rollout_streams_reserved_in_the_runs_account(tmp_path):
    """A disk flood: an 8 MB part flood stored 2.4 GB in 75 s within the per-sampler quota, and the
    run's account had no storage limit. `secure init --run-storage-gb` gives it one, and the
    rollout streams reserve their size limit within it: three samplers flooding both streams fill
    only those, and the trainer's own writes (weights, state) find the rest. A trainer whose
    rollout streams have no size limit, or one that does not fit, fails at start naming it; one
    whose weights outgrow the rest stops naming what to change (it would have retried forever)."""
    secure = SecureDir(tmp_path / "secure")
    limit, history = 96 << 20, 32 << 20
    assert main(["secure", "init", str(secure.dir), "--run-id", "sec", "--samplers", "s1,s2,s3",
                 "--run-storage-gb", str(limit / 2**30)]) == 0
    with NatsServer(tmp_path / "jetstream", ServerConfig(include=secure.dir / "server.conf")) as server:
        creds = secure.credentials("trainer")
        for too_much in (-1, limit // 2, limit // 2 + 1):  # no limit; no room left; more than the account
            with pytest.raises(ConfigError, match="nats.rollouts_max_gb"):
                await open_run(server.url, "sec", "trainer", credentials=creds,
                               storage=Storage(rollouts_max_bytes=too_much, sampler_max_bytes=history // 2))
        # Another stream of the account's reserving a quarter: the broker refuses two of 40 MB.
        nc = await nats.connect(server.url, **creds.connect_options())
        await nc.jetstream().add_stream(name="other", subjects=["other"], max_bytes=limit // 4)
        with pytest.raises(ConfigError, match="nats.rollouts_max_gb: two rollout streams of .* do not fit"):
            await open_run(server.url, "sec", "trainer", credentials=creds,
                           storage=Storage(rollouts_max_bytes=40 << 20, sampler_max_bytes=history // 2))
        await nc.jetstream().delete_stream("other")
        await nc.close()
        trainer = await open_run(server.url, "sec", "trainer", credentials=creds,
                                 storage=Storage(rollouts_max_bytes=history, sampler_max_bytes=history // 2))
        samplers = [await open_run(server.url, "sec", s, credentials=secure.credentials(f"sampler-{s}"), create=False)
                    for s in ("s1", "s2", "s3")]
        names = trainer.names
        try:
            for sampler, s in zip(samplers, ("s1", "s2", "s3")):  # each to its quota, together past the history's limit
                for i in range(160):  # 32 MB
                    await sampler.js.publish(names.rollouts_subject(s), bytes(200_000), headers={HDR_MSG_ID: f"{s}r{i}"})
                for i in range(4):  # 32 MB
                    await sampler.js.publish(names.bodies_subject(s), bytes(BODY_PART_MAX - 4096),
                                             headers={HDR_MSG_ID: f"{s}b{i}"})
            for stream in (names.rollouts_stream, names.bodies_stream):
                assert (await trainer.js.stream_info(stream)).state.bytes <= history
            weights = WeightsPublisher(await take_lease(trainer))
            await weights.publish(0, [bytes(limit - 2 * history - (3 << 20))], TINY_BASE)
            await trainer.state.put("after-the-flood", b"written")
            observer = await open_run(server.url, "sec", "observer", credentials=secure.credentials("observer"),
                                      create=False)
            samplers.append(observer)
            snap = await snapshot(observer)  # what `echo-rl status` shows of it
            assert snap["storage"]["limit"] == limit and 2 * history <= snap["storage"]["bytes"] <= limit
            out = io.StringIO()
            Console(file=out, width=400).print(render(snap))
            assert "MB of 100.7 MB" in out.getvalue(), out.getvalue()
            # Weights past the room left: the trainer stops, saying what to change (no retry frees any).
            with pytest.raises(ConfigError, match="run-storage-gb"):
                await weights.publish(1, [bytes(8 << 20)], TINY_BASE)
        finally:
            for run in (*samplers, trainer):
                await run.close()


async def test_a_flood_of_junk_stands_in_front_of_no_honest_group_and_costs_its_sender_a_quarantine(
        two_samplers, monkeypatch):
    """A backlog of junk: a sampler keeping its quota full of 64-byte junk held the run at ~14 steps a
    minute: one consumer reads every sampler's subject in stream order, each fetch asked for only
    what the step still needed, and junk earned no strike (16,400 messages took 50 s to read past).
    The samplers are now read in turn (the honest group comes with one junk message at most
    before it), junk is a strike, a quarantined sender's messages are counted unread, and the
    inbox reads a backlog a full fetch at a time."""
    server, secure = two_samplers
    trainer = await open_run(server.url, "sec", "trainer", credentials=secure.credentials("trainer"))
    honest = await open_run(server.url, "sec", "s2", credentials=secure.credentials("sampler-s2"), create=False)
    attacker = await open_run(server.url, "sec", "s1", credentials=secure.credentials("sampler-s1"), create=False)
    fetches = []

    async def counted(subscription, batch: int, timeout: float):
        fetches.append(batch)
        return await fetch_rollouts(subscription, batch, timeout)

    monkeypatch.setattr("streams.inbox.fetch_rollouts", counted)
    junk = 2000
    try:
        await asyncio.gather(*(attacker.js.publish(trainer.names.rollouts_subject("s1"), bytes(64),
                                                   headers={HDR_MSG_ID: f"junk{i}"}) for i in range(junk)))
        ledger = GrantLedger()
        await publish_rollout(honest, granted(ledger, honest_group(30, version=5, group_id="behind", sampler_id="s2")))
        quarantine = Quarantined(trainer, after=3)
        collector = Collector(await RolloutInbox.open(trainer), Judge(SCORER, Timeline(max_staleness=1)), ledger,
                              quarantine=quarantine)
        totals, accounting = await collect_and_account(collector, {}, 1)
        assert accounting["trained"] == 1 and accounting["rejected"] <= 1, accounting  # before: all 2000 first
        assert_accounting_holds(accounting)

        async def honest_once_quarantined():  # meanwhile the inbox has only the junk to read
            await eventually_async(lambda: "s1" in quarantine, 60, every=0.01)
            await publish_rollout(honest, granted(ledger, honest_group(31, version=5, group_id="later",
                                                                       sampler_id="s2")))

        later = asyncio.create_task(honest_once_quarantined())
        totals, accounting = await collect_and_account(collector, totals, 1)
        await later
        assert accounting["trained"] == 2 and quarantine.strikes == {"s1": 4}  # quarantine_after 3: the fourth
        assert len(fetches) <= junk // FETCH_MAX + 6, len(fetches)  # before: one fetch a message
        assert_accounting_holds(accounting)
    finally:
        for run in (attacker, honest, trainer):
            await run.close()


async def _connections_and_subscriptions_are_bounded(server: NatsServer, secure: SecureDir) -> None:
    options = secure.credentials("sampler-s1").connect_options()
    opened = [await nats.connect(server.url, allow_reconnect=False, **secure.credentials("sampler-s2").connect_options())]
    try:
        for _ in range(SAMPLER_LIMITS["max_connections"]):
            opened.append(await nats.connect(server.url, allow_reconnect=False, **options))
        with pytest.raises(Exception):  # one more is refused (maximum account active connections exceeded)
            opened.append(await nats.connect(server.url, allow_reconnect=False, connect_timeout=2, **options))
        for nc in opened[1:]:
            await nc.close()
        nc = await nats.connect(server.url, allow_reconnect=False, **options)
        opened.append(nc)
        for i in range(SAMPLER_LIMITS["max_subscriptions"] + 1):  # its own inbox: subscriptions it may make
            await nc.subscribe(f"{options['inbox_prefix']}.x{i}")
        with contextlib.suppress(Exception):
            await nc.flush(timeout=2)
        await eventually_async(lambda: nc.is_closed, 5)  # the server refuses the one too many; nats-py closes on it
        assert "maximum subscriptions exceeded" in str(nc.last_error), nc.last_error
        assert opened[0].is_connected  # the other sampler's connection stands
    finally:
        for nc in opened:
            with contextlib.suppress(Exception):
                await nc.close()


async def test_a_samplers_flood_of_jetstream_api_requests_is_refused_and_the_trainers_own_are_answered(
        hub, tmp_path):
    """A JetStream API flood: a sampler could ask for account INFO, stream INFO and message gets, which wait in
    the server's JetStream API queues with every request of the trainer's: 4 connections flooding
    account INFO or message gets for 20 s had the server drop the trainer's consumer and stream
    INFO requests (3 of ~80 failed), STREAM.INFO with subject listings stalled a run 44-80 s. A
    sampler now reads by direct gets alone (the stream answers them itself): the others are
    refused at its connection, never queued."""
    secure = hub.secure
    trainer = await hub.open("sec", "trainer", credentials=secure.credentials("trainer"))
    names = trainer.names
    inbox = await RolloutInbox.open(trainer)
    options = secure.credentials("sampler-s1").connect_options()
    attacker = await hub.connect(**options)
    floods = [request for api in ("$JS.hub.API", "$JS.API") for request in (
        (f"{api}.INFO", b""), (f"{api}.STREAM.MSG.GET.KV_{names.state_bucket}", b'{"seq": 1}'),
        (f"{api}.STREAM.INFO.{names.weights_stream}", b'{"subjects_filter": ">"}'))]
    for subject, body in floods:
        with pytest.raises(nats.errors.TimeoutError):  # refused: no answer comes
            await attacker.request(subject, body, timeout=1)
    answered = 0

    async def flood(seconds: float) -> None:
        ends = time.monotonic() + seconds
        while time.monotonic() < ends:
            for subject, body in floods:
                for _ in range(100):
                    await attacker.publish(subject, body, reply=options["inbox_prefix"] + ".flood")
            await asyncio.sleep(0)

    flooding = asyncio.create_task(flood(3.0))
    while not flooding.done():  # the trainer's own INFO calls, each answered within its timeout
        await inbox.counts()
        await trainer.js.stream_info(names.rollouts_stream)
        answered += 1
    await flooding
    assert answered > 0
    assert (await attacker.request(f"$JS.hub.API.DIRECT.GET.KV_{names.state_bucket}", b'{"seq": 1}', timeout=5))


async def test_a_heartbeat_claiming_a_huge_rate_at_no_cost_puts_no_honest_sampler_on_standby(hub, tmp_path):
    """With scheduler.enabled, a heartbeat claiming 1000 groups/s at cost 0 put the honest samplers
    on standby and the liar alone active: no step for as long as it kept beating. The scheduler
    now plans from the rates the trainer measured of each sampler's grants."""
    secure = hub.secure
    cfg = tiny_config(tmp_path, run={"id": "sec"}, scheduler={"enabled": True},
                      trainer={"groups_per_step": 4, "max_staleness": 2})
    trainer = await hub.open("sec", "trainer", credentials=secure.credentials("trainer"))
    liar = await hub.open("sec", "s1", credentials=secure.credentials("sampler-s1"), create=False)
    now, ledger, standby = time.time(), GrantLedger(), set()
    await put_status(trainer, SamplerStatus(  # the honest one: 2 groups/s, as the trainer measured
        sampler_id="s0", version=1, groups_published=4, weight_failures={}, updated_at=now, cost_per_hour=1.0,
        groups_per_s=2.0, call_s=1.0, sync_s={"1": 0.5}))
    slots, _ = ledger.grant("s0", 2, headroom=2, window=8, now=time.monotonic() - 1.0)
    for slot in slots:
        ledger.delivered("s0", slot, time.monotonic())
        ledger.accepted(slot)
    await put_status(liar, SamplerStatus(
        sampler_id="s1", version=1, groups_published=10**6, weight_failures={}, updated_at=now, cost_per_hour=0.0,
        groups_per_s=1000.0, call_s=0.001, sync_s={"1": 0.0}))
    pace = SimpleNamespace(status=TrainerStatus(step_s=2.0, groups_per_step=4, max_staleness=2, version=1,
                                                utilisation=1.0, updated_at=now))
    await Coordinator(trainer, cfg, standby, pace, ledger).choose()
    assert standby == set()  # the honest sampler works; the liar takes work until it is measured
