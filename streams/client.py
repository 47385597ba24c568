"""Connecting to NATS and opening (idempotently creating) everything a run owns."""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import ssl
import time
import uuid
from dataclasses import dataclass
from typing import Awaitable, Callable, TypeVar

import nats
import structlog
from nats.aio.client import Client as NATS
from nats.errors import NoRespondersError, NoServersError
from nats.js import JetStreamContext
from nats.js.api import KeyValueConfig, StreamConfig
from nats.js.errors import APIError, BadRequestError, NotFoundError, ServiceUnavailableError
from nats.js.kv import KeyValue
from nats.js.object_store import ObjectStore

from echo.config import ConfigError
from echo.wire.names import HDR_MSG_ID, HUB_DOMAIN, ID_PATTERN, RunNames, Storage
from streams import layout
from streams.credentials import Credentials

M = TypeVar("M")

log = structlog.get_logger()

# What a call to a broker that is restarting or out of reach raises: worth trying again, unlike
# an error in our own code. nats-py's timeouts subclass TimeoutError; it decodes a JetStream
# reply as JSON, and a status-only reply (a broker restarting) fails that decoding.
BROKER_ERRORS = (nats.errors.Error, TimeoutError, ConnectionError, json.JSONDecodeError)

RECANCEL_AFTER_S = 0.5  # a task still running this long after its cancellation is cancelled again
# How long a command a person waits on (status, replay, plan, quarantine) tries to reach the
# broker before it says why not, in one line (a run it names is there, or not, at once).
PATIENCE_S = 10.0


async def cancel_until_done(tasks: list[asyncio.Task], every_s: float = RECANCEL_AFTER_S) -> None:
    """Cancel the tasks and wait for them to end. nats-py swallows a CancelledError that lands
    inside its flush (Client._flush_pending): a task cancelled there runs on, so one
    cancellation can be lost. Cancel again until every task has ended."""
    while running := [task for task in tasks if not task.done()]:
        for task in running:
            task.cancel()
        await asyncio.wait(running, timeout=every_s)


async def retry_forever(what: str, call: Callable[[], Awaitable[M]], first_delay_s: float = 0.25,
                        max_delay_s: float = 10.0) -> M:
    """`call()` again, with backoff and no limit, while the broker fails it (restarting, out of
    reach, a cluster electing a new leader); for calls that are safe to repeat. An error of
    our own code is raised at once."""
    delay = first_delay_s
    while True:
        try:
            return await call()
        except BROKER_ERRORS as e:
            log.warning("broker.retry", what=what, reason=repr(e), retry_in_s=delay)
            await asyncio.sleep(delay)
            delay = min(2 * delay, max_delay_s)


class NoBroker(ConfigError):
    """A first connection that cannot succeed as configured: the server refused this client's
    certificate or credentials, or nothing answered within the patience of a command a person waits on."""


# Retrying cannot mend these on a first connection (a certificate, a CA, credentials or TLS
# settings that do not match the server's): a wrong value is said at once, not retried for hours.
REFUSALS = (ssl.SSLError, nats.errors.AuthorizationError, nats.errors.SecureConnRequiredError,
            nats.errors.SecureConnWantedError, nats.errors.SecureConnFailedError)


def refused(e: Exception) -> bool:
    # nats-py raises the server's "-ERR 'Authorization Violation'" as a plain nats.errors.Error
    return isinstance(e, REFUSALS) or "authorization violation" in str(e).lower()


class RequestLost(nats.errors.Error):
    """A request whose connection dropped before its answer came: a broker error, tried again."""


