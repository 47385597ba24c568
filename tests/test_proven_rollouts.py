"""Every group the trainer trains is proven under the versions that sampled it, from a fresh
credential's first group, across trainer restarts; and what a sampler could choose besides (a
redrawn prompt, dynamic sampling's budget, a heartbeat that does not decode). Each test failed on
the code before the defence it checks (docs/security.md, by asset)."""

from __future__ import annotations

import asyncio
import time

import pytest
import torch

from echo.config import LoraConfig
from echo.engines.hf import HFEngine
from echo.fleet.grants import GrantLedger
from echo.model.policy import group_logprobs
from echo.train.checkpoint import TrainerState
from echo.trust.noise import Draw, group_key
from echo.trust.proof import ProofSettings, SamplingProof
from echo.trust.scorer import Scorer
from echo.weights.shards import load_weights, weights_shards
from echo.wire.codec import ProtocolError, decode_rollout, encode_rollout, rollout_headers
from echo.wire.messages import GrantRequest, SamplerStatus
from echo.wire.names import RunNames, Version
from streams.client import open_run
from streams.inbox import RolloutInbox
from streams.lease import take_lease
from streams.quarantine import read_strikes
from streams.registry import put_status, read_statuses
from streams.rollouts import publish_rollout
from tests.conftest import tiny_config
from tests.groups import (
    SAMPLING,
    TASK,
    TOKENIZER,
    collect_once_quarantined,
    granted,
    honest_group,
    keyed_groups,
    perturb,
)
from workers.background import Background
from workers.cli import build_parser
from workers.operator.quarantine import quarantine_command
from workers.operator.snapshot import snapshot
from workers.sampler.generation import generate_groups
from workers.trainer.granter import AsyncGranter
from workers.trainer.intake import Collector
from workers.trainer.judge import Judge, Timeline
from workers.trainer.model import Ranks, TrainerModel
from workers.trainer.strikes import Quarantined

LORA = LoraConfig(r=4, alpha=8.0)
SEED = 7
CHUNK = 8


def _config(tmp_path, trainer: dict | None = None, **sampling):
    """A keyed async run as the attacked swarm was: staleness bound 1, the proof at its defaults."""
    return tiny_config(tmp_path, run={"id": "sec", "seed": SEED}, lora={"r": LORA.r, "alpha": LORA.alpha},
                       sampling={"group_size": 8, "max_new_tokens": 24, "temperature": 1.0, **sampling},
                       trainer={"max_staleness": 1, "quarantine_after": 3, **(trainer or {})})


def _trainer_at_version_1(cfg):
    """The trainer's proof as the run builds it (ProofSettings.of: the run's defaults), having
    published versions 0 and 1; and the published shards of each."""
    model = HFEngine("tiny", LORA, cfg.sampling).model
    proof = SamplingProof(model, TOKENIZER.pad_token_id, ProofSettings.of(cfg, torch.float32))
    shards = []
    for version in (0, 1):
        perturb(model, seed=version)
        shards.append([bytearray(s) for s in weights_shards(model, 2**30)])
        proof.remember(version)
    return proof, shards


def _chosen(sampler: HFEngine, group, shards, change_at: int | None = None):
    """`group` with half its completions replaced by text the attacker chose (the right answer,
    boxed), sent with their true log-probs under the versions it claims: the sampler's own
    forward (version 0; version 1 from `change_at` on)."""
    answer = f"\\boxed{{{TASK.prompt(group.prompt_index).answer}}}"
    tokens = [TOKENIZER(answer + "!" * j, add_special_tokens=False)["input_ids"] + [TOKENIZER.eos_token_id] if j % 2
              else c.token_ids.tolist() for j, c in enumerate(group.completions)]  # each its own: no repeat
    with torch.no_grad():
        logprobs = group_logprobs(sampler.model, group.prompt_token_ids, tokens, sampler.temperature, 0)[0]
        if change_at is not None:
            load_weights(sampler.model, shards[1])
            later = group_logprobs(sampler.model, group.prompt_token_ids, tokens, sampler.temperature, 0)[0]
            logprobs[:, change_at:] = later[:, change_at:]
            load_weights(sampler.model, shards[0])
    eos = TOKENIZER.eos_token_id
    return group.replaced(completions=[
        c.replaced(token_ids=t, logprobs=logprobs[j, : len(t)].tolist(), text=text,
                   finish_reason="stop" if t[-1] == eos else "length",
                   claimed_reward=TASK.score(text, TASK.prompt(group.prompt_index)).reward)
        for j, (c, t) in enumerate(zip(group.completions, tokens))
        for text in [TOKENIZER.decode(t, skip_special_tokens=True)]])


