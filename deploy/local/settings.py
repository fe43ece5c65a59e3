"""Host settings from an injected mapping (os.environ locally; docker-compose.yml sets the same names).

    KNOT_SERVICE           handler module, e.g. services.layer_warden            (required)
    KNOT_SERVICE_NAME      label in logs                                          (default: module's last part)
    KNOT_DURABLE_OBJECTS   comma list of the module's DURABLE_OBJECTS this process hosts
    KNOT_BINDINGS          comma list of variable names that hold binding URLs (schemes below)
    KNOT_VARS              comma list of variable names passed to the handler as plain vars
    HOST, PORT             listen address                                          (0.0.0.0, 8080)
    S3_ENDPOINT_URL, AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_REGION          for s3:// bindings
    S3_CONNECT_TIMEOUT_S, S3_READ_TIMEOUT_S, KNOT_CALL_TIMEOUT_S, KNOT_SHUTDOWN_TIMEOUT_S
    KNOT_LOG_FORMAT        json | text                                              (json)
    KNOT_ACCESS_LOG        all | errors: log every request at INFO, or only 4xx/5xx  (all)
                           (the rest at DEBUG: internal hops run ~10 requests per token)

Binding URL schemes (the value of each variable named in KNOT_BINDINGS):
    s3://BUCKET                      R2-like bucket on S3 (MinIO, SeaweedFS)
    dir:PATH                         a directory as the bucket (embedded)
    redis://HOST:PORT/DB[?prefix=P]  KV namespace on Redis, keys under P (default "NAME:")
    memory:                          in-process KV (embedded)
    do+http://HOST:PORT/CLASS        Durable Object namespace hosted by another process
    do+local:CLASS                   Durable Object namespace hosted by this process
    http://HOST:PORT                 service binding to another service
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping

from deploy.local.bindings import S3Settings

BINDING_SCHEMES = {
    "s3": "bucket", "dir": "bucket",
    "redis": "kv", "memory": "kv",
    "do+http": "durable_object", "do+local": "durable_object",
    "http": "service", "https": "service",
}


class ConfigError(ValueError):
    pass


def binding_scheme(name: str, url: str) -> str:
    scheme = url.partition(":")[0].lower()
    if scheme not in BINDING_SCHEMES:
        raise ConfigError(f"binding {name}={url!r}: unknown scheme {scheme!r} "
                          f"(known: {', '.join(sorted(BINDING_SCHEMES))})")
    return scheme


def _names(value: str) -> tuple[str, ...]:
    return tuple(n.strip() for n in value.split(",") if n.strip())


@dataclass(frozen=True)
class HostSettings:
    service: str
    name: str
    host: str = "0.0.0.0"
    port: int = 8080
    durable_objects: tuple[str, ...] = ()
    bindings: dict[str, str] = field(default_factory=dict)
    vars: dict[str, str] = field(default_factory=dict)
    s3: S3Settings = S3Settings(None, None, None)
    call_timeout_s: float = 30.0
    shutdown_timeout_s: float = 30.0
    log_format: str = "json"
    access_log: str = "all"
    max_body_bytes: int = 256 << 20

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> "HostSettings":
        def need(key: str) -> str:
            v = env.get(key)
            if not v:
                raise ConfigError(f"Config {key!r} is missing, and has no default.")
            return v

        def number(key: str, default: float, kind=float):
            raw = env.get(key)
            if raw in (None, ""):
                return default
            try:
                v = kind(raw)
            except ValueError:
                raise ConfigError(f"Config {key!r} must be a number, got {raw!r}") from None
            if v <= 0:
                raise ConfigError(f"Config {key!r} must be > 0, got {raw!r}")
            return v

        service = need("KNOT_SERVICE")
        bindings = {}
        for n in _names(env.get("KNOT_BINDINGS", "")):
            url = env.get(n)
            if not url:
                raise ConfigError(f"Config {n!r} is listed in KNOT_BINDINGS but is missing, and has no default.")
            binding_scheme(n, url)
            bindings[n] = url
        variables = {}
        for n in _names(env.get("KNOT_VARS", "")):
            if n not in env:
                raise ConfigError(f"Config {n!r} is listed in KNOT_VARS but is missing, and has no default.")
            variables[n] = env[n]
        fmt = env.get("KNOT_LOG_FORMAT", "json")
        if fmt not in ("json", "text"):
            raise ConfigError(f"Config 'KNOT_LOG_FORMAT' must be json or text, got {fmt!r}")
        access = env.get("KNOT_ACCESS_LOG", "all")
        if access not in ("all", "errors"):
            raise ConfigError(f"Config 'KNOT_ACCESS_LOG' must be all or errors, got {access!r}")
        return cls(
            service=service,
            name=env.get("KNOT_SERVICE_NAME") or service.rsplit(".", 1)[-1],
            host=env.get("HOST", "0.0.0.0"),
            port=int(number("PORT", 8080, int)),
            durable_objects=_names(env.get("KNOT_DURABLE_OBJECTS", "")),
            bindings=bindings,
            vars=variables,
            s3=S3Settings(env.get("S3_ENDPOINT_URL") or None, env.get("AWS_ACCESS_KEY_ID") or None,
                          env.get("AWS_SECRET_ACCESS_KEY") or None, env.get("AWS_REGION", "us-east-1"),
                          number("S3_CONNECT_TIMEOUT_S", 5.0), number("S3_READ_TIMEOUT_S", 30.0)),
            call_timeout_s=number("KNOT_CALL_TIMEOUT_S", 30.0),
            shutdown_timeout_s=number("KNOT_SHUTDOWN_TIMEOUT_S", 30.0),
            log_format=fmt,
            access_log=access,
            max_body_bytes=int(number("KNOT_MAX_BODY_BYTES", 256 << 20, int)),
        )
