"""The run's picture (workers/operator/charts.py): its headline and a resumed run's time axis."""

import orjson

from workers.operator.charts import held_out_line, trainer_minutes, write_report


def _steps(walls: list[float]) -> list[dict]:
    """A run's records as written before 2026-12-07 (`learner_busy`, now `utilisation`): still drawn."""
    return [{"step": i + 1, "wall_seconds": w, "reward_mean": 0.1 * (i % 5), "staleness_used": {"0": 4},
             "dropped_stale": 0, "learner_busy": 0.5} for i, w in enumerate(walls)]


def test_a_resumed_runs_processes_are_laid_end_to_end():
    """Each process's clock starts again at 0: both were drawn on one axis, with a line back
    to the start."""
    minutes, pieces = trainer_minutes(_steps([60, 120, 180, 30, 90]))
    assert minutes == [1, 2, 3, 3.5, 4.5]
    assert pieces == [(0, 3), (3, 5)]
    assert trainer_minutes(_steps([60, 120]))[1] == [(0, 2)]


def test_the_report_is_titled_with_the_held_out_result(tmp_path):
    """The held-out result is the demo's headline; the report omitted it."""
    (tmp_path / "metrics.jsonl").write_bytes(b"".join(orjson.dumps(s) + b"\n" for s in _steps([60, 120, 30] * 400)))
    assert held_out_line(tmp_path) == ""
    (tmp_path / "eval.json").write_bytes(orjson.dumps({"prompts": 21, "version": 20, "base_correct": 0.14,
                                                       "trained_correct": 0.43, "base_reward": 0.2,
                                                       "trained_reward": 0.45}))
    assert "correct 14% -> 43%" in held_out_line(tmp_path) and "21 prompts" in held_out_line(tmp_path)
    assert write_report(tmp_path).stat().st_size > 10_000  # 1,200 steps over 400 processes
