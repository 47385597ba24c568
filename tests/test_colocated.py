"""The co-located baseline (bench/colocated.py): generate, then train, in one process, from the
library's own parts, writing the trainer's metrics."""

import orjson

from bench.colocated import run_colocated
from echo.train.metrics import read_metrics, summarize
from tests.conftest import tiny_config
from tests.swarms import USER_TASK
from workers.operator.charts import write_report


def test_the_colocated_baseline_trains_on_policy_and_writes_the_trainers_metrics(tmp_path, monkeypatch):
    (tmp_path / "user_tasks").mkdir()
    (tmp_path / "user_tasks" / "shout.py").write_text(USER_TASK)  # rewards that vary within a group: gradients
    monkeypatch.syspath_prepend(str(tmp_path / "user_tasks"))
    cfg = tiny_config(tmp_path, run={"id": "colocated", "steps": 3}, task={"name": "shout:Shout", "params": {"word": "hey"}},
                      trainer={"lr": 0.05})
    run_colocated(cfg)
    metrics = [orjson.loads(line) for line in (cfg.run_dir / "metrics.jsonl").read_bytes().splitlines()]
    assert [m["version"] for m in metrics] == [1, 2, 3]
    assert any(m["grad_norm"] > 0 for m in metrics)  # the policy moved between steps
    for m in metrics:
        assert m["used"] == 4 and m["tokens"] > 0 and m["wait_seconds"] > 0 and m["busy_seconds"] > 0
        assert {version for _, version, _ in m["groups"]} == {m["step"] - 1}
        # On-policy: each step generates with the weights it trains, so pi_old / mu is 1.
        assert abs(m["is_ratio_mean"] - 1) < 1e-4 and abs(m["is_ratio_max"] - 1) < 1e-3, m
    assert summarize(read_metrics(cfg.run_dir))["steps"] == 3
    assert write_report(cfg.run_dir).exists()  # `echo-rl report` reads it as a swarm run's
