"""The aiohttp host: one service per process (`knot serve`), or many in one (`knot serve --embedded`).
An internal service that hosts no Durable Object (a station, a shard, the drafter) is served by
deploy/local/lean_http.py instead, with the same answers (serve_one; KNOT_HTTP_SERVER=aiohttp: never).

Per request: aiohttp request -> common.runtime.Request -> handler(request, env, ctx) ->
Response -> aiohttp response (a streaming Response is written chunk by chunk through a
web.StreamResponse; a client that goes away closes the handler's stream). Every app also answers
    GET /healthz                 the process is up (and its wait_until counters)
    GET /readyz                  every binding answers (S3 head_bucket, Redis PING, peers' /healthz)
    ANY /__do/{class}{path}      a hosted Durable Object, instance named by X-Durable-Object-Name
Requests carry X-Request-Id (taken from the caller or made here) into logs, replies and peers.
On SIGTERM/SIGINT: stop accepting, finish in-flight requests, drain wait_until work, close clients.
"""
from __future__ import annotations

import asyncio
import contextlib
import importlib
import logging
import os
import re
import signal
import time
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable

import aiohttp
from aiohttp import web

from common import settings as table
from common import signing
from common.runtime import (BadRequest, Context, Env, Handler, Headers, HttpError, Request, Response, aclose_stream,
                            call_handler, error_response)
from services import tracing
from deploy.local.server_bindings import HttpNamespace, HttpService, RedisKV, S3Bucket, Signer
from deploy.local.durable import DO_NAME_HEADER, DO_ROUTE_PREFIX, DurableObjectHost, LocalNamespace
from deploy.local.embedded_bindings import DirectoryBucket, MemoryKV
from deploy.local.logs import REQUEST_ID_HEADER, new_request_id, request_id_var, service_var
from deploy.local.host_settings import BindingURL, ConfigError, HostSettings, open_binding
from deploy.local.shm import (PID_NS_HEADER, SHM_HEADER, SHM_MIN_BYTES, ReplyBuffers, ReplyReader, ShmError,
                              allow_descriptors, check_private, reader_stats)
from deploy.local.tasks import BackgroundTasks

log = logging.getLogger(__name__)
READY_TIMEOUT_S = 5.0


# Request bodies beyond this are refused with 413 before they are read in full, unless the service
# module says otherwise (MAX_BODY_BYTES: the coordinator's public API takes a few MiB) or
# KNOT_MAX_BODY_BYTES does. Internal frames are at most a prefill chunk of hidden states.
DEFAULT_MAX_BODY_BYTES = 64 << 20


@dataclass(frozen=True)
class ServiceModule:
    handler: Handler
    durable_objects: dict[str, type]
    ready: Callable[[Env], Awaitable[None]] | None
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    public: bool = False  # the module says PUBLIC = True: it serves clients, not other services


def load_service(module_path: str) -> ServiceModule:
    module = importlib.import_module(module_path)
    handler = getattr(module, "fetch", None)
    if handler is None:
        raise ConfigError(f"service module {module_path} has no fetch(request, env, ctx)")
    public = bool(getattr(module, "PUBLIC", False))
    # an internal service's traced call returns its own calls' spans to its caller (services/tracing.py);
    # a public one (the coordinator) starts its traces itself, and tells clients nothing of its hops
    return ServiceModule(handler if public else tracing.serving(handler), dict(getattr(module, "DURABLE_OBJECTS", {})),
                         getattr(module, "ready", None), int(getattr(module, "MAX_BODY_BYTES", DEFAULT_MAX_BODY_BYTES)),
                         public)


@dataclass
class ServiceRuntime:
    """Everything one service needs at request time."""

    name: str
    handler: Handler
    env: Env
    tasks: BackgroundTasks
    do_host: DurableObjectHost | None = None
    ready: Callable[[Env], Awaitable[None]] | None = None
    checks: dict[str, Callable[[], Awaitable[None]]] = field(default_factory=dict)
    started_at: float = field(default_factory=time.monotonic)
    access_log: str = "all"  # "errors": successful requests are logged at DEBUG only
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    # A public service's handler is cancelled when its client disconnects (aiohttp's
    # handler_cancellation), so a whole (non-streaming) reply nobody waits for stops generating and
    # gives its slot and KV sessions back; internal services finish what they started.
    public: bool = False
    # An internal service's calls must be signed with the cluster's secret (KNOT_INTERNAL_SECRET):
    # None when it is unset (then nothing is checked, and the start says so).
    verifier: signing.Verifier | None = None
    # Large replies to callers that read KNOT_SHM_DIR go through it (deploy/local/shm.py); None: sockets only.
    shm: ReplyBuffers | None = None
    # A request's line and headers must arrive within header_timeout_s of the connection's start or of
    # the previous reply (else the connection is closed), its body within body_timeout_s (else 408).
    header_timeout_s: float = 60.0
    body_timeout_s: float = 60.0


