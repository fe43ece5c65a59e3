"""What both warden Durable Objects share: identity, /configure, the knot version, the route table.

A warden's identity is "{knot_key}|{start}-{end}" (layers for the LayerWarden, vocabulary rows for
the CobordismWarden). It is set once, by POST /configure {"knot_key", start, end} or by identity
headers on the first call, and a request that names another identity gets 409: a warden never
silently serves a different knot (seed section 8, "bucket binding mismatch": knot_key is always
explicit, never an env default).

Within its identity a warden serves one knot version at a time (a Served: the pinned source, the
header and the caches filled from that version). A request names the version its caller works on
(X-Knot-Etag); when the bucket moved on to it, the warden loads it with empty caches, and a request
for any other version gets 503 (services/knot_source.py). Every reply names the version it was
served from, and X-Knot-Cache-Rejects counts the cache entries this request found bad (each one a
miss, refetched): a caller adds them to its own /stats, which the coordinator's /metrics gathers.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Any, Awaitable, Callable, Mapping

from common.knot import KnotHeader
from common.models import Model
from common.runtime import (BadGateway, BadRequest, Conflict, DurableObjectNamespace, DurableObjectState, Env,
                            Headers, MethodNotAllowed, NotFound, Request, Response, int_param)
from common.settings import read
from services.boot import BootCache
from services.knot_source import KNOT_ETAG_HEADER, KnotSource, read_pin, serving_version
from services.peer import call

KNOT_ID_HEADER = "X-Knot-Id"
CACHE_REJECTS_HEADER = "X-Knot-Cache-Rejects"  # "tier=n,...": entries this request found bad, by tier


def format_rejects(rejects: Mapping[str, int]) -> str:
    return ",".join(f"{tier}={n}" for tier, n in sorted(rejects.items()) if n)


def parse_rejects(value: str | None) -> dict[str, int]:
    """The X-Knot-Cache-Rejects header -> {tier: n}; a malformed part is ignored (it is only a count)."""
    out: dict[str, int] = {}
    for part in (value or "").split(","):
        tier, _, n = part.partition("=")
        if tier.strip() and n.strip().isdigit():
            out[tier.strip()] = int(n)
    return out


@dataclass
class Served:
    """One knot version a warden serves: its pinned source, its header, its model and the caches
    filled from it."""

    source: KnotSource
    header: KnotHeader
    model: Model
    caches: Any  # what the subclass's _caches() built


@dataclass(frozen=True)
class Identity:
    knot_key: str
    start: int
    end: int

    @property
    def name(self) -> str:
        return f"{self.knot_key}|{self.start}-{self.end}"


class IdentityFields:
    """Where a warden kind reads its identity: JSON fields of /configure and request headers."""

    def __init__(self, start_field: str, end_field: str, start_header: str, end_header: str):
        self.start_field, self.end_field = start_field, end_field
        self.start_header, self.end_header = start_header, end_header

    def from_json(self, body: Any) -> Identity:
        if not isinstance(body, dict):
            raise BadRequest("configure body must be a JSON object")
        knot_key = body.get("knot_key")
        if not isinstance(knot_key, str) or not knot_key:
            raise BadRequest("configure needs an explicit knot_key (there is no default knot)")
        return self._make(knot_key, body.get(self.start_field), body.get(self.end_field))

    def headers(self, identity: Identity) -> dict[str, str]:
        """The headers a caller sends to name `identity` (what from_headers reads)."""
        return {KNOT_ID_HEADER: identity.knot_key, self.start_header: str(identity.start),
                self.end_header: str(identity.end)}

    def from_headers(self, headers: Headers) -> Identity | None:
        if KNOT_ID_HEADER not in headers:
            return None
        return self._make(headers[KNOT_ID_HEADER], headers.get(self.start_header), headers.get(self.end_header),
                          self.start_header, self.end_header)

    def _make(self, knot_key: str, start: Any, end: Any, start_what: str | None = None,
              end_what: str | None = None) -> Identity:
        a = int_param(None if start is None else str(start), start_what or self.start_field)
        b = int_param(None if end is None else str(end), end_what or self.end_field)
        if a >= b:
            raise BadRequest(f"empty range: {start_what or self.start_field}={a} >= {end_what or self.end_field}={b}")
        return Identity(knot_key, a, b)


Route = Callable[[Request, str], Awaitable[Response]]


class WardenBase:
    """A DO class: cls(state, env) with async fetch(request). Subclasses set FIELDS, ROUTES and READER."""

    FIELDS: IdentityFields
    READER: str  # who reads its settings (common/settings.py READERS)
    ROUTES: dict[tuple[str, str], str]  # (method, path prefix) -> method name; the rest of the path is passed

    def __init__(self, state: DurableObjectState, env: Env):
        self.state, self.env = state, env
        self.identity: Identity | None = None
        self._body: dict = {}  # the /configure body (budget_bytes), applied to every version loaded
        self._served: BootCache[Served] = BootCache()  # one entry: the version this warden serves now
        self.rejects: Counter[str] = Counter()  # cache entries found bad, by tier, across versions

    @property
    def served(self) -> Served | None:
        return None if self.identity is None else self._served.peek(self.identity.name)

    async def fetch(self, request: Request) -> Response:
        path = request.path
        for (method, prefix), attr in self.ROUTES.items():
            if path == prefix or (prefix.endswith("/") and path.startswith(prefix)):
                if request.method != method:
                    raise MethodNotAllowed(f"{request.method} {path}: use {method}")
                return await getattr(self, attr)(request, path[len(prefix):])
        raise NotFound(f"no route {request.method} {path}")

    # -------------------------------------------------------- identity

    def _check_name(self, identity: Identity) -> None:
        name = getattr(self.state.id, "name", "")
        if name and name != identity.name:
            raise Conflict(f"this warden instance is {name!r}; a request for {identity.name!r} was misrouted")

    async def _adopt(self, identity: Identity, body: dict | None, knot_etag: str | None = None) -> Served:
        """Take the identity (first call) and serve the knot version knot_etag (None: the loaded one)."""
        self._check_name(identity)
        if self.identity is not None and identity != self.identity:
            raise Conflict(f"warden is configured as {self.identity.name!r}, request is for {identity.name!r}")

        async def load(pin: str) -> Served:
            source = KnotSource(self.env.KNOT_BUCKET, identity.knot_key, pin)
            header, model = await source.header(), await source.model()
            self._validate(identity, header, model)
            return Served(source, header, model, self._caches(header, model, source, self._body))

        if self.identity is None:
            self._body = body or {}
        served = await serving_version(self._served, identity.name, load, lambda s: s.source, knot_etag,
                                       pin=read_pin(self.env, self.READER))
        self.identity = identity
        return served

    async def _identified(self, request: Request) -> Served:
        """What a data request is served from: the identity from headers on the first call (checked on
        later ones), at the knot version the request's X-Knot-Etag names."""
        identity = self.FIELDS.from_headers(request.headers) or self.identity
        if identity is None:
            raise Conflict(f"warden is not configured: POST /configure with knot_key first, or send "
                           f"{KNOT_ID_HEADER}, {self.FIELDS.start_header} and {self.FIELDS.end_header}")
        return await self._adopt(identity, None, request.headers.get(KNOT_ETAG_HEADER))

    def _reply(self, served: Served, resp: Response, rejects: Mapping[str, int] | None = None) -> Response:
        """Name the version a reply was served from, and the bad cache entries this request met."""
        resp.headers[KNOT_ETAG_HEADER] = served.source.etag
        rejects = {tier: n for tier, n in (rejects or {}).items() if n}
        if rejects:
            self.rejects.update(rejects)
            resp.headers[CACHE_REJECTS_HEADER] = format_rejects(rejects)
        return resp

    async def configure(self, request: Request, _rest: str) -> Response:
        body = request.json()
        served = await self._adopt(self.FIELDS.from_json(body), body)
        return self._reply(served, Response.from_json(await self.stats_dict()))

    async def stats(self, request: Request, _rest: str) -> Response:
        identity = self.FIELDS.from_headers(request.headers)
        if identity is not None:  # a first call may be /stats too
            await self._adopt(identity, None)
        return Response.from_json(await self.stats_dict())

    async def stats_dict(self) -> dict[str, Any]:
        served = self.served
        if served is None:
            return {"configured": False}
        return {"configured": True, "identity": self.identity.name, "knot_key": self.identity.knot_key,
                "knot_bytes": served.source.size, **served.source.stats(), "knot_reloads": self._served.reloads,
                "rejects": dict(self.rejects), **self._stats(served)}

    # -------------------------------------------------------- subclass hooks

    def _validate(self, identity: Identity, header: KnotHeader, model: Model) -> None:
        raise NotImplementedError

    def _caches(self, header: KnotHeader, model: Model, source: KnotSource, body: dict) -> Any:
        """The caches of one knot version (empty): what Served.caches holds."""
        raise NotImplementedError

    def _stats(self, served: Served) -> dict[str, Any]:
        raise NotImplementedError


