"""Processes that must not outlive the one that started them: a trainer's ranks (their launcher,
torchrun, is the one supervising them) and an embedded nats-server (its relay, `up`, a test).
Orphaned, the ranks went on training unsupervised and a relay's server held its port against
the relay's next start.

On Linux the kernel signals the process when its parent dies (PR_SET_PDEATHSIG); elsewhere a
thread watches the parent's pid (`die_with_parent`), which a server started by exec cannot carry.

And whether a process named by another has exited (`process_name`, `exited`): a trainer
restarted on its predecessor's machine takes the run at once when that one is gone.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import threading
import time
from pathlib import Path

PR_SET_PDEATHSIG = 1  # linux/prctl.h
WATCH_S = 1.0


def arm_parent_death_signal(sig: int) -> bool:
    """Have the kernel send `sig` to this process when its parent dies (Linux only; kept across
    exec, so a Popen's preexec_fn may call it). False where the kernel cannot."""
    if not sys.platform.startswith("linux"):
        return False
    return ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, sig) == 0


def die_with_parent(sig: int = signal.SIGKILL) -> None:
    """This process gets `sig` as soon as its parent dies (within WATCH_S where the kernel does
    not signal it), or at once if the parent is gone already."""
    parent = os.getppid()
    if not arm_parent_death_signal(sig):
        threading.Thread(target=_watch, args=(parent, sig), name="lifeline", daemon=True).start()
    if os.getppid() != parent:  # it died before the signal was armed
        os.kill(os.getpid(), sig)


def _watch(parent: int, sig: int) -> None:
    while os.getppid() == parent:
        time.sleep(WATCH_S)
    os.kill(os.getpid(), sig)


def process_name() -> str:
    """A name for this process that no other process has, now or later: the kernel's boot id, the
    pid namespace, the pid and when the process started ("" where there is no /proc to read)."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
        namespace = os.stat("/proc/self/ns/pid").st_ino  # pids are this namespace's
    except OSError:
        return ""
    started = _start_time(os.getpid())
    return f"{boot}/{namespace}/{os.getpid()}/{started}" if started else ""


def exited(name: str) -> bool:
    """Whether the process `name` (its process_name) has certainly exited: True only where this
    process sees the same boot and pid namespace and that pid is gone, a zombie, or another
    process's. False where that cannot be told (another machine, a container of its own, no
    /proc, another user's process hidden from this one)."""
    parts, here = name.split("/"), process_name().split("/")
    if len(parts) != 4 or not parts[2].isdigit() or parts[:2] != here[:2]:
        return False
    pid = int(parts[2])
    try:
        os.kill(pid, 0)  # told apart from a process hidden from /proc (hidepid): that one exists
    except ProcessLookupError:
        return True
    except PermissionError:
        pass
    started = _start_time(pid)
    return started is not None and started != parts[3]


def _start_time(pid: int) -> str | None:
    """When process `pid` started (clock ticks after boot), "" once it has exited (a zombie not yet
    reaped), None where /proc does not say."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # Past the command's name (which may hold spaces and parentheses): state is field 3, starttime 22.
    fields = stat[stat.rindex(")") + 2 :].split()
    return "" if fields[0] in ("Z", "X") else fields[19]