class ConnectionEvents:
    """One log line per connection event, never a traceback for an expected network event (nats-py's
    default logs each failed attempt with its traceback, and says nothing of a wrong URL): the
    server cannot be reached (which URL, why, retrying; the same reason again at most every
    REPEAT_S), a disconnect, a reconnect. Before the first connection, a refusal resolves
    `refused` with its reason instead."""

    REPEAT_S = 30.0

    def __init__(self, url: str):
        self.url, self.nc = url, None
        self.last: tuple[str, float] | None = None  # the last reason logged, and when
        self.refused: asyncio.Future[str] = asyncio.get_running_loop().create_future()

    async def error(self, e: Exception) -> None:
        reason, now = self.reason(e), time.monotonic()
        if self.nc is None and refused(e):
            if not self.refused.done():
                self.refused.set_result(reason)
            return
        if self.last and self.last[0] == reason and now - self.last[1] < self.REPEAT_S:
            return
        self.last = (reason, now)
        if isinstance(e, (OSError, asyncio.TimeoutError, NoServersError)):
            log.warning("nats.unreachable", url=self.url, reason=reason, retrying=True)
        else:
            log.warning("nats.error", url=self.url, reason=reason)

    @staticmethod
    def reason(e: Exception) -> str:
        if isinstance(e, (TimeoutError, asyncio.TimeoutError)) and not str(e):
            # The TCP connection was made and nothing spoke NATS on it within connect_timeout.
            return "connected, but no NATS greeting came: not a NATS server's client port (the monitoring " \
                   "port? a proxy?), or one too busy to answer"
        return f"{type(e).__name__}: {e}"

    async def disconnected(self) -> None:
        if self.nc is not None and not self.nc.is_closed:  # nats-py calls this on close() too
            # Requests sent on the connection that dropped: their answers will not come (the server
            # is gone, or answers the old connection). Failed now, each is tried again on the next
            # connection, not waited out to its timeout (a rollout's publish 10 s, a KV write 5 s:
            # the longest stalls of a rolling restart, test_cluster.py).
            lost = [future for future in self.nc._resp_map.values() if not future.done()]
            for future in lost:
                future.set_exception(RequestLost("the connection it was sent on dropped before its answer"))
            log.warning("nats.disconnected", url=self.url, reconnecting=True, requests_failed=len(lost))

    async def reconnected(self) -> None:
        self.last = None
        log.info("nats.reconnected", url=self.url)


async def connect(url: str, name: str, credentials: Credentials | None = None,
                  give_up_s: float | None = None) -> NATS:
    """`url`: one server, or a cluster's servers separated by commas (any of them will do).
    Out of reach, the first connection is retried without end (a worker waits for its broker),
    or for `give_up_s` (a command a person waits on); a refusal raises NoBroker at once."""
    # Reconnect forever: a sampler on a flaky link should wait out a broker restart, not die.
    options = credentials.connect_options() if credentials else {}
    events, nc = ConnectionEvents(url), NATS()
    connecting = asyncio.ensure_future(nc.connect(
        url.split(","), name=name, max_reconnect_attempts=-1, reconnect_time_wait=0.5, connect_timeout=5,
        error_cb=events.error, disconnected_cb=events.disconnected, reconnected_cb=events.reconnected, **options
    ))
    try:
        await asyncio.wait([connecting, events.refused], timeout=give_up_s, return_when=asyncio.FIRST_COMPLETED)
    finally:
        if not connecting.done():
            await cancel_until_done([connecting])
            with contextlib.suppress(Exception):
                await nc.close()
    if connecting.done() and not connecting.cancelled():
        connecting.result()  # raises what a first connection raised
        events.nc = nc
        return nc
    if events.refused.done():
        raise NoBroker(f"{url} refused {name}: {events.refused.result()}")
    last = f" (last: {events.last[0]})" if events.last else ""
    raise NoBroker(f"no NATS server answered at {url} within {give_up_s:g} s{last}")


@dataclass
class RunClient:
    """One process's client of one run (open_run): its connections, and the run's streams and
    buckets on them. Not the run (`cfg.run`), nor a command's `run`."""

    nc: NATS
    js: JetStreamContext  # the hub's JetStream: rollouts, control, state
    # The JetStream of the server weights are read from: the one this process is connected to
    # (the hub itself, or a site's relay mirroring the weights bucket and announcements,
    # streams/relay.py), or a relay reached by a second connection, `weights_nc`. Weights are
    # read from here, so each byte crosses the hub's uplink once per site.
    local_js: JetStreamContext
    names: RunNames
    weights: ObjectStore
    state: KeyValue  # the trainer's: only it writes here
    registry: KeyValue  # the samplers' heartbeats, each its own key (streams/registry.py)
    weights_nc: NATS | None = None

    async def close(self) -> None:
        # Every publish here is awaited for its ack already, so there is nothing to drain.
        for nc in (self.weights_nc, self.nc):
            if nc is not None:
                # With the server gone, nats-py 2.16 flushes what it buffered meanwhile onto the
                # lost connection and raises; the client is closed all the same.
                with contextlib.suppress(ConnectionError):
                    await nc.close()


