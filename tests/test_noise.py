"""Keyed noise (the proof of the tokens): a sampler drawing with Gumbel-max and noise keyed by its grant has no
choice of text, and the trainer checks the tokens themselves. Honest groups pass at fp32 and
bf16; a token swapped, completions chosen from other draws, or text from elsewhere with its true
log-probs (which the log-prob check alone lets through) are token forgeries."""

import asyncio
import time

import numpy as np
import pytest
import torch

from echo.config import ConfigError, LoraConfig, TaskConfig
from echo.engines import make_engine
from echo.engines.hf import HFEngine, PagedEngine
from echo.fleet.grants import GrantLedger
from echo.model.policy import group_logprobs
from echo.tasks.episodes import load_environment, play_episodes
from echo.train.learner import Batch, ForgedInStep, Forward, HeldProof, Rewarded, make_optimizer, train_step
from echo.trust.noise import GUMBEL_MAX, Draw, group_key, gumbel, gumbel_at, noisy_margin, uniform
from echo.trust.proof import Checked, ProofSettings, SamplingProof
from echo.trust.scorer import Scorer
from echo.weights.shards import load_weights, weights_shards
from streams.client import open_run
from streams.inbox import RolloutInbox
from streams.lease import take_lease
from streams.rollouts import publish_rollout
from tests.conftest import tiny_config
from tests.groups import (
    SAMPLING,
    SCORER,
    TASK,
    TOKENIZER,
    collect_once_quarantined,
    granted,
    honest_group,
    keyed_groups,
    turns_end_often,
)
from workers.background import Background
from workers.trainer.accounting import RecentSteps
from workers.trainer.granter import AsyncGranter
from workers.trainer.intake import Collector
from workers.trainer.judge import Judge, Timeline
from workers.trainer.model import Ranks, TrainerModel
from workers.trainer.step import TrainerStep
from workers.trainer.strikes import Quarantined
from workers.trainer.trainer import Trainer

LORA = LoraConfig(r=4, alpha=8.0)
SEED, TERM = 7, 1


def test_the_noise_is_the_same_bits_for_the_same_key_and_a_gumbel_draw():
    key = group_key(SEED, TERM, 3)
    noise = gumbel(key, 2, torch.arange(64), 4096)
    assert torch.equal(noise, gumbel(key, 2, torch.arange(64), 4096))
    assert torch.equal(noise[10:20], gumbel(key, 2, torch.arange(10, 20), 4096))  # a chunk is its own positions
    assert not torch.equal(noise, gumbel(key, 3, torch.arange(64), 4096))  # another completion
    assert not torch.equal(noise, gumbel(group_key(SEED, TERM, 4), 2, torch.arange(64), 4096))  # another slot
    assert not torch.equal(noise, gumbel(group_key(SEED, TERM + 1, 3), 2, torch.arange(64), 4096))  # another term
    # A standard Gumbel: mean Euler's gamma (0.5772), standard deviation pi / sqrt(6) (1.2825).
    assert noise.mean().item() == pytest.approx(0.5772, abs=0.01)
    assert noise.std().item() == pytest.approx(1.2825, abs=0.01)
    # Its argmax over logits + noise is a draw from softmax(logits): 4,000 keys, fixed bits.
    logits = torch.tensor([0.0, 1.0, 2.0])
    drawn = torch.stack([(logits + gumbel(group_key(SEED, TERM, slot), 0, torch.arange(1), 3)[0]).argmax()
                         for slot in range(4000)])
    assert torch.bincount(drawn, minlength=3) / 4000 == pytest.approx(torch.softmax(logits, 0).tolist(), abs=0.02)


