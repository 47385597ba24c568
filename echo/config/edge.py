"""What an edge sampler accepts from the broker. The run's config in KV is data written by
whoever can reach the broker; the fields that choose code or files on the edge box must come
from the box's own command line, unless they name something built in. Pure, no I/O."""

from __future__ import annotations

from echo.config import ConfigError
from echo.model.hf_hub import is_pinned
from echo.tasks import BUILTIN as BUILTIN_TASKS
from echo.tasks import GYM

BUILTIN_MODELS = ("tiny", "tiny-moe", "smollm2")  # echo/model/loading.py builds or converts them

# (path in the config, whether the broker may name this value, the sampler's flag that sets it).
# reasoning-gym's datasets are installed code, and echo/tasks/gym.py takes no file path from a config.
# A hub model at a commit is data (safetensors and configs, never code: echo/model/loading.py::HUB_FILES)
# whose digest the weights then check.
_LOCAL_ONLY = [
    (("task", "name"), lambda name: name in BUILTIN_TASKS or str(name).startswith(GYM), "--task"),
    (("model", "name"), lambda name: name in BUILTIN_MODELS or is_pinned(str(name)), "--model"),
    (("task", "params", "dataset"), lambda path: path is None, "--set task.params.dataset="),  # a file on this box
]


# Fields that describe the machine a process runs on, not the run: a sampler keeps its own
# (defaults, or its command line) whatever the trainer's machine has.
_THIS_BOX = [
    ("nats", "creds"), ("nats", "tls_ca"), ("nats", "weights_url"),  # its own files and relay
    ("model", "device"), ("model", "dtype"), ("sampler", "engine"), ("sampler", "threads"),  # its hardware
    ("sampler", "cost_per_hour"), ("sampler", "throttle_s"),
    ("sampler", "ranks"), ("sampler", "hostfile"), ("sampler", "memory_gb"), ("sampler", "rank_timeout_s"),  # its split
    ("task", "params", "path"),  # a dataset file on the trainer's box: samplers read its prompts from the broker
]


def drop_this_box_fields(broker: dict) -> None:
    """Remove from the broker's config what only the sampler's own machine can say."""
    for *above, key in _THIS_BOX:
        section = _get(broker, tuple(above))
        if isinstance(section, dict):
            section.pop(key, None)


def _get(data: dict, path: tuple[str, ...]):
    for key in path:
        data = data.get(key) if isinstance(data, dict) else None
    return data


def check_config_from_broker(broker: dict, local: dict) -> None:
    """Refuse a config from the broker that names code or a file this box's command line (its
    overrides, `local`) did not: a task module, a model folder, a hub model at a moving revision, a
    dataset path."""
    for path, allowed, flag in _LOCAL_ONLY:
        if _get(local, path) is not None:
            continue  # this box chose it itself
        value = _get(broker, path)
        if value is not None and not allowed(value):
            field = ".".join(path)
            raise ConfigError(
                f"{field} = {value!r} comes from the broker, and an edge sampler loads no code or file the broker "
                f"names: give it on this sampler's command line ({flag} ...) if you trust it"
            )
