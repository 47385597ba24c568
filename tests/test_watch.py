"""The run's keys read and followed against a real nats-server (streams/watch.py): a bad or
misnamed value is skipped, never fatal, and the next good one followed; many keys are read in a
request."""

import asyncio

import streams.watch
from echo.engines.hf import HFEngine
from echo.wire.codec import encode
from echo.wire.messages import SamplerStatus, Schedule, SlotsEnded, TrainerStatus
from echo.wire.names import SCHEDULE_KEY
from streams.quarantine import change_quarantine, watch_quarantine
from streams.registry import put_finished, put_status, put_trainer_status, read_heartbeats, read_statuses
from streams.schedule import publish_schedule, watch_schedule
from tests.conftest import eventually_async, tiny_config
from workers.sampler.sampler import Sampler


async def test_a_bad_or_misnamed_heartbeat_is_shown_as_bad_not_fatal(runs):
    """A sampler's credentials let it write its own heartbeat key, with any value: garbage, or a
    status naming another sampler. Readers (the scheduler, `echo-rl status`) take neither for
    what it says, and show both samplers as bad_heartbeat (one vanished from the view before)."""

    run = await runs.open("beats", "trainer")
    honest = SamplerStatus(sampler_id="s1", version=0, groups_published=0, weight_failures={}, updated_at=0.0)
    await put_status(run, honest)
    await run.registry.put("s2", b"junk")
    await run.registry.put("s0", encode(honest))  # s0 speaking for s1
    statuses = await read_statuses(run)
    assert statuses[1] == honest and [(s.sampler_id, s.state) for s in statuses] == [
        ("s0", "bad_heartbeat"), ("s1", "active"), ("s2", "bad_heartbeat")]


async def test_many_heartbeats_are_read_in_a_request_each_as_if_read_alone(runs, monkeypatch):
    """Holders' heartbeats read one request each were most of the trainer's broker requests at
    1,000 samplers (2026-12-07). They are read KEYS_A_REQUEST at a time (2 here): each key's
    revision and value as a read of it alone, a bad one as unreadable, a missing one as none, and
    a heartbeat carrying a status header of its own ends nothing."""
    monkeypatch.setattr(streams.watch, "KEYS_A_REQUEST", 2)
    run = await runs.open("many", "trainer")
    statuses = {f"s{i}": SamplerStatus(sampler_id=f"s{i}", version=i, groups_published=0, weight_failures={},
                                       updated_at=0.0) for i in range(4)}
    for status in statuses.values():
        await put_status(run, status)
    # s0's beat again, with a status header of its own: a sampler's credentials let it write one,
    # and read as the server's end of the answers it hid every heartbeat after its own.
    await run.registry._js.publish(run.registry._pre + "s0", encode(statuses["s0"]), headers={"Status": "204"})
    await put_status(run, statuses["s1"])  # a second beat: a new revision
    await run.registry.put("s4", b"junk")
    sent = run.nc.stats["out_msgs"]
    read = await read_heartbeats(run, ["s0", "s1", "s2", "s3", "s4", "s5"])
    assert run.nc.stats["out_msgs"] - sent == 3
    assert {s: status for s, (_, status) in read.items()} == statuses | {"s4": None, "s5": None}
    assert [read[s][0] for s in statuses] == [(await run.registry.get(s)).revision for s in statuses]
    assert read["s4"][0] == 0 and read["s5"] == (0, None) and read["s1"][0] > read["s0"][0] > read["s3"][0]


async def test_a_bad_schedule_value_is_skipped_and_the_next_good_one_followed(runs):
    run = await runs.open("schedule", "trainer")
    seen = asyncio.Queue()
    watching = asyncio.create_task(watch_schedule(run, seen.put_nowait))
    await run.state.put(SCHEDULE_KEY, b"junk")
    schedule = Schedule(active=["s1"], standby=["s2"], predicted_utilisation=0.5, cost_per_step=1.0, why="test",
                        updated_at=0.0)
    await publish_schedule(run, schedule)
    async with asyncio.timeout(10):
        assert await seen.get() == schedule
    assert not watching.done()
    watching.cancel()