def test_the_margin_drawn_only_where_a_token_could_win_is_the_whole_vocabularys():
    """noisy_margin hashes only the ids within GUMBEL_MAX of a token's noisy score where they are
    few (a language model's peaked logits): the same margins as the whole grid's, for peaked and
    flat scores, the sampled token and others; gumbel_at is gumbel's noise at its pairs (the same
    bits; a log's last bit may differ where a tensor's length leaves a vectorised loop a tail)."""
    key, positions, vocab = group_key(SEED, TERM, 3), torch.arange(5, 37), 4096
    grid = gumbel(key, 1, positions, vocab)
    rows, ids = torch.randint(0, 32, (100,)), torch.randint(0, vocab, (100,))
    assert torch.allclose(gumbel_at(key, 1, positions[rows], ids), grid[rows, ids], rtol=0, atol=1e-5)
    generator = torch.Generator().manual_seed(0)
    peaked = torch.randn(32, vocab, generator=generator) * 8  # most ids far below the top ones
    flat = torch.randn(32, vocab, generator=generator) * 0.1
    draws = [torch.full((32,), value) for value in (key & 0xFFFFFFFF, key >> 32, 1)]
    for logits, temperature in ((peaked, 1.0), (flat, 1.0), (peaked.bfloat16(), 0.7), (flat.bfloat16(), 0.7)):
        scores = logits.float() / temperature  # the margin reads a 16-bit forward's logits as they are
        for tokens in ((scores + grid).argmax(-1), scores.argmax(-1), torch.randint(0, vocab, (32,), generator=generator)):
            noisy = scores + grid
            whole = noisy.max(-1).values - noisy.gather(-1, tokens[:, None]).squeeze(-1)
            assert torch.allclose(noisy_margin(logits, tokens, temperature, *draws, positions), whole, rtol=0, atol=1e-5)
    assert int((peaked > (peaked.max(-1, keepdim=True).values - GUMBEL_MAX)).sum()) * 4 < peaked.numel()  # the few


KEYED = SAMPLING.model_copy(update={"max_new_tokens": 24, "group_size": 8, "dtypes": ["float32", "bfloat16"]})


def test_the_noise_is_finite_at_either_end_and_a_nan_is_a_forgery():
    """bench/proof.py found a group passing with 20% of its tokens replaced: one position's uniform
    had rounded to 1.0, its noise was infinite, the margin NaN, and NaN > margin is False."""
    ends = uniform(torch.tensor([0, 0xFFFFFFFF], dtype=torch.int64))
    assert 0 < ends[0] and ends[1] < 1 and torch.isfinite(-torch.log(-torch.log(ends))).all()
    _, proof = _engines()
    group = honest_group(version=0)
    assert proof.forged(group, Checked(gap=0.0, margin=float("nan"))) == "token_forgery"
    assert proof.forged(group, Checked(gap=float("nan"), margin=0.0)) == "logprob_forgery"


def _engines(dtype: str = "float32", sampling=KEYED):
    """A sampler at version 0 and the trainer's proof holding version 0, the adapter moved off zero."""
    sampler = HFEngine("tiny", LORA, sampling, "cpu", dtype)
    trainer = HFEngine("tiny", LORA, sampling).model
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in trainer.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=generator) * 0.05)
    load_weights(sampler.model, [bytearray(s) for s in weights_shards(trainer, 2**30)])
    proof = SamplingProof(trainer, sampler.tokenizer.pad_token_id,
                          ProofSettings(sampling.temperature, 1.0, 0.01, keep=2, tolerance_16bit=0.5, noise_seed=SEED))
    proof.remember(0)
    return sampler, proof


