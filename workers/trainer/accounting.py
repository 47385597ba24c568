"""The trainer's accounting: what each step did, and what became of every rollout message.

Owns the step's metrics record (metrics.jsonl, one line per checkpointed step, restored after a
crash), the run's totals by outcome (checkpointed with the step), the accounting identity
checked against the rollout inbox's consumer counts (streams/inbox.py), the learner's pace
published for the scheduler and `echo-rl status` (TrainerStatus), and the run's summary. Pure bookkeeping but for the
inbox's counts and the metrics file: it decides nothing about groups or grants.
"""

from __future__ import annotations

import math
import re
import time
import unicodedata
from collections import Counter, deque
from pathlib import Path

import orjson
import structlog

from echo.config import EchoConfig
from echo.fleet.consumed import ConsumedSeqs
from echo.train.checkpoint import TrainerState
from echo.train.diagnosis import Trained, sample_picks, step_signal
from echo.train.metrics import PAGE_SCALARS, mean_staleness, peak_rss_mb, read_metrics
from echo.wire.messages import Sample, SlotsEnded, TrainerStatus
from echo.wire.names import CONTROL_CHARACTERS, SAMPLE_CHARS, STATUS_SAMPLES
from streams.client import retry_forever
from streams.inbox import ConsumerCounts, RolloutInbox
from workers.trainer.intake import Collected
from workers.trainer.judge import Accepted
from workers.trainer.step import TrainerStep

log = structlog.get_logger()

PACE_STEPS = 10  # the learner status averages this many steps


def step_record(step: TrainerStep, version: int, proof_counts: dict, quarantined: list[str]) -> dict:
    """The step's metrics as checkpointed with it (`version`: the one it published)."""
    collected, stats, groups = step.collected, step.stats, [r.group for r in step.batch.groups]
    wait, train = step.seconds["collect"], step.seconds["train"]
    return {
        "step": step.number,
        "version": version,
        **stats,
        "tokens_per_second": stats["tokens"] / stats["train_seconds"],
        "step_seconds": wait + train,  # waiting for groups + training
        "wait_seconds": wait,  # for groups (and scoring them)
        "proof_seconds": collected.proof_seconds,  # of it, proving groups of older versions (in-step proofs: train)
        "wall_seconds": step.ended("train") - step.process_started,  # since this trainer process started
        "used": len(groups),
        "dropped_stale": len(collected.dropped_ids),
        "dropped_tokens": collected.dropped_tokens,
        "filtered_no_signal": collected.filtered,  # dynamic sampling's groups set aside
        "filtered_tokens": collected.filtered_tokens,
        "generated_seconds": collected.generated_seconds,
        "rejected": dict(collected.rejected),
        "rejected_tokens": collected.rejected_tokens,
        "reward_mismatch": dict(collected.reward_mismatch),
        "verifier_errors": collected.verifier_errors,
        "already_counted": collected.already_counted,
        "proof_of_sampling": proof_counts,  # groups checked so far by this process, by outcome
        "quarantined": quarantined,
        "staleness_used": dict(Counter(version - 1 - v for v in step.batch.versions)),
        "reward_by_source": rewards_by_source(collected.used),
        **step_signal([trained_group(a) for a in collected.used]),
        "staleness_dropped": dict(collected.dropped),
        "groups": [[g.group_id, g.version, g.sampler_id] for g in groups],
        "dropped_groups": collected.dropped_ids,
        "peak_rss_mb": peak_rss_mb(),
    }


def trained_group(a: Accepted) -> Trained:
    completions = a.group.completions
    return Trained(a.rewards, a.unanswered, [len(c.token_ids) for c in completions],
                   sum(c.truncated for c in completions), a.close)


def step_samples(step: TrainerStep, tokenizer, count: int) -> list[dict]:
    """`count` of the step's completions to read (echo/train/diagnosis.py's picks), decoded here from
    their tokens (never a sampler's own text), control characters and length bounded: they go to
    files, trackers and a web page."""
    used = step.collected.used
    rows = []
    for g, c in sample_picks([a.rewards for a in used], count):
        group, completion = used[g].group, used[g].group.completions[c]
        rows.append({"step": step.number, "group": group.group_id, "sampler": group.sampler_id,
                     "version": group.version, "reward": used[g].rewards[c], "finish_reason": completion.finish_reason,
                     "prompt": readable(tokenizer.decode(group.prompt_token_ids.tolist(), skip_special_tokens=True)),
                     "completion": readable(tokenizer.decode(completion.token_ids.tolist(), skip_special_tokens=True))})
    return rows