# How long a small write (a KV key, a rollout message under ROLLOUT_MESSAGE_MAX) waits for its
# ack before it is tried again. An ack comes in milliseconds; one whose request reached a
# stream's leader as its leadership moved (a node's planned restart) never comes, and waiting
# out nats-py's 5 s (10 s for a rollout) stalled writes longer than an election would
# (tests/test_cluster.py). Larger writes add their transfer over a slow uplink.
WRITE_TIMEOUT_S = 3.0
SLOW_UPLINK_BYTES_PER_S = 1.25e6  # 10 Mbit/s


def write_timeout_s(size: int) -> float:
    return WRITE_TIMEOUT_S + size / SLOW_UPLINK_BYTES_PER_S


class _KVWrites:
    """A JetStream context for a KV bucket whose publishes wait WRITE_TIMEOUT_S for their ack,
    and go to `$JS.<domain>.API.<subject>` when the hub has a domain.

    nats-py 2.16 writes a KV key by publishing to `$KV.<bucket>.<key>`, which a leaf node with a
    JetStream domain of its own (a relay) keeps to itself. nats.go prefixes the domain's API, as
    here; the hub answers that subject for clients connected to it directly too. Everything else
    (reads, watches) goes to the wrapped context unchanged."""

    def __init__(self, js: JetStreamContext, domain: str | None):
        self._js, self._writes_prefix = js, f"$JS.{domain}.API." if domain else ""  # not _prefix: the context's

    def __getattr__(self, name):
        return getattr(self._js, name)

    async def publish(self, subject: str, *args, timeout: float | None = None, **kwargs):
        return await self._js.publish(self._writes_prefix + subject, *args, timeout=timeout or WRITE_TIMEOUT_S,
                                      **kwargs)


async def put_expiring(kv: KeyValue, key: str, value: bytes, ttl_s: int) -> None:
    """kv.put with a per-key TTL: the key goes by itself `ttl_s` whole seconds after its last write
    (nats-py creates KV streams that allow message TTLs; its put takes none, so this is its write
    with the TTL header, through the same domain prefix)."""
    await kv._js.publish(f"{kv._pre}{key}", value, msg_ttl=ttl_s)


async def _create_kv(js: JetStreamContext, config: KeyValueConfig, domain: str | None) -> KeyValue:
    await js.create_key_value(config=config)
    return bind_kv(js, config.bucket, domain)


# Binding to a bucket asks the broker nothing. nats-py's key_value() and object_store() send a
# STREAM.INFO each, which samplers may not (streams/secure.py): its answers wait in the server's
# one JetStream API info queue, which the trainer's own calls need too (a flood of such requests
# with subject listings, ~150 KB each, stalled a run 44-80 s). Both buckets are read by direct
# gets (streams/layout.py).
def bind_kv(js: JetStreamContext, bucket: str, domain: str | None) -> KeyValue:
    return KeyValue(name=bucket, stream=f"KV_{bucket}", pre=f"$KV.{bucket}.",
                    js=_KVWrites(js, domain), direct=True)


def bind_object_store(js: JetStreamContext, bucket: str) -> ObjectStore:
    return ObjectStore(name=bucket, stream=f"OBJ_{bucket}", js=js)


async def direct_get_batch(js: JetStreamContext, stream: str, request: dict, timeout: float) -> list:
    """The messages of one batched direct get (nats-server 2.11+, ADR-31) that `request` names
    (`multi_last`; or `next_by_subj`, `seq` and `batch`); [] where there are none. The answer ends
    with the server's status (204: all sent; 404: none), and a message is what carries the
    server's `Nats-Stream` header: a sampler's heartbeat written with a `Status` header of its own
    once ended the reading of every later holder's. Taken by a callback: nats-py's `next_msg`
    makes a task a message, and in a process busy with 500 samplers 1,000 heartbeats took 29 s to
    read so (2026-12-07). TimeoutError where the end does not come within `timeout`;
    nats.errors.Error for any other status."""
    nc, msgs, ended = js._nc, [], asyncio.get_running_loop().create_future()

    async def take(msg) -> None:
        headers = msg.headers or {}
        if ended.done():
            return
        if "Nats-Stream" in headers:
            msgs.append(msg)
        else:
            ended.set_result((headers.get("Status", ""), headers.get("Description", "")))

    inbox = nc.new_inbox()
    subscription = await nc.subscribe(inbox, cb=take)
    try:
        await nc.publish(f"{js._prefix}.DIRECT.GET.{stream}", json.dumps(request).encode(), reply=inbox)
        try:
            status, description = await asyncio.wait_for(ended, timeout)
        except asyncio.TimeoutError:
            raise TimeoutError(f"{len(msgs)} messages of a direct get of {stream}, "
                               f"then none for {timeout} s") from None
    finally:
        # Closed meanwhile, it has nothing to unsubscribe; raised here, its error took the place of
        # a cancellation, which the caller's retry then took for a broker's failure, for good.
        with contextlib.suppress(nats.errors.Error):
            await subscription.unsubscribe()
    if status not in ("204", "404"):
        raise nats.errors.Error(f"a direct get of {stream} answered {status}: {description}"[:200])
    return msgs