class OneSwap:
    """A sampler's weights room as a chunked engine sees it: version 1 takes over after the first chunk."""

    def __init__(self, sampler: HFEngine, shards):
        self.sampler, self.shards, self.swapped = sampler, shards, False

    def between_chunks(self) -> int | None:
        if self.swapped:
            return None
        self.swapped = True
        load_weights(self.sampler.model, self.shards[1])
        return 1


def _attack(claim: str, sampler: HFEngine, shards, slot: int, index: int):
    """What one credential sends on `slot` for prompt `index`, under `claim`."""
    if claim == "another slot's key":  # honest draws all, with the noise of a slot it was not granted
        return keyed_groups(sampler, [index], SEED, 0, 8, first_slot=slot + 50, group_id=f"f{slot}")[0].replaced(
            slot=slot)
    if claim == "partial rollout":
        prompt_ids = sampler.encode_chat(TASK.prompt(index).messages)
        gens = sampler.generate([prompt_ids], 8, newer_weights=OneSwap(sampler, shards),
                                draws=[Draw(group_key(SEED, 0, slot))])[0]
        load_weights(sampler.model, shards[0])
        group = honest_group(index, version=0, slot=slot, group_id=f"f{slot}", prompt_token_ids=prompt_ids,
                             version_changes=[{"at": CHUNK, "version": 1}], completions=[
                                 honest_group().completions[0].replaced(token_ids=g.token_ids, logprobs=g.logprobs)
                                 for g in gens])
        return _chosen(sampler, group, shards, change_at=CHUNK)
    honest = keyed_groups(sampler, [index], SEED, 0, 8, first_slot=slot, group_id=f"f{slot}")[0]
    return _chosen(sampler, honest, shards)  # "version - 1": the version before the trainer's


@pytest.mark.parametrize("claim", ["version - 1", "partial rollout", "another slot's key"])
async def test_chosen_text_trains_nothing_from_a_fresh_credentials_first_group_nor_after_a_restart(secured, tmp_path,
                                                                                                   claim):
    """The attacked swarm: a fresh sampler credential (s1, never caught) sends chosen text with its
    true log-probs, claiming the version before the trainer's (17 of 82 trained before), a
    partial rollout (21 of 59), or an honest draw under another slot's key (7 of 17). The proof
    read only `verify_fraction` (0.1) of the groups not of the trainer's own version. Now each is
    proven under the versions it names: every one refused and struck from the first, s1
    quarantined past quarantine_after; an honest group of another sampler is trained. A trainer
    that takes over (a new process: its proof and quarantine built afresh) reads the strikes and
    the suspicion back, and still checks every group of s1's, even in a run that trusts its
    samplers enough to check none at random."""
    server, secure = secured
    cfg = _config(tmp_path, **({"chunk_tokens": CHUNK} if claim == "partial rollout" else {}))
    assert cfg.trainer.verify_fraction == 1.0  # the default: every group proven
    proof, shards = _trainer_at_version_1(cfg)
    sampler = HFEngine("tiny", LORA, cfg.sampling, "cpu", "float32")
    load_weights(sampler.model, shards[0])
    scorer = Scorer(TASK, TOKENIZER, len(TOKENIZER), cfg.sampling)
    trainer = await open_run(server.url, "sec", "trainer", credentials=secure.credentials("trainer"))
    attacker = await open_run(server.url, "sec", "s1", credentials=secure.credentials("sampler-s1"), create=False)
    forged = []
    try:
        async with Background() as background:
            quarantine = Quarantined(trainer, after=cfg.trainer.quarantine_after)
            await quarantine.start(background)
            ledger = GrantLedger(seed=SEED)
            judge = Judge(scorer, Timeline(max_staleness=1, begun_within=cfg.begun_within), proof=proof)
            collector = Collector(await RolloutInbox.open(trainer), judge, ledger, quarantine=quarantine)
            for k in range(4):  # quarantine_after 3: the fourth strike quarantines
                slot = ledger.issued + 1
                forged.append(_attack(claim, sampler, shards, slot, index=20 + k))
                assert granted(ledger, forged[-1]).slot == slot
                await publish_rollout(attacker, forged[-1])
            good = keyed_groups(sampler, [9], SEED, 0, 8, first_slot=ledger.issued + 1, group_id="good",
                                sampler_id="s2")[0]
            collected = await collect_once_quarantined(collector, quarantine, "s1", trainer, ledger, good, version=1)
        assert [a.group.group_id for a in collected.used] == ["good"]
        assert collected.rejected == {"token_forgery": 4}, collected.rejected
        assert "s1" in quarantine

        # kill -9 and a take-over: the next trainer's proof and quarantine start from the run's state.
        await trainer.close()
        trainer = await open_run(server.url, "sec", "trainer", credentials=secure.credentials("trainer"))
        async with Background() as background:
            taken_over = Quarantined(trainer, after=cfg.trainer.quarantine_after)
            await taken_over.start(background)
            assert taken_over.strikes == {"s1": 4} and taken_over.suspects == {"s1"}
            trusting = SamplingProof(proof.model, 0, ProofSettings.of(
                cfg.model_copy(update={"trainer": cfg.trainer.model_copy(update={"verify_fraction": 0.0})}),
                torch.float32))
            trusting.suspects.update(taken_over.suspects)  # as open_rooms does
            assert all(trusting.wants(g, 1) for g in forged) and not trusting.wants(good, 1)
    finally:
        await attacker.close()
        await trainer.close()


