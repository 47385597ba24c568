"""A sampler's measured rates (echo/fleet/throughput.py): per second of generating, over a window."""

import pytest

from echo.fleet.throughput import CallWindow, Rates


def test_rates_are_per_second_of_generating_over_the_window_and_an_idle_sampler_keeps_its_last():
    window = CallWindow(window_s=10)
    assert window.rates(now=0) == Rates(0.0, 0.0, 0.0)
    for ended, seconds, groups, tokens in [(1, 2.0, 2, 100), (5, 2.0, 2, 100), (9, 4.0, 2, 300), (12, 2.0, 2, 100)]:
        window.add(ended, seconds, groups, tokens)
    # At 14 the call that ended at 1 is out: 6 groups and 500 tokens in 8 s of generating.
    assert window.rates(now=14) == pytest.approx(Rates(0.75, 62.5, 8 / 3))
    # Long idle (standby): the last 3 calls still tell its speed.
    assert window.rates(now=1000) == pytest.approx(Rates(0.75, 62.5, 8 / 3))


def test_a_samplers_first_slow_calls_stop_counting_after_a_few_typical_ones():
    """`plan` on a live run excluded a sampler for its first minute: its first calls took 5-20 s
    (loading, warming up, a swarm starting on shared cores), its later ones 0.1-0.6 s, and the
    window counted the slow ones for all its 60 s."""
    window = CallWindow(window_s=60)
    ended = 0.0
    for seconds in (20.0, 12.0, 5.0):  # warming up
        ended += seconds
        window.add(ended, seconds, 2, 200)
    for seconds in [0.4, 0.5, 0.3, 0.6] * 2:  # its typical calls, seconds later
        ended += seconds
        window.add(ended, seconds, 2, 200)
    assert window.rates(now=ended) == pytest.approx(Rates(16 / 3.6, 1600 / 3.6, 0.45))  # 0.39 groups/s with them