# ---------------------------------------------------------------- translation


# host[:port], a name or an IPv4 or bracketed IPv6 address
_HOST = re.compile(r"(?:[A-Za-z0-9._-]+|\[[0-9A-Fa-f:.]+\])(?::[0-9]{1,5})?")


async def to_runtime_request(request: web.Request, url: str | None = None) -> Request:
    # A declared length over the limit is refused before a byte of the body is read; a chunked
    # body, once it passes the limit (aiohttp's read() raises the same 413).
    limit = request.client_max_size
    if request.content_length is not None and request.content_length > limit:
        raise web.HTTPRequestEntityTooLarge(max_size=limit, actual_size=request.content_length)
    if url is None:
        # Why: the URL is the Host header and the target, and a handler routes on its path. A Host
        # such as "x/evil?" would move the path, which a signature (over the target) does not cover.
        if not _HOST.fullmatch(request.host):
            raise web.HTTPBadRequest(reason=f"the Host header {request.host[:80]!r} is not a host[:port]")
        if not request.raw_path.startswith("/"):  # the absolute form is for proxies
            raise web.HTTPBadRequest(reason=f"request target {request.raw_path[:80]!r} is not a path")
        url = f"http://{request.host}{request.raw_path}"
    return Request(request.method, url, Headers(request.headers.items()), await read_body(request))


class BodyTimeout(HttpError):
    """The request's body did not arrive within KNOT_BODY_TIMEOUT_S of its headers."""

    status = 408


async def read_body(request: web.Request) -> bytes:
    """The whole body, within the runtime's body_timeout_s (408 past it: a slow client holds nothing longer)."""
    timeout_s = request.app[RUNTIME].body_timeout_s
    try:
        async with asyncio.timeout(timeout_s):
            return await request.read()
    except TimeoutError:
        raise web.HTTPRequestTimeout(reason=f"the request body did not arrive within {timeout_s:g} s "
                                            f"(KNOT_BODY_TIMEOUT_S)") from None


def reply_headers(resp: Response) -> dict[str, str]:
    """A reply's headers less those the server writes itself (framing)."""
    return {k: v for k, v in resp.headers.items() if k.lower() not in ("content-length", "transfer-encoding")}


def to_aiohttp_response(resp: Response) -> web.Response:
    assert resp.stream is None, "a streaming Response goes through send_response()"
    return web.Response(status=resp.status, body=resp.body, headers=reply_headers(resp))


# A body from SLICED_BODY_BYTES on is written in WRITE_SLICE_BYTES slices of a memoryview of it.
# Written whole, Python 3.11's aiohttp and asyncio copy it three times before the socket sees it:
# joined with the headers (aiohttp skips writelines below 3.12), the unsent tail sliced off, then
# appended to the transport's buffer. A LayerWarden's batch is ~40-60 MB per phase of a 7B, ~2 GB
# per forward; slices of 4 MiB, about what the socket takes at once, are faster
# (benchmarks/warden_transfer.py measures both).
SLICED_BODY_BYTES = 1 << 20
WRITE_SLICE_BYTES = 4 << 20


async def send_response(request: web.Request, resp: Response) -> web.StreamResponse:
    """A Response to aiohttp; a streaming one is written chunk by chunk (chunked transfer encoding),
    a body of SLICED_BODY_BYTES or more in slices (its Content-Length known).

    aiohttp does not cancel a handler whose client disconnects; the next write fails instead. Then,
    or on any other early exit (cancellation at shutdown, a failing producer), the stream is closed
    with aclose so its producer's cleanup runs (e.g. the coordinator frees the stations' KV caches).
    """
    if resp.stream is None and resp.nbytes < SLICED_BODY_BYTES:
        return to_aiohttp_response(resp)
    if resp.stream is None:
        plan = shm_plan(request.app[RUNTIME], request.headers, request.transport, resp)
        if plan is not None:
            headers = reply_headers(resp) | plan[0]
            return web.Response(status=resp.status, headers=headers, body=b"".join(plan[1]))
        return await _send_sliced(request, resp)
    out = web.StreamResponse(status=resp.status, headers=reply_headers(resp))
    out.headers[REQUEST_ID_HEADER] = request_id_var.get()  # sent with the headers, before the body
    try:
        await out.prepare(request)
        async for chunk in resp.stream:
            await out.write(chunk)
        await out.write_eof()
    except ConnectionError as e:  # the client went away (aiohttp's ClientConnectionResetError is one)
        log.info("client disconnected mid-stream: %s; closing the stream", e or type(e).__name__)
    finally:
        await aclose_stream(resp.stream)
    return out