async def require_stream(js: JetStreamContext, stream: str) -> None:
    """NotFoundError unless `stream` exists: a direct get of its first message (absent or not:
    the stream answers), not INFO. No stream, no responders."""
    try:
        await js.get_msg(stream, seq=1, direct=True)
    except NotFoundError:
        pass
    except NoRespondersError:
        raise NotFoundError(description=f"no stream {stream}") from None


class NoWeightsMirror(ConfigError):
    pass


class Unanswered(TimeoutError):
    """A request the server took and never answered."""


async def wait_for_jetstream(js: JetStreamContext, where: str, timeout: float = 30.0,
                             raise_unanswered: bool = False) -> None:
    """Wait until `js` answers: a domain behind a leaf connection that is still being made
    (a relay just started, or reconnecting) has no responders for a moment. A request that
    times out is tried again, or raised at once as Unanswered (`raise_unanswered`)."""
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        try:
            await js.account_info()
            return
        except (NoRespondersError, ServiceUnavailableError, TimeoutError, asyncio.TimeoutError) as e:
            if raise_unanswered and isinstance(e, (TimeoutError, asyncio.TimeoutError)):
                raise Unanswered(f"{where}: {e!r}") from None
            if asyncio.get_running_loop().time() > deadline:
                raise RuntimeError(f"no JetStream answers at {where} after {timeout:.0f} s ({e!r})") from None
            await asyncio.sleep(0.2)


async def answers_direct_gets(js: JetStreamContext, stream: str, where: str) -> None:
    """Unanswered unless a direct get of `stream` is answered: with its first message, none
    there, or no such stream (yet), each an answer. All a sampler may ask JetStream: it has no
    INFO (streams/secure.py)."""
    try:
        await require_stream(js, stream)
    except NotFoundError:  # not there (yet): an answer too
        pass
    except (TimeoutError, asyncio.TimeoutError) as e:
        raise Unanswered(f"{where}: {e!r}") from None


async def connect_answered(url: str, name: str, credentials: Credentials | None, give_up_s: float | None,
                           hub_domain: str | None, wait_s: float, joined: RunNames | None = None) -> NATS:
    """A connection whose JetStream answers: its INFO (the trainer, which creates the run), or a
    direct get of the state bucket of the run it `joined` (any other client). nats-server loses
    the subscriptions of a client that connects while it reloads its accounts (`secure
    add-sampler`): its requests go out and no answer ever comes back while it stays connected. A
    connection whose request times out is replaced by a new one (a reload takes milliseconds)."""
    where = f"{url} (domain {hub_domain})"
    deadline = asyncio.get_running_loop().time() + wait_s
    while True:
        nc = await connect(url, name, credentials, give_up_s)
        try:
            left = max(deadline - asyncio.get_running_loop().time(), 0.0)
            js = nc.jetstream(domain=hub_domain)
            if joined is None:
                await wait_for_jetstream(js, where, left, raise_unanswered=True)
            else:
                await answers_direct_gets(js, f"KV_{joined.state_bucket}", where)
            return nc
        except Unanswered as e:
            await nc.close()
            if asyncio.get_running_loop().time() > deadline:
                if joined is not None:  # its permissions drop a read of another run
                    raise no_run(joined.run_id, e) from None
                raise RuntimeError(f"no JetStream answers at {where} after {wait_s:.0f} s ({e})") from None
            log.warning("nats.unanswered", url=url, reason=str(e), reconnecting=True)
        except BaseException:
            await nc.close()
            raise


NO_PEERS_YET = 10005  # "no suitable peers for placement": a cluster whose nodes have not all joined yet
STORAGE_EXCEEDED = 10047  # "insufficient storage resources available": the account's or the server's
# A write refused for room: "resource limits exceeded for account", and the server's "insufficient resources".
STORAGE_FULL = (10002, 10023)
PLACEMENT_WAIT_S = 60.0


