#!/usr/bin/env bash
# On the GPU machine, from the repository root, figures first (a lease that runs out cuts what comes last):
# benchmarks/gpu_step.py with the captured step alone (a result in $OUT/cuda_graphs_only even if compiling outlasts the
# lease), then with every new step (eager bf16 step against compile, cuda_graphs and compile_graphs on synthetic
# batches of the LibriSpeech LM's shapes: $OUT/gpu_step.json), at most COMPILE_SECONDS; then the needs_gpu tests of
# train.compile (faster steps against the eager one, and no capture once every shape is met) and the other training
# ones, each pytest at most TEST_SECONDS. Results and logs go to $OUT. Extra arguments go to gpu_step.py (here,
# without a GPU: OUT=/tmp/gpu_step bash benchmarks/gpu_step.sh --device cpu --tiny --steps 4 --rounds 1, which skips
# the GPU parts).
set -euo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
PY=${PY:-python3}
OUT=${OUT:?set OUT to the folder the results go to}
mkdir -p "$OUT"
pytest() { timeout "${TEST_SECONDS:-150}" $PY -m pytest -m needs_gpu -q -p no:cacheprovider "$@"; }
gpu=0
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader && gpu=1
if [ "$gpu" = 1 ]; then
    $PY -m benchmarks.gpu_step --modes cuda_graphs --results "$OUT/cuda_graphs_only" "$@" \
        > "$OUT/gpu_step_cuda_graphs.log" 2>&1 || echo "the captured step failed (see gpu_step_cuda_graphs.log)"
    tail -2 "$OUT/gpu_step_cuda_graphs.log"
fi
timeout "${COMPILE_SECONDS:-300}" $PY -m benchmarks.gpu_step --results "$OUT" "$@" 2>&1 | tee "$OUT/gpu_step.log" \
    || echo "gpu_step with every new step failed or outlasted ${COMPILE_SECONDS:-300} s"
if [ "$gpu" = 1 ]; then
    pytest tests/test_train_compile.py > "$OUT/tests_compile.log" 2>&1 || echo "GPU compile tests failed"
    tail -3 "$OUT/tests_compile.log"
    pytest tests/test_train_device.py tests/test_step_profile.py > "$OUT/tests_train.log" 2>&1 || echo "GPU tests failed"
    tail -3 "$OUT/tests_train.log"
fi
