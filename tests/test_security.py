"""Attacks on a run by clients of its broker, each on a real nats-server. Every test here was
written to fail against the code before the defence it checks."""

from __future__ import annotations

import asyncio
import signal
import ssl
import subprocess

import nats
import orjson
import pytest

from echo.config import ConfigError
from echo.config.edge import check_config_from_broker
from echo.wire.codec import decode, encode, encode_rollout, rollout_headers
from echo.wire.messages import WeightsAnnouncement
from echo.wire.names import BUDGET_KEY, CONFIG_KEY, HDR_MSG_ID, SLOTS_KEY, SLOTS_KEY_BEFORE_14, TRAINER_KEY, RunNames
from streams.client import NoBroker, open_run, require_stream
from streams.lease import AnotherTrainer, take_lease
from streams.rollouts import reader_name, reader_subscription
from streams.secure import PID_FILE, SecureDir
from streams.server import write_secret
from streams.weights import WeightsFollower, WeightsPublisher
from tests.conftest import TINY_BASE, eventually_async, stopped, tiny_config
from tests.groups import honest_group
from workers.cli import main


def _config_naming_a_shell_command(tmp_path, marker):
    cfg = tiny_config(tmp_path, run={"id": "victim"}).model_dump()
    # logging.config.dictConfig calls any "()" factory with the other keys as arguments.
    cfg["task"] = {
        "name": "logging.config:dictConfig",
        "params": {"version": 1, "handlers": {"h": {"()": "os.system", "command": f"touch {marker}"}}},
    }
    return cfg


def test_a_config_from_the_broker_naming_code_is_refused_and_nothing_runs(nats_server, tmp_path, capsys):
    marker = tmp_path / "pwned"

    async def tamper():
        run = await open_run(nats_server.url, "victim", "attacker")
        await run.state.put(CONFIG_KEY, orjson.dumps(_config_naming_a_shell_command(tmp_path, marker)))
        await run.close()

    asyncio.run(tamper())
    code = main(["sampler", "--id", "s1", "--nats", nats_server.url, "--run-id", "victim"])
    assert not marker.exists()
    assert code == 2
    assert "task.name = 'logging.config:dictConfig' comes from the broker" in capsys.readouterr().err


@pytest.mark.parametrize(
    "broker, local, refused",
    [
        ({"task": {"name": "math"}, "model": {"name": "smollm2"}}, {}, None),
        ({"task": {"name": "my_tasks:Mine"}}, {}, "task.name"),
        ({"task": {"name": "my_tasks:Mine"}}, {"task": {"name": "my_tasks:Mine"}}, None),
        ({"model": {"name": "/home/me/model"}}, {}, "model.name"),
        ({"model": {"name": "/home/me/model"}}, {"model": {"name": "/srv/model"}}, None),
        ({"task": {"name": "math", "params": {"dataset": "/etc/passwd"}}}, {}, "task.params.dataset"),
        ({"task": {"name": "reasoning_gym:chain_sum", "params": {"max_terms": 4}}}, {}, None),  # installed code
    ],
)
def test_only_built_in_names_are_taken_from_the_broker(broker, local, refused):
    if refused is None:
        check_config_from_broker(broker, local)
    else:
        with pytest.raises(ConfigError, match=refused):
            check_config_from_broker(broker, local)


async def test_a_second_trainer_refuses_to_start_and_a_dead_ones_lease_lapses(runs):
    first = await runs.open("fence", "trainer-1")
    lease = await take_lease(first)
    renewing = asyncio.create_task(lease.renew_forever())
    second = await runs.open("fence", "trainer-2")
    with pytest.raises(AnotherTrainer, match="live trainer"):
        await take_lease(second)
    renewing.cancel()  # the first trainer dies without releasing
    taken = await take_lease(second)
    assert taken.term == lease.term + 1
    with pytest.raises(AnotherTrainer):  # the old holder wakes up: its renewal fails, it stops at once
        await lease.renew_forever()
    with pytest.raises(AnotherTrainer):
        lease.check()


