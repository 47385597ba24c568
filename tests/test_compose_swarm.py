"""`docker compose up`, run for real: `make test-compose` (Docker, as root; skipped by `make test`).

The "Docker compose" section (README, in full in docs/operations.md), followed to the letter in a copy of this checkout whose
`compose/swarm.toml` names the tiny model (the README: edit it, the trainer reads it at start):
the secured swarm trains and its accounting holds, seen from outside with `echo-rl status` and
the observer's credentials; a sampler added with `secure add-sampler` and a hub reload joins from
"another machine" (this one, outside the containers); `down` then `up` resumes from the
checkpoint; the insecure override runs too. Images come from compose/local-images.sh's local
stand-ins when PYTHON_IMAGE / NATS_IMAGE are set (make test-compose sets them).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import assert_accounting_holds, eventually, stopped

pytestmark = pytest.mark.compose

ROOT = Path(__file__).parent.parent
ECHO_RL = str(Path(sys.executable).parent / "echo-rl")
HUB = "nats://localhost:4222"  # the published client port; the hub's certificate names localhost
INSECURE = ["-f", "docker-compose.yml", "-f", "docker-compose.insecure.yml"]


def compose_tool() -> list[str]:
    plugin = subprocess.run(["docker", "compose", "version"], capture_output=True).returncode == 0
    return ["docker", "compose"] if plugin else ["docker-compose"]


class Project:
    """A copy of this checkout as a compose project of its own name: its ./secrets, ./runs and
    volumes are the test's."""

    def __init__(self, folder: Path):
        self.dir, self.tool = folder, compose_tool()
        # Docker's vfs storage (the only driver here) copies the whole image per container: on a
        # busy machine one `create` outlasted compose's 60 s default for an answer from dockerd.
        self.env = {**os.environ, "COMPOSE_PROJECT_NAME": "echo-rl-test", "COMPOSE_HTTP_TIMEOUT": "900"}

    def __call__(self, *args: str, timeout: float = 1200, check: bool = True) -> str:
        done = subprocess.run([*self.tool, *args], cwd=self.dir, env=self.env, capture_output=True, text=True,
                              timeout=timeout)
        if check and done.returncode:
            raise AssertionError(f"{' '.join(args)} exited {done.returncode}:\n{done.stdout[-3000:]}{done.stderr[-3000:]}")
        return done.stdout + done.stderr

    def status(self, *credentials: str) -> dict | None:
        """One `echo-rl status --once --json` snapshot from outside the containers (None until the
        hub answers and the trainer has published its status)."""
        done = subprocess.run([ECHO_RL, "status", "--nats", HUB, "--run-id", "compose", *credentials, "--once",
                               "--json"], capture_output=True, text=True, timeout=120)
        if done.returncode:
            return None
        snap = json.loads(done.stdout.strip().splitlines()[-1])
        return snap if snap["trainer"] else None

    def wait(self, what: str, ready, credentials: tuple[str, ...], timeout: float = 600) -> dict:
        """Polls status until `ready(snapshot)`; on a timeout, fails with the workers' logs."""
        seen = []

        def why(_) -> str:
            logs = self("logs", "--tail", "40", *([] if credentials else INSECURE[2:3]), check=False)
            return f"not seen in {timeout} s: {what}\nlast status: {seen[-1]}\n{logs[-8000:]}"

        def snapshot():
            seen.append(self.status(*credentials))
            return seen[-1] if seen[-1] and ready(seen[-1]) else None

        return eventually(snapshot, timeout, every=3, why=why)


@pytest.fixture
def project(tmp_path):
    listed = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                            capture_output=True, text=True, check=True).stdout.split()
    folder = tmp_path / "echo-rl"
    for name in listed:
        if (ROOT / name).is_file():
            (folder / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, folder / name)
    swarm = folder / "compose" / "swarm.toml"
    text = swarm.read_text()
    assert 'name = "smollm2"' in text and "steps = 50" in text, "compose/swarm.toml changed: update this test"
    # The tiny model, and steps enough to outlast every check below.
    swarm.write_text(text.replace('name = "smollm2"', 'name = "tiny"').replace("steps = 50", "steps = 100000"))
    p = Project(folder)
    try:
        yield p
    finally:
        for files in ([], INSECURE):
            p(*files, "down", "--volumes", "--remove-orphans", "--timeout", "5", check=False)
        # Earlier builds' images of the worker, left untagged by this one (GBs each on vfs).
        subprocess.run(["docker", "image", "prune", "--force", "--filter", "label=org.echo-rl.image"], check=False)
        shutil.rmtree(folder, ignore_errors=True)


