import pytest

from echo.fleet.staleness import Freshness, freshness


@pytest.mark.parametrize(
    "rollout, current, bound, fresh",
    [
        (5, 5, 0, Freshness.USE),
        (4, 5, 0, Freshness.STALE),  # max_staleness 0 is on-policy
        (4, 5, 1, Freshness.USE),
        (3, 5, 1, Freshness.STALE),
        (1, 5, 4, Freshness.USE),
        (0, 5, 4, Freshness.STALE),
        (6, 5, 4, Freshness.FUTURE),
    ],
)
def test_a_rollouts_freshness_by_its_version(rollout, current, bound, fresh):
    assert freshness(rollout, current, bound) is fresh
