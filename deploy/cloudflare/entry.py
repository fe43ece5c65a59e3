"""The Worker and Durable Object classes a Python Worker exports, built around services/ handlers.

A generated main module (deploy/wrangler.py writes it) is three lines per role, e.g. the layer warden:

    from deploy.cloudflare.entry import durable_object, worker_entrypoint
    import services.layer_warden as service
    Default = worker_entrypoint(service.fetch)
    LayerWarden = durable_object(service.DURABLE_OBJECTS["LayerWarden"])

Every request: JS Request -> Request (convert.py), Env from the Worker's env (workers_bindings.py), the
handler through common.runtime.call_handler (the one error -> status map), Response -> JS.

Durable Objects: the runtime makes one instance per id. Requests to it run one at a time, in
arrival order, as on the local host (deploy/local/durable.py); workerd's input gate only holds
events back around storage calls, which these objects do not make, so the lock is ours.
A station is hosted as a Durable Object too (station_object), one named instance per layer range,
so every token of a request reaches the isolate that holds its attention KV cache; it keeps the
plain service's concurrency (its batcher stacks concurrent decode frames), so it takes no lock.

Signed calls: every Worker but the public one (the coordinator: worker_entrypoint(..., public=True))
and every Durable Object answers only calls signed with KNOT_INTERNAL_SECRET (common/signing.py,
the local host's check), 401 before the handler runs; the health probes are the platform's, so
no path is exempt. A Worker without the secret refuses everything (503 naming it). Each isolate
remembers the nonces it accepted for the replay window; another isolate of the same Worker does
not see them, so a captured call could be replayed there within the window (REPLAY_WINDOW_S), but
not changed, and not sent at all from outside: the internal Workers have no public route.
"""
from __future__ import annotations

import asyncio
import time
from typing import Any

from workers import DurableObject, WorkerEntrypoint

from common import signing
from common.runtime import DurableObjectId, Env, Handler, Request, ServiceUnavailable, State, call_handler
from services import tracing
from deploy.cloudflare.workers_bindings import (DO_NAME_HEADER, INTERNAL_SECRET, JsContext, env_from_js, js_var, raw,
                                        request_id, secrets_from_js, signed_target)
from deploy.cloudflare.convert import request_from_js, response_to_js

REQUEST_ID_HEADER = "X-Request-Id"
SERVICE_NAME_VAR = "KNOT_SERVICE_NAME"  # the Worker's own name: what its callers sign for
_verifiers: dict[tuple[str, str], signing.Verifier] = {}  # per isolate: the nonces it accepted


def verifier_for(js_env: Any) -> signing.Verifier:
    """This isolate's Verifier of calls to this Worker (KNOT_SERVICE_NAME) under its KNOT_INTERNAL_SECRET;
    ServiceUnavailable naming what is missing.

    Its boot time is its first request's: workerd's clock stands still at global scope, and while an
    isolate computes, so a caller's signing time can lag the real one by its CPU time since its last
    I/O. The boot epoch (common/signing.py) is therefore given the whole window as its skew: on
    Cloudflare the replay defence is the nonce memory of each isolate and the window, behind
    Workers that have no public route."""
    secret = secrets_from_js(js_env).get(INTERNAL_SECRET)
    service = js_var(js_env, SERVICE_NAME_VAR)
    if secret is None or not service:
        what = f"{INTERNAL_SECRET} is not among its secrets (KNOT_SECRETS)" if secret is None else \
            f"its vars name no {SERVICE_NAME_VAR}"
        raise ServiceUnavailable(f"this internal Worker cannot check signatures: {what}; it would answer unsigned "
                                 f"calls, so it answers none")
    key = (secret, service)
    if key not in _verifiers:
        try:
            _verifiers[key] = signing.Verifier(secret, service, booted_at=time.time(),
                                               boot_skew_s=signing.REPLAY_WINDOW_S)
        except ValueError as e:
            raise ServiceUnavailable(f"secret {INTERNAL_SECRET}: {e}") from None
    return _verifiers[key]


def _signed(handler: Handler, verifier: signing.Verifier) -> Handler:
    """handler behind the signature check: Unauthorized (401) for a call not signed with the secret."""

    async def checked(request: Request, env: Env, ctx: Any):
        verifier.verify(request.method, signed_target(request.url), request.body,
                        request.headers.get(signing.SIGNATURE_HEADER), time.time(),
                        request.headers.get(DO_NAME_HEADER, ""))
        return await handler(request, env, ctx)

    return checked


async def serve(handler: Handler, js_request: Any, env: Env, ctx: Any,
                verifier: signing.Verifier | None = None) -> Any:
    """One request through a handler, translated both ways; with a verifier, only a signed one."""
    request = await request_from_js(js_request)
    rid = request_id(request)
    if verifier is not None:
        handler = _signed(handler, verifier)
    response = await call_handler(handler, request, env, ctx, rid)
    response.headers.setdefault(REQUEST_ID_HEADER, rid)
    return response_to_js(response, ctx.wait_until)


def _raising(exc: Exception) -> Handler:
    async def fail(_request: Request, _env: Env, _ctx: Any):
        raise exc

    return fail


async def _env_or_error(js_env: Any, js_request: Any, ctx: Any,
                        public: bool) -> tuple[Env | None, signing.Verifier | None, Any]:
    """(env_from_js, the verifier of an internal Worker's calls, None), or (None, None, the error reply):
    a misconfigured Worker answers 503 naming the binding or secret."""
    try:
        return env_from_js(js_env), None if public else verifier_for(raw(js_env)), None
    except Exception as e:  # noqa: BLE001 - a bad config becomes a status through call_handler's map
        return None, None, await serve(_raising(e), js_request, Env(), ctx)


def worker_entrypoint(handler: Handler, public: bool = False) -> type:
    """A WorkerEntrypoint whose fetch runs `handler` (a services/ module's fetch). Unless public,
    only calls signed with the Worker's KNOT_INTERNAL_SECRET reach it."""

    # an internal Worker's traced call returns its own calls' spans to its caller (services/tracing.py);
    # a public one (the coordinator) starts its traces itself, and tells clients nothing of its hops
    served = handler if public else tracing.serving(handler)

    class Default(WorkerEntrypoint):
        async def fetch(self, request: Any) -> Any:
            ctx = JsContext(self.ctx)
            env, verifier, error = await _env_or_error(self.env, request, ctx, public)
            return error if env is None else await serve(served, request, env, ctx, verifier)

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
        env, verifier, error = await _env_or_error(self.env, request, self._context, public=False)
        if env is not None:
            if self.serialize:
                async with self._lock:
                    return await self._run(request, env, verifier)
            return await self._run(request, env, verifier)
        return error

    async def _run(self, js_request: Any, env: Env, verifier: signing.Verifier) -> Any:
        if self._obj is None:
            js_id = self.ctx.id
            name = getattr(js_id, "name", None)
            if not isinstance(name, str) or not name:
                name = _header(js_request, DO_NAME_HEADER)
            state = State(DurableObjectId(name, str(js_id.toString())), self._context.wait_until)
            self._obj = self._make(state, env)
        return await serve(tracing.serving(self._call(self._obj)), js_request, env, self._context, verifier)


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