async def test_forged_and_pre_deduplicated_announcements_do_not_wedge_samplers(runs):
    trainer = await runs.open("forge", "trainer")
    lease = await take_lease(trainer)
    trainer_weights = WeightsPublisher(lease)
    real = await trainer_weights.publish(0, [b"v0" * 100], TINY_BASE)
    sampler_run = await runs.open("forge", "sampler")
    follower = await WeightsFollower(sampler_run, TINY_BASE).start()
    await follower.wait_for(0)

    attacker = trainer.js  # any client allowed to publish on the weights subject
    # Another term than the lease's is refused, whatever its version.
    foreign = real.model_copy(update={"version": 10**9, "term": 99})
    await attacker.publish(trainer.names.weights_subject, encode(foreign))
    # The follower only looks at the newest announcement: wait for each refusal before the next.
    await eventually_async(lambda: follower.failures["wrong_term"] == 1, 5)
    # The next version's id taken first: with the old predictable ids the real one was dropped.
    await attacker.publish(trainer.names.weights_subject, encode(foreign), headers={HDR_MSG_ID: "weights-1"})
    await eventually_async(lambda: follower.failures["wrong_term"] == 2, 5)
    await trainer_weights.publish(1, [b"v1" * 100], TINY_BASE)
    assert (await follower.wait_for(1))[0].version == 1

    # A forgery in the current term wins until the trainer restarts: its next term orders
    # its versions after every version of the old term, forged or not.
    forged = real.model_copy(update={"version": 10**9, "term": lease.term})
    await attacker.publish(trainer.names.weights_subject, encode(forged))
    await follower.wait_for(10**9)
    await lease.release()
    restarted = await take_lease(trainer)
    trainer_weights = WeightsPublisher(restarted)
    await trainer_weights.publish(2, [b"v2" * 100], TINY_BASE)
    await eventually_async(lambda: follower.ready[0].term_version == (restarted.term, 2), 5)
    await follower.stop()


async def _client(url: str, credentials, errors: list):
    async def on_error(e):
        errors.append(str(e))

    return await nats.connect(url, error_cb=on_error, max_reconnect_attempts=0, **credentials.connect_options())


async def test_a_client_without_its_certificate_and_seed_is_refused(secured, tmp_path):
    """Mutual TLS, then the nkey: a client needs a certificate the run's CA signed and a seed the
    hub knows. A stolen seed alone, or one paired with another CA's certificate, is refused."""
    server, secure = secured
    other = SecureDir(tmp_path / "other")  # another swarm's CA and users
    other.init("sec", ["localhost"], ["s1"])
    mine, theirs = secure.credentials("sampler-s1"), other.credentials("sampler-s1")

    def tls(cert_of=None):
        context = ssl.create_default_context(cafile=str(secure.ca_file))
        if cert_of:
            context.load_cert_chain(cert_of.cert_file, cert_of.key_file)
        return context

    def seed(credentials):
        return credentials.seed_file.read_text().strip()

    attempts = {
        "no TLS": {},
        "TLS, no certificate, no seed": {"tls": tls()},
        "a stolen seed without its certificate": {"tls": tls(), "nkeys_seed_str": seed(mine)},
        "a stolen seed with another CA's certificate": {"tls": tls(theirs), "nkeys_seed_str": seed(mine)},
        "a valid certificate with an unknown seed": {"tls": tls(mine), "nkeys_seed_str": seed(theirs)},
    }

    async def connects(options) -> bool:
        try:
            nc = await nats.connect(server.url, max_reconnect_attempts=0, connect_timeout=2, allow_reconnect=False,
                                    **options)
        except Exception:
            return False
        await nc.close()
        return True

    refused = {name: not await connects(options) for name, options in attempts.items()}
    assert all(refused.values()), refused
    assert await connects({"tls": tls(mine), "nkeys_seed_str": seed(mine)})  # both: accepted


