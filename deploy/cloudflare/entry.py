"""The Worker and Durable Object classes a Python Worker exports, built around services/ handlers.

A generated main module (deploy/wrangler.py writes it) is three lines per role, e.g. the layer warden:

    from deploy.cloudflare.entry import durable_object, worker_entrypoint
    import services.layer_warden as service
    Default = worker_entrypoint(service.fetch)
    LayerWarden = durable_object(service.DURABLE_OBJECTS["LayerWarden"])

Every request: JS Request -> Request (convert.py), Env from the Worker's env (bindings.py), the
handler through common.runtime.call_handler (the one error -> status map), Response -> JS.

Durable Objects: the runtime makes one instance per id. Requests to it run one at a time, in
arrival order, as on the local host (deploy/local/durable.py); workerd's input gate only holds
events back around storage calls, which these objects do not make, so the lock is ours.
A station is hosted as a Durable Object too (station_object), one named instance per layer range,
so every token of a request reaches the isolate that holds its attention KV cache; it keeps the
plain service's concurrency (its batcher stacks concurrent decode frames), so it takes no lock.
"""
from __future__ import annotations

import asyncio
from typing import Any

from workers import DurableObject, WorkerEntrypoint

from common.runtime import DurableObjectId, Env, Handler, Request, State, call_handler
from deploy.cloudflare.bindings import DO_NAME_HEADER, JsContext, env_from_js, request_id
from deploy.cloudflare.convert import request_from_js, response_to_js

REQUEST_ID_HEADER = "X-Request-Id"


async def serve(handler: Handler, js_request: Any, env: Env, ctx: Any) -> Any:
    """One request through a handler, translated both ways."""
    request = await request_from_js(js_request)
    rid = request_id(request)
    response = await call_handler(handler, request, env, ctx, rid)
    response.headers.setdefault(REQUEST_ID_HEADER, rid)
    return response_to_js(response)


def _raising(exc: Exception) -> Handler:
    async def fail(_request: Request, _env: Env, _ctx: Any):
        raise exc

    return fail


async def _env_or_error(js_env: Any, js_request: Any, ctx: Any) -> tuple[Env | None, Any]:
    """env_from_js, or the error reply (a misconfigured Worker answers 503 naming the binding)."""
    try:
        return env_from_js(js_env), None
    except Exception as e:  # noqa: BLE001 - a bad config becomes a status through call_handler's map
        return None, await serve(_raising(e), js_request, Env(), ctx)


def worker_entrypoint(handler: Handler) -> type:
    """A WorkerEntrypoint whose fetch runs `handler` (a services/ module's fetch)."""

    class Default(WorkerEntrypoint):
        async def fetch(self, request: Any) -> Any:
            ctx = JsContext(self.ctx)
            env, error = await _env_or_error(self.env, request, ctx)
            return error if env is None else await serve(handler, request, env, ctx)

    return Default


class _HostedObject(DurableObject):
    """Builds the wrapped object on its first request, when its name is known (the runtime's id
    may not carry it; our stubs send it in X-Durable-Object-Name, as the local host's do)."""

    serialize = True

    def __init__(self, ctx: Any, env: Any):
        super().__init__(ctx, env)
        self._context = JsContext(ctx)
        self._obj: Any = None
        self._lock = asyncio.Lock()

    def _make(self, state: State, env: Env) -> Any:
        raise NotImplementedError

    def _call(self, obj: Any) -> Handler:
        raise NotImplementedError

    async def fetch(self, request: Any) -> Any:
        env, error = await _env_or_error(self.env, request, self._context)
        if env is not None:
            if self.serialize:
                async with self._lock:
                    return await self._run(request, env)
            return await self._run(request, env)
        return error

    async def _run(self, js_request: Any, env: Env) -> Any:
        if self._obj is None:
            js_id = self.ctx.id
            name = getattr(js_id, "name", None)
            if not isinstance(name, str) or not name:
                name = _header(js_request, DO_NAME_HEADER)
            state = State(DurableObjectId(name, str(js_id.toString())), self._context.wait_until)
            self._obj = self._make(state, env)
        return await serve(self._call(self._obj), js_request, env, self._context)


def _header(js_request: Any, name: str) -> str:
    js_request = getattr(js_request, "js_object", js_request)
    value = js_request.headers.get(name)
    return "" if value is None else str(value)


def durable_object(cls: type) -> type:
    """A Durable Object class hosting `cls(state, env)` with `async fetch(request)` (the wardens)."""

    def make(self, state: State, env: Env) -> Any:
        return cls(state, env)

    def call(self, obj: Any) -> Handler:
        return lambda request, env, ctx: obj.fetch(request)

    return type(cls.__name__, (_HostedObject,), {"_make": make, "_call": call, "__doc__": cls.__doc__})


def station_object(handler: Handler, class_name: str = "Station") -> type:
    """A Durable Object class running a plain handler (the station) in one named instance."""

    def make(self, state: State, env: Env) -> Any:
        return state

    def call(self, state: State) -> Handler:
        return handler

    return type(class_name, (_HostedObject,), {"_make": make, "_call": call, "serialize": False,
                                               "__doc__": f"{class_name}: {handler.__module__} in a named instance"})


def forwarding_entrypoint(binding: str, instance_var: str) -> type:
    """A WorkerEntrypoint that sends every request to the named instance of a DO namespace
    (the station Worker's own fetch reaches its Station object this way)."""

    async def forward(request: Request, env: Env, ctx: Any):
        ns = getattr(env, binding)
        return await ns.get(ns.id_from_name(getattr(env, instance_var))).fetch(request)

    return worker_entrypoint(forward)
