"""`echo-rl plan` on a fleet file: the table, the JSON, and a bad file named."""

import orjson

from workers.cli import main

FLEET = """
[learner]
step_s = 2.0
groups_per_step = 2
max_staleness = 1

[[samplers]]
id = "premium"
device = "cuda"
groups_per_s = 1.5
sync_s = 0.2
call_s = 1.0
cost_per_hour = 4.0

[[samplers]]
id = "cheap"
groups_per_s = 1.2
sync_s = 0.2
call_s = 4.0
cost_per_hour = 1.0
"""


def test_plan_prints_the_chosen_set_why_the_others_are_not_and_the_cheapest_staleness(tmp_path, capsys):
    fleet = tmp_path / "fleet.toml"
    fleet.write_text(FLEET)
    assert main(["plan", "--fleet", str(fleet), "--target", "1.0"]) == 0
    table = capsys.readouterr().out
    assert "premium  cuda    1.5       1       0.2     4       yes     active: 2.70 groups per step" in table
    assert "too late for S=1: sync 0.20 s + call 4.00 s = 4.20 s > 2.00 s" in table
    assert "S=3: 100% busy, 0.000556 per step, 1 sampler(s)  <- cheapest per step" in table

    assert main(["plan", "--fleet", str(fleet), "--target", "1.0", "--json"]) == 0
    report = orjson.loads(capsys.readouterr().out)
    assert report["plan"]["active"] == ["premium"] and report["cheapest_staleness"] == 3
    assert [p["active"] for p in report["by_staleness"]] == [["premium"], ["premium"], ["premium"], ["cheap"], ["cheap"]]
    assert [w["chosen"] for w in report["plan"]["samplers"]] == [True, False]


def test_a_bad_fleet_file_fails_naming_the_field(tmp_path, capsys):
    fleet = tmp_path / "fleet.toml"
    fleet.write_text(FLEET.replace("call_s = 4.0", "call_s = -1"))
    assert main(["plan", "--fleet", str(fleet)]) == 2
    assert "samplers.1.call_s" in capsys.readouterr().err
    fleet.write_text(FLEET.replace("step_s", "step_secs"))
    assert main(["plan", "--fleet", str(fleet)]) == 2
    assert "learner.step_secs: unknown field; did you mean learner.step_s?" in capsys.readouterr().err
    assert main(["plan"]) == 2
    assert "give --fleet FILE, or --nats URL with --run-id ID" in capsys.readouterr().err