async def _add_or_update_stream(js: JetStreamContext, config: StreamConfig) -> None:
    """Create the stream, or bring an existing one to `config` (a restarted trainer given other
    retention limits)."""
    try:
        await js.add_stream(config)
    except BadRequestError as e:  # in use with another configuration
        if e.err_code == NO_PEERS_YET:
            raise
        await js.update_stream(config)


async def _reserve_rollouts(js: JetStreamContext, names: RunNames, storage: Storage) -> None:
    """The two rollout streams. Where the run's account has a storage limit (`secure init
    --run-storage-gb`), each reserves its size limit within it (nats-server counts a stream's
    max_bytes against the account when the stream is made): what samplers write can then never
    fill the room the run's weights and state need, so no flood of theirs stops the trainer's
    own writes. A stream without a size limit reserves nothing, and two that fill the account
    leave the weights no room: both refused here."""
    limit = (await js.account_info()).limits.max_storage
    if limit >= 0 and not 0 < 2 * storage.rollouts_max_bytes < limit:
        raise ConfigError(f"nats.rollouts_max_gb: the run's account keeps at most {limit / 2**30:.3g} GB on the hub; "
                          f"give the two rollout streams a size limit under half of it, leaving room for the weights")
    try:
        await _add_or_update_stream(js, layout.rollouts_stream(names, storage))
        await _add_or_update_stream(js, layout.bodies_stream(names, storage))
    except APIError as e:
        if e.err_code != STORAGE_EXCEEDED:
            raise
        raise ConfigError(f"nats.rollouts_max_gb: two rollout streams of {storage.rollouts_max_bytes / 2**30:.3g} GB "
                          f"do not fit the storage the run's account (or the hub) has left: {e.description}") from None


async def _create_run(js: JetStreamContext, names: RunNames, hub_domain: str | None, storage: Storage):
    await _reserve_rollouts(js, names, storage)
    await _add_or_update_stream(js, layout.control_stream(names, storage))
    # nats-py overwrites config.bucket with the positional name: pass both.
    weights = await js.create_object_store(names.weights_bucket, config=layout.weights_bucket(names, storage))
    state = await _create_kv(js, layout.state_bucket(names, storage), hub_domain)
    await _add_or_update_stream(js, layout.registry_stream(names, storage))
    return weights, state, bind_kv(js, names.registry_bucket, hub_domain)


async def _create_run_once_placed(js: JetStreamContext, names: RunNames, hub_domain: str | None, storage: Storage):
    """_create_run, tried again while a cluster still forms (its replicas have nowhere to go yet:
    a trainer started with the nodes, as `up --cluster` does, failed on its first stream)."""
    deadline = asyncio.get_running_loop().time() + PLACEMENT_WAIT_S
    while True:
        try:
            return await _create_run(js, names, hub_domain, storage)
        except BadRequestError as e:
            if e.err_code != NO_PEERS_YET or asyncio.get_running_loop().time() > deadline:
                raise
            log.info("nats.placement_pending", reason=e.description)
            await asyncio.sleep(0.5)


async def _join_run(js: JetStreamContext, names: RunNames, hub_domain: str | None, wait_s: float):
    """Bind to a run the trainer created, waiting up to `wait_s` for it to do so: on a secured
    broker only the trainer may create streams and buckets. A secured broker answers nothing to
    credentials issued for another run (its permissions drop the request): that is a timeout."""
    deadline, waited, others = asyncio.get_running_loop().time() + wait_s, False, []
    while True:
        try:
            await require_stream(js, f"KV_{names.state_bucket}")  # the trainer creates the registry next
            return (bind_object_store(js, names.weights_bucket), bind_kv(js, names.state_bucket, hub_domain),
                    bind_kv(js, names.registry_bucket, hub_domain))
        except (NotFoundError, *BROKER_ERRORS) as e:  # BucketNotFoundError too; or the broker restarting
            if asyncio.get_running_loop().time() > deadline:
                raise no_run(names.run_id, e, others) from None
            if not waited and wait_s > 0:
                others = await runs_on(js) if isinstance(e, NotFoundError) else []
                if others:  # a typo in the run id, most likely: say so at once, and which runs are here
                    log.warning("run.not_here", run=names.run_id, runs_here=others, for_s=wait_s,
                                why="no trainer has created it: is the run id right? (waiting for it meanwhile)")
                else:
                    log.info("run.waiting", run=names.run_id, for_s=wait_s, why="no trainer has created it yet")
                waited = True
            if not isinstance(e, NotFoundError):
                log.warning("broker.retry", what="join the run", reason=repr(e))
            await asyncio.sleep(0.5)