def _keyed_groups(sampler: HFEngine, prompts: list[int], first_slot: int = 1, **changes) -> list:
    return keyed_groups(sampler, prompts, SEED, TERM, KEYED.group_size, first_slot, **changes)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_honest_keyed_groups_pass_the_token_check_at_either_precision(dtype):
    """The margin that bounds the engines' numeric differences, measured: 256 completions of up to
    24 tokens each way. An fp32 sampler's tokens are the trainer's noisy argmax to float error
    (verify_margin 0.01); a bf16 one's fall short by its rounding (verify_margin_16bit 0.5)."""
    sampler, proof = _engines(dtype)
    groups = _keyed_groups(sampler, list(range(32)))
    assert sum(len(c.token_ids) for g in groups for c in g.completions) > 2000
    checked = [proof.check(g) for g in groups]
    assert [proof.forged(g, c) for g, c in zip(groups, checked)] == [None] * len(groups)
    worst = max(c.margin for c in checked)
    assert worst < (1e-3 if dtype == "float32" else 0.25), worst
    # The same keys draw the same text, whatever torch's generator holds: nothing for a sampler to choose.
    torch.manual_seed(123)
    assert [c.token_ids.tolist() for c in _keyed_groups(sampler, [0])[0].completions] == [
        c.token_ids.tolist() for c in groups[0].completions]


def test_a_swapped_token_or_text_chosen_with_its_true_log_probs_is_a_token_forgery():
    sampler, proof = _engines()
    honest = _keyed_groups(sampler, [5])[0]
    assert proof.forged(honest, proof.check(honest)) is None

    with_true_logprobs = _forger(proof)
    # One token of one completion replaced by the next vocabulary id (one in ~150 of the group's).
    first = honest.completions[0]
    swapped = [int(first.token_ids[0] + 1) % 256, *first.token_ids[1:].tolist()]
    one_token = with_true_logprobs(honest.replaced(completions=[first.replaced(token_ids=swapped),
                                                                *honest.completions[1:]]))
    # The group's own prompt, sampled with another slot's noise: a draw the sampler picked.
    other_draw = _keyed_groups(sampler, [5], first_slot=9)[0]
    chosen = with_true_logprobs(honest.replaced(completions=other_draw.completions))
    for forged in (one_token, chosen):
        checked = proof.check(forged)
        assert checked.gap < 1e-4  # the log-probs are true: the log-prob check alone lets it through
        assert proof.forged(forged, checked) == "token_forgery", checked


def test_episodes_draw_keyed_noise_turn_by_turn_and_a_turn_changed_is_a_token_forgery():
    """Keyed episodes: an episode's turns drew with the engine's own generator and were checked by their
    log-probs only. Each turn now draws with its group's keyed noise, episode j as completion j, a
    token at its position in the episode; the proof checks every token the model drew (the
    environment's observations are its own, replayed by the scorer). Honest episodes pass and draw
    the same again; one token of a later turn replaced, with true log-probs, is a token forgery."""
    sampler, proof = _engines()
    turns_end_often([proof.model, sampler.model], sampler.encode_chat(SCORER.task.prompt(0).messages))
    env = load_environment(TaskConfig(name="math_tools"))
    prompts = [env.prompt(i) for i in range(2)]
    prompt_ids = [sampler.encode_chat(p.messages) for p in prompts]
    keys = [group_key(SEED, TERM, slot) for slot in (1, 2)]
    episodes = play_episodes(sampler, env, prompts, prompt_ids, 2, 384, keys=keys)
    assert all(len(c.observations) >= 2 for group in episodes for c in group)  # three turns or more
    again = play_episodes(sampler, env, prompts, prompt_ids, 2, 384, keys=keys)
    assert [[c.token_ids.tolist() for c in g] for g in again] == [[c.token_ids.tolist() for c in g] for g in episodes]
    groups = [honest_group(p.index, task=env.name, version=0, term=TERM, slot=slot, prompt_token_ids=ids,
                           completions=completions)
              for p, ids, slot, completions in zip(prompts, prompt_ids, (1, 2), episodes)]
    for group in groups:
        checked = proof.check(group)
        assert proof.forged(group, checked) is None and checked.margin < 1e-3, checked

    group = groups[0]
    first = group.completions[0]
    at = first.observations[0].at + first.observations[0].tokens + 1  # the second turn's second token
    tokens = first.token_ids.copy()
    tokens[at] = (tokens[at] + 1) % 256
    with torch.no_grad():
        logprobs = group_logprobs(proof.model, group.prompt_token_ids, [tokens], proof.temperature, proof.pad_id)[0]
    true = np.where(first.model_mask(), logprobs[0, : len(tokens)].numpy(), 0.0)
    forged = group.replaced(completions=[first.replaced(token_ids=tokens.tolist(), logprobs=true.tolist()),
                                         *group.completions[1:]])
    checked = proof.check(forged)
    assert checked.gap < 1e-4 and proof.forged(forged, checked) == "token_forgery", checked


