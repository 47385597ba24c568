"""`echo-rl sampler`: one sampler; without --config it reads the run's config from the broker."""

from __future__ import annotations

import asyncio

from echo.config import ConfigError, EchoConfig, apply_override, validate_config
from echo.config.edge import check_config_from_broker, drop_this_box_fields
from echo.process.logs import bind_process, configure_logging
from echo.tasks import task_class
from echo.wire.names import HUB_DOMAIN, check_id
from streams.credentials import credentials_of
from workers.arguments import check_hardware, config_args, config_from_args, local_overrides, run_until_signal

NAME = "sampler"


def register(sub) -> None:
    sampler = sub.add_parser("sampler", help="run one sampler; without --config it reads the run's config from NATS")
    config_args(sampler, run_options=False)
    sampler.add_argument("--id", required=True, help="this sampler's id (its rollout subject)")
    sampler.add_argument("--task", help="task.name: a task not built in must be named here, never by the broker")
    sampler.add_argument("--weights-from", help="read weights from this relay, everything else from --nats, the hub "
                         "(a secured relay serves weights only) (nats.weights_url)")


async def sampler_config_from_run(args) -> EchoConfig:
    """An edge sampler needs only the server and run id: the trainer keeps the config in KV."""
    from streams.client import open_run
    from streams.run_config import wait_for_run_config

    if not (args.nats and args.run_id):
        raise ConfigError("a sampler without --config needs --nats and --run-id")
    local = local_overrides(args)
    given = checked_command_line(local)
    nats_given = given.get("nats", {})
    hub_domain = nats_given.get("hub_domain", HUB_DOMAIN)
    credentials = credentials_of(nats_given.get("creds", ""), nats_given.get("tls_ca", ""))
    run = await open_run(args.nats, args.run_id, f"sampler-{args.id}-config", hub_domain or None,
                         credentials=credentials, create=False)
    try:
        data = await wait_for_run_config(run)  # the trainer may not have started yet
    finally:
        await run.close()
    check_config_from_broker(data, given)
    drop_this_box_fields(data)
    for assignment in local:  # --nats among them: the hub, or this site's relay
        apply_override(data, assignment)
    return validate_config(data)


def checked_command_line(local: list[str]) -> dict:
    """The fields this box's command line sets, checked before the broker is reached: a typo in a
    value, a task or a model is said at once, not after minutes of waiting for a run."""
    given: dict = {}
    for assignment in local:
        apply_override(given, assignment)
    cfg = validate_config(given)  # every type and limit (run.id's characters among them)
    if "task" in given:
        task_class(cfg.task.name)
    if "model" in given:
        from echo.model.loading import check_model_name  # torch: imported by the commands that need it

        check_model_name(cfg.model.name)
    return given


def run(args) -> int:
    try:
        check_id("sampler id", args.id)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    # Before reaching the broker; the run id of a --config is known once it is read.
    configure_logging(args.log_json, run=args.run_id, role="sampler", worker=f"sampler-{args.id}")
    if args.config is None:
        cfg = asyncio.run(sampler_config_from_run(args))
    else:
        cfg = config_from_args(args)
    bind_process(run=cfg.run.id)
    check_hardware(cfg, sampler=True)
    from workers.sampler.sampler import run_sampler

    return run_until_signal(run_sampler(cfg, args.id))
