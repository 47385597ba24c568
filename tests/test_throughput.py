"""A sampler's measured rates (echo/throughput.py): per second of generating, over a window."""

import pytest

from echo.throughput import CallWindow, Rates


def test_rates_are_per_second_of_generating_over_the_window_and_an_idle_sampler_keeps_its_last():
    window = CallWindow(window_s=10)
    assert window.rates(now=0) == Rates(0.0, 0.0, 0.0)
    for ended, seconds, groups, tokens in [(1, 2.0, 2, 100), (5, 2.0, 2, 100), (9, 4.0, 2, 300), (12, 2.0, 2, 100)]:
        window.add(ended, seconds, groups, tokens)
    # At 14 the call that ended at 1 is out: 6 groups and 500 tokens in 8 s of generating.
    assert window.rates(now=14) == pytest.approx(Rates(0.75, 62.5, 8 / 3))
    # Long idle (standby): the last 3 calls still tell its speed.
    assert window.rates(now=1000) == pytest.approx(Rates(0.75, 62.5, 8 / 3))
