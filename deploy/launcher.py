"""`knot cluster up|down|status`: the cluster layout's services as local processes.

The processes, their commands, environments and start order come from the ClusterLayout for the
model and the counts of stations and shards, rendered exactly as docker-compose.yml is
(deploy/compose_writer.py, read back by deploy/local/compose_reader.py): minio and redis become SeaweedFS
and a Redis-protocol server (deploy/servers.py), the init service runs to completion (fetch,
encode, upload), and every other service runs its command with its environment, "service:port"
addresses rewritten to 127.0.0.1.

Run directory (default .knot-run/, or KNOT_RUN_DIR):
    cluster.json         what is running: name, kind, pid, port, url, log, restarts; the supervisor's pid
    supervise.json       how the supervisor starts each service again (deploy/supervisor.py), mode 600
    secrets.env          the cluster's generated secrets (deploy/cluster_secrets.py), mode 600, reused
                         on every `up`; the Redis password reaches redis-server through a 0600 file
                         and the services through their environment, never argv or a log
    logs/<service>.log   one log per service
    seaweedfs/ redis/    server data (the bucket survives `down`, so only the first `up` uploads)
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import sys
import time
import urllib.request
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Mapping
from urllib.parse import urlsplit

from common import settings
from common.signing import SIGNATURE_HEADER
from common.topology import ClusterLayout, TopologyError
from deploy import cluster_secrets, compose_writer, servers, supervisor
from deploy.local import compose_reader
from deploy.local.probe import probe

log = logging.getLogger(__name__)

STATE_FILE = "cluster.json"
SECRETS_FILE = cluster_secrets.FILE_NAME
ONESHOT_TIMEOUT_S = 3600.0  # init may download and encode a model
READY_TIMEOUT_S = 120.0
PROCESS_STOP_TIMEOUT_S = 40.0  # above the host's 30 s wait_until drain


class LauncherError(RuntimeError):
    pass


@dataclass
class Running:
    name: str
    kind: str  # process | oneshot | seaweedfs | redis
    pid: int
    port: int | None
    url: str | None
    log: str
    published: bool = False
    stop_timeout_s: float = PROCESS_STOP_TIMEOUT_S
    restarts: int = 0  # by the supervisor (deploy/supervisor.py), since `up`
    restarted_at: float | None = None  # time.time() of the last restart


def shm_dir_for(run_dir: Path) -> Path:
    """The cluster's shared-memory directory (deploy/local/shm.py): in /dev/shm (tmpfs) where there is
    one, named after the run directory, so two clusters on one machine never share it."""
    tag = hashlib.sha256(str(run_dir.resolve()).encode()).hexdigest()[:12]
    return Path("/dev/shm") / f"knot-{tag}" if Path("/dev/shm").is_dir() else run_dir / "shm"


def default_run_dir() -> Path:
    return Path(settings.read(os.environ, "KNOT_RUN_DIR", "launcher") or compose_reader.REPO_ROOT / ".knot-run")


@dataclass(frozen=True)
class ModelChoice:
    source: str  # what the init job fetches (KNOT_MODEL): a registered name or an absolute path
    knot_key: str  # its object key: the name (or the file's stem) + ".knot"
    hparams: dict  # block_count and vocab_size: all the layout needs


def choose_model(model: str | None, env: Mapping[str, str]) -> ModelChoice:
    """--model NAME|PATH, else KNOT_MODEL, else the default model."""
    from deploy import models

    name = model or settings.read(env, "KNOT_MODEL", "launcher") or models.DEFAULT_MODEL
    p = Path(name).expanduser()
    if p.is_file():
        from deploy.knotfile import open_model

        hp = open_model(p).header.hparams
        return ModelChoice(str(p.resolve()), p.stem + ".knot", {"block_count": int(hp["block_count"]),
                                                                "vocab_size": int(hp["vocab_size"])})
    if name in models.MODELS:
        spec = models.MODELS[name]
        return ModelChoice(name, name + ".knot", {"block_count": spec.block_count, "vocab_size": spec.vocab_size})
    raise LauncherError(f"--model {name}: neither a file nor a known model ({', '.join(models.MODELS)})")


def model_digest(source: str) -> str:
    """The digest of the knot init uploads for a model (fetched and encoded first if needed, as init
    would): what KNOT_DIGEST pins every service to."""
    from common.knot import read_header_sync
    from deploy import models

    with open(models.ensure_knot(source), "rb") as f:
        def read_range(a: int, b: int) -> bytes:
            f.seek(a)
            return f.read(b - a)

        return read_header_sync(read_range).digest


def layout_for(choice: ModelChoice, n_stations: int = 2, n_shards: int = 8,
               draft: ModelChoice | None = None, replicas: int = 1) -> ClusterLayout:
    """The cluster for a model (and a draft model's drafter); TopologyError (a clear message) when the
    counts do not fit it, or the draft model's vocabulary is not the model's."""
    if draft is not None and draft.hparams["vocab_size"] != choice.hparams["vocab_size"]:
        raise TopologyError(f"draft model {draft.source}: a vocabulary of {draft.hparams['vocab_size']} tokens, "
                            f"the model's is {choice.hparams['vocab_size']}: it must share the tokenizer")
    return ClusterLayout.build(choice.hparams, n_stations, n_shards, knot_key=choice.knot_key,
                               model_source=choice.source, draft_knot_key=draft and draft.knot_key,
                               draft_source=draft.source if draft else "", replicas=replicas)


def default_layout() -> ClusterLayout:
    """The committed docker-compose.yml's: the default model on 2 stations and 8 shards."""
    return layout_for(choose_model(None, {}))


def available_memory_bytes() -> int | None:
    """MemAvailable of /proc/meminfo (None where there is none)."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def profile_env(profile: str | None, env: Mapping[str, str], n_stations: int) -> dict[str, str]:
    """KNOT_PROFILE for every station (--profile wins over the environment), and for the resident
    profile the cap the host can afford: 3/4 of its available memory shared by the stations."""
    out = {"KNOT_PROFILE": profile or settings.read(env, "KNOT_PROFILE", "launcher")}
    if out["KNOT_PROFILE"] == "resident" and settings.read(env, "KNOT_RESIDENT_MAX_BYTES", "launcher") is None:
        avail = available_memory_bytes()
        if avail is not None:
            out["KNOT_RESIDENT_MAX_BYTES"] = str(avail * 3 // 4 // n_stations)
    return out


def plan(layout: ClusterLayout, env: Mapping[str, str]) -> list[compose_reader.ServiceSpec]:
    """The layout's services as processes to start, in dependency order: the compose file it renders,
    with its ${VAR:-default} substituted from env (as docker compose does)."""
    return compose_reader.plan(compose_reader.interpolate(compose_writer.render(layout), env))


def resolve_command(command: list[str]) -> list[str]:
    """The container's `python` is this interpreter locally."""
    if command and command[0] in ("python", "python3"):
        return [sys.executable, *command[1:]]
    return list(command)


def named_peers(environment: Mapping[str, str], addresses: Mapping[str, tuple[int, int]]) -> dict[str, str]:
    """The service's bindings to other services (http:// and do+http://) at 127.0.0.1:PORT, each with
    its peer's name as #NAME: the destination its calls are signed for (common/signing.py), which
    the rewritten address no longer says."""
    out = {}
    for name in settings.read(environment, "KNOT_BINDINGS", "launcher"):
        url = environment.get(name, "")
        if "#" in url or not url.startswith(("http://", "https://", "do+http://")):
            continue
        peer = urlsplit(url.removeprefix("do+")).hostname
        if peer in addresses:
            out[name] = compose_reader.rewrite_addresses({name: url}, addresses)[name] + f"#{peer}"
    return out


def process_env(spec: compose_reader.ServiceSpec, addresses: Mapping[str, tuple[int, int]], port: int | None,
                base_env: Mapping[str, str]) -> dict[str, str]:
    from deploy import models

    env = dict(base_env)
    env.update(compose_reader.rewrite_addresses(spec.environment, addresses))
    env.update(named_peers(spec.environment, addresses))
    if "KNOT_CACHE_DIR" in spec.environment:
        # The init container's cache is its volume (model-cache:/cache), a path that does not exist
        # here: a local process uses the local model cache, where `knot fetch-model` put the model.
        env["KNOT_CACHE_DIR"] = str(models.cache_dir())
    if port is not None:
        env["PORT"], env["HOST"] = str(port), "127.0.0.1"
    env["KNOT_SERVICE_NAME"] = settings.read(env, "KNOT_SERVICE_NAME", "host") or spec.name
    path = settings.read(base_env, "PYTHONPATH", "launcher")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(compose_reader.REPO_ROOT), path) if p)
    return env


