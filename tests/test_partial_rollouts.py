"""Partial rollouts end to end on the tiny model: a slow sampler's completions are taken over by
each newer version between chunks; the trainer trains such a group (its tokens within the bound)
and the proof of sampling checks each token under the version that sampled it."""

import asyncio

import pytest

from streams.replay import read_rollouts
from tests.conftest import assert_balanced, read_metrics, tiny_config, worker_process
from tests.groups import SCORER, honest_group
from workers.operator.swarm import stop_processes
from workers.trainer.judge import Case, Judge, Timeline


def test_a_partial_rollout_is_judged_by_its_newest_tokens_and_may_have_begun_a_window_further_back():
    """At version 10 with max_staleness 2 (versions 8 and newer trained) and partial rollouts
    (begun_within 5): finished by version 8, a group is trained whatever began it down to 5."""
    judge = Judge(SCORER, Timeline(max_staleness=2, begun_within=5))

    def verdict(version: int, changes: list[tuple[int, int]]) -> str:
        group = honest_group(version=version,
                             version_changes=[{"at": at, "version": v} for at, v in changes])
        found = asyncio.run(judge.fresh(Case(group, 10, group.prompt_index)))
        return "used" if found is None else found.reason

    assert verdict(8, []) == verdict(5, [(1, 8)]) == verdict(5, [(1, 6), (2, 9)]) == "used"
    assert verdict(7, []) == verdict(5, [(1, 7)]) == verdict(4, [(1, 9)]) == "stale"
    assert verdict(5, [(1, 11)]) == "future_version"


@pytest.mark.slow
def test_a_group_spanning_three_versions_is_trained_and_proved_token_by_token(nats_server, tmp_path):
    # The slow sampler pauses 1 s between its chunks of 8 tokens; the fast one keeps the trainer
    # stepping meanwhile, a step every 0.3 s or more: a few versions come out during each pause.
    # What this relies on: a tiny model's step takes well under a second.
    cfg = tiny_config(tmp_path, run={"id": "partial", "steps": 30},
                      sampling={"max_new_tokens": 24, "chunk_tokens": 8, "prompts_per_call": 1, "group_size": 8},
                      trainer={"groups_per_step": 1, "max_staleness": 20, "verify_fraction": 1.0, "min_samplers": 2,
                               "throttle_s": 0.3},
                      nats={"url": nats_server.url})
    config_path = tmp_path / "config.toml"
    config_path.write_text(cfg.to_toml())
    trainer = worker_process(config_path, "trainer")
    samplers = [worker_process(config_path, "sampler", "--id", "fast"),
                worker_process(config_path, "sampler", "--id", "slow", "--set", "sampler.throttle_s=1.0")]
    try:
        _, logs = trainer.communicate(timeout=300)
        assert trainer.returncode == 0, logs[-3000:]
    finally:
        stop_processes(samplers, timeout=30)

    async def stream():
        return [r async for r in read_rollouts(nats_server.url, "partial")]

    records = asyncio.run(stream())
    metrics = read_metrics(cfg.run_dir)
    assert_balanced(metrics, records)
    trained = {gid for m in metrics for gid, _, _ in m["groups"]}
    spanning = [r["group"] for r in records if r["group"]["group_id"] in trained and len(r["group"]["version_changes"]) >= 2]
    assert spanning, [(r["group"]["sampler_id"], r["group"]["version"], r["group"]["version_changes"], [len(c["token_ids"]) for c in r["group"]["completions"]]) for r in records if r["group"]["sampler_id"] == "slow"]  # begun by one version, finished by two newer
    assert all(g["sampler_id"] == "slow" for g in spanning)
    proof = metrics[-1]["proof_of_sampling"]  # every trained group was checked, each token under its version
    assert proof == {"passed": len(trained)}, proof
