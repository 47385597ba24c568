"""A relay on a secured hub: its leaf credentials mirror the weights and nothing else, the hub
accepts no other leaf connection, and a relay that listens beyond this machine needs
credentials. Real nats-server processes on loopback; each test fails against the code before
relays took credentials."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys

import nats
import pytest
from nats.errors import NoRespondersError
from nats.js.errors import APIError, NoStreamResponseError, ServiceUnavailableError

from echo.wire.codec import encode_rollout, rollout_headers
from echo.wire.names import CONFIG_KEY, RunNames
from streams.client import connect, open_run, wait_for_jetstream
from streams.lease import take_lease
from streams.secure import SERVER_CONF, SecureDir
from streams.server import NatsServer, ServerConfig, free_port
from streams.weights import WeightsFollower, WeightsPublisher
from tests.conftest import TINY_BASE, relay, stopped
from tests.groups import honest_group
from workers.cli import main

REFUSED = (NoRespondersError, NoStreamResponseError, nats.errors.TimeoutError, asyncio.TimeoutError, APIError,
           ServiceUnavailableError)


@pytest.fixture
def secured_hub(tmp_path):
    """A TLS-only hub accepting leaf connections, with credentials for run "sec": trainer,
    sampler s1 and relay "site"."""
    secure = SecureDir(tmp_path / "secure")
    secure.init("sec", ["localhost", "127.0.0.1"], ["s1"])
    secure.add_relay("site", [])
    with NatsServer(tmp_path / "hub", ServerConfig(leaf_port=free_port(), include=secure.dir / SERVER_CONF,
                    leaf_include=secure.leaf_conf, log_file=tmp_path / "hub.log")) as hub:
        yield hub, secure


def _relay_creds(secure: SecureDir) -> list[str]:
    return ["--creds", str(secure.relay_files("site").seed_file), "--tls-ca", str(secure.ca_file)]


async def _relay_side_client(url: str, files):
    """A client of a leaf server holding a relay's seed, with replies under the relay's own inbox
    prefix: the only one the hub delivers to that leaf."""
    return await nats.connect(url, inbox_prefix=files.connect_options()["inbox_prefix"])


def test_a_secured_relay_serves_its_samplers_the_trainers_weights(secured_hub, tmp_path):
    hub, secure = secured_hub

    async def follow(site):
        trainer = await open_run(hub.url, "sec", "trainer", credentials=secure.credentials("trainer"))
        trainer_weights = WeightsPublisher(await take_lease(trainer))
        await trainer_weights.publish(0, [b"v0" * 100], TINY_BASE)
        sampler = await asyncio.wait_for(open_run(
            hub.url, "sec", "sampler-s1", credentials=secure.credentials("sampler-s1"), create=False,
            weights_url=site.url), 60)
        follower = await WeightsFollower(sampler, TINY_BASE).start()
        assert (await asyncio.wait_for(follower.wait_for(0), 30))[1] == [b"v0" * 100]
        big = bytes(range(256)) * (12 * 4096)  # 12 MiB: mirror flow control crosses the leaf too
        await trainer_weights.publish(1, [big], TINY_BASE)
        assert (await asyncio.wait_for(follower.wait_for(1), 60))[1] == [big]
        site.stop()  # a restarted relay resumes its mirrors with the same permissions
        await trainer_weights.publish(2, [b"v2" * 100], TINY_BASE)
        site.start()
        assert (await asyncio.wait_for(follower.wait_for(2), 60))[1] == [b"v2" * 100]
        assert follower.failures == {}
        await follower.stop()
        await sampler.close()
        await trainer.close()

    with relay(tmp_path, hub.leaf_url, "sec", "site", creds=_relay_creds(secure)) as site:
        asyncio.run(follow(site))


def test_relay_credentials_mirror_and_nothing_else(secured_hub, tmp_path):
    """A hostile site holding the relay's seed: as a client the hub refuses it; as a leaf node,
    what its clients try beyond mirroring never reaches the hub, which keeps its run as it was."""
    hub, secure = secured_hub
    files = secure.relay_files("site")
    names = RunNames("sec")

    async def attack(evil_url):
        trainer = await open_run(hub.url, "sec", "trainer", credentials=secure.credentials("trainer"))
        await take_lease(trainer)
        await trainer.state.put(CONFIG_KEY, b'{"task": {"name": "math"}}')
        group = honest_group(group_id="evil", sampler_id="s1")
        await trainer.js.publish(names.rollouts_subject("s1"), encode_rollout(group), headers=rollout_headers(group))
        with pytest.raises(Exception):  # a relay's nkey opens leaf connections only
            await nats.connect(hub.url, max_reconnect_attempts=0, allow_reconnect=False, connect_timeout=2,
                               **files.connect_options())

        nc = await _relay_side_client(evil_url, files)
        js = nc.jetstream(domain="hub", timeout=1.0)
        await wait_for_jetstream(js, "hub through the leaf", timeout=20)  # the leaf is up: INFO is allowed
        attacks = [
            lambda: js.publish(names.rollouts_subject("s1"), encode_rollout(honest_group(group_id="x")),
                               headers=rollout_headers(honest_group(group_id="x"))),
            lambda: js.publish(f"$JS.hub.API.$KV.{names.state_bucket}.{CONFIG_KEY}",
                               b'{"task": {"name": "os:system"}}'),
            lambda: js.publish(f"$KV.{names.state_bucket}.{CONFIG_KEY}", b"{}"),
            lambda: js.stream_info(names.rollouts_stream),
            lambda: js.pull_subscribe(">", "thief", stream=names.rollouts_stream),
            lambda: js.get_last_msg(names.rollouts_stream, names.rollouts_subject("s1")),
            lambda: js.delete_stream(names.rollouts_stream),
            lambda: js.delete_stream(names.weights_stream),
            lambda: js.purge_stream(names.control_stream),
        ]
        for attempt in attacks:
            with pytest.raises(REFUSED):
                await attempt()
        await nc.close()

        assert (await trainer.js.stream_info(names.rollouts_stream)).state.messages == 1  # only the trainer's own
        assert (await trainer.state.get(CONFIG_KEY)).value == b'{"task": {"name": "math"}}'
        await trainer.js.stream_info(names.weights_stream)
        await trainer.close()

    evil = NatsServer(tmp_path / "evil", ServerConfig(domain="evil", hub_leaf_url=hub.leaf_url, hub_leaf_options=files.leaf_remote()))
    with evil:
        asyncio.run(attack(evil.url))


@pytest.mark.parametrize("seed, refusal", [(None, "tls handshake failure"), ("sampler-s1", "authentication error")],
                         ids=["anonymous", "sampler-seed"])
def test_the_secured_hubs_leaf_port_refuses_other_leaf_connections(secured_hub, tmp_path, seed, refusal):
    """Without a certificate the CA signed, a leaf connection ends at the TLS handshake; with a
    sampler's seed and certificate, at the nkey (a sampler's opens client connections only)."""
    hub, secure = secured_hub
    options = {"tls": {"ca_file": str(secure.ca_file)}}
    if seed:
        credentials = secure.credentials(seed)
        options["nkey"] = credentials.seed_file.read_text().strip()
        options["tls"] |= {"cert_file": str(credentials.cert_file), "key_file": str(credentials.key_file)}

    async def reach_hub(url):
        nc = await connect(url, "leaf-client")
        try:
            with pytest.raises(RuntimeError, match="no JetStream answers"):
                await wait_for_jetstream(nc.jetstream(domain="hub"), "hub", timeout=3)
        finally:
            await nc.close()

    with NatsServer(tmp_path / "leaf", ServerConfig(domain="leaf", hub_leaf_url=hub.leaf_url, hub_leaf_options=options)) as leaf:
        asyncio.run(reach_hub(leaf.url))
    assert refusal in (tmp_path / "hub.log").read_text().lower()


def test_add_relay_issues_leaf_credentials_a_running_hub_accepts_without_a_restart(secured_hub, tmp_path):
    hub, secure = secured_hub
    files = secure.add_relay("late", [])  # rewrites the user list and signals the hub

    async def reach_hub(url):
        nc = await _relay_side_client(url, files)
        await wait_for_jetstream(nc.jetstream(domain="hub"), "hub through the new relay's leaf", timeout=20)
        await nc.close()

    with NatsServer(tmp_path / "late", ServerConfig(domain="late", hub_leaf_url=hub.leaf_url,
                    hub_leaf_options=files.leaf_remote())) as leaf:
        asyncio.run(reach_hub(leaf.url))
    assert main(["secure", "add-relay", str(secure.dir), "late"]) == 2  # issued already: refused


def _relay_cli(tmp_path, hub_leaf_url: str, *flags: str) -> list[str]:
    return ["relay", "--hub", hub_leaf_url, "--run-id", "r", "--domain", "site",
            "--port", str(free_port()), "--store", str(tmp_path / "site"), *flags]


def test_a_relay_open_to_other_machines_needs_credentials_or_insecure(tmp_path, capsys):
    assert main(_relay_cli(tmp_path, "nats-leaf://127.0.0.1:1", "--host", "0.0.0.0")) == 2
    err = capsys.readouterr().err
    assert "--host 0.0.0.0" in err and "--creds" in err and "--tls-ca" in err and "--insecure" in err

    with NatsServer(tmp_path / "hub", ServerConfig(leaf_port=free_port())) as hub:
        args = _relay_cli(tmp_path, hub.leaf_url, "--host", "0.0.0.0", "--insecure")
        proc = subprocess.Popen([sys.executable, "-m", "workers.cli", *args], stderr=subprocess.PIPE, text=True)
        lines = []
        try:
            for line in proc.stderr:  # until it says it mirrors the hub, or exits (within 30 s) saying why
                lines.append(line)
                if "relay.ready" in line:
                    break
            assert "relay.ready" in lines[-1], "".join(lines)
        finally:
            stopped(proc, sig=signal.SIGTERM, timeout=20)
