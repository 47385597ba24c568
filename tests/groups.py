"""Rollout groups for tests, built one way: as an honest sampler would send them (the task's
prompt at its index, the byte tokenizer's tokens, the verifier's rewards), then changed field by
field for what a test needs. Not a test module: test modules import it, never each other."""

import asyncio
import time

import orjson
import torch

from echo.config import SamplingConfig, TaskConfig
from echo.fleet.grants import GrantLedger
from echo.model.devices import dtype_name
from echo.model.loading import byte_tokenizer, encode_chat
from echo.tasks import Task, load_task
from echo.tasks.math import Math
from echo.trust.noise import Draw, group_key
from echo.trust.scorer import Scorer
from echo.wire.codec import _pack, _read_rollout, _spans
from echo.wire.messages import Completion, RolloutGroup
from streams.rollouts import publish_rollout
from tests.conftest import eventually_async

TOKENIZER = byte_tokenizer()
TASK = Math({})
SAMPLING = SamplingConfig(group_size=2, max_new_tokens=32, temperature=1.0)
SCORER = Scorer(TASK, TOKENIZER, vocab_size=len(TOKENIZER), sampling=SAMPLING)
# \\boxed{K^{9^{8}}}: math-verify hands sympy each power tower to evaluate in full (45.9 s for
# the first in the trainer's process; the attack measured > 515 s for 8). It reaches sympy only
# where the truth is not a number (a number is compared: echo/tasks/math.py).
BOMB = [f"\\boxed{{{k}^{{9^{{8}}}}}}" for k in (3, 5)]


def symbolic_math(tmp_path) -> tuple[TaskConfig, Task, Scorer]:
    """The math task on a dataset whose truths are not numbers (math-verify checks them), as
    its config, the task and its scorer."""
    rows = [{"question": f"What is the square root of 2 (case {i})?", "answer": "\\sqrt{2}"} for i in range(32)]
    (tmp_path / "symbolic.jsonl").write_bytes(b"\n".join(orjson.dumps(r) for r in rows))
    config = TaskConfig(name="math", params={"dataset": str(tmp_path / "symbolic.jsonl")})
    task = load_task(config)
    return config, task, Scorer(task, TOKENIZER, vocab_size=len(TOKENIZER), sampling=SAMPLING)


def honest_group(index: int = 12, texts=None, of_task: Task = TASK, rewards: list[float] | None = None,
                 **changes) -> RolloutGroup:
    """The group `of_task`'s prompt `index` gets from an honest sampler: `texts` as completions
    (default: the right answer and a wrong one), each with log-probs of -0.5 a token and the
    verifier's reward (or `rewards`, claimed); `changes` replace any of the group's fields."""
    prompt = of_task.prompt(index)
    texts = texts or [f"\\boxed{{{prompt.answer}}}", "\\boxed{999}"]
    rewards = rewards or [of_task.score(t, prompt).reward for t in texts]
    completions = []
    for text, reward in zip(texts, rewards):
        ids = TOKENIZER(text, add_special_tokens=False)["input_ids"] + [TOKENIZER.eos_token_id]
        completions.append(Completion(token_ids=ids, logprobs=[-0.5] * len(ids), text=text,
                                      claimed_reward=reward, finish_reason="stop"))
    fields = dict(
        group_id="g", sampler_id="s1", version=1, task=of_task.name, prompt_index=index, slot=1, term=0,
        prompt_token_ids=encode_chat(TOKENIZER, prompt.messages), completions=completions,
        temperature=1.0, engine="hf", dtype="float32", gen_seconds=0.1, created_at=0.0,
    )
    return RolloutGroup(**{**fields, **changes})


def keyed_groups(sampler, prompts: list[int], seed: int, term: int, n: int, first_slot: int = 1,
                 **changes) -> list[RolloutGroup]:
    """What an honest sampler (an engine) drawing keyed noise sends for the task's `prompts`, n
    completions each, on consecutive slots from `first_slot` of the run seeded `seed`, in `term`."""
    prompt_ids = [sampler.encode_chat(TASK.prompt(i).messages) for i in prompts]
    slots = list(range(first_slot, first_slot + len(prompts)))
    keys = [group_key(seed, term, slot) for slot in slots]
    generations = sampler.generate(prompt_ids, n, draws=[Draw(key) for key in keys])
    return [honest_group(i, version=0, term=term, slot=slot, prompt_token_ids=ids, temperature=sampler.temperature,
                         dtype=dtype_name(sampler.dtype), completions=[
                             honest_group().completions[0].replaced(
                                 token_ids=g.token_ids, logprobs=g.logprobs, text=g.text, finish_reason=g.finish_reason,
                                 claimed_reward=TASK.score(g.text, TASK.prompt(i)).reward)
                             for g in gens], **changes)
            for i, slot, ids, gens in zip(prompts, slots, prompt_ids, generations)]


