"""docker-stack.yml for a Docker Swarm, written from the same ClusterLayout as docker-compose.yml.

    knot compose --swarm [--model M] [--stations N] [--shards K] [--replicas R] > docker-stack.yml
    knot secrets --swarm                       the cluster's secrets as Swarm secrets (once)
    docker stack deploy -c docker-stack.yml knot

Each service is compose_writer's, changed where a Swarm differs from one Docker host:

- **Secrets** are Swarm secrets (`knot_<name>`, external: `knot secrets --swarm` creates them), never
  variables: `docker service inspect` shows none of them. Each container gets the ones its
  variables name under /run/secrets/<VARIABLE>, and its command starts by exporting them
  (SECRET_LOADER), so the handlers read their variables as everywhere else.
- **Images** come from a registry every node pulls from (KNOT_REGISTRY), not a build: the cluster's
  image and the stand-ins for MinIO and Redis that scripts/docker-images.sh builds from Debian and
  PyPI packages (scripts/test-swarm.sh pushes them to a registry of Debian's docker-registry).
- **One overlay network**, `knot`, and names that resolve to the one task of each service
  (endpoint_mode dnsrr): the coordinator chooses among replicas itself, and Swarm's virtual IPs
  need IPVS in every node's kernel, which nodes in containers lack. Only the coordinator publishes
  a port (KNOT_PORT), in host mode on the manager node it runs on: clients call that node's address.
- **Placement:** the stores, the wardens, the init job and the coordinator run on manager nodes
  (the stores keep their data in node-local volumes). Replica k of every station and shard runs on
  nodes labelled `knot.replica=k` (`docker node update --label-add knot.replica=k NODE`), so
  losing a node loses one replica of each range, and the coordinator moves the generations on it
  to the others (services/coordinator/pipeline.py). With one replica, any node.
- **Restart policies and memory limits** as in compose: `restart_policy` (any; the init job on
  failure) and `resources.limits.memory`. A Swarm has no depends_on: a service that starts before
  its peers is restarted until they answer, as `restart: unless-stopped` would.
- KNOT_MODELS_DIR: a node directory with the model (the init job bind-mounts it at /cache);
  default a volume.
"""
from __future__ import annotations

import yaml

from common.topology import ClusterLayout, Knob, Service
from deploy import compose_writer
from deploy.compose_writer import CONTAINER_PORT, CONTAINERS, value

# variable -> the cluster secret it holds (deploy/cluster_secrets.py SECRETS, plus the API key)
SECRET_VARS = {"KNOT_INTERNAL_SECRET": "KNOT_INTERNAL_SECRET", "KNOT_REDIS_PASSWORD": "KNOT_REDIS_PASSWORD",
               "REDISCLI_AUTH": "KNOT_REDIS_PASSWORD", "MINIO_ROOT_USER": "MINIO_ROOT_USER",
               "MINIO_ROOT_PASSWORD": "MINIO_ROOT_PASSWORD", "AWS_ACCESS_KEY_ID": "MINIO_ROOT_USER",
               "AWS_SECRET_ACCESS_KEY": "MINIO_ROOT_PASSWORD", "KNOT_API_KEY": "KNOT_API_KEY"}
SWARM_SECRETS = ("KNOT_INTERNAL_SECRET", "KNOT_REDIS_PASSWORD", "MINIO_ROOT_USER", "MINIO_ROOT_PASSWORD",
                 "KNOT_API_KEY")
NETWORK = "knot"
REPLICA_LABEL = "knot.replica"
# Exports every file of /run/secrets as the variable it is named after; SECRET_LOADER then runs the command.
LOAD_SECRETS = 'for f in /run/secrets/*; do [ -f "$$f" ] && export "$${f##*/}=$$(cat "$$f")"; done; '
SECRET_LOADER = LOAD_SECRETS + 'exec "$$@"'
# the stand-ins' images (scripts/docker-images.sh) and what they run
STORE_IMAGES = {"bucket": "knot/seaweedfs:4.48", "kv": "knot/valkey:9.1"}
STORE_COMMANDS = {  # the bucket's stand-in's own (its image's CMD); the kv's is compose's
    "bucket": ("python3", "/usr/local/lib/knot/seaweedfs.py", "serve", "/data", "-ip=127.0.0.1", "-ip.bind=0.0.0.0",
               "-s3.port=9000", "-s3.port.iceberg=0", "-s3.port.lance=0", "-master.telemetry=false",
               "-volume.max=64", "-master.volumeSizeLimitMB=256", "-volume.preStopSeconds=0",
               "-s3.concurrentUploadLimitMB=128", "-filer.concurrentUploadLimitMB=128",
               "-volume.concurrentUploadLimitMB=128"),
}
STORE_HEALTHCHECKS = {
    "bucket": ("CMD", "sh", "-c", LOAD_SECRETS + "exec python3 /usr/local/lib/knot/seaweedfs.py check http://127.0.0.1:9000"),
    # AUTH with the password from its secret file, then PING, as RESP arrays, with bash builtins
    "kv": ("CMD", "bash", "-c", "exec 3<>/dev/tcp/127.0.0.1/6379 && p=$$(cat /run/secrets/KNOT_REDIS_PASSWORD) && "
           "printf '*2\\r\\n$$4\\r\\nAUTH\\r\\n$$%d\\r\\n%s\\r\\n*1\\r\\n$$4\\r\\nPING\\r\\n' $${#p} \"$$p\" >&3 && "
           "read -r a <&3 && read -r b <&3 && [[ $$a == +OK* && $$b == +PONG* ]]"),
}
SECRET_UID = "10001"  # every image's user (knot, weed, valkey): the secret files are theirs, mode 0400
MANAGER_ROLES = ("bucket", "kv", "init", "layer_warden", "cobordism_warden", "coordinator", "drafter")