def test_the_step_proves_its_own_versions_groups_from_its_forward_and_updates_nothing_for_a_forgery(tmp_path):
    """The proof in the step: the groups sampled by the version the trainer holds are proved every time, from
    the forward the step runs anyway (its pi_old): the same gap and margins as the proof's own
    forward, a group split between passes judged whole. A token swapped with true log-probs is
    found before the optimizer's update: no update is made (ForgedInStep), the step is to be
    taken again without it."""
    sampler, proof = _engines()
    cfg = tiny_config(tmp_path, lora={"r": LORA.r, "alpha": LORA.alpha},
                      sampling=KEYED.model_dump(), trainer={"micro_batch_tokens": 64, "pack_groups": "on"})
    model, pad = proof.model, proof.pad_id
    optimizer = make_optimizer(model, cfg)
    honest = _keyed_groups(sampler, [3, 4])
    seen: list[dict] = []

    def judge(groups):
        def answer(checked):
            seen.append(checked)
            return proof.judged_in_step({g.group_id: g for g in groups}, checked)
        return answer

    first = honest[1].completions[0]
    swapped = [*first.token_ids[:5].tolist(), int(first.token_ids[5] + 1) % 256, *first.token_ids[6:].tolist()]
    forged = _forger(proof)(honest[1].replaced(group_id="forged", completions=[first.replaced(token_ids=swapped),
                                                                                *honest[1].completions[1:]]))
    batch = [honest[0], forged]
    before = {k: p.detach().clone() for k, p in model.named_parameters() if p.requires_grad}
    with pytest.raises(ForgedInStep) as caught:
        train_step(Forward.of(model, cfg, pad), optimizer, Batch([Rewarded(g, [1.0, 0.0] * 4) for g in batch]),
                   held=HeldProof(0, proof.noise_key, judge(batch)))
    assert caught.value.forged == {"forged": "token_forgery"}
    assert all(torch.equal(p, before[k]) for k, p in model.named_parameters() if p.requires_grad)
    assert all(p.grad is None for p in model.parameters())
    step = seen[-1]
    for group in batch:
        alone = proof.check(group)  # the proof's own forward
        assert step[group.group_id].gap == pytest.approx(alone.gap, abs=1e-5)
        assert step[group.group_id].margin == pytest.approx(alone.margin, abs=1e-5)

    stats = train_step(Forward.of(model, cfg, pad), optimizer, Batch([Rewarded(g, [1.0, 0.0] * 4) for g in honest]),
                       held=HeldProof(0, proof.noise_key, judge(honest)))
    assert stats["passes"] > len(honest)  # split between passes, judged whole
    assert set(seen[-1]) == {g.group_id for g in honest} and proof.counts["passed"] == 2
    assert not all(torch.equal(p, before[k]) for k, p in model.named_parameters() if p.requires_grad)