async def test_a_followed_value_is_sent_once_however_often_it_is_read(runs):
    """Followers read every POLL_S. Each reading sent the whole value again: the schedule names
    every sampler, so a thousand samplers following it moved the square of the fleet in bytes a
    second through the hub (bench.load, 2026-12-07). A reading asks for what is newer than what was seen, and
    where nothing is the answer is a status line."""
    run = await runs.open("unchanged", "trainer")
    ids = [f"sampler-{i}" for i in range(1000)]
    schedule = Schedule(active=ids, standby=ids, predicted_utilisation=0.5, cost_per_step=1.0, why="test",
                        updated_at=0.0)
    await publish_schedule(run, schedule)
    seen: list[bytes] = []
    following = asyncio.create_task(streams.watch.watch_forever(run, SCHEDULE_KEY, seen.append))  # every POLL_S
    try:
        await eventually_async(lambda: len(seen) == 1, 5)
        received = run.nc.stats["in_bytes"]
        await asyncio.sleep(10 * streams.watch.POLL_S)
        assert run.nc.stats["in_bytes"] - received < len(seen[0]) / 10  # ten readings or fewer, none of it
        newer = schedule.model_copy(update={"why": "again"})
        await publish_schedule(run, newer)
        await eventually_async(lambda: len(seen) == 2, 5)
        assert seen[1] == encode(newer)
    finally:
        following.cancel()


async def test_a_samplers_heartbeat_reads_as_much_of_the_run_among_a_thousand_samplers_as_alone(runs, tmp_path):
    """Each beat reads whether the run has finished. Read from the trainer's status, whose tables
    by sampler (slots, strikes) grow with the fleet, a thousand samplers each read a thousand
    entries every heartbeat_s: a sixth of the bench's sampler processes' CPU at 1,000 (py-spy,
    2026-12-07). The run's end is a key of its own (schema 30)."""
    cfg = tiny_config(tmp_path, run={"id": "beat-reads"})
    run = await runs.open("beat-reads", "trainer")
    heartbeat = Sampler(cfg, "s1", run, HFEngine("tiny", cfg.lora, cfg.sampling), task=None).heartbeat

    async def read_by_a_beat() -> int:
        before = run.nc.stats["in_bytes"]
        await heartbeat.beat()
        return run.nc.stats["in_bytes"] - before

    def fleet_of(samplers: int) -> TrainerStatus:
        ids = [f"s{i}" for i in range(samplers)]
        return TrainerStatus(step_s=1.0, groups_per_step=4, max_staleness=1, version=3, utilisation=0.5, updated_at=0.0,
                             strikes=dict.fromkeys(ids, 1), slots=dict.fromkeys(ids, SlotsEnded(ended=9, undelivered=1)))

    await put_trainer_status(run, fleet_of(1))
    alone = await read_by_a_beat()
    await put_trainer_status(run, fleet_of(1000))
    among_many = await read_by_a_beat()
    assert among_many - alone < 100, (alone, among_many)  # the put's ack names a sequence one longer, at most
    assert not heartbeat.finished

    await put_finished(run, 3)
    await heartbeat.beat()
    assert heartbeat.finished and [s.state for s in await read_statuses(run)] == ["finished"]


async def test_the_trainer_reads_the_quarantine_once_a_second_and_sees_a_lift_within_it(runs):
    """Read every 0.1 s, the quarantine was most of an idle trainer's broker requests, paid each
    second a step waits on a large fleet (2026-12-07); an operator's lift need not be seen sooner."""
    run = await runs.open("quarantine-reads", "trainer")
    await change_quarantine(run, lambda samplers: samplers.update(s1="caught"))
    seen: list[dict[str, str]] = []
    follower = asyncio.create_task(watch_quarantine(run, seen.append))
    try:
        await eventually_async(lambda: seen == [{"s1": "caught"}], 5)
        sent = run.nc.stats["out_msgs"]
        await asyncio.sleep(3 * streams.watch.RARELY_S)
        assert run.nc.stats["out_msgs"] - sent <= 4  # three reads, and a ping at most
        await change_quarantine(run, lambda samplers: samplers.pop("s1"))
        await eventually_async(lambda: seen[-1] == {}, 5)
    finally:
        follower.cancel()