def image(role: str) -> str:
    name = STORE_IMAGES.get(role, compose_writer.OUR_IMAGE["image"])
    return f"{value(Knob('KNOT_REGISTRY'))}/{name}"


def secret_name(secret: str) -> str:
    """KNOT_REDIS_PASSWORD -> knot_redis_password; MINIO_ROOT_USER -> knot_minio_root_user."""
    return f"knot_{secret.lower().removeprefix('knot_')}"


def replica_of(s: Service) -> int | None:
    """k of a station's or shard's replica (station-0-r2: 2; station-0: 0); None for other roles."""
    if s.role not in ("station", "shard"):
        return None
    head, _, k = s.name.rpartition("-r")
    return int(k) if head and k.isdigit() else 0


def service_doc(s: Service, layout: ClusterLayout) -> dict:
    c = CONTAINERS[s.role]
    doc = compose_writer.service_doc(s, layout)
    env = doc.pop("environment", {})  # the coordinator's has KNOT_API_KEY: a secret here, so always set
    secrets = sorted((var, SECRET_VARS[var]) for var in env if var in SECRET_VARS)
    env = {k: v for k, v in env.items() if k not in SECRET_VARS}
    for gone in ("build", "restart", "mem_limit", "memswap_limit", "depends_on", "x-knot-local", "ports"):
        doc.pop(gone, None)
    command = list(STORE_COMMANDS.get(s.role, doc.pop("command")))
    out: dict = {"image": image(s.role)}
    out["command"] = ["sh", "-c", SECRET_LOADER, "knot-secrets", *command] if secrets else command
    if env:
        out["environment"] = env
    if secrets:
        out["secrets"] = [{"source": secret_name(secret), "target": var, "uid": SECRET_UID, "gid": SECRET_UID,
                           "mode": 0o400} for var, secret in secrets]
    if s.role == "init":  # the model from a node directory when KNOT_MODELS_DIR names one
        out["volumes"] = [f"{value(Knob('KNOT_MODELS_DIR', 'model-cache'))}:/cache"]
    elif "volumes" in doc:
        out["volumes"] = doc["volumes"]
    if c.published_port is not None:
        out["ports"] = [{"target": CONTAINER_PORT, "published": value(c.published_port), "protocol": "tcp",
                         "mode": "host"}]
    if s.role in STORE_HEALTHCHECKS:
        out["healthcheck"] = {**doc["healthcheck"], "test": list(STORE_HEALTHCHECKS[s.role])}
    elif "healthcheck" in doc:
        out["healthcheck"] = doc["healthcheck"]
    out["networks"] = [NETWORK]
    k = replica_of(s)
    placement: dict = {"constraints": ["node.role == manager"]} if s.role in MANAGER_ROLES else {}
    if k is not None and layout.replicas > 1:
        placement = {"constraints": [f"node.labels.{REPLICA_LABEL} == {k}"], "max_replicas_per_node": 1}
    deploy: dict = {"replicas": 1, "endpoint_mode": "dnsrr", "restart_policy": {
        "condition": "on-failure" if c.restart == "no" else "any", "delay": "2s"}}
    if c.mem_limit is not None:
        deploy["resources"] = {"limits": {"memory": value(c.mem_limit)}}
    if placement:
        deploy["placement"] = placement
    out["deploy"] = deploy
    return out


def render(layout: ClusterLayout) -> dict:
    """The stack document (variables not substituted: docker stack deploy takes them from its environment)."""
    services = {s.name: service_doc(s, layout) for s in layout.services}
    volumes = sorted({v.split(":", 1)[0] for d in services.values() for v in d.get("volumes", ())
                      if not v.startswith("$")} | {"model-cache"})  # KNOT_MODELS_DIR's default
    return {"version": "3.8", "services": services, "networks": {NETWORK: {"driver": "overlay", "attachable": True}},
            "volumes": {v: None for v in volumes},
            "secrets": {secret_name(n): {"external": True} for n in SWARM_SECRETS}}


HEADER = """\
# GENERATED from the cluster layout (common/topology.py, deploy/stack_writer.py): do not edit.
#   knot compose --swarm{args} > docker-stack.yml
# The cluster for {model} on a Docker Swarm: {stations} and {shards}, {replicas} of each.
#
#   knot secrets --swarm                               the cluster's secrets as Swarm secrets, once
#   docker node update --label-add knot.replica=K NODE  replica K of every station and shard runs there
#   KNOT_REGISTRY=HOST:PORT docker stack deploy -c docker-stack.yml knot
#
# deploy/stack_writer.py says how it differs from docker-compose.yml; README "Several hosts".
"""


def render_text(layout: ClusterLayout, model: str = "the model", args: str = "") -> str:
    def count(n: int, what: str) -> str:
        return f"{n} {what}" + ("s" if n != 1 else "")

    header = HEADER.format(args=args, model=model, stations=count(len(layout.stations), "station"),
                           shards=count(len(layout.shards), "shard"), replicas=count(layout.replicas, "replica"))
    return header + yaml.dump(render(layout), Dumper=compose_writer._Dumper, sort_keys=False, width=120,
                              default_flow_style=False)
