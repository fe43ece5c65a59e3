"""Reading a compose document back into processes to start.

deploy/compose_writer.py renders the ClusterLayout as docker-compose.yml; `knot cluster up` (real
servers), `knot serve --embedded` (one process) and the integration tests plan their processes
from that same rendering (deploy.launcher.plan), so what runs here is what compose runs.

A service is one of:
- "local server": it carries `x-knot-local: seaweedfs | redis`; the launcher runs that server
  instead of the container image (SeaweedFS for minio, redis-server/valkey for redis);
- "process": built from our Dockerfile; its `command` runs as a local process with its
  `environment`, where every "{service}:{container_port}" address is rewritten to
  "127.0.0.1:{local_port}" and PORT/HOST are set to the local listen address.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

import yaml

from common.settings import read
from deploy.compose_writer import probe_url

REPO_ROOT = Path(__file__).resolve().parents[2]
COMPOSE_FILE = REPO_ROOT / "docker-compose.yml"
LOCAL_KINDS = {"seaweedfs": 9000, "redis": 6379}  # kind -> the container port it stands in for
CONDITIONS = ("service_started", "service_healthy", "service_completed_successfully")


class ComposeError(ValueError):
    pass


_VAR = re.compile(r"\$(?:\$|\{(?P<name>[A-Za-z_][A-Za-z0-9_]*)(?:(?P<op>:?[-?])(?P<default>[^}]*))?\})")


def interpolate(value: Any, env: Mapping[str, str]) -> Any:
    """Compose variable substitution: ${VAR}, ${VAR:-default}, ${VAR-default}, ${VAR:?error},
    ${VAR?error}, $$ -> $. A required variable that is missing raises ComposeError with its error."""
    if isinstance(value, str):
        def sub(m: re.Match) -> str:
            if m.group(0) == "$$":
                return "$"
            name, op, default = m.group("name"), m.group("op"), m.group("default")
            v = env.get(name)
            if (op == ":?" and not v) or (op == "?" and v is None):
                raise ComposeError(f"{name} is not set: {default}")
            if op == ":-" and not v:
                return default
            if op == "-" and v is None:
                return default
            return v or ""
        return _VAR.sub(sub, value)
    if isinstance(value, list):
        return [interpolate(v, env) for v in value]
    if isinstance(value, dict):
        return {k: interpolate(v, env) for k, v in value.items()}
    return value


def load(path: str | Path = COMPOSE_FILE, env: Mapping[str, str] | None = None) -> dict:
    """The compose document with YAML merge keys resolved and variables substituted."""
    raw = yaml.safe_load(Path(path).read_text())
    if not isinstance(raw, dict) or not isinstance(raw.get("services"), dict):
        raise ComposeError(f"{path}: no services")
    return interpolate(raw, dict(env or {}))


@dataclass
class ServiceSpec:
    name: str
    kind: str  # "process" | "seaweedfs" | "redis"
    command: list[str]
    environment: dict[str, str]
    container_port: int | None  # where it listens inside its container (PORT), if it serves
    depends_on: dict[str, str]  # service -> condition
    published_port: int | None = None  # host side of `ports:`, for the entry service
    oneshot: bool = False  # runs to completion (depends_on ... service_completed_successfully)
    healthcheck_url: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)


def _environment(svc: dict) -> dict[str, str]:
    env = svc.get("environment") or {}
    if isinstance(env, list):  # ["A=1", "B=2"]
        env = dict(e.split("=", 1) if "=" in e else (e, "") for e in env)
    return {str(k): "" if v is None else str(v) for k, v in env.items()}


def _depends_on(svc: dict) -> dict[str, str]:
    deps = svc.get("depends_on") or {}
    if isinstance(deps, list):
        return {d: "service_started" for d in deps}
    return {d: (c or {}).get("condition", "service_started") for d, c in deps.items()}


def _published(svc: dict) -> int | None:
    for p in svc.get("ports") or []:
        spec = str(p["published"]) if isinstance(p, dict) else str(p).rsplit(":", 1)[0].rsplit(":", 1)[-1]
        if spec.isdigit():
            return int(spec)
    return None


def _healthcheck_url(svc: dict) -> str | None:
    """The URL an HTTP healthcheck (compose_writer.http_probe) GETs, so the launcher can run the same check."""
    test = (svc.get("healthcheck") or {}).get("test") or []
    return probe_url(test) if isinstance(test, list) else None


def plan(doc: dict) -> list[ServiceSpec]:
    """Services in dependency order (a service after everything it depends on)."""
    services = doc["services"]
    specs: dict[str, ServiceSpec] = {}
    for name, svc in services.items():
        kind = svc.get("x-knot-local", "process")
        if kind != "process" and kind not in LOCAL_KINDS:
            raise ComposeError(f"service {name}: x-knot-local {kind!r} is not one of {sorted(LOCAL_KINDS)}")
        env = _environment(svc)
        command = svc.get("command") or []
        if isinstance(command, str):
            command = command.split()
        if kind == "process" and not command:
            raise ComposeError(f"service {name}: a process service needs a command")
        port = LOCAL_KINDS.get(kind) or read(env, "PORT", "host")  # where the host will listen
        specs[name] = ServiceSpec(name, kind, [str(c) for c in command], env, port, _depends_on(svc),
                                  _published(svc), healthcheck_url=_healthcheck_url(svc))
    for s in specs.values():
        for dep, cond in s.depends_on.items():
            if dep not in specs:
                raise ComposeError(f"service {s.name} depends on unknown service {dep}")
            if cond not in CONDITIONS:
                raise ComposeError(f"service {s.name}: depends_on {dep} condition {cond!r} is not one of {CONDITIONS}")
            if cond == "service_completed_successfully":
                specs[dep].oneshot = True
    order: list[str] = []
    visiting: set[str] = set()

    def visit(n: str) -> None:
        if n in order:
            return
        if n in visiting:
            raise ComposeError(f"dependency cycle through service {n}")
        visiting.add(n)
        for d in specs[n].depends_on:
            visit(d)
        visiting.discard(n)
        order.append(n)

    for n in specs:
        visit(n)
    return [specs[n] for n in order]


def rewrite_addresses(env: Mapping[str, str], addresses: Mapping[str, tuple[int, int]]) -> dict[str, str]:
    """Replace "service:container_port" by "127.0.0.1:local_port" in every value.

    addresses: service -> (container_port, local_port).
    """
    out = {}
    for k, v in env.items():
        for svc, (cport, lport) in addresses.items():
            v = re.sub(rf"(?<![\w.-]){re.escape(svc)}:{cport}(?!\d)", f"127.0.0.1:{lport}", v)
        out[k] = v
    return out
