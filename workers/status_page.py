"""`echo-rl status --serve [HOST:]PORT`: the run's live page. The status snapshot
(workers/status.py) every REFRESH_S, pushed to each open page as a server-sent event, with the
trainer's steps seen since the page server started (reward and staleness a step); the page
(workers/static/status.html) draws them with uPlot, vendored. Read-only: it serves the page, its
two static files and the events, nothing else; bound to 127.0.0.1 unless a host is given. A
snapshot holds what `status` shows and no credential (the server's own stay in this process)."""

from __future__ import annotations

import asyncio
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import orjson
import structlog

from streams.client import BROKER_ERRORS, Run
from workers.status import REFRESH_S, snapshot

log = structlog.get_logger()

STATIC = Path(__file__).parent / "static"
FILES = {"/": ("status.html", "text/html; charset=utf-8"), "/uPlot.iife.min.js": ("uPlot.iife.min.js", "text/javascript"),
         "/uPlot.min.css": ("uPlot.min.css", "text/css")}
STEPS_KEPT = 10_000  # points a page's charts hold


class Latest:
    """The newest snapshot and the steps seen, shared between the broker's loop and the HTTP threads."""

    def __init__(self):
        self.changed = threading.Condition()
        self.event = b""  # the newest snapshot as one server-sent event
        self.steps: dict[int, dict] = {}  # step -> {"reward", "staleness"}

    def update(self, snap: dict) -> None:
        trainer = snap["trainer"]
        if trainer and trainer["rewards"] and trainer["step"] not in self.steps:
            self.steps[trainer["step"]] = {"reward": trainer["rewards"][-1], "staleness": trainer["staleness"]}
            for old in sorted(self.steps)[:-STEPS_KEPT]:
                del self.steps[old]
        body = orjson.dumps({**snap, "steps": [{"step": s, **p} for s, p in sorted(self.steps.items())]})
        with self.changed:
            self.event = b"data: " + body + b"\n\n"
            self.changed.notify_all()


def handler_for(latest: Latest) -> type[BaseHTTPRequestHandler]:
    class Page(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - http.server's name
            if self.path == "/events":
                return self.events()
            if self.path not in FILES:
                return self.send_error(404)
            name, kind = FILES[self.path]
            body = (STATIC / name).read_bytes()
            self.send_response(200)
            self.send_header("Content-Type", kind)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def events(self) -> None:
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Cache-Control", "no-store")
            self.end_headers()
            sent = None
            try:
                while True:
                    with latest.changed:
                        latest.changed.wait_for(lambda: latest.event is not sent, timeout=30)
                        sent = latest.event
                    self.wfile.write(sent or b": waiting for the first snapshot\n\n")
                    self.wfile.flush()
            except (BrokenPipeError, ConnectionResetError):  # the page was closed
                return

        def log_message(self, *args) -> None:  # requests are not news
            pass

    return Page


def parse_address(text: str) -> tuple[str, int]:
    """[HOST:]PORT; the host defaults to 127.0.0.1 (this machine only)."""
    host, _, port = text.rpartition(":")
    return host or "127.0.0.1", int(port)


async def serve_page(run: Run, address: str) -> None:
    latest = Latest()
    host, port = parse_address(address)
    server = ThreadingHTTPServer((host, port), handler_for(latest))
    server.daemon_threads = True  # an open page does not keep the process alive
    threading.Thread(target=server.serve_forever, daemon=True).start()
    print(f"echo-rl status: serving http://{host}:{server.server_port}/ (Ctrl-C stops it)", flush=True)
    try:
        while True:
            try:
                latest.update(await snapshot(run))
            except BROKER_ERRORS as e:  # the page keeps its last snapshot; the next read may work
                log.warning("status.read_failed", reason=repr(e))
            await asyncio.sleep(REFRESH_S)
    finally:
        server.shutdown()