def shm_plan(rt: ServiceRuntime, request_headers, transport, resp: Response) -> tuple[dict[str, str], list] | None:
    """How a whole reply of SLICED_BODY_BYTES or more goes to a caller that reads this host's shared
    memory (it offered it: SHM_HEADER): (headers to add, the parts still for the socket); None: all
    of it over the socket (no offer, a smaller or streaming reply, or every buffer in use and no part
    a block)."""
    shm = rt.shm
    if (shm is None or resp.stream is not None or transport is None or request_headers.get(SHM_HEADER) != shm.offer
            or resp.nbytes < max(SLICED_BODY_BYTES, SHM_MIN_BYTES)):
        return None
    return shm.reply(transport, resp.parts, shm.pid_ns is not None and request_headers.get(PID_NS_HEADER) == shm.pid_ns)


async def _send_sliced(request: web.Request, resp: Response) -> web.StreamResponse:
    """A large body as it is, part by part (Response.parts, never joined): each slice goes to the
    socket without a copy, and only what the socket does not take at once is buffered (aiohttp then
    waits for the buffer to drain)."""
    out = web.StreamResponse(status=resp.status, headers=reply_headers(resp))
    out.content_length = resp.nbytes
    out.headers[REQUEST_ID_HEADER] = request_id_var.get()  # sent with the headers, before the body
    try:
        await out.prepare(request)
        for part in resp.parts:
            part = memoryview(part).cast("B")
            for a in range(0, len(part), WRITE_SLICE_BYTES):
                await out.write(part[a:a + WRITE_SLICE_BYTES])
        await out.write_eof()
    except ConnectionError as e:  # the client went away
        log.info("client disconnected mid-body: %s", e or type(e).__name__)
    return out


# ---------------------------------------------------------------- the app

RUNTIME = web.AppKey("runtime", ServiceRuntime)


@web.middleware
async def request_context(request: web.Request, handler) -> web.StreamResponse:
    rid = request.headers.get(REQUEST_ID_HEADER) or new_request_id()
    token = request_id_var.set(rid)
    service_token = service_var.set(request.app[RUNTIME].name)
    t0 = time.perf_counter()
    try:
        try:
            resp = await handler(request)
        except web.HTTPException as e:  # aiohttp's own (413 body too large, ...), same JSON shape
            resp = web.json_response({"error": type(e).__name__, "message": e.reason, "request_id": rid},
                                     status=e.status)
        resp.headers[REQUEST_ID_HEADER] = rid
        log_access(request.app[RUNTIME], request.method, request.path, resp.status, t0)
        return resp
    finally:
        request_id_var.reset(token)
        service_var.reset(service_token)


UNSIGNED_PATHS = ("/healthz", "/readyz")  # the host's own probes: they change nothing and tell nothing secret


def log_access(rt: ServiceRuntime, method: str, path: str, status: int, t0: float) -> None:
    """The access log line of a request that began at t0 (perf_counter): INFO for an error or with
    KNOT_ACCESS_LOG=all, else DEBUG; none for the probes. Both servers log through here."""
    level = logging.INFO if status >= 400 or rt.access_log == "all" else logging.DEBUG
    if path not in UNSIGNED_PATHS and log.isEnabledFor(level):
        log.log(level, "%s %s -> %d", method, path, status,
                extra={"method": method, "path": path, "status": status, "ms": round((time.perf_counter() - t0) * 1e3, 2)})


def must_be_signed(rt: ServiceRuntime, path: str) -> bool:
    """Whether a call to path must carry the cluster's signature: on an internal service, for any
    path but the probes. Both servers ask here, before they check (signature_refusal)."""
    return rt.verifier is not None and not rt.public and path not in UNSIGNED_PATHS


