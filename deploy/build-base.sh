#!/bin/sh
# The base image of deploy/Containerfile, built from Debian packages (no container registry is needed):
# bookworm minbase with python3 (3.11, with venv) and CA certificates, imported into podman as IMAGE.
#
#   deploy/build-base.sh [IMAGE]        # default localhost/lmserve-base:bookworm
#
# Needs root (mmdebstrap in its default mode) and a Debian mirror (MIRROR, default deb.debian.org). Installs podman,
# mmdebstrap and runc with apt when they are missing. Where a registry is reachable, debian:bookworm-slim with python3
# and python3-venv added is the same base.
set -eu
# Debian's own tools only: mmdebstrap runs mmtarfilter (#!/usr/bin/env python3) once per package, and a python3 shim
# earlier on PATH (pyenv's, here) adds a bash and a pyenv start to each of those calls
export PATH=/usr/sbin:/usr/bin:/sbin:/bin
image=${1:-localhost/lmserve-base:bookworm}
mirror=${MIRROR:-http://deb.debian.org/debian}
security=${SECURITY_MIRROR:-http://deb.debian.org/debian-security}
here=$(cd "$(dirname "$0")" && pwd)

missing=""
for tool in podman mmdebstrap runc; do command -v $tool >/dev/null || missing="$missing $tool"; done
if [ -n "$missing" ]; then
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends$missing
fi

work=$(mktemp -d "${TMPDIR:-/var/tmp}/lmserve-base.XXXXXX")
trap 'rm -rf "$work"' EXIT
# passwd for useradd; the rest of minbase is dpkg, apt and the essential set (zlib, bzip2, xz, libstdc++ among them:
# the compiled kenlm module links them). Like debian:bookworm-slim: no manuals, translations or documentation but
# the copyright files, no recommends, and no apt lists left behind.
mmdebstrap --variant=minbase --include=python3,python3-venv,ca-certificates,passwd \
    --aptopt='APT::Install-Recommends "false"' \
    --dpkgopt='path-exclude=/usr/share/man/*' --dpkgopt='path-exclude=/usr/share/info/*' \
    --dpkgopt='path-exclude=/usr/share/locale/*' --dpkgopt='path-include=/usr/share/locale/locale.alias' \
    --dpkgopt='path-exclude=/usr/share/doc/*' --dpkgopt='path-include=/usr/share/doc/*/copyright' \
    --customize-hook='rm -rf "$1"/var/lib/apt/lists/* "$1"/var/cache/apt/*' \
    bookworm "$work/rootfs.tar" "deb $mirror bookworm main" "deb $mirror bookworm-updates main" \
    "deb $security bookworm-security main"
"$here/podman.sh" import --change 'CMD ["/bin/bash"]' "$work/rootfs.tar" "$image"