def test_a_claim_the_run_cannot_have_made_is_refused_at_decode(tmp_path):
    """A partial rollout in a run without sampling.chunk_tokens was read and judged (21 of 59
    trained); a version change where no engine makes one (from token 1) was too. Both are now
    refused at decode, a strike as any malformed message."""
    cfg = _config(tmp_path)
    plain = Scorer(TASK, TOKENIZER, len(TOKENIZER), cfg.sampling)
    chunked = Scorer(TASK, TOKENIZER, len(TOKENIZER), cfg.sampling.model_copy(update={"chunk_tokens": CHUNK}))
    completions = [c.replaced(token_ids=[65] * 20 + [TOKENIZER.eos_token_id], logprobs=[-0.5] * 21)
                   for c in honest_group().completions] * 4
    subject = RunNames("sec").rollouts_subject("s1")

    def decoded(scorer, *changes):
        group = honest_group(version=0, completions=completions, version_changes=[
            {"at": at, "version": v} for at, v in changes])
        return decode_rollout(encode_rollout(group), rollout_headers(group), subject, scorer.limits)

    with pytest.raises(ProtocolError, match="partial_not_enabled"):
        decoded(plain, (CHUNK, 1))
    with pytest.raises(ProtocolError, match="bad_version_change"):
        decoded(chunked, (1, 1))
    assert decoded(chunked, (CHUNK, 1)).newest_version == 1  # what a chunked engine sends
    assert decoded(plain).version == 0


