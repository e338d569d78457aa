#!/bin/sh
# Fill the models volume of the lm-serve pods with what the LibriSpeech rescoring session of the guide writes: the
# neural LM bundle, its 5-gram and the weights tuned on dev_clean, under the names configmap.yaml gives them. Run from
# the repository root with kubectl pointing at the cluster, before `kubectl apply -f deploy/kubernetes/`:
#
#   deploy/kubernetes/models/load.sh
#
# It creates the claim (pvc.yaml) and a loader pod that mounts it read-write (loader.yaml), copies the files in with
# kubectl cp and deletes the pod; the claim stays. Run it again after tuning again (then roll the pods out again).
# KUBECTL: the kubectl command (default: kubectl).
set -eu
here=$(cd "$(dirname "$0")" && pwd)
kubectl=${KUBECTL:-kubectl}
models="bundles/librispeech_lm ngrams/glarge_5gram.bin rescore/dev_clean.weights.json"  # under var/, as written
for model in $models; do
    [ -e "var/$model" ] || { echo "load.sh: var/$model: missing; run the LibriSpeech rescoring session first" >&2; exit 1; }
done
"$kubectl" apply -f "$here/pvc.yaml" -f "$here/loader.yaml"
"$kubectl" wait --for=condition=Ready pod/lmserve-models-loader --timeout=300s
for model in $models; do
    name=$(basename "$model")
    "$kubectl" exec lmserve-models-loader -- rm -rf "/models/$name"  # (a copy over an earlier one would nest in it)
    "$kubectl" cp "var/$model" "lmserve-models-loader:/models/$name"
done
"$kubectl" delete -f "$here/loader.yaml"
