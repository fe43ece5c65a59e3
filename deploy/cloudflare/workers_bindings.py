"""Workers bindings behind the protocols of common.runtime: R2 -> Bucket, KV -> KVNamespace, Durable
Object namespaces, service bindings, ctx.waitUntil -> Ctx. Which env name is which binding comes
from the KNOT_BINDINGS var that `knot deploy cloudflare` writes (env_from_js).

Each wrapper takes the raw JS binding (the SDK's env wrapper is looked through), converts its
arguments explicitly (convert.py) and turns JS failures into the runtime's typed errors:
an unreachable or failing binding is ServiceUnavailable (503), a wrong range RangeNotSatisfiable.

R2 ranged reads, measured on workerd-shaped objects: get(key, {range: {offset, length}})
- clamps a length that runs past the end (a short body, no error);
- throws "Unspecified error (0)" when offset == size, and error 10039 when offset > size.
The Bucket contract is [start, end) with 0 <= start < end <= size or RangeNotSatisfiable, so the
wrapper checks the returned object's size and body length, and on a thrown range error asks head()
for the size to tell "past the end" (416) from a failing bucket (503).

Pinned reads (get(..., if_match=etag)) pass onlyIf {etagMatches: etag}. When the object has another
etag, workerd's get() resolves to the object's metadata without a body (an R2Object, not an
R2ObjectBody: "when no body is present, preconditions have failed", Cloudflare's R2 example);
some references say null. Either way the wrapper raises PreconditionFailed, as S3's 412 does
locally, and it checks the etag of every body it returns, so a bucket that ignored onlyIf still
cannot hand out another version's bytes.

Internal calls are signed as on the local host (common/signing.py): every service binding and
Durable Object stub signs what it sends with the Worker's KNOT_INTERNAL_SECRET (a secret, `wrangler
secret put`) for the Worker it goes to (KNOT_PEERS: binding -> Worker name), and every internal
Worker and Durable Object verifies what it receives as its own name (KNOT_SERVICE_NAME; entry.py).
Which secrets a Worker must have comes from the KNOT_SECRETS var; a missing one is a 503 naming it.
"""
from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from urllib.parse import urlsplit
from typing import Any, Awaitable

import js
from pyodide.ffi import JsException, JsProxy, to_js

from common import signing
from common.runtime import (BadGateway, DurableObjectId, Env, ObjectBody, ObjectMeta, PreconditionFailed,
                            RangeNotSatisfiable, Request, Response, ServiceUnavailable)
from services import tracing
from deploy.cloudflare.convert import absolute, as_bytes, js_object, request_to_js, response_from_js

log = logging.getLogger(__name__)

KV_MIN_TTL_S = 60  # Workers KV refuses an expirationTtl below 60 s
DO_NAME_HEADER = "X-Durable-Object-Name"  # as on the local host: the instance learns its name from it
BINDINGS_VAR = "KNOT_BINDINGS"  # JSON {name: kind}; kinds below
VARS_VAR = "KNOT_VARS"  # comma-separated names of the plain vars the handler reads
KINDS = ("r2", "kv", "do", "service", "do-service")  # "do-service:INSTANCE": one named DO as a Service
SECRETS_VAR = "KNOT_SECRETS"  # comma-separated names of the secrets the Worker must have (wrangler secret put)
PEERS_VAR = "KNOT_PEERS"  # JSON {binding: the Worker its calls go to}: what they are signed for
INTERNAL_SECRET = "KNOT_INTERNAL_SECRET"  # signs and verifies internal calls (the handlers key caches with it)


def raw(binding: Any) -> Any:
    """The JS object behind the SDK's wrappers (_EnvWrapper, _BindingWrapper, _FetcherWrapper). A JS
    object is returned as it is: a service binding (a Fetcher) answers every property name with an RPC
    stub, so probing it for `_binding` would give a stub whose fetch is refused as an RPC call."""
    if isinstance(binding, JsProxy):
        return binding
    for attr in ("_binding", "_env"):
        inner = getattr(binding, attr, None)
        if inner is not None:
            return inner
    return binding


def _missing(value: Any) -> bool:
    """JS null and undefined both arrive as None, or as pyodide's jsnull on newer Pyodides."""
    return value is None or type(value).__name__ == "JsNull"