async def test_a_sampler_cannot_touch_what_the_trainer_owns(secured, runs):
    """Each attack a malicious sampler could make with its own credentials: the server refuses
    it, and the trainer then finds its run as it was."""
    server, secure = secured

    trainer = await runs.open("sec", "trainer", url=server.url, credentials=secure.credentials("trainer"))
    trainer_weights = WeightsPublisher(await take_lease(trainer))
    await reader_subscription(trainer, trainer.names.rollouts_subject("s1"))
    await trainer.state.put(CONFIG_KEY, b'{"task": {"name": "math"}}')
    announcement = await trainer_weights.publish(0, [b"v0" * 100], TINY_BASE)
    names = trainer.names

    errors: list[str] = []
    nc = await _client(server.url, secure.credentials("sampler-s1"), errors)
    js = nc.jetstream(domain="hub", timeout=1.0)
    forged = encode(announcement.model_copy(update={"version": 10**9}))
    impostor = encode_rollout(honest_group(group_id="imp", sampler_id="s2"))
    attacks = [
        js.delete_stream(names.rollouts_stream),
        js.purge_stream(names.rollouts_stream),
        js.delete_consumer(names.rollouts_stream, reader_name(names, names.rollouts_subject("s1"))),
        js.add_stream(name="ECHO_sec_JUNK", subjects=["junk.>"]),
        js.publish(f"$JS.hub.API.$KV.{names.state_bucket}.{CONFIG_KEY}", b'{"task": {"name": "os:system"}}'),
        js.publish(f"$KV.{names.state_bucket}.{TRAINER_KEY}", b"{}"),
        js.publish(f"$KV.{names.state_bucket}.{BUDGET_KEY}", b"{}"),
        js.publish(f"$KV.{names.state_bucket}.samplers.s2", b"{}"),
        js.publish(f"$KV.{names.registry_bucket}.s2", b"{}"),  # another's heartbeat
        js.publish(f"$KV.{names.state_bucket}.{SLOTS_KEY}", b"1000000"),  # starve the others of slots
        js.publish(f"$KV.{names.state_bucket}.{SLOTS_KEY_BEFORE_14}", b"1000000"),  # as a resumed run reads it
        nc.request(names.grants_subject("s2"), b"{}", timeout=1.0),  # ask for work as another sampler
        js.publish(names.weights_subject, forged),
        js.publish(names.weights_subject, forged, headers={HDR_MSG_ID: "weights-1"}),
        js.publish(names.pull_subject, b"{}"),
        js.publish(names.rollouts_subject("s2"), impostor),
        js.publish(names.bodies_subject("s2"), b"part"),  # a body under another's name
        js.purge_stream(names.bodies_stream),
        # A JetStream API flood: INFO with a subject listing (~150 KB an answer) in a flood filled the server's
        # one JetStream info queue, where the trainer's own calls wait too: no step for 44-80 s.
        js.stream_info(names.weights_stream, subjects_filter=">"),
        js.stream_info(f"KV_{names.state_bucket}"),
        js.stream_info(f"KV_{names.registry_bucket}"),
    ]
    for attack in attacks:
        with pytest.raises((nats.errors.TimeoutError, asyncio.TimeoutError, nats.js.errors.APIError)):
            await attack
    # Replies to others: a subscription on every inbox is refused.
    await nc.subscribe("_INBOX.>")
    await nc.flush()
    # The server's refusals arrive through the error callback.
    await eventually_async(lambda: any("permissions violation for subscription" in e and "_inbox.>" in e.lower()
                                       for e in errors), 10)
    assert sum("permissions violation for publish" in e for e in errors) == len(attacks)
    # What a sampler may do still works.
    await js.publish(names.rollouts_subject("s1"), encode_rollout(honest_group(group_id="mine")),
                     headers=rollout_headers(honest_group(group_id="mine")))
    await js.publish(names.bodies_subject("s1"), b"part")  # a large group's part
    await nc.close()

    info = await trainer.js.stream_info(names.rollouts_stream)
    assert info.state.messages == 1  # only s1's own group
    assert (await trainer.js.stream_info(names.bodies_stream)).state.messages == 1
    await trainer.js.consumer_info(names.rollouts_stream, reader_name(names, names.rollouts_subject("s1")))
    assert (await trainer.state.get(CONFIG_KEY)).value == b'{"task": {"name": "math"}}'
    last = await trainer.js.get_last_msg(names.control_stream, names.weights_subject)
    assert decode(WeightsAnnouncement, last.data).version == 0


