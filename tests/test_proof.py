"""Proof of sampling: honest log-probs pass under the version they claim, forged ones are
rejected, and a sampler caught too often is quarantined until an operator lifts it."""


import pytest
import torch

from echo.config import LoraConfig
from echo.engines.hf import HFEngine
from echo.fleet.grants import GrantLedger
from echo.model.policy import group_logprobs
from echo.train.checkpoint import TrainerState
from echo.trust.noise import Draw, group_key
from echo.trust.proof import ProofSettings, SamplingProof, logprob_gap
from echo.weights.shards import load_weights, policy_tensors, weights_shards
from echo.wire.messages import Completion, GrantRequest, Observation
from streams.inbox import RolloutInbox
from streams.lease import take_lease
from streams.quarantine import read_quarantine
from streams.registry import read_statuses
from streams.rollouts import publish_rollout
from tests.conftest import eventually_async, tiny_config
from tests.groups import SAMPLING, SCORER, collect_once_quarantined, granted, honest_group, perturb
from workers.background import Background
from workers.cli import build_parser
from workers.operator.quarantine import quarantine_command
from workers.sampler.sampler import Sampler
from workers.trainer.granter import AsyncGranter
from workers.trainer.intake import Collector
from workers.trainer.judge import Judge, Timeline
from workers.trainer.strikes import Quarantined

LORA = LoraConfig(r=4, alpha=8.0)


def _proof(policy, tolerance: float = 0.01, fraction: float = 1.0) -> SamplingProof:
    return SamplingProof(policy, 0, ProofSettings(SAMPLING.temperature, fraction, tolerance, keep=2))


def test_which_groups_are_checked_cannot_be_told_from_the_run_config():
    """The choice was drawn from a generator seeded by run.seed, which every sampler reads in the
    config: a forger could tell which groups would be checked. Two trainers of the same config
    now choose differently (the chance that 128 draws agree is 2**-128)."""
    group = honest_group(version=0)
    first, second = (_proof(torch.nn.Linear(1, 1), fraction=0.5) for _ in range(2))
    assert [first.wants(group, 0) for _ in range(128)] != [second.wants(group, 0) for _ in range(128)]


def _claimed(logprobs: list[float], observations=()) -> Completion:
    return Completion(token_ids=[5] * len(logprobs), logprobs=logprobs, text="", claimed_reward=0.0, finish_reason="length",
                      observations=list(observations))


def test_the_gap_is_the_largest_difference_of_a_token_the_model_sampled():
    recomputed = torch.tensor([[-0.5, -1.0, 0.0, 0.0], [-2.0, -0.1, -0.3, -0.2]])
    assert logprob_gap([_claimed([-0.5, -1.0]), _claimed([-2.0, -0.4, -0.3])], recomputed) == pytest.approx(0.3)
    # An episode's observation (the environment's tokens, claimed 0) is not the model's to check.
    episode = _claimed([-2.0, 0.0, -0.3, -0.2], observations=[Observation(at=1, tokens=1)])
    assert logprob_gap([_claimed([-0.5, -1.0]), episode], recomputed) == pytest.approx(0.0)


def test_honest_log_probs_pass_under_the_claimed_version_and_forged_ones_fail():
    sampler = HFEngine("tiny", LORA, SAMPLING)
    perturb(sampler.model, seed=0)
    trainer = HFEngine("tiny", LORA, SAMPLING).model  # another instance, given version 0 as published
    load_weights(trainer, [bytearray(s) for s in weights_shards(sampler.model, 2**30)])
    proof = _proof(trainer)
    proof.remember(0)
    prompt = SCORER.task.prompt(3)
    prompt_ids = sampler.encode_chat(prompt.messages)
    generations = sampler.generate([prompt_ids], SAMPLING.group_size)[0]
    group = honest_group(3, version=0, prompt_token_ids=prompt_ids, completions=[
        honest_group().completions[0].replaced(token_ids=g.token_ids, logprobs=g.logprobs)
        for g in generations])
    assert proof.check(group).gap < 1e-4  # fp32: float error only

    perturb(trainer, seed=1)  # the trainer steps on: version 1
    proof.remember(1)
    version_1 = {k: v.clone() for k, v in policy_tensors(trainer).items()}
    assert proof.check(group).gap < 1e-4  # version 0 swapped in for the check...
    assert all(torch.equal(v, version_1[k]) for k, v in policy_tensors(trainer).items())  # ...and 1 back

    shifted = [c.replaced(logprobs=[x - 0.05 for x in c.logprobs]) for c in group.completions]
    forged = group.model_copy(update={"completions": shifted, "sampler_id": "s9"})
    assert proof.forged(forged, proof.check(forged)) and proof.suspects == {"s9"}
    assert proof.wants(forged.model_copy(update={"group_id": "next"}), 0)  # every group of a suspect
    proof.remember(2)  # version 0 is no longer kept
    assert proof.check(group) is None and proof.counts == {"passed": 2, "forged": 1, "unverifiable": 1}