class R2Bucket:
    """Bucket over an R2 binding."""

    def __init__(self, binding: Any, name: str = "R2"):
        self._b, self.name = raw(binding), name

    @staticmethod
    def _meta(obj: Any) -> ObjectMeta:
        return ObjectMeta(str(obj.key), int(obj.size), str(obj.etag))

    async def _call(self, what: str, call: Awaitable) -> Any:
        try:
            return await call
        except JsException as e:
            raise ServiceUnavailable(f"R2 {self.name} {what}: {e}") from None

    async def head(self, key: str) -> ObjectMeta | None:
        obj = await self._call(f"head {key!r}", self._b.head(key))
        return None if _missing(obj) else self._meta(obj)

    async def _unmatched(self, key: str, obj: Any, if_match: str | None) -> bool:
        """Whether get()'s result says the object is missing (False) or not version if_match
        (PreconditionFailed); True: obj is a body of the version asked for."""
        if _missing(obj):
            if if_match is None or await self.head(key) is None:
                return False
            raise PreconditionFailed(f"{key}: the object is no longer version {if_match!r}")
        if if_match is not None and str(obj.etag) != if_match:  # the failed onlyIf: metadata, no body
            raise PreconditionFailed(f"{key}: the object is now version {str(obj.etag)!r}, not {if_match!r}")
        return True

    async def get(self, key: str, range: tuple[int, int] | None = None,
                  if_match: str | None = None) -> ObjectBody | None:
        options: dict[str, Any] = {} if if_match is None else {"onlyIf": {"etagMatches": if_match}}
        if range is None:
            obj = await self._call(f"get {key!r}", self._b.get(key, js_object(options)))
            if not await self._unmatched(key, obj, if_match):
                return None
            meta = self._meta(obj)
            return ObjectBody(key, meta.size, meta.etag, as_bytes(await obj.arrayBuffer()))
        start, end = range
        if not 0 <= start < end:
            raise RangeNotSatisfiable(f"{key}: invalid byte range [{start}, {end})")
        try:
            obj = await self._b.get(key, js_object({**options, "range": {"offset": start, "length": end - start}}))
        except JsException as e:
            meta = await self.head(key)  # offset == size or offset > size throw; anything else is the bucket's
            if meta is not None and end > meta.size:
                raise RangeNotSatisfiable(f"{key}: byte range [{start}, {end}) runs past the object's "
                                          f"{meta.size} bytes") from None
            raise ServiceUnavailable(f"R2 {self.name} get {key!r} [{start}, {end}): {e}") from None
        if not await self._unmatched(key, obj, if_match):
            return None
        meta = self._meta(obj)
        if end > meta.size:  # R2 clamped the length: never hand out a short read
            raise RangeNotSatisfiable(f"{key}: byte range [{start}, {end}) runs past the object's {meta.size} bytes")
        body = as_bytes(await obj.arrayBuffer())
        if len(body) != end - start:
            raise BadGateway(f"R2 {self.name} get {key!r} [{start}, {end}): {len(body)} bytes, expected {end - start}")
        return ObjectBody(key, meta.size, meta.etag, body, (start, end))

    async def put(self, key: str, value: bytes) -> ObjectMeta:
        obj = await self._call(f"put {key!r}", self._b.put(key, to_js(bytes(value))))
        return self._meta(obj)

    async def list(self, prefix: str = "", limit: int = 1000) -> list[ObjectMeta]:
        res = await self._call(f"list {prefix!r}", self._b.list(js_object({"prefix": prefix, "limit": limit})))
        return [self._meta(o) for o in res.objects]


class KV:
    """KVNamespace over a Workers KV binding; values are bytes (ArrayBuffer)."""

    def __init__(self, binding: Any, name: str = "KV"):
        self._kv, self.name = raw(binding), name

    async def get(self, key: str) -> bytes | None:
        try:
            value = await self._kv.get(key, js_object({"type": "arrayBuffer"}))
        except JsException as e:
            raise ServiceUnavailable(f"KV {self.name} get {key!r}: {e}") from None
        return None if _missing(value) else as_bytes(value)

    async def put(self, key: str, value: bytes, expiration_ttl: int | None = None) -> None:
        options: dict[str, Any] = {}
        if expiration_ttl is not None:
            if expiration_ttl < KV_MIN_TTL_S:
                raise ValueError(f"KV {self.name} put {key!r}: expiration_ttl {expiration_ttl} s, "
                                 f"Workers KV needs at least {KV_MIN_TTL_S} s")
            options["expirationTtl"] = int(expiration_ttl)
        try:
            await self._kv.put(key, to_js(bytes(value)), js_object(options))
        except JsException as e:
            raise ServiceUnavailable(f"KV {self.name} put {key!r}: {e}") from None

    async def delete(self, key: str) -> None:
        try:
            await self._kv.delete(key)
        except JsException as e:
            raise ServiceUnavailable(f"KV {self.name} delete {key!r}: {e}") from None


