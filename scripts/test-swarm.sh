#!/usr/bin/env bash
# The cluster on a multi-node Docker Swarm on one machine (issue 56): three nodes, each a container
# running its own dockerd (Debian's docker.io; ../shared/notes/swarm-offline.md says what works
# without --privileged), a registry of Debian's docker-registry they pull from, the stack that
# `knot compose --swarm --replicas 2` writes, and tests/swarm against it: a stream survives the loss
# of a whole node (`docker stop` of the node holding its replicas) with the fault-free text.
#   1. a Docker engine (scripts/docker-engine.sh) and the images (scripts/docker-images.sh), plus the
#      lab's registry and node images (deploy/docker/swarm.Dockerfile);
#   2. the lab network 10.77.0.0/24: the registry at 10.77.0.2, nodes knot-node-1..3 at .11-.13;
#      node 1 is the manager (the stores, wardens, init and coordinator run there), node 2 has label
#      knot.replica=0, node 3 knot.replica=1;
#   3. the images pushed to the registry, the secrets as Swarm secrets (`knot secrets --swarm`), the
#      stack deployed with the 0.5B's knot from the host's cache (bind-mounted into node 1);
#   4. pytest tests/swarm (arguments go to pytest); 5. always: the stack, nodes and network removed.
# Prints how long each step took. Needs .venv (scripts/setup.sh dev), root and ~15 GB of disk (vfs).
#   KNOT_SWARM_KEEP=1   leave the lab running afterwards (remove it with: bash scripts/test-swarm.sh --down)
set -euo pipefail
cd "$(dirname "$0")/.."

LAB=knot-swarm-lab
SUBNET=10.77.0.0/24
REGISTRY_IP=10.77.0.2
REGISTRY="$REGISTRY_IP:5000"
NODES=(knot-node-1 knot-node-2 knot-node-3)
NODE_IPS=(10.77.0.11 10.77.0.12 10.77.0.13)
MANAGER="tcp://${NODE_IPS[0]}:2375"
PORT=8000
say() { echo "test-swarm: $*" >&2; }

teardown() {
  for n in "${NODES[@]}" knot-swarm-registry; do docker rm -f -v "$n" >/dev/null 2>&1 || true; done
  docker network rm "$LAB" >/dev/null 2>&1 || true
}
if [ "${1:-}" = "--down" ]; then teardown; exit 0; fi

t_start=$(date +%s)
step_t=$t_start
timings=()
step() { local now; now=$(date +%s); timings+=("$1 $(( now - step_t )) s"); step_t=$now; }
finish() {
  local rc=$?
  if [ "$rc" != 0 ] && docker -H "$MANAGER" info >/dev/null 2>&1; then
    docker -H "$MANAGER" stack ps knot --no-trunc 2>&1 | tail -30 >&2 || true
  fi
  if [ "${KNOT_SWARM_KEEP:-0}" != 1 ]; then teardown; step down; fi
  timings+=("total $(( $(date +%s) - t_start )) s")
  say "stage times: $(IFS=,; echo "${timings[*]}" | sed 's/,/, /g')"
  exit "$rc"
}
trap finish EXIT

# ---- 1. engine and images
bash scripts/docker-engine.sh
KNOT_DOCKER_OFFLINE=1 bash scripts/docker-images.sh
for target in registry node; do
  docker build -q -f deploy/docker/swarm.Dockerfile --target "$target" \
    --build-arg PYTHON_IMAGE=knot/python:3.11-bookworm -t "knot/swarm-$target:local" deploy/docker >/dev/null
done
step images

# ---- 2. the lab: registry and three nodes, each its own dockerd
teardown
docker network create --subnet "$SUBNET" "$LAB" >/dev/null
docker run -d --name knot-swarm-registry --network "$LAB" --ip "$REGISTRY_IP" -p 127.0.0.1:5000:5000 \
  knot/swarm-registry:local >/dev/null
models="$(.venv/bin/python -c 'from deploy.models import cache_dir; print(cache_dir())')"
.venv/bin/knot fetch-model --encode qwen2.5-coder-0.5b >/dev/null  # the knot init uploads, from the host's cache
for i in 0 1 2; do
  # every capability but the one the host lacks (--privileged is refused here), and the host's cgroups
  docker run -d --name "${NODES[$i]}" --hostname "${NODES[$i]}" --network "$LAB" --ip "${NODE_IPS[$i]}" \
    --cap-add ALL --cap-drop SYS_RESOURCE --security-opt seccomp=unconfined --security-opt apparmor=unconfined \
    --cgroupns host -v /sys/fs/cgroup:/sys/fs/cgroup:rw -v "$models:/models:ro" \
    -e REGISTRY="$REGISTRY" knot/swarm-node:local >/dev/null
done
for ip in "${NODE_IPS[@]}"; do
  for _ in $(seq 60); do docker -H "tcp://$ip:2375" info >/dev/null 2>&1 && break; sleep 1; done
  docker -H "tcp://$ip:2375" info >/dev/null || { say "the engine of $ip did not start"; docker logs "${NODES[0]}" | tail -20 >&2; exit 1; }
done
docker -H "$MANAGER" swarm init --advertise-addr "${NODE_IPS[0]}" >/dev/null
token="$(docker -H "$MANAGER" swarm join-token -q worker)"
for i in 1 2; do
  docker -H "tcp://${NODE_IPS[$i]}:2375" swarm join --token "$token" "${NODE_IPS[0]}:2377" >/dev/null
done
docker -H "$MANAGER" node update --label-add knot.replica=0 "${NODES[1]}" >/dev/null
docker -H "$MANAGER" node update --label-add knot.replica=1 "${NODES[2]}" >/dev/null
step swarm

# ---- 3. images to the registry, secrets, the stack
for image in knot-cluster:local knot/seaweedfs:4.48 knot/valkey:9.1; do
  docker tag "$image" "127.0.0.1:5000/$image"
  docker push -q "127.0.0.1:5000/$image" >/dev/null
done
step push
secrets="$(mktemp -d)/secrets.env"
DOCKER_HOST="$MANAGER" .venv/bin/knot secrets --swarm --file "$secrets" >/dev/null
stack="$(mktemp -d)/docker-stack.yml"
.venv/bin/knot compose --swarm --replicas 2 --shards 4 >"$stack"
DOCKER_HOST="$MANAGER" KNOT_REGISTRY="$REGISTRY" KNOT_MODELS_DIR=/models KNOT_PORT=$PORT PEER_WAIT_S=5 \
  KNOT_MODEL=/cache/qwen2.5-coder-0.5b-q4_k_m.knot KNOT_PROFILE=resident \
  MAX_CONCURRENT_REQUESTS=32 MAX_QUEUED_REQUESTS=32 \
  docker stack deploy --with-registry-auth -c "$stack" knot >/dev/null
url="http://${NODE_IPS[0]}:$PORT"
for _ in $(seq 600); do
  curl -sf -m 5 -H "Authorization: Bearer $(grep ^KNOT_API_KEY= "$secrets" | cut -d= -f2-)" \
    "$url/v1/models" >/dev/null 2>&1 && break
  sleep 2
done
step deploy

# ---- 4. the tests
export KNOT_SWARM_STACK=1 KNOT_SWARM_URL="$url" KNOT_SWARM_MANAGER="$MANAGER" KNOT_SWARM_SECRETS="$secrets"
export KNOT_SWARM_NODES="$(IFS=,; echo "${NODES[*]}")"
status=0
.venv/bin/python -m pytest -m swarm tests/swarm "$@" || status=$?
step tests
exit "$status"
