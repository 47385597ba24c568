"""`echo-rl status --serve [HOST:]PORT`: the run's live page. The status snapshot
(workers/operator/snapshot.py) every REFRESH_S, pushed to each open page as a server-sent event, with
the trainer's steps (CHARTED a step: from the run's metrics where this machine has them, else those
seen since the page server started); the page (workers/operator/static/status.html) draws them
with uPlot, vendored. Read-only: it serves the page, its two static files, the events and the
newest snapshot (/snapshot), nothing else; bound to 127.0.0.1 unless a host is given. A snapshot
holds what `status` shows and no credential (the server's own stay in this process).

One asyncio server in the process's loop: an idle connection costs a few KB, not a thread, and
waits READ_TIMEOUT_S at most for its request; past MAX_CONNECTIONS a new one is closed at once;
a request whose Host header is not the address the page is served at is refused (a page on
another site that rebinds its DNS name to this address reads nothing)."""

from __future__ import annotations

import asyncio
import ipaddress
import socket
from pathlib import Path

import orjson
import structlog

from echo.train.metrics import mean_staleness, read_metrics
from streams.client import RunClient
from workers.operator.snapshot import REFRESH_S, snapshot

log = structlog.get_logger()

STATIC = Path(__file__).parent / "static"
FILES = {"/": ("status.html", "text/html; charset=utf-8"), "/uPlot.iife.min.js": ("uPlot.iife.min.js", "text/javascript"),
         "/uPlot.min.css": ("uPlot.min.css", "text/css")}
STEPS_KEPT = 10_000  # points a page's charts hold
SAMPLE_STEPS = 5  # the last steps whose completions the page shows (from the run's samples.jsonl)
SAMPLES_TAIL = 256 << 10  # the bytes of samples.jsonl read for them (a sample is at most a few KB)
# A step's record keys the page charts, by the names the page reads.
CHARTED = {"reward_mean": "reward", "loss": "loss", "kl": "kl", "entropy": "entropy", "grad_norm": "grad_norm",
           "lr": "lr", "length_mean": "length", "zero_spread_share": "zero_spread"}
MAX_CONNECTIONS = 4096
READ_TIMEOUT_S = 10.0  # for a request's line and headers
WRITE_TIMEOUT_S = 30.0  # for a page to take an event: one that stops reading is closed
HEAD_MAX = 16 << 10  # a request's line and headers
KEEPALIVE_S = 30.0  # an event stream with no new snapshot gets a comment this often
FIRST_SNAPSHOT_S = 30.0  # /snapshot waits this long for the first (a broker that does not answer: closed)


class Latest:
    """The newest snapshot as one server-sent event, and the trainer's steps seen. With the run's
    directory (the trainer's machine): its held-out evaluations and the last steps' completions."""

    def __init__(self, run_dir: Path | None = None):
        self.changed = asyncio.Condition()
        self.body = self.event = b""  # the newest snapshot, as JSON and as a server-sent event
        self.run_dir = run_dir
        # step -> its charted values: the run's metrics where this machine has them (the page
        # then shows the run since its first step), then each step the trainer's status names.
        history = read_metrics(run_dir) if run_dir else []
        self.steps: dict[int, dict] = {r["step"]: point(r, mean_staleness(r)) for r in history}

    async def update(self, snap: dict) -> None:
        trainer = snap["trainer"]
        if trainer and trainer["rewards"] and trainer["step"] not in self.steps:
            self.steps[trainer["step"]] = point({"reward_mean": trainer["rewards"][-1], **trainer["scalars"]},
                                                trainer["staleness"])
        for old in sorted(self.steps)[:-STEPS_KEPT]:
            del self.steps[old]
        extra = {}
        if self.run_dir is not None:  # read again each time: small, or read from their ends
            extra["evals"] = [{"step": e["step"], "reward": e["reward"]} for e in read_metrics(self.run_dir, "evals.jsonl")]
            samples = read_metrics(self.run_dir, "samples.jsonl", tail_bytes=SAMPLES_TAIL)
            last = sorted({s["step"] for s in samples})[-SAMPLE_STEPS:]
            extra["samples"] = [s for s in samples if s["step"] in last][::-1]  # the newest first
        body = orjson.dumps({**snap, **extra, "steps": [{"step": s, **p} for s, p in sorted(self.steps.items())]})
        async with self.changed:
            self.body, self.event = body, b"data: " + body + b"\n\n"
            self.changed.notify_all()


def point(values: dict, staleness: float) -> dict:
    """A step's charted values (the page draws one chart each), from its record or status."""
    return {"staleness": staleness, **{CHARTED[k]: values[k] for k in CHARTED if k in values}}