def signed_target(url: str) -> str:
    """What a signature covers of a URL: its path and query, as in a request line."""
    parts = urlsplit(absolute(url))
    return (parts.path or "/") + (f"?{parts.query}" if parts.query else "")


class Signer:
    """Signs this Worker's calls to one other Worker (`to`: its name) and its Durable Objects; never
    shows the secret."""

    def __init__(self, secret: str, to: str):
        if not to:
            raise ValueError("a signer needs its destination's name (the Worker its calls go to)")
        self._secret, self.to = signing.check_secret(secret), to

    def __repr__(self) -> str:
        return f"Signer(<secret>, to={self.to!r})"

    def signed(self, request: Request, do_name: str = "") -> Request:
        """A copy of request carrying its signature (the clock and a random nonce: uuid4's 122 bits)."""
        out = request.with_url(request.url)
        out.headers[signing.SIGNATURE_HEADER] = signing.sign(self._secret, request.method, signed_target(request.url),
                                                             request.body or b"", time.time(), uuid.uuid4().hex,
                                                             to=self.to, do_name=do_name)
        return out


async def _fetch(what: str, fetcher: Any, request: Request) -> Response:
    try:
        js_response = await fetcher.fetch(request_to_js(request))
    except JsException as e:
        raise ServiceUnavailable(f"{what}: {e}") from None
    return await response_from_js(js_response)


class ServiceBinding:
    """Service over a service binding (another Worker's fetch)."""

    def __init__(self, binding: Any, name: str = "service", signer: Signer | None = None):
        self._f, self.name, self._signer = raw(binding), name, signer

    async def fetch(self, request: Request) -> Response:
        if self._signer is not None:
            request = self._signer.signed(request)
        return await _fetch(f"service {self.name} {request.method} {request.path}", self._f, request)


class DurableObjectStub:
    """A JS stub is got anew for every call: workerd binds a stub to the request that got it and
    refuses it in another ("Cannot perform I/O on behalf of a different request"), while a booted
    handler keeps its stubs across requests."""

    def __init__(self, ns: Any, id: DurableObjectId, what: str, signer: Signer | None = None):
        self._ns, self.id, self._what, self._signer = ns, id, what, signer

    async def fetch(self, request: Request) -> Response:
        request = request.with_url(request.url)
        request.headers[DO_NAME_HEADER] = self.id.name
        if self._signer is not None:
            request = self._signer.signed(request, self.id.name)
        stub = self._ns.get(self._ns.idFromName(self.id.name))
        return await _fetch(f"{self._what} {self.id.name!r} {request.method} {request.path}", stub, request)


class DurableObjectNamespace:
    """DurableObjectNamespace over a DO namespace binding; ids are derived from names."""

    def __init__(self, binding: Any, name: str = "DO", signer: Signer | None = None):
        self._ns, self.name, self._signer = raw(binding), name, signer

    def id_from_name(self, name: str) -> DurableObjectId:
        return DurableObjectId(name, str(self._ns.idFromName(name).toString()))

    def get(self, id: DurableObjectId) -> DurableObjectStub:
        return DurableObjectStub(self._ns, id, f"Durable Object {self.name}",
                                 self._signer)


class DurableObjectService:
    """A Service that is one named instance of a DO namespace (a station: its KV sessions stay put)."""

    def __init__(self, namespace: DurableObjectNamespace, instance: str):
        self.namespace, self.instance = namespace, instance

    async def fetch(self, request: Request) -> Response:
        return await self.namespace.get(self.namespace.id_from_name(self.instance)).fetch(request)


def js_promise(task: asyncio.Future) -> Any:
    """A JS Promise settled by `task`: what waitUntil must be given. A Python awaitable handed over
    directly becomes a borrowed proxy, destroyed when the call returns, before JS awaits it."""

    def executor(resolve: Any, reject: Any) -> None:  # runs inside Promise.new, before it returns
        def settle(t: asyncio.Future) -> None:
            if t.cancelled():
                reject(js.Error.new("cancelled"))
            elif t.exception() is not None:
                e = t.exception()
                log.warning("waitUntil task failed: %s: %s", type(e).__name__, e, exc_info=e)
                reject(js.Error.new(f"{type(e).__name__}: {e}"))
            else:
                resolve(None)

        task.add_done_callback(settle)

    return js.Promise.new(executor)