def signature_refusal(rt: ServiceRuntime, method: str, target: str, body: bytes, headers) -> HttpError | None:
    """For a call that must_be_signed: why the service refuses it before its handler runs (401: not
    signed with the cluster's secret, common/signing.py), or None. Both servers check through here."""
    try:
        rt.verifier.verify(method, target, body, headers.get(signing.SIGNATURE_HEADER), time.time(),
                           headers.get(DO_NAME_HEADER, ""))
    except HttpError as e:
        return e
    return None


@web.middleware
async def signed_calls(request: web.Request, handler) -> web.StreamResponse:
    """An internal service answers only calls signed with the cluster's secret (common/signing.py):
    401 for any other, before the handler runs."""
    rt = request.app[RUNTIME]
    if must_be_signed(rt, request.path):  # the body is read only then
        err = signature_refusal(rt, request.method, request.raw_path, await read_body(request), request.headers)
        if err is not None:
            return to_aiohttp_response(error_response(err, request_id_var.get()))
    return await handler(request)


def health_body(rt: ServiceRuntime) -> dict:
    """GET /healthz: the process is up, and its wait_until and shared-memory counters."""
    return {"ok": True, "service": rt.name, "pid": os.getpid(), "uptime_s": round(time.monotonic() - rt.started_at, 3),
            "wait_until": rt.tasks.stats(), "durable_objects": len(rt.do_host.stats()) if rt.do_host else 0,
            **({"shm_replies": rt.shm.stats()} if rt.shm is not None else {}),
            **({"shm_reads": reads} if (reads := reader_stats()) is not None else {})}


async def ready_body(rt: ServiceRuntime) -> tuple[dict, int]:
    """GET /readyz: every binding answers (and the service's own check) -> (body, 200 or 503)."""
    checks = dict(rt.checks)
    if rt.ready is not None:
        checks["service"] = lambda: rt.ready(rt.env)

    async def run(fn) -> tuple[bool, str]:
        """-> (passed, "ok" or the check's note, or the failure)."""
        try:
            async with asyncio.timeout(READY_TIMEOUT_S):
                note = await fn()  # a check may say how it passed (the coordinator: serving unverified)
            return True, note if isinstance(note, str) else "ok"
        except Exception as e:  # noqa: BLE001 - any failure means "not ready", reported by name
            return False, f"{type(e).__name__}: {e}"

    results = dict(zip(checks, await asyncio.gather(*(run(f) for f in checks.values()))))
    failed = [k for k, (passed, _) in results.items() if not passed]
    body = {"ready": not failed, "service": rt.name, "checks": {k: v for k, (_, v) in results.items()}}
    return body, 503 if failed else 200


async def _healthz(request: web.Request) -> web.Response:
    return web.json_response(health_body(request.app[RUNTIME]))


async def _readyz(request: web.Request) -> web.Response:
    body, status = await ready_body(request.app[RUNTIME])
    return web.json_response(body, status=status)


async def _durable_object(request: web.Request) -> web.StreamResponse:
    rt = request.app[RUNTIME]
    rest = request.path[len(DO_ROUTE_PREFIX):]
    class_name, _, tail = rest.partition("/")
    name = request.headers.get(DO_NAME_HEADER)
    if rt.do_host is None or not name:
        why = "this process hosts no Durable Objects" if rt.do_host is None else f"{DO_NAME_HEADER} is missing"
        return to_aiohttp_response(error_response(BadRequest(why), request_id_var.get()))
    url = str(request.url.with_path("/" + tail, encoded=False))
    if request.query_string:
        url += "?" + request.query_string
    req = await to_runtime_request(request, url)
    return await send_response(request, await rt.do_host.fetch(class_name, name, req))


async def _worker(request: web.Request) -> web.StreamResponse:
    rt = request.app[RUNTIME]
    req = await to_runtime_request(request)
    resp = await call_handler(rt.handler, req, rt.env, Context(rt.tasks.add), request_id_var.get())
    return await send_response(request, resp)


def build_app(rt: ServiceRuntime) -> web.Application:
    app = web.Application(middlewares=[request_context, signed_calls], client_max_size=rt.max_body_bytes)
    app[RUNTIME] = rt
    app.router.add_get("/healthz", _healthz)
    app.router.add_get("/readyz", _readyz)
    app.router.add_route("*", DO_ROUTE_PREFIX + "{rest:.*}", _durable_object)
    app.router.add_route("*", "/{tail:.*}", _worker)
    return app