def readable(text: str) -> str:
    """Text as shown: at most SAMPLE_CHARS (the end, where a prompt's question and a
    completion's answer are), with no control characters but newlines and tabs."""
    text = text[-SAMPLE_CHARS:]
    return "".join(ch if ch in "\n\t" or unicodedata.category(ch)[0] != "C" else "\ufffd" for ch in text)


def rewards_by_source(used: list[Accepted]) -> dict[str, float]:
    """The step's mean reward by its prompts' data source (a dataset's), or by task."""
    rewards: dict[str, list[float]] = {}
    for a in used:
        rewards.setdefault(a.source or a.group.task, []).extend(a.rewards)
    return {source: sum(r) / len(r) for source, r in rewards.items() if r}


def finished_record(step: TrainerStep, accounting: dict) -> dict:
    """The checkpointed record with what came after the checkpoint: publishing, accounting, and
    the step's busy time (everything but the wait: T of the capacity model, echo/fleet/capacity.py,
    and the share of the step it is, what `echo-rl status` shows over the last steps)."""
    busy = step.busy_seconds()
    return {**step.record, "publish_seconds": step.seconds["publish"], "accounting": accounting,
            "busy_seconds": busy, "utilisation": busy / (busy + step.record["wait_seconds"])}


def run_task(cfg: EchoConfig) -> str:
    """The task as the page names it: a dataset's file beside the task's name."""
    path = cfg.task.params.get("path") if cfg.task.name == "dataset" else None
    return f"{cfg.task.name} ({path})" if path else cfg.task.name


class RecentSteps:
    """The trainer's pace (TrainerStatus) over its last PACE_STEPS steps."""

    def __init__(self, groups_per_step: int, max_staleness: int, steps: int, model: str = "", task: str = ""):
        self.groups_per_step, self.max_staleness, self.run_steps = groups_per_step, max_staleness, steps
        self.model, self.task = (re.sub(f"[{CONTROL_CHARACTERS}]", "", text)[-256:] for text in (model, task))
        self.steps: deque[tuple[float, float]] = deque(maxlen=PACE_STEPS)  # (busy, wait) seconds
        self.rewards: deque[float] = deque(maxlen=PACE_STEPS)
        self.rejected: Counter = Counter()  # by reason, since this trainer started
        self.status: TrainerStatus | None = None  # after the last step

    def add(self, record: dict, version: int, strikes: dict[str, int],
            slots: dict[str, SlotsEnded] | None = None, samples: list[dict] = ()) -> TrainerStatus:
        self.steps.append((record["busy_seconds"], record["wait_seconds"]))
        self.rewards.append(record["reward_mean"])
        self.rejected.update(record["rejected"])
        busy, wait = (sum(column) for column in zip(*self.steps))
        self.status = TrainerStatus(
            step_s=busy / len(self.steps), groups_per_step=self.groups_per_step, max_staleness=self.max_staleness,
            version=version, utilisation=busy / (busy + wait) if busy + wait > 0 else 1.0, updated_at=time.time(),
            step=record["step"], rewards=list(self.rewards), publish_s=record["publish_seconds"],
            accounting=record["accounting"], rejected=dict(self.rejected), staleness=mean_staleness(record),
            strikes=strikes, slots=slots or {}, steps=self.run_steps, elapsed_s=record["wall_seconds"],
            eta_s=(busy + wait) / len(self.steps) * max(self.run_steps - record["step"], 0),
            scalars={k: float(record[k]) for k in PAGE_SCALARS if math.isfinite(record.get(k, math.nan))},
            samples=[Sample(**s) for s in samples[:STATUS_SAMPLES]], model=self.model, task=self.task)
        return self.status


def count_consumed(totals: dict[str, int], collected: Collected) -> dict[str, int]:
    """The run's messages so far by what became of them (checkpointed with the step)."""
    return {
        **totals,
        "trained": totals.get("trained", 0) + len(collected.used),
        "dropped_stale": totals.get("dropped_stale", 0) + len(collected.dropped_ids),
        "rejected": totals.get("rejected", 0) + sum(collected.rejected.values()),
        "filtered_no_signal": totals.get("filtered_no_signal", 0) + collected.filtered,
    }


