#!/usr/bin/env bash
# On the GPU machine, from the repository root, with .gpu/ carried (benchmarks/gpu_carry.py made it; its docstring
# says why in two calls): onnxruntime-gpu and the packages the machine lacks installed into $SITE, then, in this order
# (a lease that runs out cuts what comes last): benchmarks.gpu_scorer (the GPU in fp32 and fp16 against the CPU) on
# the bundle and lists in .gpu/; the needs_gpu scorer tests; with VARIANT="ARGS", gpu_scorer once more with those
# arguments added, into $OUT/variant; then (unless SERVE=0) issue 32's beam steps against lm-serve with the neural LM
# on the GPU and on the same machine's CPU: benchmarks.beam_step_load --device cuda|cpu into $OUT/serve_cuda and
# $OUT/serve_cpu, walking the lists' first hypotheses (the shared LibriSpeech references are not on that machine), no
# n-gram. Results and logs go to $OUT; extra arguments go to gpu_scorer.py. A dry run on a CPU machine, with .gpu/
# made by gpu_carry.py: OUT=/tmp/o SERVE_DEVICES=cpu bash benchmarks/gpu_scorer.sh --device cpu --lists 20 ...
set -euo pipefail
export PYTHONUNBUFFERED=1
PY=${PY:-python3}
OUT=${OUT:?set OUT to the folder the results go to}
SITE=${SITE:-/tmp/site}
for part in prov ort whl whlA bundle lists; do
    [ -e ".gpu/$part" ] || { echo "no .gpu/$part here: carry it (benchmarks/gpu_carry.py)" >&2; exit 2; }
done
rm -rf "$SITE" && mkdir -p "$SITE/onnxruntime/capi"
$PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$SITE" .gpu/whl/*.whl .gpu/whlA/*.whl
tar -xJf .gpu/ort/onnxruntime.tar.xz -C "$SITE"
xz -dc .gpu/prov/libonnxruntime_providers_cuda.so.xz > "$SITE/onnxruntime/capi/libonnxruntime_providers_cuda.so"
export PYTHONPATH="$SITE:$PWD"
# the CUDA 13 and cuDNN libraries of torch's nvidia-* wheels, which the provider loads
LIBS=$($PY -c "import glob, os, site
print(':'.join(sorted({os.path.dirname(p) for d in site.getsitepackages()
                       for p in glob.glob(os.path.join(d, 'nvidia', '**', 'lib*.so*'), recursive=True)})))")
export LD_LIBRARY_PATH="$LIBS${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader || true
$PY -c "import onnxruntime as o; print('onnxruntime', o.__version__, o.get_available_providers())"
$PY -m benchmarks.gpu_scorer --bundle .gpu/bundle --list .gpu/lists/dev_other500.jsonl.gz --results "$OUT" "$@" 2>&1 \
    | tee "$OUT/gpu_scorer.log" || echo "gpu_scorer failed (see gpu_scorer.log); the rest runs anyway"
timeout "${TEST_SECONDS:-200}" $PY -m pytest -m needs_gpu tests/test_scorer_gpu.py -q -p no:cacheprovider \
    > "$OUT/tests_scorer.log" 2>&1 || echo "GPU scorer tests failed (see tests_scorer.log)"
tail -3 "$OUT/tests_scorer.log"
if [ -n "${VARIANT:-}" ]; then
    # shellcheck disable=SC2086  # VARIANT holds several arguments
    $PY -m benchmarks.gpu_scorer --bundle .gpu/bundle --list .gpu/lists/dev_other500.jsonl.gz \
        --results "$OUT/variant" "$@" $VARIANT 2>&1 | tee "$OUT/gpu_scorer_variant.log" || echo "the variant failed"
fi
if [ "${SERVE:-1}" != 0 ]; then
    $PY -c "from lmserve.rescoring.nbest import read_nbest
print('\n'.join(e.hypotheses[0].text for e in read_nbest('.gpu/lists/dev_other500.jsonl.gz')))" > /tmp/walk.txt
    for device in ${SERVE_DEVICES:-cuda cpu}; do
        timeout "${SERVE_SECONDS:-150}" $PY -m benchmarks.beam_step_load --device "$device" \
            --bundle "$PWD/.gpu/bundle" --texts /tmp/walk.txt --steps 50 --modes batched,stream \
            --results "$OUT/serve_$device" 2>&1 | tee "$OUT/serve_$device.log" | grep -v '^ ' \
            || echo "beam_step_load on $device failed or outlasted the limit"
    done
fi
