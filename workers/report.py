"""`echo-rl report`: the picture a user looks at first. Reward, staleness and learner
utilisation of a run, against step and against wall-clock time, as one PNG."""

from __future__ import annotations

from pathlib import Path

from echo.checkpoint import read_metrics


def write_report(run_dir: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")  # files only, no screen needed
    import matplotlib.pyplot as plt

    lines = read_metrics(run_dir)
    if not lines:
        raise ValueError(f"{run_dir}/metrics.jsonl has no steps yet")
    steps = [r["step"] for r in lines]
    minutes = [r["wall_seconds"] / 60 for r in lines]

    def mean_age(r: dict) -> float:
        ages = {int(k): v for k, v in r["staleness_used"].items()}
        return sum(a * n for a, n in ages.items()) / max(sum(ages.values()), 1)

    rewards = [r["reward_mean"] for r in lines]
    window = 5  # a step's reward is a few groups: the rolling mean shows the trend
    trend = [sum(rewards[max(0, i - window + 1) : i + 1]) / len(rewards[max(0, i - window + 1) : i + 1]) for i in range(len(rewards))]
    series = [
        ("mean reward", rewards, None),
        ("staleness of used groups (versions)", [mean_age(r) for r in lines], [r["dropped_stale"] for r in lines]),
        ("learner busy", [r["learner_busy"] for r in lines], None),
    ]
    fig, axes = plt.subplots(len(series), 2, figsize=(11, 8), sharex="col")
    for row, (label, values, dropped) in enumerate(series):
        for col, x in enumerate((steps, minutes)):
            ax = axes[row][col]
            ax.plot(x, values, marker=".", label=label)
            if row == 0:
                ax.plot(x, trend, color="black", linewidth=2, label=f"rolling mean of {window}")
                ax.legend(loc="upper left", fontsize=8)
            if dropped is not None:
                ax.bar(x, dropped, alpha=0.3, color="tab:red", width=0.6 if col == 0 else 0.05, label="groups dropped as stale")
                ax.legend(loc="upper left", fontsize=8)
            ax.set_ylabel(label if col == 0 else "")
            ax.grid(alpha=0.3)
    axes[-1][0].set_xlabel("step")
    axes[-1][1].set_xlabel("wall-clock (minutes, this trainer process)")
    for ax in axes[-1]:
        ax.set_ylim(0, 1.05)
    fig.suptitle(f"echo-rl run {run_dir.name}")
    fig.tight_layout()
    path = run_dir / "report.png"
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
