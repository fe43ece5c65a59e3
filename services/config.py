"""Reading a service's configuration from env (Starlette-Config style): missing or invalid values
fail at boot with a message that names the variable. A misconfigured service is not ready (503)."""
from __future__ import annotations

from common.runtime import Env, ServiceUnavailable

_MISSING = object()


def var(env: Env, name: str, default: object = _MISSING) -> str:
    value = env.get(name)
    if value is None or str(value) == "":
        if default is _MISSING:
            raise ServiceUnavailable(f"config {name!r} is missing, and has no default")
        return str(default)
    return str(value)


def int_var(env: Env, name: str, default: object = _MISSING) -> int:
    text = var(env, name, default)
    try:
        return int(text)
    except ValueError:
        raise ServiceUnavailable(f"config {name}={text!r} is not an integer") from None


def float_var(env: Env, name: str, default: object = _MISSING) -> float:
    text = var(env, name, default)
    try:
        return float(text)
    except ValueError:
        raise ServiceUnavailable(f"config {name}={text!r} is not a number") from None
