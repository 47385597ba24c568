"""Background tasks (workers/background.py) end when their block does, even one that shrugs off
its cancellation the way nats-py does when it lands inside a flush."""

import asyncio

import pytest

from workers.background import Background


def test_leaving_the_block_ends_a_task_that_swallowed_its_first_cancellation():
    swallowed = []

    async def like_a_nats_call_in_a_loop():
        # nats-py's Client._flush_pending has `except asyncio.CancelledError: pass`: a cancellation
        # landing there is lost and the caller's loop goes on (seen as a trainer that finished its
        # last step and never exited, its scheduler polling the registry every second).
        while True:
            try:
                await asyncio.sleep(0.01)
            except asyncio.CancelledError:
                if swallowed:
                    raise
                swallowed.append(True)

    async def main():
        async with Background() as background:
            background.start(like_a_nats_call_in_a_loop())
            await asyncio.sleep(0.05)

    asyncio.run(asyncio.wait_for(main(), timeout=5))
    assert swallowed == [True]


def test_a_failing_task_still_ends_the_block_with_its_error():
    async def fails():
        raise ValueError("a bug in a background task")

    async def main():
        async with Background() as background:
            background.start(fails())
            await asyncio.sleep(10)

    with pytest.raises(ValueError, match="a bug in a background task"):
        asyncio.run(asyncio.wait_for(main(), timeout=5))
