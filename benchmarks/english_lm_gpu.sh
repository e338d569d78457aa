#!/usr/bin/env bash
# On the GPU machine, from the repository root (benchmarks/english_lm_gpu.py says what travels): prepare the packed
# text, train configs/english_lm_gpu.toml for at most FIT_SECONDS (SIGTERM saves a checkpoint), pack its weights
# into $OUT. Extra arguments go to `lm-train fit` (e.g. --set train.device=\"cpu\" for a smoke test here).
set -euo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
PY=${PY:-python3}
OUT=${OUT:?set OUT to the folder the results go to}
TEXT=${TEXT:-.gpu/text}
WORK=${WORK:-var/english_lm_gpu}
CONFIG=${CONFIG:-configs/english_lm_gpu.toml}
VOCAB_ARGS=${VOCAB_ARGS:---max-size 50000}  # the subword variant: --type subword --pieces 8000
rm -rf "$WORK" && mkdir -p "$WORK"
start=$(date +%s)
{ xz -dc "$TEXT/english.train.txt.xz"; xz -dc "$TEXT/gutenberg.train.txt.xz"; } > "$WORK/train.txt"
$PY -m lmserve.training prepare --train "$WORK/train.txt" --valid "$TEXT/valid.txt.gz" --test "$TEXT/test.txt.gz" \
    $VOCAB_ARGS --out "$WORK/prepared" --workers "${WORKERS:-12}"
echo "prepared in $(( $(date +%s) - start )) s"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader || true
set +e
timeout -s TERM "${FIT_SECONDS:-300}" $PY -m lmserve.training fit "$CONFIG" --out "$WORK/run" \
    --set "data.train=\"$WORK/prepared\"" --set "data.valid=\"$WORK/prepared\"" --set "data.test=\"$WORK/prepared\"" \
    "$@" > "$OUT/fit.json" 2> "$OUT/fit.log"
echo "fit exit $? after $(( $(date +%s) - start )) s"
set -e
tail -5 "$OUT/fit.log"
$PY -m benchmarks.english_lm_gpu pack-weights "$WORK/run" "$OUT"
echo "done in $(( $(date +%s) - start )) s"