RUNS_SHOWN = 20


async def runs_on(js: JetStreamContext) -> list[str]:
    """The runs this broker holds (their state buckets' streams), RUNS_SHOWN at most; none where
    these credentials may not list streams (a secured broker's sampler)."""
    try:
        streams = await js.streams_info()
    except (APIError, *BROKER_ERRORS):
        return []
    found = (re.fullmatch(r"KV_echo_(.+)_state", info.config.name or "") for info in streams)
    return sorted(m[1] for m in found if m and re.fullmatch(ID_PATTERN, m[1]))[:RUNS_SHOWN]


def no_run(run_id: str, e: Exception, others: list[str] = ()) -> NoRun:
    if isinstance(e, NotFoundError):
        here = f" (it has {', '.join(others)})" if others else ""
        return NoRun(f"run {run_id!r} is not on this broker{here}: is its trainer running, and the run id right?")
    return NoRun(f"run {run_id!r} did not answer ({type(e).__name__}): it is not on this broker, or these "
                 "credentials are another run's")


class NoRun(ConfigError):
    pass


async def open_run(
    url: str, run_id: str, client_name: str, hub_domain: str | None = HUB_DOMAIN, mirror_wait_s: int = 30,
    credentials: Credentials | None = None, create: bool = True, join_wait_s: float = 600.0,
    weights_url: str | None = None, storage: Storage = Storage(), give_up_s: float | None = None,
) -> RunClient:
    """Connect and open the run's streams and buckets. The trainer creates them (`create`:
    creation with an identical config is a no-op); every other client joins, waiting up to
    `join_wait_s` for the trainer to have created them. `url` is the hub, or a relay in front of
    it; `hub_domain` is the hub's JetStream domain (None: the hub has none, and `url` must be
    the hub). `weights_url`: read weights from this relay over a second connection (a secured
    relay forwards nothing else), everything else goes to `url`. `give_up_s`: connect()'s."""
    names = RunNames(run_id)
    nc = await connect_answered(url, client_name, credentials, give_up_s, hub_domain,
                                mirror_wait_s if create else min(mirror_wait_s, join_wait_s), None if create else names)
    js = nc.jetstream(domain=hub_domain)
    try:
        if create:
            weights, state, registry = await _create_run_once_placed(js, names, hub_domain, storage)
        else:
            weights, state, registry = await _join_run(js, names, hub_domain, join_wait_s)
    except BaseException:
        await nc.close()
        raise
    run = RunClient(nc, js, nc.jetstream(), names, weights, state, registry)
    try:
        if weights_url:
            run.weights_nc = await connect(weights_url, f"{client_name}-weights", credentials, give_up_s)
            run.local_js = run.weights_nc.jetstream()
        await _wait_for_weights_mirror(run.local_js, names, weights_url or url, mirror_wait_s)
    except BaseException:
        await run.close()
        raise
    return run


async def _wait_for_weights_mirror(local_js: JetStreamContext, names: RunNames, url: str, wait_s: int) -> None:
    not_there = 0
    while True:
        try:
            await require_stream(local_js, names.weights_stream)
            return
        except NotFoundError:  # a relay started alongside may not mirror it yet
            not_there += 1
            if not_there >= wait_s * 2:
                break
        except BROKER_ERRORS as e:  # no answer at all (restarting): wait it out
            log.warning("broker.retry", what="find the weights stream", reason=repr(e))
        await asyncio.sleep(0.5)
    raise NoWeightsMirror(
        f"{url} holds no weights of run {names.run_id!r}: start its relay with --run-id {names.run_id}")


class DuplicatePublish(RuntimeError):
    pass


async def publish_once(run: RunClient, subject: str, data: bytes) -> None:
    """Publish with a message id nobody can guess: JetStream drops a second message with the same
    id, so a predictable id (weights-7) could be taken first by a forger and ours dropped."""
    ack = await run.js.publish(subject, data, headers={HDR_MSG_ID: uuid.uuid4().hex})
    if ack.duplicate:
        raise DuplicatePublish(f"{subject}: the server dropped our message as a duplicate")


