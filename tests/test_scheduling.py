"""Cost-aware activation on a real swarm (bench/scheduling.py's fleets): the trainer's coordinator
puts a dear sampler the cheap ones make unnecessary on standby, and the capacity model's
prediction of the learner's utilisation holds against the measured one."""

import pytest

from bench.scheduling import FleetSampler, run_fleet

pytestmark = pytest.mark.slow


def test_the_scheduler_keeps_a_dear_sampler_on_standby_and_predicts_the_learners_utilisation(tmp_path):
    # Samplers slowed to about 3 groups a second: the learner waits on their throughput, where the
    # model is exact. Two cheap ones reach the 20% asked for; a third, six times dearer, is not
    # worth its cost. (Where a step lasts little more than the broker's round trips, the model
    # runs up to 0.1-0.25 above the measured utilisation: README, Scheduling.)
    fleet = [FleetSampler("s1", 0.3, 1.0), FleetSampler("s2", 0.3, 1.0), FleetSampler("s3", 0.3, 6.0)]
    result = run_fleet(tmp_path, fleet, steps=16, scheduler=True, target=0.2)
    assert "s3" in result["standby"] and "s3" not in result["active"], result  # s1 alone may do
    assert result["groups_by_sampler_second_half"]["s3"] == 0, result  # granted no work on standby
    assert result["cost_per_hour"] <= 2.0
    assert abs(result["predicted_utilisation"] - result["measured_utilisation"]) <= 0.1, result
