"""Host settings from an injected mapping (os.environ locally; docker-compose.yml sets the same names).

Every variable is declared in common/settings.py (docs/configuration.md lists them); this module
turns the host's into HostSettings and says which binding URL schemes exist:

    s3://BUCKET                      R2-like bucket on S3 (MinIO, SeaweedFS)
    dir:PATH                         a directory as the bucket (embedded)
    redis://HOST:PORT/DB[?prefix=P]  KV namespace on Redis, keys under P (default "NAME:")
    memory:                          in-process KV (embedded)
    do+http://HOST:PORT/CLASS        Durable Object namespace hosted by another process
    do+local:CLASS                   Durable Object namespace hosted by this process
    http://HOST:PORT                 service binding to another service

An http or do+http URL may end in #NAME: the peer's service name, which its calls are signed for
(common/signing.py; never sent). Without one, the host name is (docker-compose.yml's service
names); `knot cluster up` adds #NAME where it rewrites a service's address to 127.0.0.1:PORT.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Mapping
from urllib.parse import urlsplit

from common.settings import ConfigError, read
from deploy.local.server_bindings import S3Settings

__all__ = ["BINDING_SCHEMES", "BindingURL", "ConfigError", "HostSettings", "binding_scheme", "open_binding",
           "parse_binding"]

BINDING_SCHEMES = {
    "s3": "bucket", "dir": "bucket",
    "redis": "kv", "memory": "kv",
    "do+http": "durable_object", "do+local": "durable_object",
    "http": "service", "https": "service",
}


@dataclass(frozen=True)
class BindingURL:
    """A binding URL taken apart: the one parser of the schemes above. `open_binding` turns it into
    an object through the host's own constructors (real servers, or embedded stand-ins)."""

    name: str  # the variable, e.g. "LAYER_WARDEN"
    url: str
    scheme: str  # a key of BINDING_SCHEMES
    target: str  # s3: the bucket; dir: the path; do+*: the class; redis: the URL without its query; http: the URL
    host: str | None = None  # the server or peer: redis, do+http, http(s)
    base_url: str = ""  # do+http: the hosting process's URL
    peer: str = ""  # http(s), do+http: the service the calls go to (#NAME, else the host name)
    prefix: str = ""  # redis, memory: where this binding's keys live


def parse_binding(name: str, url: str) -> BindingURL:
    scheme = binding_scheme(name, url)
    rest = url.partition(":")[2]
    if scheme == "s3":
        return BindingURL(name, url, scheme, rest.strip("/"))
    if scheme in ("dir", "do+local"):
        return BindingURL(name, url, scheme, rest)
    if scheme in ("redis", "memory"):
        base, _, query = url.partition("?")
        params = dict(p.split("=", 1) for p in query.split("&") if "=" in p)
        return BindingURL(name, url, scheme, base, urlsplit(base).hostname, prefix=params.get("prefix", f"{name}:"))
    address, _, peer = url.partition("#")
    host = urlsplit(address.removeprefix("do+")).hostname
    if scheme == "do+http":
        base_url, _, class_name = address.removeprefix("do+").rpartition("/")
        return BindingURL(name, url, scheme, class_name, host, base_url, peer=peer or host or "")
    return BindingURL(name, url, scheme, address, host, peer=peer or host or "")


def open_binding(name: str, url: str, openers: Mapping[str, Callable[[BindingURL], Any]]) -> Any:
    """The binding object for `url`: openers maps each scheme to the host's constructor."""
    b = parse_binding(name, url)
    opener = openers.get(b.scheme)
    if opener is None:
        raise ConfigError(f"binding {name}={url!r}: this host cannot open {b.scheme} bindings", name=name)
    return opener(b)


def binding_scheme(name: str, url: str) -> str:
    scheme = url.partition(":")[0].lower()
    if scheme not in BINDING_SCHEMES:
        raise ConfigError(f"binding {name}={url!r}: unknown scheme {scheme!r} "
                          f"(known: {', '.join(sorted(BINDING_SCHEMES))})", name=name)
    return scheme