def budget_from(body: dict, env: Env, reader: str) -> int:
    """budget_bytes from the configure body, else MEMORY_BUDGET_BYTES (the var, else the reader's default)."""
    raw = body.get("budget_bytes")
    return read(env, "MEMORY_BUDGET_BYTES", reader) if raw in (None, "") else int_param(str(raw), "budget_bytes")


async def route_to_warden(request: Request, namespace, fields: IdentityFields) -> Response:
    """The warden Worker's fetch: pick the DO instance named by the request's identity."""
    if request.path == "/configure" and request.method == "POST":
        identity = fields.from_json(request.json())
    else:
        identity = fields.from_headers(request.headers)
        if identity is None:
            raise BadRequest(f"{request.method} {request.path}: send {KNOT_ID_HEADER}, {fields.start_header} "
                             f"and {fields.end_header} so the request reaches the right warden")
    stub = namespace.get(namespace.id_from_name(identity.name))
    return await stub.fetch(request)


class WardenVersionMismatch(BadGateway):
    """A warden answered for another knot version than its caller serves: the caller reads R2."""


class WardenClient:
    """Calls to the warden instance named "{knot_key}|{start}-{end}" through its DO namespace, with
    its identity headers built once. The clients next to each warden subclass it.

    With knot_etag (the caller's pinned version), every request names it and every reply must come
    from it (WardenVersionMismatch otherwise); the bad cache entries the warden reports in
    X-Knot-Cache-Rejects add up in `rejects`, by tier."""

    FIELDS: IdentityFields
    URL: str  # a DO stub routes by itself: only the path is read

    def __init__(self, namespace: DurableObjectNamespace, knot_key: str, start: int, end: int,
                 knot_etag: str | None = None):
        identity = Identity(knot_key, start, end)
        self.stub = namespace.get(namespace.id_from_name(identity.name))
        self.knot_etag = knot_etag
        self.headers = self.FIELDS.headers(identity) | ({KNOT_ETAG_HEADER: knot_etag} if knot_etag else {})
        self.rejects: Counter[str] = Counter()
        self.version_mismatches = 0

    async def _post(self, path: str, content_type: str | None = None, body: bytes = b"") -> Response:
        """The warden's 2xx reply; PeerError for any other status (no timeout: the DO is the cache)."""
        headers = self.headers | ({"Content-Type": content_type} if content_type else {})
        resp = await call(self.stub, Request("POST", self.URL + path, headers, body), None)
        if self.knot_etag and resp.headers.get(KNOT_ETAG_HEADER) != self.knot_etag:
            self.version_mismatches += 1
            raise WardenVersionMismatch(f"{path}: the warden answered for knot version "
                                        f"{resp.headers.get(KNOT_ETAG_HEADER)!r}, the caller serves {self.knot_etag!r}")
        self.rejects.update(parse_rejects(resp.headers.get(CACHE_REJECTS_HEADER)))
        return resp
