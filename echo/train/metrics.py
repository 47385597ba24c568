"""A step's metrics as the scalars experiment trackers log, under the names docs/operations.md
lists (Watching a run): the step's record (workers/trainer/accounting.py) and the samplers'
heartbeats, flattened; and a run's steps summed up in one record. Pure, but for peak_rss_mb,
which reads this process's own usage (the trainer's and the benches' one reading of it), and
read_metrics, a run's metrics.jsonl (here, not beside the checkpoint: reading it needs no torch,
whose import cost `echo-rl up` seconds after every run)."""

from __future__ import annotations

import math
import resource
import sys
from pathlib import Path

import orjson

from echo.wire.messages import SamplerStatus

# record key -> tracker name
STEP_SCALARS = {
    "reward_mean": "reward/mean", "reward_std": "reward/std",
    "loss": "loss/policy", "kl": "loss/kl", "entropy": "loss/entropy", "clip_fraction": "loss/clip_fraction",
    "clip_low_fraction": "loss/clip_low_fraction", "clip_high_fraction": "loss/clip_high_fraction",
    "grad_norm": "loss/grad_norm", "lr": "learner/lr",
    "zero_spread_share": "signal/zero_spread_share", "no_answer_share": "signal/no_answer_share",
    "length_mean": "completions/mean_length", "length_max": "completions/max_length",
    "truncated_share": "completions/clipped_ratio",
    "is_ratio_mean": "importance/ratio_mean", "is_ratio_max": "importance/ratio_max",
    "is_truncated_fraction": "importance/truncated_fraction", "is_masked_fraction": "importance/masked_fraction",
    "rs_rejected_tokens": "importance/rejected_tokens", "mismatch_kl": "mismatch/kl",
    "used": "groups/used", "dropped_stale": "groups/dropped_stale", "dropped_tokens": "groups/dropped_tokens",
    "filtered_no_signal": "groups/filtered_no_signal", "rejected_tokens": "groups/rejected_tokens",
    "verifier_errors": "groups/verifier_errors",
    "utilisation": "learner/utilisation", "tokens_per_second": "learner/tokens_per_s", "tokens": "learner/tokens",
    "step_seconds": "time/step_s", "wait_seconds": "time/wait_s", "train_seconds": "time/train_s",
}
# Dicts of counts in the record: each key becomes `<prefix>/<key>`.
STEP_COUNTS = {
    "rejected": "groups/rejected", "reward_mismatch": "groups/reward_mismatch", "proof_of_sampling": "proof",
    "staleness_used": "staleness/used", "staleness_dropped": "staleness/dropped", "reward_by_source": "reward/source",
    "phase_seconds": "time/phase",
}
BROKER_PHASES = ("publish", "account")  # the step's time spent on the broker, beyond the learner's own
# A step's headline values, in the trainer's status for the page (record keys).
PAGE_SCALARS = ("reward_mean", "loss", "kl", "entropy", "grad_norm", "lr", "length_mean", "length_max",
                "zero_spread_share", "no_answer_share", "truncated_share")


def mean_staleness(record: dict) -> float:
    """The step's trained groups' mean age in versions (0 with none)."""
    ages = record.get("staleness_used") or {}
    return sum(int(age) * n for age, n in ages.items()) / max(sum(ages.values()), 1)


def step_scalars(record: dict, strikes: int = 0) -> dict[str, float]:
    """The step's scalars: its record's and the broker's overhead."""
    out = {name: float(record[key]) for key, name in STEP_SCALARS.items() if key in record}
    for key, prefix in STEP_COUNTS.items():
        out |= {f"{prefix}/{k}": float(v) for k, v in (record.get(key) or {}).items()}
    out["groups/rejected_total"] = float(sum((record.get("rejected") or {}).values()))
    if record.get("staleness_used"):
        out["staleness/mean"] = mean_staleness(record)
    phases = record.get("phase_seconds") or {}
    if record.get("train_seconds"):
        out["broker/overhead_share"] = sum(phases.get(p, 0.0) for p in BROKER_PHASES) / record["train_seconds"]
    out["quarantine/samplers"] = float(len(record.get("quarantined") or []))
    out["quarantine/strikes"] = float(strikes)
    return out