def test_add_sampler_issues_credentials_a_running_hub_accepts_without_a_restart(secured):
    """Accepted, and able to do its work: nats-server leaves inert the imports of an account a
    reload introduces, so a sampler issued into one connected and reached nothing. Joined at
    once, as a sampler does: a connection made while the hub reloads loses its subscriptions
    (its requests went unanswered for good, 1 try in 4), and is replaced."""
    server, secure = secured

    async def connect_new(sampler_id: str):
        credentials = secure.add_sampler(sampler_id)  # rewrites the user list and signals the hub
        for _ in range(50):  # the reload is asynchronous: until it has begun, the user is unknown
            try:
                run = await open_run(server.url, "sec", sampler_id, credentials=credentials, create=False,
                                     give_up_s=5)
                break
            except NoBroker:
                await asyncio.sleep(0.1)
        else:
            pytest.fail("the new sampler's credentials were not accepted")
        await require_stream(run.js, RunNames("sec").weights_stream)  # reads by direct gets, its only reads
        assert (await run.js.publish(RunNames("sec").rollouts_subject(sampler_id), b"{}")).seq
        await run.close()

    async def main_():
        trainer = await open_run(server.url, "sec", "trainer", credentials=secure.credentials("trainer"))
        for sampler_id in ("s8", "s9"):  # the second is issued into the spare the first one's reload made
            await connect_new(sampler_id)
        await trainer.close()

    asyncio.run(main_())
    assert main(["secure", "add-sampler", str(secure.dir), "s9"]) == 2  # issued already: refused


def test_replay_reads_a_secured_run_with_an_observers_credentials(secured, tmp_path):
    server, secure = secured

    async def publish():
        trainer = await open_run(server.url, "sec", "trainer", credentials=secure.credentials("trainer"))
        group = honest_group(group_id="seen")
        await trainer.js.publish(trainer.names.rollouts_subject("s1"), encode_rollout(group), headers=rollout_headers(group))
        await trainer.close()

    asyncio.run(publish())
    observer = secure.credentials("observer")
    out = tmp_path / "replay.jsonl"
    assert main(["replay", "--run", "sec", "--nats", server.url, "--out", str(out),
                 "--creds", str(observer.seed_file), "--tls-ca", str(observer.ca_file)]) == 0
    [record] = [orjson.loads(line) for line in out.read_text().splitlines()]
    assert record["group"]["group_id"] == "seen"


def test_seeds_and_keys_are_owners_only_from_their_first_byte(tmp_path):
    secure = SecureDir(tmp_path / "secure")
    secure.init("sec", ["localhost"], ["s1"])
    secrets = [*secure.dir.glob("*.nk"), *secure.dir.glob("*key.pem")]
    assert secrets and all(f.stat().st_mode & 0o777 == 0o600 for f in secrets)
    stale = tmp_path / "was-readable"
    stale.write_text("old")
    stale.chmod(0o644)
    write_secret(stale, b"seed")
    assert stale.stat().st_mode & 0o777 == 0o600 and stale.read_bytes() == b"seed"


def test_a_reload_signals_only_a_nats_server(tmp_path):
    """The pid file of a hub in a container (or one that stopped) names another process here:
    add-sampler must not send it SIGHUP."""
    secure = SecureDir(tmp_path / "secure")
    secure.init("sec", ["localhost"], ["s1"])
    bystander = subprocess.Popen(["sleep", "30"])
    try:
        (secure.dir / PID_FILE).write_text(str(bystander.pid))
        assert secure.reload() is False
        # Pending signals are delivered lowest number first: had SIGHUP (1) been sent, it, not
        # SIGUSR1 (10), would end the bystander.
        bystander.send_signal(signal.SIGUSR1)
        assert bystander.wait(timeout=30) == -signal.SIGUSR1  # not hung up on
    finally:
        stopped(bystander)
