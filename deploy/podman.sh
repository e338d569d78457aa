#!/bin/sh
# podman with deploy/containers.conf and storage of our own: images under LMSERVE_PODMAN_DIR (default: var/podman of
# the repository, git-ignored), run state under /run (cleared at boot, as podman expects). --root/--runroot go on the
# command line: a storage.conf makes every podman call stall 20 s on this host.
#   deploy/podman.sh images; deploy/podman.sh run --rm --read-only localhost/lmserve:latest --help
set -eu
here=$(cd "$(dirname "$0")" && pwd)
dir=${LMSERVE_PODMAN_DIR:-$here/../var/podman}
mkdir -p "$dir"
dir=$(cd "$dir" && pwd -P)
run=/run/lmserve-podman$(printf %s "$dir" | cksum | cut -d' ' -f1)
export CONTAINERS_CONF="$here/containers.conf"
exec podman --root "$dir/root" --runroot "$run/run" --tmpdir "$run/tmp" "$@"