def test_a_restarted_trainer_proves_its_predecessors_versions_from_the_runs_weights(tmp_path):
    """A restarted trainer kept only the version it resumed at: every group of the version before
    (a third of an async run's) was "unverifiable", and an unverifiable group was trained. It now
    reads the versions its proof keeps back from the run's weights files, so their groups are
    proven as before the restart; a group of a version it cannot read is refused, with no strike."""
    cfg = _config(tmp_path)
    first = TrainerModel(cfg, Ranks("cpu"))
    first.resume()
    for version in (0, 1):  # as the steps publish them
        perturb(first.module, seed=version)
        first.write_weights(version)
        first.remember(version)
    first.state.version = 1
    first.save(first.state)
    sampler = HFEngine("tiny", LORA, cfg.sampling, "cpu", "float32")
    load_weights(sampler.model, [bytearray(f.read_bytes()) for f in sorted((cfg.run_dir / "weights").glob("v000000-*"))])
    honest = keyed_groups(sampler, [3], SEED, 0, 8)[0]
    forged = _chosen(sampler, honest, None)

    restarted = TrainerModel(cfg, Ranks("cpu"))
    restarted.resume()
    restarted.remember(1)  # the version it publishes first (publish_version)
    assert sorted(restarted.proof.versions) == [0, 1]
    checked = restarted.check_many([honest])[honest.group_id]
    assert checked is not None and checked.gap < 1e-4 and checked.margin < 1e-4
    assert restarted.proof.forged(forged, restarted.proof.check(forged)) == "token_forgery"

    for f in (cfg.run_dir / "weights").glob("v000000-*"):
        f.unlink()
    without = TrainerModel(cfg, Ranks("cpu"))
    without.resume()
    without.remember(1)
    scorer = Scorer(TASK, TOKENIZER, len(TOKENIZER), cfg.sampling)
    judge = Judge(scorer, Timeline(max_staleness=1), proof=without.proof, check_many=without.check_many)
    assert judge.wants_proof(honest, 1)
    verdict = asyncio.run(judge.prove([honest], 1))[honest.group_id]
    assert verdict.reason == "unverifiable" and not verdict.strike


async def test_a_group_older_than_the_version_its_sender_asked_with_is_refused_and_struck(runs):
    """A sampler asks for work naming the version it runs (the grant records it) and may claim
    an older one for its groups, where only a fraction were proven. Weights only move forward:
    a group older than the version its sender asked with is refused and struck."""
    run = await runs.open("asked", "trainer")
    ledger = GrantLedger(seed=SEED)
    quarantine = Quarantined(run, after=10)
    scorer = Scorer(TASK, TOKENIZER, len(TOKENIZER), SAMPLING)
    collector = Collector(await RolloutInbox.open(run), Judge(scorer, Timeline(max_staleness=1)), ledger,
                          quarantine=quarantine)
    for group_id, version in (("older", 4), ("as-asked", 5)):
        (slot,), _ = ledger.grant("s1", 1, 1, 1 << 20, time.monotonic(), version=5)
        await publish_rollout(run, honest_group(ledger.prompts[slot], version=version, slot=slot, group_id=group_id))
    async with asyncio.timeout(60):
        collected = await collector.collect(1, version=5)
    assert [a.group.group_id for a in collected.used] == ["as-asked"]
    assert collected.rejected == {"version_not_granted": 1} and quarantine.strikes == {"s1": 1}


async def test_a_lift_clears_the_kept_strikes_and_the_next_trainer_starts_the_sampler_afresh(runs):
    run = await runs.open("lift", "trainer")
    async with Background() as background:
        quarantine = Quarantined(run, after=0)
        await quarantine.start(background)
        await quarantine.strike("s1", "token_forgery")
        await quarantine.strike("s2", "reward_mismatch")
        kept = await read_strikes(run)
        assert kept.counts == {"s1": 1, "s2": 1} and kept.suspects == ["s1"]  # a forger only is a suspect
        args = ["quarantine", "lift", "s1", "--nats", runs.url, "--run-id", "lift"]
        assert await quarantine_command(build_parser().parse_args(args)) == 0
        after = Quarantined(run, after=0)
        await after.start(background)
        assert after.strikes == {"s2": 1} and after.suspects == set() and "s1" not in after


