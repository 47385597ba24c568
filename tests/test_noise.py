"""Keyed noise (issue 63): a sampler drawing with Gumbel-max and noise keyed by its grant has no
choice of text, and the trainer checks the tokens themselves. Honest groups pass at fp32 and
bf16; a token swapped, completions chosen from other draws, or text from elsewhere with its true
log-probs (which the log-prob check alone lets through) are token forgeries."""

import pytest
import torch

from echo.config import ConfigError, LoraConfig
from echo.devices import dtype_name
from echo.engines import make_engine
from echo.engines.hf import HFEngine
from echo.noise import group_key, gumbel
from echo.policy import group_logprobs, load_weights, weights_shards
from echo.proof import ProofSettings, SamplingProof
from tests.conftest import tiny_config
from tests.groups import REFEREE, SAMPLING, honest_group

LORA = LoraConfig(r=4, alpha=8.0)
SEED, EPOCH = 7, 1


def test_the_noise_is_the_same_bits_for_the_same_key_and_a_gumbel_draw():
    key = group_key(SEED, EPOCH, 3)
    noise = gumbel(key, 2, torch.arange(64), 4096)
    assert torch.equal(noise, gumbel(key, 2, torch.arange(64), 4096))
    assert torch.equal(noise[10:20], gumbel(key, 2, torch.arange(10, 20), 4096))  # a chunk is its own positions
    assert not torch.equal(noise, gumbel(key, 3, torch.arange(64), 4096))  # another completion
    assert not torch.equal(noise, gumbel(group_key(SEED, EPOCH, 4), 2, torch.arange(64), 4096))  # another slot
    assert not torch.equal(noise, gumbel(group_key(SEED, EPOCH + 1, 3), 2, torch.arange(64), 4096))  # another epoch
    # A standard Gumbel: mean Euler's gamma (0.5772), standard deviation pi / sqrt(6) (1.2825).
    assert noise.mean().item() == pytest.approx(0.5772, abs=0.01)
    assert noise.std().item() == pytest.approx(1.2825, abs=0.01)
    # Its argmax over logits + noise is a draw from softmax(logits): 4,000 keys, fixed bits.
    logits = torch.tensor([0.0, 1.0, 2.0])
    drawn = torch.stack([(logits + gumbel(group_key(SEED, EPOCH, slot), 0, torch.arange(1), 3)[0]).argmax()
                         for slot in range(4000)])
    assert torch.bincount(drawn, minlength=3) / 4000 == pytest.approx(torch.softmax(logits, 0).tolist(), abs=0.02)


def _engines(dtype: str = "float32"):
    """A sampler at version 0 and the trainer's proof holding version 0, the adapter moved off zero."""
    sampling = SAMPLING.model_copy(update={"max_new_tokens": 24, "group_size": 8, "dtypes": ["float32", "bfloat16"]})
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


def _keyed_groups(sampler: HFEngine, prompts: list[int], first_slot: int = 1) -> list:
    prompt_ids = [sampler.encode_chat(REFEREE.task.prompt(i).messages) for i in prompts]
    slots = list(range(first_slot, first_slot + len(prompts)))
    keys = [group_key(SEED, EPOCH, slot) for slot in slots]
    generations = sampler.generate(prompt_ids, 8, keys=keys)
    return [honest_group(i, version=0, epoch=EPOCH, slot=slot, prompt_token_ids=ids, temperature=sampler.temperature,
                         dtype=dtype_name(sampler.dtype), completions=[
                             honest_group().completions[0].replaced(token_ids=g.token_ids, logprobs=g.logprobs)
                             for g in gens])
            for i, slot, ids, gens in zip(prompts, slots, prompt_ids, generations)]


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

    def with_true_logprobs(group):
        """What a forger who runs the model forward reports: the policy's own log-probs of its text."""
        with torch.no_grad():
            logprobs, _, _ = group_logprobs(proof.model, group.prompt_token_ids,
                                            [c.token_ids for c in group.completions], sampler.temperature,
                                            sampler.tokenizer.pad_token_id)
        return group.replaced(completions=[c.replaced(logprobs=logprobs[i, : len(c.token_ids)].tolist())
                                           for i, c in enumerate(group.completions)])

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


def test_an_engine_that_cannot_draw_keyed_noise_is_refused_at_start_unless_the_run_trusts_its_text(tmp_path):
    cfg = tiny_config(tmp_path, sampler={"engine": "hf-paged"})
    with pytest.raises(ConfigError, match="sampling.noise = 'engine'"):
        make_engine(cfg)
    assert make_engine(tiny_config(tmp_path, sampler={"engine": "hf-paged"}, sampling={"noise": "engine"})).name == "hf"
