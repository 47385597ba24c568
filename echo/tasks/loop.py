"""One event loop a process, on a daemon thread, for the async code of other people's environments
(`verifiers` rollouts, OpenEnv's WebSocket client) that our sync callers drive: the scoring
process, the samplers' episode loop, the trainer's event loop's thread. An episode's coroutines
wait there between its turns."""

from __future__ import annotations

import asyncio
import os
import threading

_loop: tuple[int, asyncio.AbstractEventLoop] | None = None  # (pid, loop): a forked child starts its own
_loop_lock = threading.Lock()


def _quiet_at_exit(loop: asyncio.AbstractEventLoop, context: dict) -> None:
    """The coroutines of episodes still held when the process exits die with its daemon loop: said
    by asyncio as "Task was destroyed but it is pending", which is nothing lost here."""
    if not context.get("message", "").startswith("Task was destroyed but it is pending"):
        loop.default_exception_handler(context)


def on_loop(coroutine):
    """Run a coroutine to its end on this process's loop, and give its result."""
    global _loop
    with _loop_lock:
        if _loop is None or _loop[0] != os.getpid():
            loop = asyncio.new_event_loop()
            loop.set_exception_handler(_quiet_at_exit)
            threading.Thread(target=loop.run_forever, name="environments", daemon=True).start()
            _loop = (os.getpid(), loop)
    return asyncio.run_coroutine_threadsafe(coroutine, _loop[1]).result()


def submit(callback, *args) -> None:
    """Call back on this process's loop without waiting (from a finaliser); nothing if it has none."""
    if _loop is not None and _loop[0] == os.getpid():
        _loop[1].call_soon_threadsafe(callback, *args)