async def test_a_heartbeat_that_does_not_decode_shows_its_sampler_and_gets_it_no_work(runs, tmp_path):
    """A sampler whose heartbeat failed to decode vanished from `status` and the page, strikes
    and all, and was granted work as before. Now it is shown as bad_heartbeat (with what the
    trainer counted of it) and granted nothing until its heartbeat reads again, whatever headers
    it was written with."""
    cfg = tiny_config(tmp_path, trainer={"groups_per_step": 4, "max_staleness": 0})
    run = await runs.open("beat", "trainer")
    lease = await take_lease(run)
    granter = AsyncGranter(run, lease.term, cfg, TrainerState(), GrantLedger())
    await granter.ask(0)
    asked = GrantRequest(want=2, term=lease.term, version=0)
    junk = b'{"schema_version": 23, "sampler_id": {"a": 1}, "sync_s": {"x": {}}}'
    await run.registry.put("s9", junk)
    assert (await granter.grant("s9", asked)).groups == 0
    # Written with a `Status: 503` header of its own, a single get of it failed as the broker's
    # "no responders", which the grant passes over as a broker restarting: it was granted work.
    await run.registry._js.publish(run.registry._pre + "s9", junk, headers={"Status": "503"})
    assert (await granter.grant("s9", asked)).groups == 0
    assert [(s.sampler_id, s.state) for s in await read_statuses(run)] == [("s9", "bad_heartbeat")]
    rows = (await snapshot(run))["samplers"]
    assert [(r["id"], r["state"], r["strikes"]) for r in rows] == [("s9", "bad_heartbeat", 0)]
    await put_status(run, SamplerStatus(sampler_id="s9", version=0, groups_published=0, weight_failures={},
                                        updated_at=time.time()))
    assert (await granter.grant("s9", asked)).groups == 2


async def test_one_samplers_groups_with_no_signal_use_only_its_share_of_the_set_aside_budget(runs):
    """Dynamic sampling sets aside at most algorithm.dynamic_sampling_max groups a step with no
    signal (all rewards equal). One sampler's such groups used it all, and another's were then
    trained. Now each sampler asking has an equal part of it."""
    run = await runs.open("dynamic", "trainer")
    ledger = GrantLedger(seed=SEED)
    scorer = Scorer(TASK, TOKENIZER, len(TOKENIZER), SAMPLING)
    collector = Collector(await RolloutInbox.open(run), Judge(scorer, Timeline(max_staleness=1)), ledger,
                          set_aside=2)
    wrong = ["\\boxed{99999}", "\\boxed{99998}"]  # no answer of the task's: rewards 0 and 0
    groups = [granted(ledger, honest_group(12, group_id="s2-none", sampler_id="s2", texts=wrong)),
              granted(ledger, honest_group(13, group_id="s2-some", sampler_id="s2")),
              granted(ledger, honest_group(14, group_id="s1-none", sampler_id="s1", texts=wrong)),
              granted(ledger, honest_group(15, group_id="s1-none-again", sampler_id="s1", texts=wrong))]
    for group in [groups[2], groups[3], groups[0], groups[1]]:  # s1's first: they would use the budget up
        await publish_rollout(run, group)
    async with asyncio.timeout(60):
        collected = await collector.collect(2, version=1)
    assert [a.group.group_id for a in collected.used] == ["s1-none-again", "s2-some"]
    assert collected.filtered_by == {"s1": 1, "s2": 1}


def test_groups_proven_together_get_the_check_each_gets_alone(tmp_path):
    """The intake proves a step's groups together (check_many): a version swapped in once and
    forwards of several groups. Each group's gap and margin are what its own check finds, a
    forgery among honest groups is caught alone, and the trainer's weights are its own after."""
    cfg = _config(tmp_path)
    proof, shards = _trainer_at_version_1(cfg)
    live = {k: v.clone() for k, v in proof.live.items()}
    sampler = HFEngine("tiny", LORA, cfg.sampling, "cpu", "float32")
    load_weights(sampler.model, shards[0])
    older = keyed_groups(sampler, [1, 2, 3], SEED, 0, 8, first_slot=1)
    forged = _chosen(sampler, older[1], shards).replaced(group_id="forged", sampler_id="s9")
    load_weights(sampler.model, shards[1])
    current = [g.replaced(version=1) for g in keyed_groups(sampler, [4, 5], SEED, 0, 8, first_slot=4)]
    groups = [older[0], current[0], forged, older[1], current[1], older[2]]
    together = proof.check_many(groups, rows_per_forward=16)  # two groups a forward
    for group in groups:
        alone = proof.check(group)
        assert together[group.group_id].gap == pytest.approx(alone.gap, abs=1e-5)
        assert together[group.group_id].margin == pytest.approx(alone.margin, abs=1e-5)
        assert bool(proof.forged(group, together[group.group_id])) == (group is forged)
    assert proof.suspects == {"s9"}
    assert all(torch.equal(p, live[k]) for k, p in proof.model.named_parameters() if p.requires_grad)