async def test_a_forgery_found_in_the_step_is_refused_and_struck_and_the_step_trains_on_another_group(runs, tmp_path):
    """The trainer's step (Trainer.train_proven) on a real broker: of the two groups it collected
    at version 0, one has a token swapped with true log-probs. Its own forward finds it before the
    update; the group is refused as a token forgery and its sender struck, a group is collected in
    its place, and the step trains on the two honest ones."""
    cfg = tiny_config(tmp_path, run={"id": "held", "seed": SEED}, lora={"r": LORA.r, "alpha": LORA.alpha},
                      sampling=KEYED.model_dump(), trainer={"groups_per_step": 2})
    run = await runs.open("held", "trainer")
    lease = await take_lease(run)
    assert lease.term == TERM
    model = TrainerModel(cfg, Ranks("cpu"))
    model.resume()
    model.remember(0)
    sampler = HFEngine("tiny", LORA, KEYED, "cpu", "float32")
    load_weights(sampler.model, [bytearray(s) for s in weights_shards(model.module, 2**30)])
    quarantine, ledger = Quarantined(run, after=3), GrantLedger(seed=cfg.run.seed)
    judge = Judge(Scorer(TASK, TOKENIZER, len(TOKENIZER), KEYED), Timeline(max_staleness=1, term=TERM),
                  proof=model.proof, check_many=model.check_many)
    collector = Collector(await RolloutInbox.open(run), judge, ledger, quarantine=quarantine)
    granter = AsyncGranter(run, TERM, cfg, model.state, ledger, quarantine)
    await granter.start()
    await granter.ask(0)
    trainer = Trainer(cfg, lease, model, collector, granter, RecentSteps(2, 1, cfg.run.steps))
    try:
        async def send(sampler_id: str, prompt: int) -> None:
            group = _keyed_groups(sampler, [prompt], first_slot=ledger.issued + 1, sampler_id=sampler_id,
                                  group_id=f"{sampler_id}{prompt}")[0]
            if sampler_id == "s1":
                first = group.completions[0]
                swapped = [*first.token_ids[:3].tolist(), int(first.token_ids[3] + 1) % 256, *first.token_ids[4:].tolist()]
                group = _forger(model.proof)(group.replaced(completions=[first.replaced(token_ids=swapped),
                                                                         *group.completions[1:]]))
            await publish_rollout(run, granted(ledger, group))

        await send("s2", 3)
        await send("s1", 4)
        step = TrainerStep(1, time.perf_counter())
        step.collected = await collector.collect(2, 0)
        assert {a.group.group_id for a in step.collected.used} == {"s23", "s14"}  # the intake leaves version 0 to the step
        step.batch = step.collected.batch(0, 1)
        await send("s2", 5)  # what the step collects in the forged one's place
        async with asyncio.timeout(120):  # a hang guard
            stats = await trainer.train_proven(step)
        assert {a.group.group_id for a in step.collected.used} == {"s23", "s25"}
        assert stats["sequences"] == 2 * KEYED.group_size and step.collected.rejected == {"token_forgery": 1}
        assert quarantine.strikes == {"s1": 1} and model.proof.counts == {"forged": 1, "passed": 2}
        assert [prompt for prompt, _ in ledger.owed] == [4]  # the forged group's prompt, granted again next
    finally:
        await granter.subscription.unsubscribe()
        model.close()


def _forger(proof: SamplingProof):
    """What a forger who runs the model forward reports for its text: the policy's own log-probs."""

    def with_true_logprobs(group):
        with torch.no_grad():
            tokens = [c.token_ids for c in group.completions]
            logprobs, _, _ = group_logprobs(proof.model, group.prompt_token_ids, tokens, proof.temperature,
                                            proof.pad_id)
        eos = TOKENIZER.eos_token_id
        return group.replaced(completions=[
            c.replaced(logprobs=logprobs[i, : len(c.token_ids)].tolist(), text=text,
                       finish_reason="stop" if c.token_ids[-1] == eos else "length",
                       claimed_reward=TASK.score(text, TASK.prompt(group.prompt_index)).reward)
            for i, c in enumerate(group.completions)
            for text in [TOKENIZER.decode(c.token_ids.tolist(), skip_special_tokens=True)]])

    return with_true_logprobs


