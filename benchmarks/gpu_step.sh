#!/usr/bin/env bash
# On the GPU machine, from the repository root: the GPU tests of train.compile (faster steps against the eager one),
# then benchmarks/gpu_step.py (eager bf16 step against compile and cuda_graphs on synthetic batches of the LibriSpeech
# LM's shapes); its result and both logs go to $OUT. Extra arguments go to gpu_step.py (here, without a GPU:
# OUT=/tmp/gpu_step bash benchmarks/gpu_step.sh --device cpu --tiny --steps 4 --rounds 1, which skips the GPU tests).
set -euo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
PY=${PY:-python3}
OUT=${OUT:?set OUT to the folder the results go to}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader || true
$PY -m pytest tests/test_train_compile.py -q -p no:cacheprovider > "$OUT/tests.log" 2>&1 \
    || echo "GPU tests failed (see tests.log); the benchmark runs anyway"
tail -3 "$OUT/tests.log"
$PY -m benchmarks.gpu_step --results "$OUT" "$@" 2>&1 | tee "$OUT/gpu_step.log"