async def test_a_prompt_granted_again_is_drawn_with_the_noise_of_the_slot_it_was_first_granted_on(runs, tmp_path):
    """A sampler that lets a slot go (selective delivery, under the 1-in-8 bound) had its prompt
    granted again on a new slot, drawn with that slot's noise: a new draw, so it chose which of a
    prompt's completions were trained. The grant now names the noise of the slot the prompt was
    first granted on: the redraw is the same draw (here at the same version: the same tokens), and
    a group drawn with any other noise is refused and struck."""
    cfg = _config(tmp_path, trainer={"groups_per_step": 4, "max_staleness": 0})
    run = await runs.open("again", "trainer")
    lease = await take_lease(run)
    ledger = GrantLedger(seed=SEED)
    granter = AsyncGranter(run, lease.term, cfg, TrainerState(), ledger)
    await granter.ask(0)
    asked = GrantRequest(want=2, term=lease.term, version=0)
    first = await granter.grant("s1", asked)
    assert first.slots == [1, 2] and first.noise_slots == []  # fresh draws: each its own noise
    ledger.release("s1")  # s1 let them go
    granter.reissue_lost(ledger.take_lost(), accepted=0)
    again = await granter.grant("s2", asked)
    assert again.prompts == first.prompts and again.keyed_slots() == [1, 2] and again.slots == [3, 4]

    sampler = HFEngine("tiny", LORA, cfg.sampling, "cpu", "float32")
    perturb(sampler.model, seed=0)
    prompt_ids = [sampler.encode_chat(TASK.prompt(i).messages) for i in first.prompts]
    withheld = sampler.generate(prompt_ids, 8, draws=[Draw(group_key(SEED, lease.term, s)) for s in first.slots])
    redrawn = sampler.generate(prompt_ids, 8, draws=[Draw(group_key(SEED, lease.term, s))
                                                     for s in again.keyed_slots()])
    assert [[g.token_ids for g in gens] for gens in redrawn] == [[g.token_ids for g in gens] for gens in withheld]
    keys = [group_key(SEED, lease.term, s) for s in again.keyed_slots()]  # as the sampler's generation call draws
    sent = generate_groups(sampler, TASK, [TASK.prompt(i) for i in again.prompts], cfg.sampling, "s2",
                           Version(lease.term, 0), again.slots, keys=keys, noise_slots=again.keyed_slots())
    assert [(g.slot, g.noise_slot, g.keyed_slot) for g in sent] == [(3, 1, 1), (4, 2, 2)]
    assert [[c.token_ids.tolist() for c in g.completions] for g in sent] == [[list(g.token_ids) for g in gens]
                                                                            for gens in redrawn]

    quarantine = Quarantined(run, after=10)
    collector = Collector(await RolloutInbox.open(run), Judge(Scorer(TASK, TOKENIZER, len(TOKENIZER), cfg.sampling),
                                                              Timeline(max_staleness=0, term=lease.term)),
                          ledger, quarantine=quarantine)
    own = sampler.generate(prompt_ids[:1], 8, draws=[Draw(group_key(SEED, lease.term, 3))])  # slot 3's noise
    for slot, prompt, noise, gens in zip(again.slots, again.prompts, [None, 2], [own[0], redrawn[1]]):
        await publish_rollout(run, honest_group(prompt, version=0, term=lease.term, slot=slot, sampler_id="s2",
                                                group_id=f"slot{slot}", temperature=cfg.sampling.temperature,
                                                noise_slot=noise, prompt_token_ids=sampler.encode_chat(
                                                    TASK.prompt(prompt).messages), completions=[
                                                    honest_group().completions[0].replaced(
                                                        token_ids=g.token_ids, logprobs=g.logprobs, text=g.text,
                                                        finish_reason=g.finish_reason,
                                                        claimed_reward=TASK.score(g.text, TASK.prompt(prompt)).reward)
                                                    for g in gens]))
    async with asyncio.timeout(60):
        collected = await collector.collect(1, version=0)
    assert [a.group.group_id for a in collected.used] == ["slot4"]
    assert collected.rejected == {"wrong_noise_slot": 1} and quarantine.strikes == {"s2": 1}