class JsContext:
    """Ctx (and a Durable Object's wait_until) over a JS ExecutionContext or DurableObjectState."""

    def __init__(self, js_ctx: Any):
        self._ctx = raw(getattr(js_ctx, "_ctx", js_ctx))  # the SDK wraps a DO's state too

    def wait_until(self, awaitable: Awaitable[Any]) -> None:
        self._ctx.waitUntil(js_promise(asyncio.ensure_future(awaitable)))


def js_var(js_env: Any, name: str) -> str | None:
    value = getattr(js_env, name, None)
    return None if _missing(value) else str(value)


def _names(js_env: Any, var: str) -> list[str]:
    return [n.strip() for n in (js_var(js_env, var) or "").split(",") if n.strip()]


def secrets_from_js(js_env: Any) -> dict[str, str]:
    """The secrets KNOT_SECRETS names, each required: a Worker deployed without one answers 503 naming it."""
    js_env = raw(js_env)
    values = {n: js_var(js_env, n) for n in _names(js_env, SECRETS_VAR)}
    missing = [n for n, v in values.items() if not v]
    if missing:
        raise ServiceUnavailable(f"secret {', '.join(missing)} is not set: this Worker refuses every request until "
                                 f"`npx wrangler secret put {missing[0]}` (its README says where the value is)")
    return values


def env_from_js(js_env: Any) -> Env:
    """The handler's Env from a Worker's env: KNOT_BINDINGS says what each binding is, KNOT_VARS
    which plain vars to pass, KNOT_SECRETS which secrets it must have (the internal secret signs its
    calls through the bindings; all go to the handler, e.g. KNOT_API_KEY). A binding or secret missing
    from the Worker's config fails here, by name."""
    js_env = raw(js_env)
    secrets = secrets_from_js(js_env)
    secret = secrets.get(INTERNAL_SECRET)
    if secret is not None and len(secret) < signing.MIN_SECRET_CHARS:  # not the generated one
        raise ServiceUnavailable(f"secret {INTERNAL_SECRET} has {len(secret)} characters, at least "
                                 f"{signing.MIN_SECRET_CHARS} are needed")
    try:
        peers = json.loads(js_var(js_env, PEERS_VAR) or "{}")
    except ValueError as e:
        raise ServiceUnavailable(f"config {PEERS_VAR} is not JSON: {e}") from None

    def signer(name: str) -> Signer | None:
        if secret is None:
            return None
        if not peers.get(name):
            raise ServiceUnavailable(f"config {PEERS_VAR} names no Worker for binding {name!r}: its calls "
                                     f"could not be signed")
        return Signer(secret, peers[name])
    spec_text = js_var(js_env, BINDINGS_VAR)
    if spec_text is None:
        raise ServiceUnavailable(f"config {BINDINGS_VAR!r} is missing: the Worker's vars must name its bindings")
    try:
        spec = json.loads(spec_text)
    except ValueError as e:
        raise ServiceUnavailable(f"config {BINDINGS_VAR} is not JSON: {e}") from None
    bindings: dict[str, Any] = {}
    for name, kind in spec.items():
        kind, _, instance = str(kind).partition(":")
        if kind not in KINDS:
            raise ServiceUnavailable(f"config {BINDINGS_VAR}: binding {name!r} has kind {kind!r}, expected one of {KINDS}")
        b = getattr(js_env, name, None)
        if _missing(b):
            raise ServiceUnavailable(f"binding {name!r} ({kind}) is not in this Worker's env: check its wrangler config")
        if kind == "r2":
            bindings[name] = R2Bucket(b, name)
        elif kind == "kv":
            bindings[name] = KV(b, name)
        elif kind == "do":
            bindings[name] = DurableObjectNamespace(b, name, signer(name))
        elif kind == "service":
            bindings[name] = ServiceBinding(b, name, signer(name))
        else:
            bindings[name] = DurableObjectService(DurableObjectNamespace(b, name, signer(name)), instance)
    values = {n: js_var(js_env, n) for n in _names(js_env, VARS_VAR)}
    values.update(secrets)  # as the local host's handler_vars: the internal secret keys the wardens' caches
    # every call carries the request's traceparent (services/tracing.py)
    return Env({n: tracing.traced(b, n) for n, b in bindings.items()}, {n: v for n, v in values.items() if v is not None})


def request_id(request: Request) -> str:
    return request.headers.get("X-Request-Id") or request.headers.get("Cf-Ray") or uuid.uuid4().hex