def process_recipe(spec: compose_reader.ServiceSpec, addresses: Mapping[str, tuple[int, int]], run_dir: Path,
                   base_env: Mapping[str, str] | None = None) -> dict:
    """How one compose service runs as a local process: argv, environment, cwd, log (deploy/supervisor.py)."""
    port = addresses[spec.name][1] if spec.name in addresses else None
    return {"kind": "process", "argv": resolve_command(spec.command), "cwd": str(compose_reader.REPO_ROOT),
            "env": process_env(spec, addresses, port, base_env if base_env is not None else os.environ),
            "log": str(run_dir / "logs" / f"{spec.name}.log")}


def start_process(spec: compose_reader.ServiceSpec, addresses: Mapping[str, tuple[int, int]], run_dir: Path,
                  base_env: Mapping[str, str] | None = None) -> Running:
    """Spawn one compose service as a local process (used by `up` and by the integration tests)."""
    port = addresses[spec.name][1] if spec.name in addresses else None
    recipe = process_recipe(spec, addresses, run_dir, base_env)
    log_path = Path(recipe["log"])
    pid = supervisor.start(recipe)
    url = f"http://127.0.0.1:{port}" if port else None
    return Running(spec.name, "oneshot" if spec.oneshot else "process", pid, port, url, str(log_path),
                   published=spec.published_port is not None)