def sampler_scalars(samplers: list[SamplerStatus], version: int) -> tuple[dict[str, float], list[str]]:
    """Each sampler's rate, weight sync time and version lag behind `version` (the step's), and
    the samplers left out: a heartbeat is a sampler's own word, bounded at decode, and whatever
    slips past costs that sampler its scalars, never the trainer its run."""
    out, left_out = {}, []
    for s in samplers:
        try:
            mine = {f"sampler/{s.sampler_id}/groups_per_s": float(s.groups_per_s),
                    f"sampler/{s.sampler_id}/tokens_per_s": float(s.tokens_per_s)}
            if s.version >= 0:  # it runs a version
                mine[f"sampler/{s.sampler_id}/version_lag"] = float(version - s.version)
            if s.sync_s:
                mine[f"sampler/{s.sampler_id}/sync_s"] = float(s.sync_s[max(s.sync_s, key=int)])
            if not all(math.isfinite(v) for v in mine.values()):
                raise ValueError("not finite")
        except (ArithmeticError, TypeError, ValueError):
            left_out.append(s.sampler_id)
            continue
        out |= mine
    return out, left_out


def summarize(lines: list[dict]) -> dict:
    """The run's steps (its metrics.jsonl, read_metrics) in one record: what
    `up`, the trainer's last line and summary.json say."""
    if not lines:
        return {"steps": 0}
    first, last = lines[0], lines[-1]
    later = lines[1:] or lines
    wasted = sum(r["dropped_tokens"] for r in lines)
    return {
        "steps": len(lines),
        "final_version": last["version"],
        "time_to_first_step_s": round(first["wall_seconds"], 1),
        "seconds_per_step": round(sum(r["step_seconds"] for r in later) / len(later), 2),
        "reward_first": round(first["reward_mean"], 3),
        "reward_last": round(last["reward_mean"], 3),
        "reward_last5": round(sum(r["reward_mean"] for r in lines[-5:]) / len(lines[-5:]), 3),
        "rollouts_used": sum(r["used"] for r in lines),
        "rollouts_dropped_stale": sum(r["dropped_stale"] for r in lines),
        "wasted_token_fraction": round(wasted / max(wasted + sum(r["tokens"] for r in lines), 1), 4),
        "utilisation": round(sum(r["utilisation"] for r in lines) / len(lines), 2),
        "accounting": last.get("accounting"),  # published = trained + dropped_stale + rejected + pending
    }


def peak_rss_mb() -> float:
    """This process's peak resident memory so far, in MiB (getrusage: KiB on Linux, bytes on macOS)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / 2**20 if sys.platform == "darwin" else peak / 1024


def read_metrics(run_dir: Path, name: str = "metrics.jsonl", tail_bytes: int | None = None) -> list[dict]:
    """The run's `metrics.jsonl`, one record per step ([] before the first step), or another of
    its JSON Lines files (`evals.jsonl`, `samples.jsonl`); with `tail_bytes`, only the records in
    its last so many bytes. A last line without its newline is not one yet: being appended now,
    or cut short by a crash."""
    path = run_dir / name
    if not path.exists():
        return []
    with open(path, "rb") as f:
        start = 0 if tail_bytes is None else max(0, f.seek(0, 2) - tail_bytes)
        f.seek(start)
        data = f.read()
    if start:
        data = data[data.find(b"\n") + 1:]  # its first line, cut by the seek
    return [_upgraded(orjson.loads(line)) for line in data[: data.rfind(b"\n") + 1].splitlines() if line.strip()]


def _upgraded(record: dict) -> dict:
    """A record in today's names: runs before 2026-12-07 named the learner's busy share
    `learner_busy` (one word for it since, the trainer's status's)."""
    if "learner_busy" in record:
        record["utilisation"] = record.pop("learner_busy")
    return record
