"""`echo-rl config show`: the config a run would start with, every value resolved, each with where
it came from: the default, the algorithm's preset, the file, or an override (--set, KEY=VALUE, a
shortcut flag)."""

from __future__ import annotations

import tomli_w

from echo.config import PRESETS, read_config_file
from workers.arguments import config_and_task_from_args, config_args, local_overrides

NAME = "config"


def register(sub) -> None:
    config = sub.add_parser("config", help="the resolved config, each value with its source").add_subparsers(
        dest="action", required=True)
    config_args(config.add_parser("show", help="print the config a run would start with, as TOML: each value "
                                  "with its source (default, file, override)"))


def run(args) -> int:
    cfg = config_and_task_from_args(args)  # a task's own params checked as the trainer checks them
    from_file = dotted(read_config_file(args.config)) if args.config else set()
    overridden = {assignment.partition("=")[0].strip() for assignment in local_overrides(args)}
    preset = cfg.algorithm.preset
    by_preset = {f"algorithm.{key}" for key in PRESETS[preset]} if preset != "default" else set()
    print(sourced_toml(cfg.model_dump(mode="json"), from_file, overridden, by_preset).lstrip(), end="")
    return 0


def dotted(data: dict, prefix: str = "") -> set[str]:
    """Every key of nested sections, as section.key."""
    keys = set()
    for key, value in data.items():
        keys.add(prefix + key)
        if isinstance(value, dict):
            keys |= dotted(value, f"{prefix}{key}.")
    return keys


def sourced_toml(data: dict, from_file: set[str], overridden: set[str], by_preset: set[str] = frozenset(),
                 prefix: str = "") -> str:
    """`data` as TOML tables, each value followed by `# default`, `# preset`, `# file` or `# override`."""
    out = []
    for key, value in data.items():
        if not isinstance(value, dict):
            path = prefix + key
            source = ("override" if path in overridden else "file" if path in from_file
                      else "preset" if path in by_preset else "default")
            out.append(f"{key} = {_inline(value)}  # {source}\n")
    for key, value in data.items():
        if isinstance(value, dict):
            out.append(f"\n[{prefix}{key}]\n")
            out.append(sourced_toml(value, from_file, overridden, by_preset, f"{prefix}{key}."))
    return "".join(out)


def _inline(value) -> str:
    """A TOML value on one line (tomli_w puts each item of an array on its own)."""
    if isinstance(value, list):
        return "[" + ", ".join(_inline(item) for item in value) + "]"
    return tomli_w.dumps({"v": value})[len("v = "):].strip()