def wait_exit(pid: int, timeout_s: float) -> int:
    """Exit status of our child pid (waits at most timeout_s)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        time.sleep(0.1)
    raise LauncherError(f"pid {pid} still running after {timeout_s:.0f} s")


def wait_ready(r: Running, url: str, timeout_s: float = READY_TIMEOUT_S) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not servers.pid_alive(r.pid):
            raise LauncherError(f"{r.name} exited during startup; {r.log}:\n{servers.tail(Path(r.log))}")
        if probe(url, timeout_s=2.0):
            return
        time.sleep(0.2)
    raise LauncherError(f"{r.name} not ready at {url} after {timeout_s:.0f} s; {r.log}:\n{servers.tail(Path(r.log))}")


class Cluster:
    def __init__(self, run_dir: Path | None = None):
        self.run_dir = Path(run_dir or default_run_dir())
        self.state_path = self.run_dir / STATE_FILE

    # -------------------------------------------------------- state

    def _load(self) -> list[Running]:
        if not self.state_path.exists():
            return []
        return [Running(**r) for r in json.loads(self.state_path.read_text())["services"]]

    def _save(self, running: list[Running], layout: ClusterLayout, supervisor_pid: int | None = None) -> None:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        tmp = self.state_path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"layout": {"stations": len(layout.stations), "shards": len(layout.shards),
                                              "replicas": layout.replicas},
                                   "supervisor": supervisor_pid,
                                   "services": [asdict(r) for r in running]}, indent=2))
        os.replace(tmp, self.state_path)

    def supervisor_pid(self) -> int | None:
        if not self.state_path.exists():
            return None
        return json.loads(self.state_path.read_text()).get("supervisor")

    # -------------------------------------------------------- up

    def allocate(self, specs: list[compose_reader.ServiceSpec], base_port: int | None) -> dict[str, tuple[int, int]]:
        """service -> (container_port, local_port); published services keep their host port."""
        serving = [s for s in specs if s.container_port is not None and not s.oneshot]
        free = servers.free_ports(len(serving)) if base_port is None else []
        out = {}
        for i, s in enumerate(serving):
            if s.published_port is not None and base_port is None:
                local = s.published_port
                # Why check: a service that cannot bind exits, but its readiness probe would be
                # answered by whatever holds the port, and `up` would call that the cluster.
                if not servers.port_is_free(local):
                    raise LauncherError(f"port {local} ({s.name}'s published port, KNOT_PORT) is in use by another "
                                        f"process: stop it, or choose another with KNOT_PORT=PORT")
            else:
                local = base_port + i if base_port is not None else free[i]
            out[s.name] = (s.container_port, local)
        return out

    def up(self, model: str | None = None, base_port: int | None = None, env: Mapping[str, str] | None = None,
           n_stations: int = 2, n_shards: int = 8, profile: str | None = None, replicas: int = 1,
           draft_model: str | None = None) -> list[Running]:
        base_env = dict(os.environ if env is None else env)
        choice = choose_model(model, base_env)
        draft = choose_model(draft_model, {}) if draft_model else None
        # before anything starts: counts that do not fit fail here
        layout = layout_for(choice, n_stations, n_shards, draft, replicas)
        base_env.update(profile_env(profile, base_env, len(layout.stations) * replicas))
        if draft is not None:
            base_env["KNOT_DRAFT_MODEL"] = draft.source
        if "KNOT_SHM_DIR" not in base_env:  # set empty, it stays off
            base_env["KNOT_SHM_DIR"] = str(shm_dir_for(self.run_dir))
        alive = [r for r in self._load() if r.kind != "oneshot" and servers.pid_alive(r.pid)]
        if alive:
            raise LauncherError(f"cluster already up ({', '.join(f'{r.name}={r.pid}' for r in alive)}); "
                                f"run `knot cluster down` first")
        if model:  # --model wins over KNOT_MODEL; an explicit KNOT_KEY still wins over the model's key
            base_env["KNOT_MODEL"] = choice.source
        if not settings.read(base_env, "KNOT_DIGEST", "launcher"):  # the knot every service serves, init uploads
            digest = base_env["KNOT_DIGEST"] = model_digest(choice.source)
            log.info("%s: knot digest %s (KNOT_DIGEST)", choice.source, digest)
        kept = cluster_secrets.ensure(self.run_dir / SECRETS_FILE)
        for name, secret in kept.items():
            if not base_env.get(name):  # one set in the environment wins, as over compose's .env
                base_env[name] = secret
        chosen = {name: base_env[name] for name in kept}
        shm = settings.read(base_env, "KNOT_SHM_DIR", "launcher")
        if shm:
            Path(shm).mkdir(mode=0o700, parents=True, exist_ok=True)
        if chosen != kept:  # the supervisor restarts services with the file's: it holds what they run with
            cluster_secrets.write(self.run_dir / SECRETS_FILE, {**cluster_secrets.read(self.run_dir / SECRETS_FILE),
                                                                **chosen})
        specs = plan(layout, base_env)
        addresses = self.allocate(specs, base_port)
        running: list[Running] = []
        recipes: dict[str, dict] = {}
        try:
            for spec in specs:
                r = self._start(spec, addresses, base_env)
                running.append(r)
                self._save(running, layout)
                log.info("started %s (pid %d%s)", r.name, r.pid, f", port {r.port}" if r.port else "")
                if spec.oneshot:
                    code = wait_exit(r.pid, ONESHOT_TIMEOUT_S)
                    if code != 0:
                        raise LauncherError(f"{spec.name} exited with status {code}; {r.log}:\n"
                                            f"{servers.tail(Path(r.log))}")
                elif spec.kind == "process" and spec.healthcheck_url:
                    cport, lport = addresses[spec.name]
                    wait_ready(r, spec.healthcheck_url.replace(f"127.0.0.1:{cport}", f"127.0.0.1:{lport}"))
                if not spec.oneshot:
                    recipes[spec.name] = self._recipe(spec, addresses, base_env)
            supervisor.write_recipes(self.run_dir, recipes)
            pid = servers.spawn([sys.executable, "-m", "deploy.supervisor", str(self.run_dir)],
                                self.run_dir / "logs" / "supervisor.log", env=dict(base_env),
                                cwd=str(compose_reader.REPO_ROOT))
            self._save(running, layout, supervisor_pid=pid)
        except BaseException:
            self._stop_all(running)
            self.state_path.unlink(missing_ok=True)
            raise
        return running

    def _recipe(self, spec: compose_reader.ServiceSpec, addresses: Mapping[str, tuple[int, int]],
                base_env: Mapping[str, str]) -> dict:
        """How the supervisor starts it again: the same command, environment, port and log. The
        secrets' values are not in it (the supervisor reads them from secrets.env): for each variable
        that holds one (AWS_SECRET_ACCESS_KEY holds MINIO_ROOT_PASSWORD's), the secret's name."""
        log_path = str(self.run_dir / "logs" / f"{spec.name}.log")
        if spec.kind in ("seaweedfs", "redis"):
            return {"kind": spec.kind, "dir": str(self.run_dir / spec.kind), "port": addresses[spec.name][1],
                    "log": log_path}
        recipe = process_recipe(spec, addresses, self.run_dir, base_env)
        secret_names = {base_env[n]: n for n in cluster_secrets.SECRETS if base_env.get(n)}
        recipe["secrets"] = {k: secret_names[v] for k, v in recipe["env"].items() if v in secret_names}
        recipe["env"] = {k: v for k, v in recipe["env"].items() if v not in secret_names}
        return recipe

    def _start(self, spec: compose_reader.ServiceSpec, addresses: Mapping[str, tuple[int, int]],
               base_env: Mapping[str, str]) -> Running:
        log_path = self.run_dir / "logs" / f"{spec.name}.log"
        if spec.kind == "seaweedfs":  # closed: the keys compose gives MinIO (the cluster's, secrets.env)
            s = servers.start_seaweedfs(self.run_dir / "seaweedfs", addresses[spec.name][1], log_path,
                                        access_key=settings.read(base_env, "MINIO_ROOT_USER", "launcher"),
                                        secret_key=settings.read(base_env, "MINIO_ROOT_PASSWORD", "launcher"))
        elif spec.kind == "redis":
            s = servers.start_redis(self.run_dir / "redis", addresses[spec.name][1], log_path,
                                    password=settings.read(base_env, "KNOT_REDIS_PASSWORD", "launcher"))
        else:
            return start_process(spec, addresses, self.run_dir, base_env)
        return Running(spec.name, spec.kind, s.pid, s.port, s.url, s.log_path, stop_timeout_s=s.stop_timeout_s)

    def memory_lines(self, running: list[Running]) -> list[str]:
        """One line per station: its profile, budget, whether its layers fit, bytes streamed per token."""
        from services.station.station_memory import MemoryPlan, describe_plan, expected_tok_s

        lines, plans = [], []
        for r in running:
            if not r.name.startswith("station-") or not r.url:
                continue
            try:
                req = urllib.request.Request(r.url + "/stats", headers=self.signed("GET", r.url + "/stats"))
                with urllib.request.urlopen(req, timeout=10.0) as resp:  # an internal call: signed
                    s = json.loads(resp.read())
            except (OSError, ValueError) as e:
                lines.append(f"{r.name}: GET /stats failed ({e}); its log has the memory line: {r.log}")
                continue
            m = {k: v for k, v in s["memory"].items() if k in MemoryPlan.__dataclass_fields__}
            plans.append(MemoryPlan(**m))
            lines.append(describe_plan(r.name, (s["layer_start"], s["layer_end"]), plans[-1]))
        streamed = sum(p.streamed_bytes_per_token for p in plans)
        if streamed:  # the stations run in series: their streams add up per token
            lines.append(f"the stations stream ~{streamed / 1e6:.0f} MB per token: expect about "
                         f"{expected_tok_s(streamed):.1f} tok/s decode" +
                         (" (--profile resident keeps the layers)" if any(p.profile == "worker" for p in plans) else ""))
        return lines

    def signed(self, method: str, url: str, body: bytes = b"") -> dict[str, str]:
        """Headers that let a tool call one of this cluster's internal services directly (a station's
        /stats, say): its signature with the cluster's secret, for the service cluster.json lists at
        url's port; {} when the cluster has no secret."""
        from deploy.local.server_bindings import Signer

        path = self.run_dir / SECRETS_FILE
        secret = cluster_secrets.read(path).get("KNOT_INTERNAL_SECRET") if path.exists() else None
        if not secret:
            return {}
        u = urlsplit(url)
        names = [r.name for r in self._load() if r.port is not None and r.port == u.port]
        if not names:
            raise LauncherError(f"{url}: no service of the cluster in {self.run_dir} listens on port {u.port}")
        return {SIGNATURE_HEADER: Signer(secret, names[0]).header(method, (u.path or "/") +
                                                                  (f"?{u.query}" if u.query else ""), body)}

    # -------------------------------------------------------- down / status

    def _stop_all(self, running: list[Running]) -> list[str]:
        stopped = []
        for r in reversed(running):
            if r.kind == "oneshot" or not servers.pid_alive(r.pid):
                continue
            servers.stop_pid(r.pid, r.stop_timeout_s)
            stopped.append(r.name)
        return stopped

    def reload(self, model: str | None = None, env: Mapping[str, str] | None = None, **up_args) -> list[Running]:
        """Serve another knot (or the bucket's new one): down, then up with KNOT_DIGEST the model's, so
        init uploads it unless the bucket holds it already and every service is pinned to it."""
        base_env = {k: v for k, v in (os.environ if env is None else env).items() if k != "KNOT_DIGEST"}
        self.down()
        return self.up(model, env=base_env, **up_args)

    def down(self) -> list[str]:
        sup = self.supervisor_pid()
        if sup and servers.pid_alive(sup):  # first, or it would start again what is stopped next
            servers.stop_pid(sup, 10.0)
        stopped = self._stop_all(self._load())
        self.state_path.unlink(missing_ok=True)
        # reply buffers a killed process could not unlink (the hosts unlink theirs as connections close)
        shutil.rmtree(shm_dir_for(self.run_dir), ignore_errors=True)
        return stopped

    def status(self) -> list[dict]:
        out = []
        for r in self._load():
            alive = servers.pid_alive(r.pid)
            if r.kind == "oneshot":
                state = "done"
            elif not alive:
                state = "dead"
            elif r.kind == "process" and r.url:
                state = "ready" if probe(r.url + "/readyz", 2.0) else ("up" if probe(r.url + "/healthz") else "unhealthy")
            else:
                state = "up"
            out.append({**asdict(r), "state": state})
        return out
