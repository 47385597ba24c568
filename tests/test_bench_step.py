"""The learner benches (bench/micro_batches.py, bench/ranks.py) time the step the trainer would
take: its device and compute dtype (model.device, model.dtype), the adapter in fp32. The engine
bench (bench/engines.py) times each engine on one call."""

import subprocess
import sys

import orjson
import pytest
import torch

from bench.micro_batches import step_setup, timed_step


def test_a_bench_step_runs_in_the_configured_device_and_dtype():
    cfg, policy, pad_id, batch, compute_dtype = step_setup("tiny", 2, 2, 8, 0, device="cpu", dtype="bfloat16")
    assert compute_dtype == torch.bfloat16
    assert policy.get_input_embeddings().weight.dtype == torch.bfloat16  # the base, as the trainer loads it
    trained = [p for p in policy.parameters() if p.requires_grad]
    assert trained and all(p.dtype == torch.float32 for p in trained)
    result = timed_step(cfg, policy, pad_id, batch, compute_dtype)
    assert (result["device"], result["dtype"], result["passes"]) == ("cpu", "bfloat16", 2)
    assert "peak_device_mb" not in result  # on the CPU, the process's resident peak is the step's


def test_the_bench_says_where_its_steps_ran_and_compares_the_two_ways_to_log_probs(tmp_path):
    subprocess.run([sys.executable, "-m", "bench.micro_batches", "--model", "tiny", "--groups", "2", "--group", "2",
                    "--tokens", "8", "--budgets", "0", "4096", "--pack-groups", "on", "--dtype", "bfloat16",
                    "--heads", "logits", "chunked"], check=True, capture_output=True,
                   env={"BENCH_RESULTS": str(tmp_path), "PATH": "/usr/bin:/bin"})
    result = orjson.loads((tmp_path / "micro_batches-tiny-2-groups-heads.json").read_bytes())
    assert (result["device"], result["dtype"]) == ("cpu", "bfloat16")
    runs = result["runs"]
    assert [(run["head"], run["budget"]) for run in runs] == [("logits", 0), ("logits", 4096), ("chunked", 0),
                                                              ("chunked", 4096)]
    assert [run["passes"] for run in runs] == [2, 1, 2, 1]  # packed: both groups in one pass
    assert runs[0]["peak_vs_logits"] == 1.0 and all("time_vs_logits" in run for run in runs)


def test_the_learner_bench_reports_throughput_mfu_and_where_the_time_went():
    from bench.learner import measure

    result = measure("tiny", "parity", repeats=1, pack_groups="on", device="cpu", dtype="float32", peak_tflops=1.0,
                     profile=True)
    assert (result["groups"], result["completions"], result["tokens"], result["passes"]) == (8, 8, 32, 1)
    assert result["completion_tokens_per_s"] == round(64 * 32 / result["step_s"], 1)
    assert result["mfu"] > 0 and result["mfu"] == pytest.approx(result["tflops_per_s"], abs=1e-3)  # peak 1 TFLOP/s
    ops = result["profile"]
    assert ops and ops[0]["self_ms"] >= ops[-1]["self_ms"] and 0 < sum(op["share"] for op in ops) <= 1.0001
    assert any(op["op"].startswith("aten::") for op in ops)


def test_the_engine_bench_times_generate_against_continuous_batching(tmp_path):
    """What the GPU engine comparison runs (bench/gpu/issue32.sh engines), here on the tiny model."""
    subprocess.run([sys.executable, "-m", "bench.engines", "--engines", "hf", "hf-paged", "--model", "tiny",
                    "--prompts", "2", "--group", "2", "--tokens", "8"], check=True, capture_output=True,
                   env={"BENCH_RESULTS": str(tmp_path), "PATH": "/usr/bin:/bin"})
    result = orjson.loads((tmp_path / "engines-hf-hf-paged-cpu-tiny.json").read_bytes())
    assert result["hf"]["tokens_per_s"] > 0 and result["hf-paged"]["tokens_per_s"] > 0
    # The ratio of the rates it reports, to its two decimals, whichever engine this machine favours.
    assert result["hf-paged_speed_ratio"] == round(result["hf-paged"]["tokens_per_s"] / result["hf"]["tokens_per_s"], 2)


def test_the_engine_bench_splits_an_mlx_model_and_says_what_each_rank_holds(tmp_path):
    """bench/engines.py's mlx rows (the MLX engine), two models in one run, each in its own process: on
    the tiny model the split engine generates beside the whole one, each of its 2 ranks holding
    less and peaking lower; SmolLM2 (llama), which mlx-lm cannot split, gets a row saying so."""
    pytest.importorskip("mlx.core")
    done = subprocess.run([sys.executable, "-m", "bench.engines", "--engines", "hf", "mlx", "mlx-split", "--model",
                           "tiny", "smollm2", "--prompts", "1", "--group", "2", "--tokens", "8", "--rounds", "1"],
                          check=True, capture_output=True, text=True,
                          env={"BENCH_RESULTS": str(tmp_path), "PATH": "/usr/bin:/bin"})
    assert "Traceback" not in done.stderr, done.stderr[-3000:]  # rank 1 refused SmolLM2 too, in rank 0's one line
    result = orjson.loads((tmp_path / "engines-hf-mlx-mlx-split-cpu-tiny-smollm2.json").read_bytes())
    tiny, smollm2 = result["models"]["tiny"], result["models"]["smollm2"]
    assert result["call"].startswith("1 prompts x 2 completions x 8 tokens") and tiny["machine"]["cores"]
    split, whole = tiny["mlx-split"], tiny["mlx"]
    assert split["tokens_per_s"] > 0 and len(split["weights_mb_per_rank"]) == len(split["peak_mb_per_rank"]) == 2
    assert max(split["weights_mb_per_rank"]) < whole["weights_mb_per_rank"][0]
    assert max(split["peak_mb_per_rank"]) < whole["peak_mb_per_rank"][0]
    assert all(peak >= held for peak, held in zip(split["peak_mb_per_rank"], split["weights_mb_per_rank"]))
    assert smollm2["mlx"]["tokens_per_s"] > 0 and "cannot split" in smollm2["mlx-split"]["refused"]
    assert "mlx-split_speed_ratio" not in smollm2
