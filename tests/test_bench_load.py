"""The load bench (bench/load.py) drives the real trainer loop, broker and samplers with its
bench-only engine and learner: a small shape, so it does not rot between `make bench` runs."""

import os
import subprocess
import sys

import orjson
import pytest

pytestmark = pytest.mark.slow


def test_the_load_bench_runs_a_shape_with_partial_rollouts_behind_a_relay(tmp_path):
    subprocess.run([sys.executable, "-m", "bench.load", "--samplers", "3", "--relays", "1", "--groups", "4", "--group-size", "4",
                    "--max-tokens", "256", "--median-tokens", "64", "--steps", "3", "--chunks", "32",
                    "--tokens-per-s", "4000", "--slow-share", "0.34", "--slow-factor", "4"], check=True, capture_output=True,
                   env={**os.environ, "BENCH_RESULTS": str(tmp_path)}, timeout=300)
    (shape,) = orjson.loads((tmp_path / "load.json").read_bytes())["shapes"]
    assert (shape["samplers"], shape["relays"], shape["chunk_tokens"], shape["steps"]) == (3, 1, 32, 3)
    assert shape["tokens_per_step"] > 0 and shape["trainer_peak_gb"] > 0 and shape["broker_peak_gb"] > 0
    assert 0 <= shape["wasted_token_share"] < 1 and shape["overhead_share_of_learner"] >= 0
    # What the machine was doing (recovery figures taken at load 3.5-10 did not say so), and the
    # trainer's own CPU, which does not depend on it.
    assert shape["machine"]["cores"] == os.cpu_count() and shape["machine"]["load_during_max"] >= 0
    assert shape["trainer_cpu_s_per_step"] > 0
