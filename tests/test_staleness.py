import pytest

from echo.staleness import Verdict, judge


@pytest.mark.parametrize(
    "rollout, current, bound, verdict",
    [
        (5, 5, 0, Verdict.USE),
        (4, 5, 0, Verdict.STALE),  # max_staleness 0 is on-policy
        (4, 5, 1, Verdict.USE),
        (3, 5, 1, Verdict.STALE),
        (1, 5, 4, Verdict.USE),
        (0, 5, 4, Verdict.STALE),
        (6, 5, 4, Verdict.FUTURE),
    ],
)
def test_judge(rollout, current, bound, verdict):
    assert judge(rollout, current, bound) is verdict
