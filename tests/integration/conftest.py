"""Real servers, started here: SeaweedFS (S3), a Redis-protocol server, and the project's services
as real processes, launched from the cluster layout's rendering (the committed docker-compose.yml's).

No mocks of S3 or Redis. Everything listens on free 127.0.0.1 ports and is stopped at the end.
"""
from __future__ import annotations

import json
import signal
import subprocess
import sys
from contextlib import contextmanager
import urllib.error
import urllib.request
from urllib.parse import urlsplit
from dataclasses import dataclass
from pathlib import Path

import pytest
import redis
from gguf import GGMLQuantizationType as Q

from common.knot import read_header_sync
from common.signing import SIGNATURE_HEADER
from deploy import cluster_secrets, launcher, servers
from deploy.encoder import encode
from deploy.local import compose_reader
from deploy.local.server_bindings import S3Settings, Signer, s3_client
from deploy.local.durable import DO_NAME_HEADER
from tests.tiny_gguf import TinySpec, write_tiny_gguf
from tests.waits import wait_for  # noqa: F401  (the integration tests import it from here)

BUCKET = "knots"
CREDENTIALS = {"AWS_ACCESS_KEY_ID": "knot", "AWS_SECRET_ACCESS_KEY": "knot-secret-key", "AWS_REGION": "us-east-1"}
# hidden 1024: the attention and FFN matrices are above the 1 MiB residency threshold (evictable);
# token_embd is Q4_K so the embedding rows exercise a K-quant.
SPEC = TinySpec(hidden=1024, ffn=1536, n_head=8, n_kv_head=2, overrides={"token_embd.weight": Q.Q4_K})


def knot_cli(run_dir, *args, timeout_s: float = 300, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """`knot cluster --run-dir run_dir ARGS` -> its exit code and output. Interrupted (Ctrl-C, a
    stopped test lane) or out of time, the CLI gets one SIGINT and up to 60 s to stop what it
    started. Why not subprocess.run: on any exception it SIGKILLs the CLI, and a `knot cluster up`
    killed halfway leaves the services and supervisor it had spawned (each in its own session)
    running with no state file for `down` to find; on SIGINT the launcher stops them itself."""
    cmd = [sys.executable, "-m", "deploy.cli", "cluster", "--run-dir", str(run_dir), *args]
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          cwd=compose_reader.REPO_ROOT, env=env) as p:
        try:
            out, err = p.communicate(timeout=timeout_s)
        except BaseException:
            p.send_signal(signal.SIGINT)
            try:
                p.communicate(timeout=60)
            except subprocess.TimeoutExpired:
                p.kill()
            raise
    return subprocess.CompletedProcess(cmd, p.returncode, out, err)


def pytest_collection_modifyitems(items):
    for item in items:
        if "tests/integration/" in str(item.fspath):
            item.add_marker(pytest.mark.integration)


@dataclass
class Knot:
    path: Path
    data: bytes
    header: object


@pytest.fixture(scope="session")
def run_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("run")


@pytest.fixture(scope="session")
def s3_server(run_dir):
    """SeaweedFS as the launcher starts it: with one S3 identity, the tests' CREDENTIALS, and no other."""
    s = servers.start_seaweedfs(run_dir / "seaweedfs", log_path=run_dir / "logs" / "seaweedfs.log",
                                access_key=CREDENTIALS["AWS_ACCESS_KEY_ID"],
                                secret_key=CREDENTIALS["AWS_SECRET_ACCESS_KEY"])
    yield s
    s.stop()


@dataclass(frozen=True)
class RedisServer:
    url: str  # redis://127.0.0.1:PORT/0, no password in it
    port: int
    password: str  # the test cluster's, generated as `knot cluster up` generates one
    pid: int

    def client(self) -> redis.Redis:
        return redis.Redis.from_url(self.url, password=self.password)


@pytest.fixture(scope="session")
def redis_server(run_dir):
    """A real Redis-protocol server that requires a password, like every cluster's."""
    password = cluster_secrets.ensure(run_dir / launcher.SECRETS_FILE)["KNOT_REDIS_PASSWORD"]
    s = servers.start_redis(run_dir / "redis", log_path=run_dir / "logs" / "redis.log", password=password)
    yield RedisServer(s.url, s.port, password, s.pid)
    s.stop()