def with_completion(group: RolloutGroup | None = None, i: int = 0, **changes) -> RolloutGroup:
    """`group` (default: honest_group()) with completion i's fields changed."""
    group = group or honest_group()
    completions = list(group.completions)
    completions[i] = completions[i].replaced(**changes)
    return group.model_copy(update={"completions": completions})


def unlikely(group: RolloutGroup, i: int) -> RolloutGroup:
    """Completion i of `group` with log-probs of -1.5 a token: a completion of 13 tokens or more
    is below REPEAT_LOGPROB, as any sampled reasoning-length completion is."""
    n = len(group.completions[i].token_ids)
    return with_completion(group, i, logprobs=[-1.5] * n)


# A rollout message from and to plain data: the tests build malformed ones, which no RolloutGroup holds.
def pack_rollout(raw: dict) -> bytes:
    """A rollout message from a group's fields as plain data (RolloutGroup.model_dump(), or any
    dict shaped like it: the tests build malformed ones)."""
    fields = {k: v for k, v in raw.items() if k != "prompt_token_ids"}
    fields["completions"] = [{k: v for k, v in c.items() if k not in ("token_ids", "logprobs")}
                             for c in raw["completions"]]
    return _pack(fields, raw["prompt_token_ids"], [c["token_ids"] for c in raw["completions"]],
                 [c["logprobs"] for c in raw["completions"]])


def unpack_rollout(data: bytes) -> dict:
    """A rollout message back into plain data, as RolloutGroup.model_dump() gives it (unchecked)."""
    raw, prompt_tokens, counts, ids, logprobs = _read_rollout(data)
    raw["prompt_token_ids"] = ids[:prompt_tokens].tolist()
    for c, (a, b) in zip(raw["completions"], _spans(counts)):
        c["token_ids"], c["logprobs"] = ids[prompt_tokens + a : prompt_tokens + b].tolist(), logprobs[a:b].tolist()
    return raw


def granted(ledger: GrantLedger, group: RolloutGroup) -> RolloutGroup:
    """`group` on a slot `ledger` granted its sampler, with the group's prompt as the slot's (the
    test's choice of prompt, as if the trainer had drawn it): what an honest sampler sends."""
    (slot,), _ = ledger.grant(group.sampler_id, 1, 1, 1 << 20, time.monotonic())
    ledger.prompts[slot] = group.prompt_index
    ledger.noise.pop(slot, None)  # a fresh draw: its own slot's noise
    return group.model_copy(update={"slot": slot})


def turns_end_often(models: list, prompt_ids: list[int]) -> None:
    """The random tiny models almost never end a turn: give the end-of-turn token a logit of about
    3 (its head row along the first model's mean final hidden state over `prompt_ids`), in every
    model alike, so episodes play several turns."""
    with torch.no_grad():
        mean = models[0](input_ids=torch.tensor([prompt_ids]), output_hidden_states=True).hidden_states[-1][0].mean(0)
        for model in models:
            model.get_output_embeddings().weight[TOKENIZER.eos_token_id] = 3.0 * mean / mean.norm() ** 2


def perturb(model, seed: int) -> None:
    """Move a policy off its initial values, as training would: a LoRA adapter's B (zero at init:
    every version would be the base model), or in full-weight mode every parameter, the head too."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=generator) * 0.05)
            elif p.requires_grad and "lora" not in name:
                p.add_(torch.randn(p.shape, generator=generator) * 0.02)


async def collect_once_quarantined(collector, quarantine, forger: str, run, ledger: GrantLedger,
                                   honest: RolloutGroup, version: int):
    """What `collector` collects for one group while another sampler's `honest` group is published
    only once `forger` is quarantined (else it would be read in turn with the forger's first)."""

    async def once_quarantined():
        await eventually_async(lambda: forger in quarantine, 60, every=0.01)
        await publish_rollout(run, granted(ledger, honest))

    publishing = asyncio.create_task(once_quarantined())
    async with asyncio.timeout(120):  # a hang guard: all is published
        collected = await collector.collect(1, version=version)
    await publishing
    return collected