async def test_a_forging_sampler_is_rejected_then_quarantined_until_an_operator_lifts_it(runs, tmp_path):
    cfg = tiny_config(tmp_path, run={"id": "forge"})
    policy = HFEngine("tiny", LORA, SAMPLING).model
    perturb(policy, seed=0)

    def true_logprobs(group):
        with torch.no_grad():
            logprobs, _, _ = group_logprobs(policy, group.prompt_token_ids, [c.token_ids for c in group.completions],
                                            SAMPLING.temperature, 0)
        return group.model_copy(update={"completions": [
            c.replaced(logprobs=logprobs[i, : len(c.token_ids)].tolist())
            for i, c in enumerate(group.completions)]})

    run = await runs.open("forge", "trainer")
    lease = await take_lease(run)
    async with Background() as background:  # the quarantine watch
        quarantine = Quarantined(run, after=1)
        await quarantine.start(background)
        proof = _proof(policy, fraction=0.0)  # no random checks: the first catch is by suspicion
        proof.remember(1)
        proof.suspects.add("s1")
        ledger = GrantLedger()
        collector = Collector(await RolloutInbox.open(run), Judge(SCORER, Timeline(max_staleness=1), proof=proof), ledger,
                              quarantine=quarantine)
        # honest_group's log-probs are a constant -0.5: not what the model gives its tokens.
        for index, group_id in [(12, "f1"), (13, "f2"), (16, "f3")]:
            await publish_rollout(run, granted(ledger, honest_group(index, group_id=group_id, sampler_id="s1")))

        collected = await collect_once_quarantined(collector, quarantine, "s1", run, ledger, true_logprobs(
            honest_group(14, group_id="h1", sampler_id="s2")), version=1)
        assert [a.group.group_id for a in collected.used] == ["h1"]
        assert collected.rejected == {"logprob_forgery": 2, "quarantined": 1}  # f3 came after the quarantine
        assert await read_quarantine(run) == {"s1": "2 strikes, the last logprob_forgery"}
        orders = AsyncGranter(run, lease.term, cfg, TrainerState(version=1), GrantLedger(), quarantine)
        asked = GrantRequest(want=2, term=lease.term, version=1)
        assert (await orders.grant("s1", asked)).groups == 0 and (await orders.grant("s2", asked)).groups == 2

        # The sampler's heartbeat shows it.
        await Sampler(cfg, "s1", run, HFEngine("tiny", cfg.lora, cfg.sampling), task=None).heartbeat.beat()
        assert (await read_statuses(run))[0].state == "quarantined"

        args = ["quarantine", "lift", "s1", "--nats", runs.url, "--run-id", "forge"]
        assert await quarantine_command(build_parser().parse_args(args)) == 0
        await eventually_async(lambda: "s1" not in quarantine, 5)  # the trainer follows the key
        assert quarantine.strikes["s1"] == 0 and (await orders.grant("s1", asked)).groups == 2


@pytest.mark.parametrize("lora", [LORA, LoraConfig(enabled=False)], ids=["lora", "full-weight"])
def test_a_partial_rollout_is_checked_token_by_token_under_the_version_that_sampled_it(lora):
    """A sampler generating in chunks swaps in each newer version between them (keeping its
    key/value cache); the group says where each took over, and the proof recomputes every token
    under the version that sampled it, its log-prob and, drawn with keyed noise, the token itself.
    The same tokens claimed as one version's do not pass, nor a token changed after a swap."""
    sampling = SAMPLING.model_copy(update={"max_new_tokens": 24, "chunk_tokens": 8, "group_size": 16})
    sampler = HFEngine("tiny", lora, sampling)
    trainer = HFEngine("tiny", lora, sampling).model
    proof = SamplingProof(trainer, 0, ProofSettings(sampling.temperature, 1.0, 0.01, keep=3, noise_seed=5))
    versions = []
    for version in range(3):  # as the trainer publishes them
        perturb(trainer, seed=version)
        proof.remember(version)
        versions.append([bytearray(s) for s in weights_shards(trainer, 2**30)])
    load_weights(sampler.model, versions[0])
    class TwoSwaps:  # the sampler's weights room, as the engine sees it (NewerWeights)
        swaps = iter([1, 2])

        def between_chunks(self) -> int | None:
            version = next(self.swaps, None)
            if version is not None:
                load_weights(sampler.model, versions[version])
            return version

    prompt_ids = sampler.encode_chat(SCORER.task.prompt(3).messages)
    generations = sampler.generate([prompt_ids], sampling.group_size, newer_weights=TwoSwaps(),
                                   draws=[Draw(group_key(5, 0, 1))])[0]  # the group's slot 1 of term 0
    for g in generations:  # a completion that ended before a swap does not name it
        assert g.version_changes == tuple(c for c in ((8, 1), (16, 2)) if c[0] < len(g.token_ids))
    assert max(len(g.version_changes) for g in generations) == 2
    group = honest_group(3, version=0, prompt_token_ids=prompt_ids, completions=[
        honest_group().completions[0].replaced(token_ids=g.token_ids, logprobs=g.logprobs) for g in generations],
        version_changes=[{"at": 8, "version": 1}, {"at": 16, "version": 2}])
    assert group.newest_version == 2
    checked = proof.check(group)
    assert checked.gap < 1e-4 and checked.margin < 1e-4  # fp32: float error only
    as_one_version = group.replaced(version_changes=[])
    assert proof.forged(as_one_version, proof.check(as_one_version))
    longest = max(range(len(group.completions)), key=lambda j: len(group.completions[j].token_ids))
    tokens = group.completions[longest].token_ids.copy()
    tokens[17] = (tokens[17] + 1) % 256  # drawn by version 2
    changed = group.replaced(completions=[c.replaced(token_ids=tokens) if j == longest else c
                                          for j, c in enumerate(group.completions)])
    assert proof.forged(changed, proof.check(changed)) == "token_forgery"