# ---------------------------------------------------------------- real runtime (one service per process)


def real_binding(name: str, url: str, settings: HostSettings, session: aiohttp.ClientSession,
                 do_host: DurableObjectHost | None) -> Any:
    timeout_s = settings.call_timeout_s

    reader = ReplyReader(settings.shm_dir) if settings.shm_dir is not None else None

    def local_namespace(b: BindingURL) -> LocalNamespace:
        if do_host is None or b.target not in do_host.classes:
            raise ConfigError(f"binding {name}={url}: this process does not host {b.target!r} "
                              f"(KNOT_DURABLE_OBJECTS={','.join(settings.durable_objects)})", name=name)
        return LocalNamespace(do_host, b.target)

    def signer(b: BindingURL) -> Signer | None:  # signs for the peer's name (#NAME, else its host name)
        return Signer(settings.internal_secret, b.peer) if settings.internal_secret else None

    def service(b: BindingURL) -> HttpService:
        return HttpService(session, b.target, timeout_s, signer(b))

    return open_binding(name, url, {
        "s3": lambda b: S3Bucket(settings.s3, b.target),
        "dir": lambda b: DirectoryBucket(b.target),
        "redis": lambda b: RedisKV(b.target, b.prefix, timeout_s, password=settings.redis_password),
        "memory": lambda b: MemoryKV(),
        "do+http": lambda b: HttpNamespace(session, b.base_url, b.target, timeout_s, signer(b), reader),
        "do+local": local_namespace,
        "http": service, "https": service,
    })


def export_traces(settings: HostSettings, stack: contextlib.AsyncExitStack) -> None:
    """With OTEL_EXPORTER_OTLP_ENDPOINT set, the service's trace ring (the coordinator's TRACES) sends
    each request's spans there; `stack` flushes them at exit. A service without a ring keeps no traces."""
    if settings.otlp_endpoint is None:
        return
    ring = getattr(importlib.import_module(settings.service), "TRACES", None)
    if ring is None:
        log.info("OTEL_EXPORTER_OTLP_ENDPOINT is set, but %s keeps no traces (the coordinator does): ignored",
                 settings.service)
        return
    from deploy.otlp import OtlpExport  # the SDK only where it is used

    export = OtlpExport(settings.otlp_endpoint, settings.name)
    ring.on_end.append(export)
    stack.callback(export.close)
    stack.callback(ring.on_end.remove, export)  # (callbacks run last first: unhooked, then flushed)
    log.info("traces go to the OpenTelemetry collector at %s", settings.otlp_endpoint)


def check_settings(name: str, module: str, env: Env) -> None:
    """Before serving: every setting the handler reads (common/settings.py) parses, or a ConfigError
    that names the service and the variable ends the start."""
    reader = module.rsplit(".", 1)[-1]
    if module.startswith("services.") and reader in table.HANDLERS:
        try:
            table.check(env, reader)
        except ConfigError as e:
            raise ConfigError(f"{name}: {e}", name=e.name) from None


