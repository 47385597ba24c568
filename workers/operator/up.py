"""`echo-rl up`: a local swarm on this machine."""

from __future__ import annotations

from echo.process.logs import configure_logging
from workers.arguments import config_and_task_from_args, config_args

NAME = "up"
NEEDS = ("cryptography",)


def register(sub) -> None:
    up = sub.add_parser("up", help="a local swarm: embedded nats-server, one trainer, N samplers")
    config_args(up)
    up.add_argument("--samplers", type=int, help="sampler.count")
    up.add_argument("--relay", action="store_true", help="put the samplers behind a site relay, as on a remote site")
    up.add_argument("--secure", action="store_true", help="TLS and per-role credentials (echo-rl secure init)")
    up.add_argument("--cluster", type=int, default=0, metavar="N", help="the broker as an N-node JetStream cluster "
                    "(3: survives one node down), every stream on all nodes (nats.replicas = N)")
    up.add_argument("--trainer-ranks", type=int, default=1, metavar="N", help="the trainer as N ranks under "
                    "torchrun on this machine, its model sharded across them (FSDP2)")


def starts_server(args) -> bool:
    return True  # the swarm's


def run(args) -> int:
    cfg = config_and_task_from_args(args)
    configure_logging(args.log_json, run=cfg.run.id, role="up", worker="up")
    from workers.operator.swarm import up

    return up(cfg, args.log_json, relay=args.relay, secure=args.secure, cluster=args.cluster,
              trainer_ranks=args.trainer_ranks)