async def test_one_samplers_text_of_its_choosing_is_refused_and_it_is_quarantined(secured):
    """On a secured hub, a client with exactly sampler s1's credentials sends, on slots the trainer
    granted it, text it chose with its true log-probs: completions of another model, one token in
    64 replaced, a fixed phrase put in front, and the best of 4 draws of each completion (by the
    verifier's reward). The log-probs are all true, so the log-prob check alone let each through;
    now each is a token forgery, a strike, and past trainer.quarantine_after (3) s1 is quarantined
    and its next group, honest or not, is refused. An honest group of another sampler is trained."""
    server, secure = secured
    sampler, proof = _engines()
    forge = _forger(proof)
    other_model, _ = _engines()  # another adapter: another model's text
    with torch.no_grad():
        for name, p in other_model.model.named_parameters():
            if "lora_B" in name:
                p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(9)) * 0.2)
    phrase = sampler.tokenizer("BUY NOW ", add_special_tokens=False)["input_ids"]

    def one_in_64(group):
        return group.replaced(completions=[c.replaced(token_ids=[(t + 1) % 256 if k % 64 == 5 else t for k, t in
                                                                 enumerate(c.token_ids.tolist(), start=24 * j)])
                                           for j, c in enumerate(group.completions)])

    def phrase_first(group):
        texts = [[*phrase, *c.token_ids.tolist()][:24] for c in group.completions]
        return group.replaced(completions=[c.replaced(token_ids=t, logprobs=[-1.0] * len(t))  # the forger's next
                                           for c, t in zip(group.completions, texts)])

    def best_of_4(group):
        draws = [_keyed_groups(sampler, [group.prompt_index], first_slot=100 + 10 * k)[0] for k in range(4)]
        def reward(c):
            return TASK.score(c.text, TASK.prompt(group.prompt_index)).reward, len(c.token_ids)

        best = [max((d.completions[j] for d in draws), key=reward) for j in range(len(group.completions))]
        return group.replaced(completions=best)

    attacks = {
        "another model": lambda g: _keyed_groups(other_model, [g.prompt_index], g.slot, group_id=g.group_id)[0],
        "one token in 64": one_in_64,
        "a phrase put in": phrase_first,
        "best of 4": best_of_4,
    }
    trainer = await open_run(server.url, "sec", "trainer", credentials=secure.credentials("trainer"))
    attacker = await open_run(server.url, "sec", "s1", credentials=secure.credentials("sampler-s1"), create=False)
    try:
        async with Background() as background:
            quarantine = Quarantined(trainer, after=3)
            await quarantine.start(background)
            ledger, scorer = GrantLedger(), Scorer(TASK, TOKENIZER, len(TOKENIZER), KEYED)
            judge = Judge(scorer, Timeline(max_staleness=1, term=TERM), proof=proof)
            collector = Collector(await RolloutInbox.open(trainer), judge, ledger, quarantine=quarantine)
            for slot, (what, attack) in enumerate(attacks.items(), start=1):
                honest = _keyed_groups(sampler, [slot], first_slot=slot, group_id=f"f{slot}")[0]
                forged = forge(attack(honest))
                assert forged.completions != honest.completions, what
                assert granted(ledger, forged).slot == slot
                await publish_rollout(attacker, forged)
            await publish_rollout(attacker, granted(ledger, _keyed_groups(sampler, [7], first_slot=5,
                                                                           group_id="late")[0]))
            good = _keyed_groups(sampler, [8], first_slot=6, group_id="good", sampler_id="s2")[0]
            collected = await collect_once_quarantined(collector, quarantine, "s1", trainer, ledger, good, version=0)
        assert [a.group.group_id for a in collected.used] == ["good"]
        assert collected.rejected == {"token_forgery": 4, "quarantined": 1}, collected.rejected
        assert "s1" in quarantine
    finally:
        await attacker.close()
        await trainer.close()