@pytest.fixture(scope="session")
def cluster_env(redis_server, run_dir) -> dict[str, str]:
    """What the test clusters are planned with: the S3 credentials and the cluster's secrets (the
    Redis password; the internal calls' signing key, which docker-compose.yml requires). `http`
    signs the tests' own calls with that key, as the services sign theirs. The bucket's keys are
    CREDENTIALS: the ones the S3 server enforces (compose's MINIO_ROOT_* become every AWS_*)."""
    global _SECRET
    _SECRET = cluster_secrets.ensure(run_dir / launcher.SECRETS_FILE)["KNOT_INTERNAL_SECRET"]
    return {**CREDENTIALS, "MINIO_ROOT_USER": CREDENTIALS["AWS_ACCESS_KEY_ID"],
            "MINIO_ROOT_PASSWORD": CREDENTIALS["AWS_SECRET_ACCESS_KEY"],
            "KNOT_REDIS_PASSWORD": redis_server.password, "KNOT_INTERNAL_SECRET": _SECRET}


@pytest.fixture(scope="session")
def s3_settings(s3_server) -> S3Settings:
    return S3Settings(s3_server.url, CREDENTIALS["AWS_ACCESS_KEY_ID"], CREDENTIALS["AWS_SECRET_ACCESS_KEY"],
                      connect_timeout_s=2.0, read_timeout_s=10.0)


@pytest.fixture(scope="session")
def knot(tmp_path_factory) -> Knot:
    d = tmp_path_factory.mktemp("knot")
    path = d / "tiny.knot"
    encode(write_tiny_gguf(d / "tiny.gguf", SPEC), path, progress=False)
    data = path.read_bytes()
    return Knot(path, data, read_header_sync(lambda a, b: data[a:b], len(data)))


@pytest.fixture(scope="session")
def upload(s3_settings, knot):
    """upload(key) puts the test knot into the bucket under key (one key per test keeps tests apart)."""
    client = s3_client(s3_settings)
    client.create_bucket(Bucket=BUCKET)
    done = set()

    def put(key: str) -> str:
        if key not in done:
            client.upload_file(str(knot.path), BUCKET, key)
            done.add(key)
        return key

    return put


class Procs:
    """Project services as real processes, from the compose file's definitions."""

    def __init__(self, run_dir: Path, addresses: dict, specs: dict, env: dict[str, str]):
        self.run_dir, self.addresses, self.specs = run_dir, addresses, specs
        self.env = env  # what the specs were planned with (cluster_env)
        self.running: dict[str, launcher.Running] = {}

    def url(self, name: str) -> str:
        return f"http://127.0.0.1:{self.addresses[name][1]}"

    def start(self, name: str) -> launcher.Running:
        spec = self.specs[name]
        r = launcher.start_process(spec, self.addresses, self.run_dir)
        self.running[name] = r
        launcher.wait_ready(r, self.url(name) + "/readyz", timeout_s=60)
        return r

    def stop(self, name: str) -> None:
        """SIGTERM: graceful, the host drains wait_until work before exiting."""
        r = self.running.pop(name)
        servers.stop_pid(r.pid, launcher.PROCESS_STOP_TIMEOUT_S)

    def restart(self, name: str) -> None:
        self.stop(name)
        self.start(name)

    def stop_all(self) -> None:
        for name in list(self.running):
            self.stop(name)


def probe_spec(port_var: str, redis_password: str) -> compose_reader.ServiceSpec:
    env = {"KNOT_REDIS_PASSWORD": redis_password,
        "KNOT_SERVICE": "tests.integration.probe_service", "KNOT_SERVICE_NAME": "probe",
        "KNOT_DURABLE_OBJECTS": "Sequencer", "KNOT_BINDINGS": "KV,SEQUENCER,SELF",
        "KV": "redis://redis:6379/0?prefix=probe:", "SEQUENCER": f"do+http://{port_var}:8080/Sequencer",
        "SELF": f"http://{port_var}:8080", "PORT": "8080", "KNOT_SHUTDOWN_TIMEOUT_S": "20",
    }
    return compose_reader.ServiceSpec(port_var, "process", ["python", "-m", "deploy.cli", "serve"], env, 8080, {},
                               healthcheck_url="http://127.0.0.1:8080/readyz")


