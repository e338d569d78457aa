#!/bin/sh
# The lm-serve image of deploy/Containerfile, built as its header says, with what a first build trips over said plainly.
#
#   deploy/build-image.sh [--pip-ca FILE] [IMAGE] [-- MORE PODMAN BUILD OPTIONS]    # IMAGE: localhost/lmserve
#
# --pip-ca FILE: the CA bundle that a TLS-intercepting proxy's certificates chain to (on such a host usually its
#   /etc/ssl/certs/ca-certificates.crt), handed to the builder's pip as the build secret pip_ca. Without it, pip behind
#   such a proxy cannot verify PyPI and reports "No matching distribution found" for the first requirement; this script
#   recognises that in the build's output and says which flag to add.
# A build leaves its builder stage behind as an untagged image (about 1.1 GB: compilers and wheels, the cache of the
# next build); the script says so, and `deploy/podman.sh image prune` removes it.
# PODMAN: the podman command (default: deploy/podman.sh, podman with this repository's storage and settings).
set -eu
here=$(cd "$(dirname "$0")" && pwd)
podman=${PODMAN:-$here/podman.sh}
image=localhost/lmserve
ca=""
while [ $# -gt 0 ]; do
    case $1 in
        --pip-ca)
            ca=${2:-}
            [ -f "$ca" ] || { echo "deploy/build-image.sh: --pip-ca ${ca}: no such file" >&2; exit 2; }
            shift 2 ;;
        --) shift; break ;;
        -*) echo "deploy/build-image.sh: unknown option $1 (usage: [--pip-ca FILE] [IMAGE] [-- PODMAN BUILD OPTIONS])" >&2
            exit 2 ;;
        *) image=$1; shift ;;
    esac
done
if [ -n "$ca" ]; then
    set -- --secret "id=pip_ca,src=$ca" "$@"
fi

log=$(mktemp "${TMPDIR:-/tmp}/lmserve-build.XXXXXX")
trap 'rm -f "$log" "$log.status"' EXIT
{ status=0
  "$podman" build --network host --format docker -f "$here/Containerfile" -t "$image" "$@" "$here/.." 2>&1 || status=$?
  echo "$status" >"$log.status"; } | tee "$log"
status=$(cat "$log.status")
if [ "$status" -ne 0 ]; then
    if grep -qE 'No matching distribution found|CERTIFICATE_VERIFY_FAILED|certificate verify failed|SSLError' "$log"; then
        if [ -n "$ca" ]; then
            echo "deploy/build-image.sh: pip in the builder still could not verify PyPI's certificate with --pip-ca $ca:" \
                "is it the CA bundle that the proxy's certificates chain to?" >&2
        else
            echo "deploy/build-image.sh: pip in the builder could not verify PyPI's certificate (\"No matching" \
                "distribution found\" is how pip reports it). Behind a TLS-intercepting proxy, build again with its CA" \
                "bundle: deploy/build-image.sh --pip-ca /etc/ssl/certs/ca-certificates.crt" >&2
        fi
    fi
    exit "$status"
fi
untagged=$("$podman" images --filter dangling=true --format '{{.ID}} {{.Size}}' | tr '\n' ' ')
echo "deploy/build-image.sh: built $image. The builder stage stays as an untagged image, the cache of the next build" \
    "(${untagged:-none now}); deploy/podman.sh image prune removes it." >&2