@dataclass(frozen=True)
class HostSettings:
    service: str
    name: str
    host: str
    port: int
    durable_objects: tuple[str, ...]
    bindings: dict[str, str]
    vars: dict[str, str]
    s3: S3Settings
    call_timeout_s: float
    shutdown_timeout_s: float
    log_format: str
    access_log: str
    max_body_bytes: int | None  # None: the service module's MAX_BODY_BYTES (deploy/local/host.py)
    http_server: str = "lean"  # lean: internal services without Durable Objects on deploy/local/lean_http.py
    redis_password: str | None = field(default=None, repr=False)  # a secret: kept out of repr and logs
    internal_secret: str | None = field(default=None, repr=False)  # a secret: kept out of repr and logs
    shm_dir: str | None = None  # large replies through shared memory (deploy/local/shm.py)
    header_timeout_s: float = 60.0  # a request's line and headers, from the connection's start or last reply
    body_timeout_s: float = 60.0  # a request's body, from its headers
    otlp_endpoint: str | None = None  # traces to an OpenTelemetry collector (deploy/otlp.py); None: none leave

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> "HostSettings":
        """ConfigError (common/settings.py) naming the variable when one is missing or invalid."""
        def get(key: str):
            return read(env, key, "host")

        service = get("KNOT_SERVICE")
        bindings = {}
        for n in get("KNOT_BINDINGS"):
            url = env.get(n)  # any name the service binds (the table declares the project's)
            if not url:
                raise ConfigError(f"Config {n!r} is listed in KNOT_BINDINGS but is missing, and has no default.",
                                  name=n)
            binding_scheme(n, url)
            bindings[n] = url
        variables = {}
        for n in get("KNOT_VARS"):
            if n not in env:
                raise ConfigError(f"Config {n!r} is listed in KNOT_VARS but is missing, and has no default.", name=n)
            variables[n] = env[n]
        return cls(
            service=service,
            name=get("KNOT_SERVICE_NAME") or service.rsplit(".", 1)[-1],
            host=get("HOST"),
            port=get("PORT"),
            durable_objects=get("KNOT_DURABLE_OBJECTS"),
            bindings=bindings,
            vars=variables,
            s3=S3Settings(get("S3_ENDPOINT_URL"), get("AWS_ACCESS_KEY_ID"), get("AWS_SECRET_ACCESS_KEY"),
                          get("AWS_REGION"), get("S3_CONNECT_TIMEOUT_S"), get("S3_READ_TIMEOUT_S")),
            call_timeout_s=get("KNOT_CALL_TIMEOUT_S"),
            shutdown_timeout_s=get("KNOT_SHUTDOWN_TIMEOUT_S"),
            log_format=get("KNOT_LOG_FORMAT"),
            access_log=get("KNOT_ACCESS_LOG"),
            max_body_bytes=get("KNOT_MAX_BODY_BYTES"),
            http_server=get("KNOT_HTTP_SERVER"),
            redis_password=redis_password(bindings, get("KNOT_REDIS_PASSWORD")),
            internal_secret=get("KNOT_INTERNAL_SECRET"),
            shm_dir=get("KNOT_SHM_DIR") or None,
            header_timeout_s=get("KNOT_HEADER_TIMEOUT_S"),
            body_timeout_s=get("KNOT_BODY_TIMEOUT_S"),
            otlp_endpoint=get("OTEL_EXPORTER_OTLP_ENDPOINT") or None,
        )

    def handler_vars(self) -> dict[str, str]:
        """The handler's plain vars: KNOT_VARS, and the internal secret its caches are keyed with."""
        return {**self.vars, **({"KNOT_INTERNAL_SECRET": self.internal_secret} if self.internal_secret else {})}


def redis_password(bindings: Mapping[str, str], password: str | None) -> str | None:
    """The cluster's Redis requires a password: a redis:// binding without one fails at start."""
    uses = [n for n, url in bindings.items() if binding_scheme(n, url) == "redis"]
    if uses and not password:
        raise ConfigError(f"Config 'KNOT_REDIS_PASSWORD' is missing: {', '.join(uses)} bind Redis, which "
                          f"requires the cluster's password (deploy/cluster_secrets.py)", name="KNOT_REDIS_PASSWORD")
    return password