@pytest.fixture(scope="session")
def procs(run_dir, s3_server, redis_server, cluster_env, upload):
    """The wardens exactly as docker-compose.yml defines them, plus the probe service."""
    specs = {s.name: s for s in launcher.plan(launcher.default_layout(), cluster_env)}
    specs["probe"], specs["probe-2"] = (probe_spec("probe", redis_server.password),
                                        probe_spec("probe-2", redis_server.password))
    addresses = {"minio": (9000, s3_server.port), "redis": (6379, redis_server.port)}
    names = ["layer-warden", "cobordism-warden", "probe", "probe-2"]
    for name, port in zip(names, servers.free_ports(len(names))):
        addresses[name] = (8080, port)
    p = Procs(run_dir, addresses, specs, cluster_env)
    try:
        for name in ("layer-warden", "cobordism-warden", "probe"):
            p.start(name)
        yield p
    finally:
        p.stop_all()


_SECRET: str | None = None  # the test cluster's signing key (cluster_env), once it is planned
_NAMES: dict[str, str] = {}  # "127.0.0.1:PORT" -> the service there (ports are never handed out twice)


def service_at(url: str) -> str | None:
    """The name of the service listening at url's address (what a call to it is signed for), as its
    unsigned /healthz says; None when nothing answers there."""
    address = urlsplit(url).netloc
    if address not in _NAMES:
        try:
            with urllib.request.urlopen(f"http://{address}/healthz", timeout=5.0) as r:
                _NAMES[address] = json.loads(r.read())["service"]
        except (OSError, ValueError, KeyError):
            return None
    return _NAMES[address]


def signed_headers(method: str, url: str, body: bytes = b"", do_name: str = "", to: str | None = None) -> dict:
    """The X-Knot-Signature for one call with the test cluster's key, for the service at url (or `to`)."""
    u = urlsplit(url)
    signer = Signer(_SECRET, to or service_at(url))
    return {SIGNATURE_HEADER: signer.header(method, (u.path or "/") + (f"?{u.query}" if u.query else ""), body,
                                            do_name)}


def http(method: str, url: str, body: dict | bytes | None = None, headers: dict | None = None,
         timeout_s: float = 30.0, signed: bool = True) -> tuple[int, dict, bytes]:
    """One call. Signed with the test cluster's key for the service at url unless signed=False or the
    headers carry their own signature: its internal services refuse unsigned calls (the public
    coordinator ignores it)."""
    data = json.dumps(body).encode() if isinstance(body, dict) else body
    headers = dict(headers or {})
    if signed and _SECRET is not None and SIGNATURE_HEADER not in headers and service_at(url):
        headers.update(signed_headers(method, url, data or b"", headers.get(DO_NAME_HEADER, "")))
    req = urllib.request.Request(url, data=data, method=method, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as r:
            return r.status, dict(r.headers), r.read()
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), e.read()


def metric(url: str, name: str) -> float:
    """The sum of a service's /metrics samples of `name` (all labels)."""
    status, _, raw = http("GET", url + "/metrics")
    assert status == 200, raw
    total = 0.0
    for line in raw.decode().splitlines():
        if line.startswith(name) and line[len(name)] in " {":
            total += float(line.rsplit(" ", 1)[1])
    return total


def page_replica(coordinator_url: str, node: str) -> dict:
    """The first replica of a node ("shard 3", "station 1") in the coordinator's GET /cluster."""
    status, _, raw = http("GET", coordinator_url + "/cluster")
    assert status == 200, raw
    return next(n for n in json.loads(raw)["nodes"] if n["name"] == node)["replicas"][0]


PIPELINE = ["station-0", "station-1", *(f"shard-{i}" for i in range(8)), "coordinator"]


@contextmanager
def pipeline_services(procs: Procs, knot_path: Path, knot_key: str, overrides: dict[str, dict[str, str]] | None = None):
    """Add the pipeline services of the default layout, serving knot_key (already uploaded), to the
    running wardens (procs); overrides: service -> environment entries to change. Stops them after."""
    # What `knot cluster up --model PATH` derives from the model: the layer split, the shard bounds.
    layout = launcher.layout_for(launcher.choose_model(str(knot_path), {}))
    specs = {s.name: s for s in launcher.plan(layout, {**procs.env, "KNOT_KEY": knot_key})}
    for name, port in zip(PIPELINE, servers.free_ports(len(PIPELINE))):
        procs.specs[name] = specs[name]
        procs.specs[name].environment.update((overrides or {}).get(name, {}))
        procs.addresses[name] = (8080, port)
    started = []
    try:
        for name in PIPELINE:
            procs.start(name)
            started.append(name)
        yield procs
    finally:
        for name in reversed(started):
            if name in procs.running:
                procs.stop(name)
        for name in PIPELINE:  # a later module may start services of these names (its own layout)
            procs.specs.pop(name, None)
            procs.addresses.pop(name, None)
