"""`echo-rl report`: the picture a user looks at first. Reward, staleness and learner
utilisation of a run, against step and against wall-clock time, as one PNG."""

from __future__ import annotations

from pathlib import Path

import orjson

from echo.train.metrics import read_metrics


def write_report(run_dir: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")  # files only, no screen needed
    import matplotlib.pyplot as plt

    lines = read_metrics(run_dir)
    if not lines:
        raise ValueError(f"{run_dir}/metrics.jsonl has no steps yet")
    steps = [r["step"] for r in lines]
    minutes, pieces = trainer_minutes(lines)

    def mean_age(r: dict) -> float:
        ages = {int(k): v for k, v in r["staleness_used"].items()}
        return sum(a * n for a, n in ages.items()) / max(sum(ages.values()), 1)

    rewards = [r["reward_mean"] for r in lines]
    window = 5  # a step's reward is a few groups: the rolling mean shows the trend
    trend = [sum(rewards[max(0, i - window + 1) : i + 1]) / len(rewards[max(0, i - window + 1) : i + 1]) for i in range(len(rewards))]
    series = [
        ("mean reward", rewards, None),
        ("staleness of used groups (versions)", [mean_age(r) for r in lines], [r["dropped_stale"] for r in lines]),
        ("learner busy", [r["utilisation"] for r in lines], None),
    ]
    fig, axes = plt.subplots(len(series), 2, figsize=(11, 8), sharex="col")
    marker = "." if len(lines) <= 200 else None  # markers of a thousand steps are a blob
    for row, (label, values, dropped) in enumerate(series):
        for col, x in enumerate((steps, minutes)):
            ax = axes[row][col]
            # One line per trainer process on the wall-clock side: no line back across a restart.
            for k, (a, b) in enumerate(pieces if col == 1 else [(0, len(lines))]):
                ax.plot(x[a:b], values[a:b], marker=marker, color="tab:blue", label=label if k == 0 else None)
                if row == 0:
                    ax.plot(x[a:b], trend[a:b], color="black", linewidth=2,
                            label=f"rolling mean of {window}" if k == 0 else None)
            if col == 1:
                for a, _ in pieces[1:]:
                    ax.axvline(x[a], color="gray", linestyle=":", linewidth=1)  # a resume
            if row == 0:
                ax.legend(loc="upper left", fontsize=8)
            if dropped is not None:
                ax.bar(x, dropped, alpha=0.3, color="tab:red", width=0.6 if col == 0 else 0.05, label="groups dropped as stale")
                ax.legend(loc="upper left", fontsize=8)
            ax.set_ylabel(label if col == 0 else "")
            ax.grid(alpha=0.3)
    axes[-1][0].set_xlabel("step")
    axes[-1][1].set_xlabel("trainer wall-clock (minutes, its processes end to end; dotted: a resume)")
    for ax in axes[-1]:
        ax.set_ylim(0, 1.05)
    fig.suptitle(f"echo-rl run {run_dir.name}" + held_out_line(run_dir))
    fig.tight_layout()
    path = run_dir / "report.png"
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def trainer_minutes(lines: list[dict]) -> tuple[list[float], list[tuple[int, int]]]:
    """Each step's trainer time in minutes, processes laid end to end (a resumed trainer's
    clock starts again at 0), and the [start, end) rows of each process."""
    minutes, pieces, offset, start = [], [], 0.0, 0
    for i, r in enumerate(lines):
        if i and r["wall_seconds"] < lines[i - 1]["wall_seconds"]:  # a new process
            offset += lines[i - 1]["wall_seconds"]
            pieces.append((start, i))
            start = i
        minutes.append((offset + r["wall_seconds"]) / 60)
    pieces.append((start, len(lines)))
    return minutes, pieces


def held_out_line(run_dir: Path) -> str:
    """The held-out result (eval.json), the run's headline, for the report's title."""
    path = run_dir / "eval.json"
    if not path.exists():
        return ""
    e = orjson.loads(path.read_bytes())
    return (f"\nheld-out ({e['prompts']} prompts, greedy, version {e['version']}): correct {e['base_correct']:.0%}"
            f" -> {e['trained_correct']:.0%}, reward {e['base_reward']:.2f} -> {e['trained_reward']:.2f}")