async def count_abandoned(inbox: RolloutInbox, consumed: ConsumedSeqs, totals: dict[str, int]) -> dict[str, int]:
    """At start: messages the broker has acked that this trainer's checkpoint never counted. A
    trainer of an earlier term consumed them in a timeline whose checkpoint is gone (the run restarted
    from an older checkpoint, or a wiped run directory on a broker that kept its streams). They
    are counted as `abandoned`, once."""
    counts = await inbox.counts()
    return _count_uncounted(counts.ack_floor, consumed, totals, "abandoned", "trainer.rewound")


def _count_uncounted(acked: int, consumed: ConsumedSeqs, totals: dict[str, int], name: str, event: str) -> dict[str, int]:
    """Sequences up to the readers' ack floor `acked` that `consumed` never counted, as `name`."""
    uncounted = consumed.missing_through(acked)
    if not uncounted:
        return totals
    log.warning(event, **{name: uncounted}, checkpoint_floor=consumed.floor, broker_ack_floor=acked)
    consumed.raise_floor(acked)
    return {**totals, name: totals.get(name, 0) + uncounted}


def account(counts: ConsumerCounts, totals: dict[str, int], consumed: ConsumedSeqs,
            unconfirmed: int) -> tuple[dict[str, int], dict[str, int]]:
    """Every message published on the run's rollouts stream is trained, dropped as stale,
    rejected, filtered (no signal: dynamic sampling), abandoned or evicted, or still pending (not acked): `published = counted + pending`,
    and `counted` (distinct messages counted) is the sum of the others (each once), from one
    reading of the readers' counts (published and pending at the same instant). Evicted messages
    are those the stream's retention limits (a sampler's quota, nats.rollouts_max_gb, _hours)
    removed before the trainer read them: up to the ack floor, the sequences it never counted
    (added to the totals, once); above it, what is neither counted nor pending (a reader skips an
    evicted message unseen). After a broker crash the broker may offer counted messages again
    (`unconfirmed` acks, or state it lost): until they are skipped, they are in `pending` too.
    Returns the new totals and the accounting."""
    totals = _count_uncounted(counts.ack_floor, consumed, totals, "evicted", "rollouts.evicted")
    if not counts.exact:
        log.warning("rollouts.accounting_inexact", reason="samplers published between every reading")
    unread = max(0, counts.published - len(consumed) - counts.pending)  # evicted above the floor
    return totals, {"published": counts.published, **totals, "evicted": totals.get("evicted", 0) + unread,
                    "pending": counts.pending, "counted": len(consumed) + unread, "unconfirmed_acks": unconfirmed}


async def settle(inbox: RolloutInbox, consumed: ConsumedSeqs, totals: dict[str, int]) -> tuple[dict[str, int], dict]:
    """After a step's checkpoint: its groups acked, every message accounted for (account)."""
    unconfirmed = await inbox.ack_held()
    return account(await retry_forever("count rollouts", inbox.counts), totals, consumed, unconfirmed)


def metrics_line(record: dict) -> bytes:
    return orjson.dumps(record, option=orjson.OPT_NON_STR_KEYS) + b"\n"  # histograms have int keys


def restore_metrics(run_dir: Path, state: TrainerState) -> None:
    """After a crash, metrics.jsonl must hold exactly one line per checkpointed step: drop lines
    of steps the checkpoint does not have, and restore the last step's line if it was lost. A
    restored line says so; what came after the checkpoint (publishing, accounting) is not in it,
    and its busy time is the step's training only."""
    path = run_dir / "metrics.jsonl"
    lines = read_metrics(run_dir)
    kept = [r for r in lines if r["step"] <= state.step]
    if state.record and (not kept or kept[-1]["step"] < state.step):
        record, busy = state.record, state.record["step_seconds"] - state.record["wait_seconds"]
        kept.append({**record, "busy_seconds": busy, "utilisation": busy / record["step_seconds"], "restored": True})
    cut_short = path.exists() and path.stat().st_size > 0 and not path.read_bytes().endswith(b"\n")
    if len(kept) != len(lines) or cut_short:  # a line cut short would run into the next one appended
        path.write_bytes(b"".join(metrics_line(r) for r in kept))