def allowed_hosts(host: str, port: int) -> set[str] | None:
    """The Host headers a browser sends for the page at host:port; None: any IP literal or this
    machine's names (bound to every interface)."""
    if host in ("", "0.0.0.0", "::"):
        return None
    names = {host}
    if _is_loopback(host):
        names |= {"localhost", "127.0.0.1", "[::1]"}
    if ":" in host and not host.startswith("["):
        names.add(f"[{host}]")
    return {f"{n}:{port}" for n in names} | (names if port == 80 else set())


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def _host_ok(header: str, allowed: set[str] | None) -> bool:
    if allowed is not None:
        return header.lower() in allowed
    name = header.rsplit(":", 1)[0] if not header.endswith("]") else header
    try:
        ipaddress.ip_address(name.strip("[]"))
        return True
    except ValueError:
        return name.lower() in {socket.gethostname().lower(), socket.getfqdn().lower(), "localhost"}


class PageServer:
    """Serves the page, its files and the events from `latest`; see the module's docstring."""

    def __init__(self, latest: Latest, read_timeout_s: float = READ_TIMEOUT_S):
        self.latest, self.read_timeout_s = latest, read_timeout_s
        self.open = 0  # connections being served

    async def start(self, host: str, port: int) -> int:
        """Listen at host:port (0: any free port); the port."""
        self.server = await asyncio.start_server(self.serve, host, port, limit=HEAD_MAX, backlog=1024)
        port = self.server.sockets[0].getsockname()[1]
        self.allowed = allowed_hosts(host, port)
        return port

    async def close(self) -> None:
        self.server.close()

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self.open >= MAX_CONNECTIONS:
            writer.close()
            return
        self.open += 1
        try:
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), self.read_timeout_s)
            await self.answer(head, writer)
        except (TimeoutError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, ConnectionError):
            pass  # slow, cut short or too long: closed
        finally:
            self.open -= 1
            writer.close()

    async def answer(self, head: bytes, writer: asyncio.StreamWriter) -> None:
        lines = head.decode("latin-1").split("\r\n")
        method, path, *_ = lines[0].split(" ") + ["", ""]
        headers = dict(line.split(":", 1) for line in lines[1:] if ":" in line)
        headers = {k.strip().lower(): v.strip() for k, v in headers.items()}
        if not _host_ok(headers.get("host", ""), self.allowed):
            return await self.respond(writer, 421, b"not this page's address\n", "text/plain")
        if method != "GET":
            return await self.respond(writer, 405, b"GET only\n", "text/plain")
        path = path.partition("?")[0]  # /?once: the page drawn once, from /snapshot (static/status.html)
        if path == "/events":
            return await self.events(writer)
        if path == "/snapshot":  # the newest snapshot, once: for a page that must finish loading (a screenshot)
            async with self.latest.changed:  # the first one, on a page opened as the server starts
                await asyncio.wait_for(self.latest.changed.wait_for(lambda: self.latest.body), FIRST_SNAPSHOT_S)
            return await self.respond(writer, 200, self.latest.body, "application/json")
        if path not in FILES:
            return await self.respond(writer, 404, b"not found\n", "text/plain")
        name, kind = FILES[path]
        await self.respond(writer, 200, (STATIC / name).read_bytes(), kind)

    async def respond(self, writer: asyncio.StreamWriter, code: int, body: bytes, kind: str) -> None:
        reason = {200: "OK", 404: "Not Found", 405: "Method Not Allowed", 421: "Misdirected Request"}[code]
        writer.write(f"HTTP/1.1 {code} {reason}\r\nContent-Type: {kind}\r\nContent-Length: {len(body)}\r\n"
                     f"Connection: close\r\n\r\n".encode() + body)
        await asyncio.wait_for(writer.drain(), WRITE_TIMEOUT_S)

    async def events(self, writer: asyncio.StreamWriter) -> None:
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nCache-Control: no-store\r\n"
                     b"Connection: close\r\n\r\n")
        latest, sent = self.latest, None
        while True:
            async with latest.changed:
                try:
                    await asyncio.wait_for(latest.changed.wait_for(lambda: latest.event not in (sent, b"")), KEEPALIVE_S)
                    sent = latest.event
                    writer.write(sent)
                except TimeoutError:
                    writer.write(b": waiting for the next snapshot\n\n")
            await asyncio.wait_for(writer.drain(), WRITE_TIMEOUT_S)


def parse_address(text: str) -> tuple[str, int]:
    """[HOST:]PORT; the host defaults to 127.0.0.1 (this machine only)."""
    host, _, port = text.rpartition(":")
    return host or "127.0.0.1", int(port)


async def serve_page(run: RunClient, address: str, run_dir: Path | None = None) -> None:
    latest = Latest(run_dir)
    host, port = parse_address(address)
    server = PageServer(latest)
    port = await server.start(host, port)
    print(f"echo-rl status: serving http://{host}:{port}/ (Ctrl-C stops it)", flush=True)
    try:
        while True:
            try:
                await latest.update(await snapshot(run))
            except Exception as e:  # noqa: BLE001 - the page keeps its last snapshot; the next read may work
                log.warning("status.read_failed", reason=repr(e)[:300])
            await asyncio.sleep(REFRESH_S)
    finally:
        await server.close()
