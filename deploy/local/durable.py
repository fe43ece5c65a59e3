"""Durable Objects on the local host.

A DurableObjectHost owns the live instances of the classes one process hosts:
- one live instance per (class, name), created on first use with cls(state, env);
- requests to one instance run one at a time, in arrival order (asyncio.Lock is FIFO), like a
  DO's input gate; different instances run concurrently;
- instances live in RAM only, so a process restart loses their state, as a DO eviction does.

Namespace bindings reach a host either in-process (LocalNamespace) or over HTTP
(HttpNamespace in server_bindings.py, served by the host's /__do/{class} route).
"""
from __future__ import annotations

import asyncio
import hashlib
import logging
from dataclasses import dataclass, field
from typing import Any

from common.runtime import DurableObjectId, Env, NotFound, Request, Response, State, call_handler, error_response
from services import tracing
from deploy.local.tasks import BackgroundTasks

log = logging.getLogger(__name__)

DO_ROUTE_PREFIX = "/__do/"  # /__do/{class_name}{path}; the instance name travels in a header
DO_NAME_HEADER = "X-Durable-Object-Name"


def object_id(class_name: str, name: str) -> DurableObjectId:
    """The same (class, name) gives the same id, on every host."""
    return DurableObjectId(name, hashlib.sha256(f"{class_name}\x00{name}".encode()).hexdigest())


@dataclass
class _Instance:
    obj: Any
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    requests: int = 0


class DurableObjectHost:
    def __init__(self, classes: dict[str, type], tasks: BackgroundTasks, env: Env | None = None):
        self.classes = dict(classes)
        self.tasks = tasks
        self.env = env  # set after construction when the env's bindings point back at this host
        self._instances: dict[tuple[str, str], _Instance] = {}

    def _instance(self, class_name: str, name: str) -> _Instance:
        key = (class_name, name)
        inst = self._instances.get(key)
        if inst is None:
            cls = self.classes.get(class_name)
            if cls is None:
                raise NotFound(f"this host has no Durable Object class {class_name!r} "
                               f"(it hosts: {', '.join(sorted(self.classes)) or 'none'})")
            assert self.env is not None, "DurableObjectHost.env must be set before the first request"
            state = State(object_id(class_name, name), self.tasks.add)
            inst = _Instance(cls(state, self.env))
            self._instances[key] = inst
            log.info("durable object created", extra={"do_class": class_name, "do_name": name})
        return inst

    async def fetch(self, class_name: str, name: str, request: Request) -> Response:
        try:
            inst = self._instance(class_name, name)
        except Exception as e:  # noqa: BLE001 - unknown class or a constructor that failed: a status, not a crash
            return error_response(e)
        async with inst.lock:  # the input gate: one request at a time per instance
            inst.requests += 1
            return await call_handler(tracing.serving(lambda r, e, c: inst.obj.fetch(r)), request, self.env, None)

    def stats(self) -> dict[str, Any]:
        return {f"{c}|{n}": i.requests for (c, n), i in self._instances.items()}


class LocalStub:
    def __init__(self, host: DurableObjectHost, class_name: str, id: DurableObjectId):
        self._host, self._class, self.id = host, class_name, id

    async def fetch(self, request: Request) -> Response:
        # A copy: the callee must not see (or mutate) the caller's object, as over the network.
        return await self._host.fetch(self._class, self.id.name, request.with_url(request.url))


class LocalNamespace:
    """In-process DO namespace binding onto a DurableObjectHost."""

    def __init__(self, host: DurableObjectHost, class_name: str):
        self._host, self.class_name = host, class_name

    def id_from_name(self, name: str) -> DurableObjectId:
        return object_id(self.class_name, name)

    def get(self, id: DurableObjectId) -> LocalStub:
        return LocalStub(self._host, self.class_name, id)
