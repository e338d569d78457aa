#!/usr/bin/env bash
# On the GPU machine, from the repository root: the general English LM (packed by benchmarks/english_lm_gpu.py, in
# PACKED with its vocab.tsv) continued on ATIS references (configs/adapt_atis.toml, lm-train fit --init-from), its
# best checkpoint packed into $OUT the same way. TEXT holds train_a.txt (the adaptation text) and train_b.txt (the
# references of the tuning lists, reported as the run's test text, never trained on).
set -euo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
PY=${PY:-python3}
OUT=${OUT:?set OUT to the folder the results go to}
WORK=${WORK:-var/adapt_atis_gpu}
rm -rf "$WORK" && mkdir -p "$WORK"
$PY -m benchmarks.english_lm_gpu unpack "${PACKED:?}" --out "$WORK/base"
$PY -m lmserve.training fit configs/adapt_atis.toml --init-from "$WORK/base" --out "$WORK/run" \
    --set "data.train=\"$TEXT/train_a.txt\"" --set "data.test=\"$TEXT/train_b.txt\"" "$@" \
    > "$OUT/adapt.json" 2> "$OUT/adapt.log"
tail -3 "$OUT/adapt.log"
$PY -m benchmarks.english_lm_gpu pack-weights "$WORK/run" "$OUT" --which best