def test_the_paged_engine_draws_the_keyed_noise_hf_draws_and_its_groups_pass_the_check():
    """Keyed noise in hf-paged: transformers' continuous batching (sampler.engine = "hf-paged") drew with its own
    generator, so a keyed run refused it. It now draws each token by its group's keyed noise,
    through the manager's per-request processor: the same tokens as `hf` for the same draws (each
    completion leaving the batch at its own step: the end-of-turn token made likely), with the
    log-probs of softmax(logits / T), and its groups pass the proof's token check."""
    sampler, proof = _engines()
    turns_end_often([proof.model, sampler.model], sampler.encode_chat(SCORER.task.prompt(0).messages))
    paged = PagedEngine("tiny", LORA, KEYED, "cpu", "float32")
    paged.model.load_state_dict(sampler.model.state_dict())
    prompts = [sampler.encode_chat(SCORER.task.prompt(i).messages) for i in range(6)]
    draws = [Draw(group_key(SEED, TERM, slot), first=slot % 3, position=slot % 5) for slot in range(1, 7)]
    want = [g for gens in sampler.generate(prompts, 4, draws=draws) for g in gens]
    got = [g for gens in paged.generate(prompts, 4, draws=draws) for g in gens]
    assert len({len(g.token_ids) for g in got}) > 3  # they left the batch at different steps
    assert [g.token_ids for g in got] == [g.token_ids for g in want]
    assert [g.finish_reason for g in got] == [g.finish_reason for g in want]
    assert max(abs(a - b) for x, y in zip(got, want) for a, b in zip(x.logprobs, y.logprobs)) < 1e-4
    groups = _keyed_groups(paged, [0, 1, 2])
    assert [proof.forged(g, proof.check(g)) for g in groups] == [None] * 3


def test_an_engine_that_cannot_draw_keyed_noise_is_refused_at_start_unless_the_run_trusts_its_text(tmp_path,
                                                                                                      monkeypatch):
    monkeypatch.setattr(PagedEngine, "keyed_noise", False)  # a transformers without per-request processors
    cfg = tiny_config(tmp_path, sampler={"engine": "hf-paged"}, sampling={"trusted_samplers": ["t1"]})
    with pytest.raises(ConfigError, match="sampling.trusted_samplers"):
        make_engine(cfg, "s1")
    assert make_engine(cfg, "t1").name == "hf"  # this sampler's text is trusted
    assert make_engine(tiny_config(tmp_path, sampler={"engine": "hf-paged"}, sampling={"noise": "engine"}),
                       "s1").name == "hf"  # every sampler's


def test_a_trusted_samplers_text_drawn_with_its_engines_noise_is_checked_by_its_log_probs_only():
    """A keyed run may trust named samplers (sampling.trusted_samplers) to run an engine that draws
    its own noise: their groups pass the scorer and the proof checks their log-probs, not their
    tokens. The same group from a sampler not trusted is a token forgery, whichever engine it names."""
    sampler, _ = _engines()
    trainer = sampler.model  # the sampler's own weights: version 0
    proof = SamplingProof(trainer, sampler.tokenizer.pad_token_id, ProofSettings(
        KEYED.temperature, 1.0, 0.01, keep=2, noise_seed=SEED, trusted=frozenset({"t1"})))
    proof.remember(0)
    drawn = _keyed_groups(sampler, [5])[0]  # for its shape; its tokens drawn again below with the engine's noise
    prompt_ids = drawn.prompt_token_ids.tolist()
    torch.manual_seed(1)
    own = sampler.generate([prompt_ids], KEYED.group_size)[0]
    group = drawn.replaced(engine="vllm", sampler_id="t1", completions=[
        c.replaced(token_ids=g.token_ids, logprobs=g.logprobs, text=g.text, finish_reason=g.finish_reason,
                   claimed_reward=TASK.score(g.text, TASK.prompt(5)).reward) for c, g in zip(drawn.completions, own)])
    scorer = Scorer(TASK, TOKENIZER, len(TOKENIZER), KEYED.model_copy(update={"trusted_samplers": ["t1"]}))
    assert scorer.malformed(group) is None
    checked = proof.check(group)
    assert checked.margin is None and proof.forged(group, checked) is None
    for engine in ("vllm", "hf"):
        untrusted = group.replaced(sampler_id="s1", engine=engine)
        assert scorer.malformed(untrusted) is None
        assert proof.forged(untrusted, proof.check(untrusted)) == "token_forgery"
