"""`echo-rl export-env`: a run's task as a `verifiers` environment module, so that verifiers' own
tools (`vf-eval`, its `evaluate`) score a model on it exactly as the trainer would."""

from __future__ import annotations

from pathlib import Path

from workers.arguments import config_args, config_from_args

NAME = "export-env"
NEEDS = ("verifiers",)

MODULE = '''"""echo-rl's task {name!r} as a verifiers environment (written by `echo-rl export-env`)."""

from echo.tasks.verifiers_env import as_environment

TASK = {task!r}


def load_environment(train: int = {train}, held_out: int = {held_out}):
    return as_environment(TASK, train, held_out)
'''


def register(sub) -> None:
    p = sub.add_parser(NAME, help="write the config's task as a verifiers environment module")
    config_args(p, run_options=False)
    p.add_argument("--out", required=True, help="the module to write, e.g. my_task_env.py (load it as my_task_env)")
    p.add_argument("--train", type=int, default=2000, help="training prompts in its dataset")
    p.add_argument("--held-out", type=int, default=200, help="held-out prompts in its eval dataset")


def run(args) -> int:
    from echo.tasks.verifiers_env import as_environment

    cfg = config_from_args(args)
    task = cfg.task.model_dump(mode="json")
    as_environment(task, 1, 1)  # a task that cannot be exported says so now, not when loaded
    out = Path(args.out)
    out.write_text(MODULE.format(name=cfg.task.name, task=task, train=args.train, held_out=args.held_out))
    print(f"wrote {out}: load it with verifiers.load_environment({out.stem!r}) where {out.parent} is on sys.path")
    return 0
