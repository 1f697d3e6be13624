#!/bin/sh
# The base image of deploy/Dockerfile.server and deploy/Dockerfile.client, built from Debian's
# packages alone (no container registry needed): a Debian 12 minbase root filesystem with
# Python 3.11 and venv, imported into podman (or docker) under the tag given.
#
#   deploy/images/build-base.sh localhost/afl-base:bookworm
#   podman build --build-arg BASE_IMAGE=localhost/afl-base:bookworm -f deploy/Dockerfile.server .
#
# Needs mmdebstrap and podman (Debian packages) and root (or mmdebstrap's unshare mode).
# AFL_DEBIAN_MIRROR overrides the mirror; ENGINE=docker imports into docker instead.
set -eu
tag=${1:?usage: build-base.sh TAG}
mirror=${AFL_DEBIAN_MIRROR:-http://deb.debian.org/debian}
engine=${ENGINE:-podman}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
mmdebstrap --quiet --variant=minbase --include=python3,python3-venv,ca-certificates \
    --aptopt='Acquire::Retries "3"' \
    --customize-hook='rm -rf "$1"/var/cache/apt/* "$1"/var/lib/apt/lists/*' \
    bookworm "$work/rootfs.tar" "$mirror"
"$engine" import --change 'CMD ["/bin/bash"]' "$work/rootfs.tar" "$tag" >/dev/null
echo "$tag"
