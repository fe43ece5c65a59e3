"""Structured logs: one JSON object per line, with the service name and the request id.

The request id lives in a contextvar set by the host's middleware; asyncio copies contextvars
into tasks, so wait_until work logs the id of the request that started it.
"""
from __future__ import annotations

import contextvars
import json
import logging
import sys
import time
import uuid

request_id_var: contextvars.ContextVar[str | None] = contextvars.ContextVar("request_id", default=None)
# Set per request by the host, so one process hosting many services (--embedded) labels each line.
service_var: contextvars.ContextVar[str | None] = contextvars.ContextVar("service", default=None)
REQUEST_ID_HEADER = "X-Request-Id"

# LogRecord attributes that are not user-supplied `extra` fields.
_STANDARD = set(vars(logging.LogRecord("", 0, "", 0, "", None, None))) | {"message", "asctime", "taskName"}


def new_request_id() -> str:
    return uuid.uuid4().hex[:16]


class JsonFormatter(logging.Formatter):
    def __init__(self, service: str):
        super().__init__()
        self.service = service

    def format(self, record: logging.LogRecord) -> str:
        out = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "service": service_var.get() or self.service,
            "logger": record.name,
            "request_id": request_id_var.get(),
            "msg": record.getMessage(),
        }
        for k, v in vars(record).items():
            if k not in _STANDARD and not k.startswith("_"):
                out[k] = v
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str)


class TextFormatter(logging.Formatter):
    def __init__(self, service: str):
        super().__init__("%(asctime)s %(levelname)s %(service)s [%(request_id)s] %(name)s: %(message)s")
        self.service = service

    def format(self, record: logging.LogRecord) -> str:
        record.request_id = request_id_var.get() or "-"
        record.service = service_var.get() or self.service
        return super().format(record)


def configure(service: str, fmt: str = "json", level: int = logging.INFO) -> None:
    """Route the root logger to stderr in the given format ("json" or "text")."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter(service) if fmt == "json" else TextFormatter(service))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
    logging.getLogger("aiohttp.access").setLevel(logging.WARNING)  # the middleware logs requests
    logging.getLogger("botocore").setLevel(logging.WARNING)