async def open_runtime(settings: HostSettings, stack: contextlib.AsyncExitStack) -> ServiceRuntime:
    """Build a service's env from real bindings; `stack` closes them (after draining wait_until)."""
    svc = load_service(settings.service)
    missing = [c for c in settings.durable_objects if c not in svc.durable_objects]
    if missing:
        raise ConfigError(f"KNOT_DURABLE_OBJECTS names {missing}, but {settings.service} defines "
                          f"{sorted(svc.durable_objects)}")
    if settings.shm_dir is not None:  # replies are read from there: nobody but the cluster's user may write it
        try:
            check_private(settings.shm_dir)
        except ShmError as e:
            raise ConfigError(f"KNOT_SHM_DIR: {e}", name="KNOT_SHM_DIR") from None
    tasks = BackgroundTasks(f"{settings.name} wait_until")
    session = aiohttp.ClientSession()
    stack.push_async_callback(session.close)
    do_host = (DurableObjectHost({c: svc.durable_objects[c] for c in settings.durable_objects}, tasks)
               if settings.durable_objects else None)
    bindings, checks = {}, {}
    for name, url in settings.bindings.items():
        b = real_binding(name, url, settings, session, do_host)
        if hasattr(b, "close"):
            stack.push_async_callback(b.close)
        if hasattr(b, "ping"):
            checks[name] = b.ping
        bindings[name] = tracing.traced(b, name)  # its calls carry a request's traceparent
    shm = None
    if settings.shm_dir is not None:
        allow_descriptors()  # each shared block this process keeps or holds is a descriptor
        shm = ReplyBuffers(settings.shm_dir)
        stack.callback(shm.close)
        bindings["SHARED_BLOCKS"] = shm.blocks  # the LayerWarden keeps its tensors there (deploy/local/shm.py)
    env = Env(bindings, settings.handler_vars())
    check_settings(settings.name, settings.service, env)
    export_traces(settings, stack)
    if do_host is not None:
        do_host.env = env
    # Exit callbacks run last-in first-out: wait_until work drains before any client closes.
    stack.push_async_callback(tasks.drain, settings.shutdown_timeout_s)
    # Its boot time, taken as it is about to serve: calls signed before it are refused (a replay
    # of what the service's previous incarnation accepted; common/signing.py).
    verifier = (signing.Verifier(settings.internal_secret, settings.name, booted_at=time.time())
                if settings.internal_secret else None)
    if verifier is None and not svc.public:
        log.warning("%s: KNOT_INTERNAL_SECRET is unset: this internal service answers unsigned calls from "
                    "anyone who can reach its port (knot cluster up and knot secrets generate one)", settings.name)
    return ServiceRuntime(settings.name, svc.handler, env, tasks, do_host, svc.ready, checks,
                          access_log=settings.access_log, max_body_bytes=settings.max_body_bytes or svc.max_body_bytes,
                          public=svc.public, verifier=verifier, shm=shm, header_timeout_s=settings.header_timeout_s,
                          body_timeout_s=settings.body_timeout_s)


def app_runner(app: web.Application) -> web.AppRunner:
    """The runner every app is served with (a public service's handlers are cancelled on disconnect)."""
    # keepalive_timeout: aiohttp closes a connection that has not delivered a whole request head this
    # long after its start or its previous reply (idle or half-open alike); its own default is an hour.
    return web.AppRunner(app, handle_signals=False, shutdown_timeout=30.0, access_log=None,
                         handler_cancellation=app[RUNTIME].public, keepalive_timeout=app[RUNTIME].header_timeout_s)


async def serve_apps(apps: list[tuple[web.Application, str, int]], on_ready: Callable[[], None] | None = None,
                     stop: asyncio.Event | None = None) -> None:
    """Serve until SIGTERM/SIGINT (or `stop`), then shut down gracefully."""
    stop = stop or asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    runners = []
    try:
        for app, host, port in apps:
            runner = app_runner(app)
            await runner.setup()
            runners.append(runner)
            await web.TCPSite(runner, host, port).start()
        if on_ready:
            on_ready()
        await stop.wait()
        log.info("shutting down")
    finally:
        for runner in reversed(runners):
            await runner.cleanup()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(sig)


def lean_serves(settings: HostSettings, rt: ServiceRuntime) -> bool:
    """Whether the lean server (deploy/local/lean_http.py) serves this service: an internal one that
    hosts no Durable Object, unless KNOT_HTTP_SERVER=aiohttp."""
    return settings.http_server == "lean" and not rt.public and rt.do_host is None


async def serve_lean(rt: ServiceRuntime, host: str, port: int, on_ready: Callable[[], None] | None = None,
                     stop: asyncio.Event | None = None, shutdown_timeout_s: float = 30.0) -> None:
    """serve_apps for one service on the lean server: until SIGTERM/SIGINT (or `stop`), then the
    requests in progress finish and the connections close."""
    from deploy.local.lean_http import LeanServer

    stop = stop or asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    server = LeanServer(rt, host, port)
    try:
        await server.start()
        if on_ready:
            on_ready()
        await stop.wait()
        log.info("shutting down")
    finally:
        await server.close(shutdown_timeout_s)
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(sig)


async def serve_one(settings: HostSettings) -> None:
    async with contextlib.AsyncExitStack() as stack:
        rt = await open_runtime(settings, stack)
        lean = lean_serves(settings, rt)

        def ready() -> None:
            log.info("listening on %s:%d (%s)", settings.host, settings.port,
                     "lean HTTP server" if lean else "aiohttp", extra={"port": settings.port})

        if lean:
            await serve_lean(rt, settings.host, settings.port, ready)
        else:
            await serve_apps([(build_app(rt), settings.host, settings.port)], on_ready=ready)
    log.info("stopped", extra={"wait_until": rt.tasks.stats()})
