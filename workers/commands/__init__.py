"""One module per `echo-rl` command, its arguments beside its code; workers/cli.py dispatches to
them by name. Each module has:

    NAME                  the command's name on the command line
    register(sub)         adds the command's parser, with its flags and help, to `sub` (argparse subparsers)
    run(args) -> int      does the command; the exit code (a ConfigError is said in one line, exit 2)

and may have:

    NEEDS                 packages of the full install it imports, which an edge sampler's leaves out
    starts_server(args)   whether it starts a nats-server of its own (its binary is checked at start)

Heavy imports (torch, transformers, the workers' own modules) stay inside `run`: the parser,
and a command that does not need them, load without them. Shared helpers: common.py."""
