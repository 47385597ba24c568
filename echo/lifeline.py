"""Processes that must not outlive the one that started them: a trainer's ranks (their launcher,
torchrun, is the one supervising them) and an embedded nats-server (its relay, `up`, a test).
Orphaned, the ranks went on training unsupervised and a relay's server held its port against
the relay's next start.

On Linux the kernel signals the process when its parent dies (PR_SET_PDEATHSIG); elsewhere a
thread watches the parent's pid (`die_with_parent`), which a server started by exec cannot carry.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import threading
import time

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
