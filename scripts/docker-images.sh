#!/usr/bin/env bash
# Images for a host without Docker Hub (an air-gapped site, or a machine that reaches only the
# Debian archive and PyPI), built from Debian packages and PyPI:
#   knot/python:3.11-bookworm   Python 3.11 from debootstrap (minbase), with this host's CA bundle
#   knot/seaweedfs:4.48         SeaweedFS's S3 gateway, in place of MinIO
#   knot/valkey:9.1             valkey-server, in place of Redis
# then the cluster's own image on that base. Afterwards:
#   docker compose -f docker-compose.yml -f deploy/docker/offline.yml up -d --wait
#
# Needs root (debootstrap) and a running engine (scripts/docker-engine.sh). The debootstrap
# rootfs is cached as a tarball in $KNOT_CACHE_DIR/docker (default ~/.cache/knot/docker), and
# Docker's build cache keeps the rest, so a second run takes seconds.
#   KNOT_DEBIAN_MIRROR   the archive debootstrap and apt use (default http://deb.debian.org/debian)
#   KNOT_CA_BUNDLE       the CA bundle copied in (default /etc/ssl/certs/ca-certificates.crt)
set -euo pipefail
cd "$(dirname "$0")/.."

SUITE=bookworm
INCLUDE=python3,python3-venv,python3-pip,ca-certificates
MIRROR="${KNOT_DEBIAN_MIRROR:-http://deb.debian.org/debian}"
CA_BUNDLE="${KNOT_CA_BUNDLE:-/etc/ssl/certs/ca-certificates.crt}"
BASE_IMAGE=knot/python:3.11-bookworm
cache="${KNOT_CACHE_DIR:-$HOME/.cache/knot}/docker"

say() { echo "docker-images: $*" >&2; }
elapsed() { echo "$(( $(date +%s) - $1 )) s"; }
build() {  # docker build ARGS...: quiet, its log shown only when it fails
  local log; log="$(mktemp)"
  if ! docker build --force-rm "$@" >"$log" 2>&1; then
    tail -30 "$log" >&2; rm -f "$log"; return 1
  fi
  rm -f "$log"
}

# ---- 1. the rootfs: debootstrap once, then the cached tarball
key="$(printf '%s\n' "$SUITE" minbase "$INCLUDE" "$MIRROR" | sha256sum | cut -c1-12)"
rootfs_image="knot/rootfs:$SUITE-$key"
if ! docker image inspect "$rootfs_image" >/dev/null 2>&1; then
  tarball="$cache/rootfs-$SUITE-$key.tar.gz"
  if [ ! -s "$tarball" ]; then
    command -v debootstrap >/dev/null || {
      say "installing debootstrap"
      apt-get update -q >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -q debootstrap >/dev/null
    }
    t0=$(date +%s)
    work="$(mktemp -d)"
    trap 'rm -rf "$work"' EXIT
    say "debootstrap $SUITE ($INCLUDE) from $MIRROR"
    debootstrap --variant=minbase --include="$INCLUDE" "$SUITE" "$work/root" "$MIRROR" >"$work/log" 2>&1 \
      || { tail -20 "$work/log" >&2; exit 1; }
    cat >"$work/root/etc/apt/sources.list" <<EOF
deb $MIRROR $SUITE main
deb $MIRROR $SUITE-updates main
deb ${MIRROR%/debian}/debian-security $SUITE-security main
EOF
    rm -rf "$work"/root/var/cache/apt/archives/*.deb "$work"/root/var/lib/apt/lists/*
    mkdir -p "$cache"
    tar --numeric-owner -C "$work/root" -czf "$tarball.partial" .
    mv "$tarball.partial" "$tarball"
    rm -rf "$work"
    trap - EXIT
    say "rootfs cached at $tarball ($(du -h "$tarball" | cut -f1), $(elapsed "$t0"))"
  fi
  docker import "$tarball" "$rootfs_image" >/dev/null
fi

# ---- 2. the base: the rootfs with this host's CA bundle
t0=$(date +%s)
ctx="$(mktemp -d)"
trap 'rm -rf "$ctx"' EXIT
cp "$CA_BUNDLE" "$ctx/ca-certificates.crt"
cp deploy/seaweedfs.py "$ctx/seaweedfs.py"  # the SeaweedFS stand-in's command and healthcheck (stdlib only)
build -f deploy/docker/base.Dockerfile --build-arg ROOTFS_IMAGE="$rootfs_image" -t "$BASE_IMAGE" "$ctx"
say "$BASE_IMAGE ($(elapsed "$t0"))"

# ---- 3. the stand-ins for MinIO and Redis
for target in seaweedfs:4.48 valkey:9.1; do
  t0=$(date +%s)
  build -f deploy/docker/standins.Dockerfile --target "${target%%:*}" \
    --build-arg PYTHON_IMAGE="$BASE_IMAGE" -t "knot/$target" "$ctx"
  say "knot/$target ($(elapsed "$t0"))"
done

# ---- 4. the cluster's image on that base (docker-compose.yml's `image:`; `up` uses it as built)
t0=$(date +%s)
build -f deploy/docker/Dockerfile --build-arg PYTHON_IMAGE="$BASE_IMAGE" -t knot-cluster:local .
say "knot-cluster:local ($(elapsed "$t0"))"