def training(samplers: set[str], steps: int):
    """A status snapshot's test: at least `steps` steps, each of `samplers` has published groups
    and none is quarantined."""
    def ready(snap: dict) -> bool:
        published = {s["id"] for s in snap["samplers"] if s["groups_published"] and s["state"] != "quarantined"}
        return snap["trainer"]["step"] >= steps and samplers <= published
    return ready


def trainer_ready_steps(p: Project) -> list[int]:
    """The step each trainer process started from, in its `trainer.ready` log lines."""
    lines = p("logs", "--no-color", "trainer").splitlines()
    return [int(line.split(" step=")[1].split()[0]) for line in lines if "trainer.ready" in line]


@pytest.mark.timeout(3600)  # the first build installs the project's dependencies into the image (vfs: 20 min on a busy 2-core box)
def test_the_readme_compose_swarm_trains_grows_resumes_and_runs_open(project, tmp_path):
    p = project
    p("build", timeout=2400)

    # `docker compose up`: secured; watched from outside with the observer's credentials.
    p("up", "--detach")
    observer = ("--creds", str(p.dir / "secrets/observer.nk"), "--tls-ca", str(p.dir / "secrets/ca.pem"))
    snap = p.wait("the secured swarm training with s1, s2 and s3", training({"s1", "s2", "s3"}, 3), observer)
    assert_accounting_holds(snap["trainer"]["accounting"])
    assert snap["trainer"]["rejected"] == {}
    assert {s["id"]: s["relay"] for s in snap["samplers"]} == {"s1": "hub", "s2": "site-a", "s3": "site-a"}
    assert subprocess.run([ECHO_RL, "status", "--nats", HUB, "--run-id", "compose", "--once"],
                          capture_output=True, timeout=120).returncode != 0, "the secured hub answered without credentials"

    # Another machine's sampler, as the README adds it.
    p("run", "--rm", "--no-deps", "secrets", "secure", "add-sampler", "/secrets", "s4")
    p("kill", "-s", "HUP", "nats")
    elsewhere = tmp_path / "edge"
    elsewhere.mkdir()
    for name in ("sampler-s4.nk", "sampler-s4-cert.pem", "sampler-s4-key.pem", "ca.pem"):
        shutil.copy(p.dir / "secrets" / name, elsewhere / name)
    edge = subprocess.Popen([ECHO_RL, "sampler", "--nats", HUB, "--run-id", "compose", "--id", "s4",
                             "--creds", "sampler-s4.nk", "--tls-ca", "ca.pem"], cwd=elsewhere,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        step = p.wait("s4 (outside the containers) publishing", training({"s1", "s2", "s3", "s4"}, 0), observer)
        assert edge.poll() is None
    except AssertionError as e:
        edge.terminate()
        raise AssertionError(f"{e}\ns4's log:\n{edge.communicate(timeout=60)[1][-4000:]}") from None
    finally:
        stopped(edge, sig=signal.SIGTERM)
    step = step["trainer"]["step"]

    # `docker compose down`, then `up`: the trainer starts from its checkpoint, not from step 0.
    p("down", "--timeout", "30")
    p("up", "--detach")
    resumed = p.wait(f"training again past step {step}", training({"s1", "s2", "s3"}, step + 2), observer)
    assert_accounting_holds(resumed["trainer"]["accounting"])
    starts = trainer_ready_steps(p)
    assert len(starts) == 1 and starts[0] >= step - 1, starts  # down/up keeps ./runs and the hub's volume

    # The insecure override: open hub, relay serving its samplers everything.
    p("down", "--volumes", "--timeout", "5")
    shutil.rmtree(p.dir / "runs")
    p(*INSECURE, "up", "--detach")
    snap = p.wait("the open swarm training with s1, s2 and s3", training({"s1", "s2", "s3"}, 3), ())
    assert_accounting_holds(snap["trainer"]["accounting"])
