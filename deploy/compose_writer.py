"""docker-compose.yml, written from the ClusterLayout (common/topology.py).

    knot compose [--model M] [--stations N] [--shards K] > docker-compose.yml

The layout says which services run, their handler vars, bindings and dependencies; this module
says how each role becomes a container: CONTAINERS, one row per role, is the one place for a
container's deploy attributes (image, command, healthcheck, restart policy, memory limit,
published port, volumes). A binding becomes the URL the local host understands
(deploy/local/host_settings.py), a Knob a ${NAME:-default} substitution. `knot cluster up` runs the same
rendering as local processes (deploy/launcher.py), and tests/unit/test_runtime_compose.py fails
when the committed docker-compose.yml differs from `render_text(default_layout())`.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field

import yaml

from common.settings import REQUIRED, TABLE
from common.topology import Binding, ClusterLayout, Knob, Service

CONTAINER_PORT = 8080  # every service of our image listens here inside its container
# PYTHON_IMAGE: the Dockerfile's base (the official image unless a host without Docker Hub
# passes the one scripts/docker-images.sh builds).
OUR_IMAGE = {"build": {"context": ".", "dockerfile": "deploy/docker/Dockerfile",
                       "args": {"PYTHON_IMAGE": Knob("KNOT_PYTHON_IMAGE")}},
             "image": "knot-cluster:local"}
SERVE = ("python", "-m", "deploy.cli", "serve")
STORE_PORTS = {"bucket": 9000, "kv": 6379}  # S3 (MinIO) and Redis inside their containers


def http_probe(url: str) -> tuple[str, ...]:
    """A healthcheck that GETs url (http://127.0.0.1:PORT/PATH) and passes on 200, with bash's
    /dev/tcp and builtins only: no interpreter starts every few seconds in every container
    (a Python probe cost 74 ms of CPU per check here, this one 25 ms, 17 of them Docker's exec)."""
    m = re.fullmatch(r"http://127\.0\.0\.1:(\d+)(/\S*)", url)
    assert m, url
    return ("CMD", "bash", "-c", f"exec 3<>/dev/tcp/127.0.0.1/{m[1]} && printf 'GET {m[2]} HTTP/1.0\\r\\n\\r\\n' >&3 "
            "&& read -r _ code _ <&3 && [ \"$$code\" = 200 ]")


def probe_url(test: list[str] | tuple[str, ...]) -> str | None:
    """The URL an http_probe() healthcheck GETs (the launcher runs the same check); None for another test."""
    m = re.search(r"/dev/tcp/127\.0\.0\.1/(\d+) .*'GET (/\S*) HTTP", " ".join(test))
    return f"http://127.0.0.1:{m[1]}{m[2]}" if m else None


READYZ = http_probe(f"http://127.0.0.1:{CONTAINER_PORT}/readyz")


@dataclass(frozen=True)
class Healthcheck:
    test: tuple[str, ...]
    interval: str = "5s"
    timeout: str = "3s"
    retries: int = 30
    start_period: str | None = "5s"


@dataclass(frozen=True)
class Container:
    """How a role runs as a container. image None: our image, built from deploy/docker/Dockerfile.

    Every container is supervised: a restart policy (a crash or an OOM kill brings it back) and a
    memory limit without swap beyond it (a runaway is killed inside its cgroup, never eats the
    host). The limits come from measurement (docs/runtime.md; tests/compose checks the peaks)."""

    image: str | None = None
    command: tuple[str, ...] = SERVE
    healthcheck: Healthcheck | None = Healthcheck(READYZ)
    mem_limit: Knob | None = None  # e.g. Knob("KNOT_SHARD_MEM_LIMIT"): "384m"
    restart: str = "unless-stopped"  # compose restart policy
    published_port: Knob | None = None  # host side of the port mapping (the container side: CONTAINER_PORT)
    publish_address: Knob | None = None  # the host address it is published on
    volumes: tuple[str, ...] = ()
    environment: dict = field(default_factory=dict)  # container-level settings beyond the layout's vars
    local: str | None = None  # x-knot-local: what `knot cluster up` runs instead (seaweedfs | redis)


# glibc hands every allocation over 32 MiB fresh pages from mmap and unmaps them on free, so a
# station that streams 30-60 MB warden batches (fluid), and the LayerWarden that builds them,
# page-fault all of them again each time, several times slower than a copy. Keeping big
# blocks in the heap lets them be reused; RSS then stays at the peak, which the station's budget
# bounds. Only there: elsewhere (the coordinator after a huge request) freed memory goes back.
KEEP_HEAP = {"MALLOC_MMAP_THRESHOLD_": str(1 << 30), "MALLOC_TRIM_THRESHOLD_": str(1 << 30)}

CONTAINERS: dict[str, Container] = {
    "bucket": Container("minio/minio:RELEASE.2025-04-22T22-12-26Z", ("server", "/data"),
                        Healthcheck(("CMD", "mc", "ready", "local"), start_period=None),
                        Knob("KNOT_S3_MEM_LIMIT"), volumes=("minio-data:/data",), local="seaweedfs",
                        environment={"MINIO_ROOT_USER": Knob("MINIO_ROOT_USER"),
                                     "MINIO_ROOT_PASSWORD": Knob("MINIO_ROOT_PASSWORD")}),
    # A cache (Workers KV's stand-in): past maxmemory it evicts, well before its container's limit.
    # Redis requires the cluster's password (deploy/cluster_secrets.py). It reaches redis-server through
    # a config file, not argv (which `ps` shows); redis-cli in the healthcheck reads REDISCLI_AUTH.
    # (With a password, protected mode does not apply: the other containers may connect.)
    "kv": Container("redis:7.4-alpine",
                    ("sh", "-c", 'umask 077 && printf "requirepass %s\\n" "$$KNOT_REDIS_PASSWORD" > /tmp/redis.conf'
                                 ' && exec redis-server /tmp/redis.conf --save "" --appendonly no'
                                 ' --maxmemory 128mb --maxmemory-policy allkeys-lru'),
                    Healthcheck(("CMD", "redis-cli", "ping"), start_period=None), Knob("KNOT_KV_MEM_LIMIT"),
                    local="redis",
                    environment={"KNOT_REDIS_PASSWORD": Knob("KNOT_REDIS_PASSWORD"),
                                 "REDISCLI_AUTH": Knob("KNOT_REDIS_PASSWORD")}),
    # Fetches the model, encodes it to a .knot and uploads it to the bucket, once. No restart: compose
    # waits for it to complete, and a failed start is one to look at (`docker compose logs init`).
    "init": Container(command=("python", "-m", "deploy.local.init"), healthcheck=None,
                      mem_limit=Knob("KNOT_INIT_MEM_LIMIT"), restart="no",
                      volumes=("model-cache:/cache",), environment={"KNOT_CACHE_DIR": "/cache"}),
    "layer_warden": Container(mem_limit=Knob("KNOT_LAYER_WARDEN_MEM_LIMIT"), environment=KEEP_HEAP),
    "cobordism_warden": Container(mem_limit=Knob("KNOT_COBORDISM_WARDEN_MEM_LIMIT")),
    "station": Container(mem_limit=Knob("KNOT_STATION_MEM_LIMIT"), environment=KEEP_HEAP),
    "shard": Container(mem_limit=Knob("KNOT_SHARD_MEM_LIMIT"), environment={"KNOT_THREADS": Knob("KNOT_SHARD_THREADS")}),
    "drafter": Container(mem_limit=Knob("KNOT_DRAFTER_MEM_LIMIT")),
    # The public API: the only published port, on loopback unless KNOT_PUBLISH_ADDRESS says otherwise;
    # it logs every request, and its calls wait for whole generations' hops.
    "coordinator": Container(mem_limit=Knob("KNOT_COORDINATOR_MEM_LIMIT"), published_port=Knob("KNOT_PORT"),
                             publish_address=Knob("KNOT_PUBLISH_ADDRESS"),
                             environment={"KNOT_ACCESS_LOG": "all", "KNOT_CALL_TIMEOUT_S": "300"}),
}


def knot_env(layout: ClusterLayout) -> dict:
    """What every container of our image gets (docs/configuration.md says why each is set)."""
    bucket = layout.by_role("bucket")[0].name
    return {
        "S3_ENDPOINT_URL": f"http://{bucket}:{STORE_PORTS['bucket']}",
        "AWS_ACCESS_KEY_ID": Knob("MINIO_ROOT_USER"), "AWS_SECRET_ACCESS_KEY": Knob("MINIO_ROOT_PASSWORD"),
        "AWS_REGION": "us-east-1", "KNOT_LOG_FORMAT": "json", "KNOT_ACCESS_LOG": Knob("KNOT_ACCESS_LOG"),
        "PORT": str(CONTAINER_PORT), "PYTHONUNBUFFERED": "1", "OPENBLAS_NUM_THREADS": "1",
        "KNOT_SPIN_US": Knob("KNOT_SPIN_US"), "KNOT_HTTP_SERVER": Knob("KNOT_HTTP_SERVER"),
        "KNOT_INTERNAL_SECRET": Knob("KNOT_INTERNAL_SECRET"),  # signs internal calls: `knot secrets` writes .env
    }


def value(v) -> str:
    """A layout value as compose text: a Knob is ${NAME:-default} (its default from common/settings.py),
    or ${NAME:?why} when it has none (docker compose then refuses to start without it)."""
    if not isinstance(v, Knob):
        return str(v)
    default = v.default if v.default is not None else TABLE[v.name].default_for("compose")
    if default is REQUIRED:
        return f"${{{v.name}:?{REQUIRED_HINTS[v.name]}}}"
    return f"${{{v.name}:-{default}}}"


# What the error of a required variable says (docker compose prints it when the variable is unset).
REQUIRED_HINTS = {"KNOT_REDIS_PASSWORD": "the Redis password is generated per cluster; run knot secrets (writes .env)",
                  "KNOT_INTERNAL_SECRET": "the signing key is per cluster; run knot secrets (writes .env)",
                  "MINIO_ROOT_USER": "the bucket's keys are per cluster; run knot secrets (writes .env)",
                  "MINIO_ROOT_PASSWORD": "the bucket's keys are per cluster; run knot secrets (writes .env)"}


def binding_url(b: Binding, owner: Service, layout: ClusterLayout) -> str:
    """The URL deploy/local/host_settings.py turns into the binding."""
    if b.kind == "bucket":
        return f"s3://{b.resource}"
    if b.kind == "kv":
        return f"redis://{b.service}:{STORE_PORTS['kv']}/0"
    if b.kind == "durable_object":
        return f"do+local:{b.resource}" if b.service == owner.name else \
            f"do+http://{b.service}:{CONTAINER_PORT}/{b.resource}"
    assert b.kind == "service", b
    return f"http://{b.service}:{CONTAINER_PORT}"


def environment(s: Service, layout: ClusterLayout) -> dict[str, str]:
    c = CONTAINERS[s.role]
    if c.image is not None:  # a store: only its own settings
        return {k: value(v) for k, v in c.environment.items()}
    env = dict(knot_env(layout))
    if s.is_worker:
        env.update({"KNOT_SERVICE": s.module, "KNOT_SERVICE_NAME": s.name})
        if s.durable_objects:
            env["KNOT_DURABLE_OBJECTS"] = ",".join(s.durable_objects)
        env["KNOT_BINDINGS"] = ",".join(b.name for b in s.bindings)
    env.update({b.name: binding_url(b, s, layout) for b in s.bindings})
    if any(b.kind == "kv" for b in s.bindings):  # the KV's Redis requires it (the URL carries no password)
        env["KNOT_REDIS_PASSWORD"] = Knob("KNOT_REDIS_PASSWORD")
    if s.is_worker and s.vars:
        env["KNOT_VARS"] = ",".join(s.vars)
    env.update(s.vars)
    env.update(c.environment)
    return {k: value(v) for k, v in env.items()}


CONDITIONS = {"started": "service_started", "healthy": "service_healthy",
              "completed": "service_completed_successfully"}


def service_doc(s: Service, layout: ClusterLayout) -> dict:
    c = CONTAINERS[s.role]
    doc: dict = {"image": c.image} if c.image is not None else {
        "build": {**OUR_IMAGE["build"], "args": {k: value(v) for k, v in OUR_IMAGE["build"]["args"].items()}},
        "image": OUR_IMAGE["image"]}
    doc["command"] = list(c.command)
    env = environment(s, layout)
    if env:
        doc["environment"] = env
    if c.volumes:
        doc["volumes"] = list(c.volumes)
    if c.published_port is not None:
        address = f"{value(c.publish_address)}:" if c.publish_address is not None else ""
        doc["ports"] = [f"{address}{value(c.published_port)}:{CONTAINER_PORT}"]
    doc["restart"] = c.restart
    if c.mem_limit is not None:  # and no swap beyond it
        doc["mem_limit"] = doc["memswap_limit"] = value(c.mem_limit)
    if c.healthcheck is not None:
        h = c.healthcheck
        doc["healthcheck"] = {"test": list(h.test), "interval": h.interval, "timeout": h.timeout,
                              "retries": h.retries, **({"start_period": h.start_period} if h.start_period else {})}
    if s.depends_on:
        doc["depends_on"] = {d: {"condition": CONDITIONS[cond]} for d, cond in s.depends_on.items()}
    if c.local is not None:
        doc["x-knot-local"] = c.local
    return doc


def render(layout: ClusterLayout) -> dict:
    """The compose document (variables not substituted)."""
    services = {s.name: service_doc(s, layout) for s in layout.services}
    volumes = sorted({v.split(":", 1)[0] for s in layout.services for v in CONTAINERS[s.role].volumes})
    return {"name": "knot-cluster", "services": services, "volumes": {v: None for v in volumes}}


HEADER = """\
# GENERATED from the cluster layout (common/topology.py, deploy/compose_writer.py): do not edit.
#   knot compose{args} > docker-compose.yml
# The cluster for {model}: {n_layers} layers on {stations} ({splits}), a vocabulary of
# {vocab} on {shards}, two wardens, MinIO (stands in for R2) and Redis (stands in for Workers KV).
#
#   docker compose up          the containers
#   knot cluster up            the same services as local processes (deploy/launcher.py): SeaweedFS
#                              runs instead of minio, redis-server/valkey instead of redis
#                              (see x-knot-local), and "service:port" addresses become 127.0.0.1
#   knot serve --embedded      the same handlers in one process with embedded bindings
#
# Services reach each other by binding URLs (deploy/local/host_settings.py lists the schemes):
#   s3://BUCKET   redis://HOST:PORT/DB   do+http://HOST:PORT/CLASS   do+local:CLASS   http://HOST:PORT
# Only the coordinator publishes a port (KNOT_PORT). Every variable: docs/configuration.md.
#
# Redis requires a password generated per cluster: `knot secrets` writes it to .env (mode 600), which
# docker compose reads; `knot cluster up` keeps its own in .knot-run/secrets.env.
"""


class _Dumper(yaml.SafeDumper):
    def ignore_aliases(self, data) -> bool:  # write every service out in full, no &id001 anchors
        return True


def _list(dumper: yaml.SafeDumper, data: list):
    flow = all(isinstance(x, (str, int)) for x in data) and len(data) <= 8
    return dumper.represent_sequence("tag:yaml.org,2002:seq", data, flow_style=flow)


def _none(dumper: yaml.SafeDumper, _):
    return dumper.represent_scalar("tag:yaml.org,2002:null", "")


_Dumper.add_representer(list, _list)
_Dumper.add_representer(type(None), _none)


def render_text(layout: ClusterLayout, model: str = "the model", args: str = "") -> str:
    """docker-compose.yml as text: the header comment, then the document."""
    splits = " ".join(f"[{s.layer_start},{s.layer_end})" for s in layout.stations)
    def count(n: int, what: str) -> str:
        return f"{n} {what}" + ("s" if n != 1 else "")

    header = HEADER.format(args=args, model=model, n_layers=layout.n_layers, splits=splits,
                           stations=count(len(layout.stations), "station"), vocab=f"{layout.vocab_size:,}",
                           shards=count(len(layout.shards), "shard"))
    body = yaml.dump(render(layout), Dumper=_Dumper, sort_keys=False, width=120, default_flow_style=False)
    return header + body
