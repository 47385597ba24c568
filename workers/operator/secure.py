"""`echo-rl secure`: credentials and TLS for a secured broker (streams/secure.py)."""

from __future__ import annotations

from pathlib import Path

from echo.config import ConfigError

NAME = "secure"
NEEDS = ("cryptography",)


def register(sub) -> None:
    secure = sub.add_parser("secure", help="credentials and TLS for a secured broker").add_subparsers(
        dest="secure_command", required=True)
    init = secure.add_parser("init", help="a CA, the server's certificate and config, trainer/observer/sampler nkeys")
    init.add_argument("dir", type=Path)
    init.add_argument("--run-id", required=True, help="the run the credentials are for")
    init.add_argument("--host", action="append", default=[], help="a name or address samplers reach the hub by "
                      "(repeat; localhost and 127.0.0.1 always)")
    init.add_argument("--samplers", default="", help="comma-separated sampler ids to issue now")
    init.add_argument("--relay", action="append", default=[], metavar="NAME=HOST",
                      help="a relay to issue now, and the name its samplers reach it by (repeat)")
    init.add_argument("--run-storage-gb", type=float, default=0.0, help="what the run's streams may keep on the "
                      "hub's disk, all together (0: no limit); the trainer's nats.rollouts_max_gb must fit in it")
    init.add_argument("--exist-ok", action="store_true", help="DIR holds this run's credentials already: keep them "
                      "(compose runs init on every up)")
    add = secure.add_parser("add-sampler", help="a new sampler's credentials; reloads a running hub")
    add.add_argument("dir", type=Path)
    add.add_argument("id")
    add_relay = secure.add_parser("add-relay", help="a relay's leaf credentials and client-port certificate; "
                                  "reloads a running hub")
    add_relay.add_argument("dir", type=Path)
    add_relay.add_argument("name")
    add_relay.add_argument("--host", action="append", default=[], help="a name or address samplers reach the relay "
                           "by (repeat; localhost and 127.0.0.1 always)")


def run(args) -> int:
    from streams.secure import SecureDir

    secure = SecureDir(args.dir)
    try:
        if args.secure_command == "init":
            if args.exist_ok and secure.holds_run(args.run_id):
                print(f"{secure.dir} holds run {args.run_id}'s credentials already: kept")
                return 0
            relays = [relay.partition("=") for relay in args.relay]
            if any(not host for _, _, host in relays):
                raise ValueError(f"--relay {args.relay}: give each as NAME=HOST")
            samplers = [s for s in args.samplers.split(",") if s]
            secure.init(args.run_id, ["localhost", "127.0.0.1", *args.host], samplers,
                        run_storage=int(args.run_storage_gb * 2**30) or -1)
            for name, _, host in relays:
                secure.add_relay(name, [host])
            print(f"wrote {secure.dir}: include {secure.dir / 'server.conf'} in the hub's config "
                  f"(and {secure.leaf_conf} in its leafnodes block, for relays); "
                  f"trainer: --creds {secure.seed_file('trainer')} --tls-ca {secure.ca_file}")
        elif args.secure_command == "add-relay":
            files = secure.add_relay(args.name, args.host)
            print(f"relay {args.name}: copy {files.seed_file.name}, {files.cert_file.name}, {files.key_file.name}, "
                  f"{files.users_file.name} and ca.pem from {secure.dir} to the site, side by side; "
                  f"echo-rl relay --creds {files.seed_file.name} --tls-ca ca.pem ...")
        else:
            creds = secure.add_sampler(args.id)
            print(f"sampler {args.id}: --creds {creds.seed_file} --tls-ca {creds.ca_file}")
    except (FileExistsError, FileNotFoundError, ValueError) as e:
        raise ConfigError(str(e)) from None
    return 0
