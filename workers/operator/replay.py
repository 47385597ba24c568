"""`echo-rl replay`: a run's rollout stream as JSON lines or a table, filtered; or the run trained
again over the groups each step consumed (workers/operator/retrain.py)."""

from __future__ import annotations

import tomllib
from pathlib import Path

import orjson

from echo.process.logs import configure_logging
from streams.credentials import credentials_of
from workers.arguments import run_directory, span

NAME = "replay"


def register(sub) -> None:
    replay = sub.add_parser("replay", help="print a run's rollout stream as JSON lines")
    replay.add_argument("--run", required=True, help="run directory (starts a server on its store) or run id with --nats")
    replay.add_argument("--nats", help="read from this server instead of the run directory's store")
    replay.add_argument("--creds", help="with --nats, on a secured broker: observer (or trainer) credentials")
    replay.add_argument("--tls-ca")
    replay.add_argument("--out", help="write to this file instead of stdout")
    replay.add_argument("--seq", type=span(int), metavar="FIRST:LAST", help="stream sequences (both included)")
    replay.add_argument("--since", type=float, metavar="UNIX_S", help="groups created at or after this time")
    replay.add_argument("--until", type=float, metavar="UNIX_S", help="groups created at or before this time")
    replay.add_argument("--version", type=int, help="groups generated with this policy version")
    replay.add_argument("--sampler", help="groups published by this sampler")
    replay.add_argument("--task", help="groups of this task")
    replay.add_argument("--reward", type=span(float), metavar="LOW:HIGH", help="groups whose mean claimed reward "
                        "lies in this range")
    replay.add_argument("--rejected", action="store_true", help="only the messages the trainer would reject, with why")
    replay.add_argument("--table", action="store_true", help="a readable line per record, then each completion's "
                        "reward and text, decoded with the run's tokenizer (--model with --nats; else the text "
                        "the sampler claimed), an episode turn by turn")
    replay.add_argument("--model", help="the model whose tokenizer decodes completions (default: the run's)")
    replay.add_argument("--retrain", action="store_true", help="train again over exactly the groups each recorded "
                        "step consumed, from the run's config and seed, and compare with its published weights")
    replay.add_argument("--log-json", action="store_true")


def starts_server(args) -> bool:
    return not args.nats  # one on the run directory's store


def run(args) -> int:
    from streams.replay import Keep, replay

    source = args.run if args.nats else run_directory(args.run, "config.toml")
    # A replay's records are the output, a failure is said in one line; a retrain logs its steps.
    configure_logging(args.log_json, level="info" if args.retrain else "error", run=Path(args.run).name,
                      role="replay", worker="replay")
    if args.retrain:
        from workers.operator.retrain import retrain

        report = retrain(run_directory(args.run, "metrics.jsonl"), args.nats, credentials_of(args.creds, args.tls_ca))
        print(orjson.dumps(report, option=orjson.OPT_INDENT_2).decode())
        return 0 if report["identical"] else 1
    keep = Keep(seqs=args.seq, since=args.since, until=args.until, version=args.version, sampler=args.sampler,
                task=args.task, rewards=args.reward, rejected_only=args.rejected)
    return replay(source, args.nats, args.out, keep, args.table, credentials_of(args.creds, args.tls_ca),
                  _decoder(args) if args.table else None)


def _decoder(args):
    """The tokenizer's decode of the model the run trained (or --model's); None where neither is known."""
    from echo.model.loading import load_tokenizer

    config = Path(args.run) / "config.toml"
    if not (args.model or config.exists()):
        return None
    model = args.model or tomllib.loads(config.read_text())["model"]["name"]
    tokenizer = load_tokenizer(model)
    return lambda ids: tokenizer.decode(ids)
