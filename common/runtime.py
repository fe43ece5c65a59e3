"""The handler contract: Worker-shaped `fetch(request, env, ctx) -> Response`.

Pure (stdlib only): the same handlers run on the local aiohttp host (deploy/local/), in one
process with embedded bindings (`knot serve --embedded`), and later on Cloudflare's Python
Workers under Pyodide, where aiohttp, boto3 and redis do not exist. docs/runtime.md is the
long form.

A service module exports
    async def fetch(request: Request, env: Env, ctx: Ctx) -> Response
and optionally DURABLE_OBJECTS = {"ClassName": cls}, each class built as cls(state, env) with
    async def fetch(self, request: Request) -> Response
"""
from __future__ import annotations

import json as _json
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Awaitable, Callable, Iterable, Iterator, Mapping, MutableMapping, Protocol
from urllib.parse import parse_qsl, urlsplit

# ---------------------------------------------------------------- headers


class Headers(MutableMapping[str, str]):
    """Case-insensitive header map; keeps the spelling of the last write for output."""

    def __init__(self, items: Mapping[str, str] | Iterable[tuple[str, str]] | None = None):
        self._d: dict[str, tuple[str, str]] = {}
        if items is not None:
            pairs = items.items() if isinstance(items, Mapping) else items
            for k, v in pairs:
                self[k] = v

    def __getitem__(self, key: str) -> str:
        return self._d[key.lower()][1]

    def __setitem__(self, key: str, value: str) -> None:
        self._d[key.lower()] = (key, str(value))

    def __delitem__(self, key: str) -> None:
        del self._d[key.lower()]

    def __iter__(self) -> Iterator[str]:
        return (k for k, _ in self._d.values())

    def __len__(self) -> int:
        return len(self._d)

    def __repr__(self) -> str:
        return f"Headers({dict(self.items())!r})"

    def copy(self) -> "Headers":
        return Headers(self.items())


# ---------------------------------------------------------------- request / response


@dataclass
class Request:
    """An HTTP request with its body already read. `url` is absolute or a path."""

    method: str
    url: str
    headers: Headers = field(default_factory=Headers)
    body: bytes = b""

    def __post_init__(self) -> None:
        self.method = self.method.upper()
        if not isinstance(self.headers, Headers):
            self.headers = Headers(self.headers)
        self.body = bytes(self.body)

    @property
    def path(self) -> str:
        return urlsplit(self.url).path or "/"

    @property
    def query(self) -> dict[str, str]:
        """Query parameters; for a repeated key the last value wins."""
        return dict(parse_qsl(urlsplit(self.url).query, keep_blank_values=True))

    def text(self) -> str:
        try:
            return self.body.decode("utf-8")
        except UnicodeDecodeError as e:
            raise BadRequest(f"request body is not UTF-8 (byte {e.start})") from None

    def json(self) -> Any:
        """The body parsed as JSON; BadRequest (400) when it is not, when it nests deeper than
        MAX_JSON_DEPTH, or when a string holds a lone surrogate (JSON can spell "\\ud800"; no
        UTF-8 text can hold it, so the tokenizer and every later encode would fail on it)."""
        if not self.body:
            raise BadRequest("request body is empty, expected JSON")
        try:
            value = _json.loads(self.text(), parse_int=_json_int)
        except _json.JSONDecodeError as e:
            raise BadRequest(f"request body is not JSON: {e.msg} at byte {e.pos}") from None
        except RecursionError:
            raise BadRequest(f"request body: JSON nested too deeply (at most {MAX_JSON_DEPTH} levels)") from None
        _check_json_value(value)
        return value

    def with_url(self, url: str) -> "Request":
        """A copy aimed at another URL (same method, headers, body)."""
        return Request(self.method, url, self.headers.copy(), self.body)


MAX_JSON_DEPTH = 64  # arrays and objects inside each other; no API body needs more than a few
# Digits of an integer in a body: a seed (2**64) has 20. Why a bound of ours: past Python's own
# (4,300 by default) int() raises a ValueError that json.loads lets through (a 500), and where that
# bound is lifted, a million-digit integer takes quadratic time to convert.
MAX_JSON_INT_DIGITS = 100


def _json_int(digits: str) -> int:
    if len(digits.lstrip("-")) > MAX_JSON_INT_DIGITS:
        raise BadRequest(f"request body: an integer of {len(digits.lstrip('-')):,} digits; numbers here have at "
                         f"most {MAX_JSON_INT_DIGITS}")
    return int(digits)


def _check_json_value(value: Any) -> None:
    """Depth and text checks over a parsed body, iteratively (no recursion for a hostile depth)."""
    stack = [(value, 1, "$")]
    while stack:
        v, depth, where = stack.pop()
        if isinstance(v, str):
            _check_text(v, where)
        elif isinstance(v, (list, dict)):
            if depth > MAX_JSON_DEPTH:
                raise BadRequest(f"request body: JSON nested too deeply at {where} (at most {MAX_JSON_DEPTH} levels)")
            if isinstance(v, dict):
                for k, item in v.items():
                    _check_text(k, f"{where} key")
                    stack.append((item, depth + 1, f"{where}.{k}"[:200]))
            else:
                stack.extend((item, depth + 1, f"{where}[{i}]") for i, item in enumerate(v))


def _check_text(s: str, where: str) -> None:
    try:
        s.encode("utf-8")
    except UnicodeEncodeError as e:
        raise BadRequest(f"request body: {where} holds a lone surrogate U+{ord(s[e.start]):04X} at character "
                         f"{e.start}, which is not Unicode text") from None


class Response:
    """A reply. `body` is bytes; a streaming reply has `stream` instead (and body b"").

    `stream` is an async iterator of bytes chunks, written one by one as they come (Workers: a
    ReadableStream body). The host either iterates it to the end or, when the client goes away,
    stops and calls aclose_stream(), so a producer's `finally` always runs (cancel work, free state).

    A body may also be given as `parts` (from_parts): buffers whose concatenation is the body. A
    host that can write them one by one (the local host, to a socket or a shared-memory buffer)
    never joins them; reading `body` joins them once. Why: a LayerWarden's batch is ~56 MB of frames
    it already holds, per phase of a 7B; the join was a copy of every streamed byte (issue 15).
    """

    def __init__(self, status: int = 200, headers: Mapping[str, str] | Iterable[tuple[str, str]] | None = None,
                 body: bytes | memoryview = b"", stream: AsyncIterator[bytes] | None = None):
        self.status = status
        self.headers = headers if isinstance(headers, Headers) else Headers(headers)
        self.body = body
        self.stream = stream
        # offset -> (length, crc32) of byte ranges of the body, computed by this process's own binding
        # as it copied them in (never read from the wire): a decoder may take a frame's crc32 from
        # here instead of a second pass over its bytes (deploy/local/shm.py, common/wire.py)
        self.body_crc32s: dict[int, tuple[int, int]] = {}

    @property
    def body(self) -> bytes | memoryview:
        # bytes; or a read-only memoryview of the buffer a large reply was received into, kept as it
        # is (a host's binding that reads a peer's body straight into one buffer: no copy of tens of MB)
        if self._parts is not None:
            self._body, self._parts = b"".join(self._parts), None
        return self._body

    @body.setter
    def body(self, value: bytes | memoryview) -> None:
        self._parts = None
        self._body = value if isinstance(value, memoryview) and value.readonly else bytes(value)

    @property
    def parts(self) -> tuple[bytes | memoryview, ...]:
        """The body's buffers in order, not joined (one part unless from_parts made it)."""
        return self._parts if self._parts is not None else (self._body,)

    @property
    def nbytes(self) -> int:
        """len(body), without joining the parts."""
        return sum(memoryview(p).nbytes for p in self.parts)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Response):
            return NotImplemented
        return (self.status, self.headers, self.body) == (other.status, other.headers, other.body)

    def __repr__(self) -> str:
        return f"Response(status={self.status}, headers={self.headers!r}, nbytes={self.nbytes})"

    @classmethod
    def from_parts(cls, parts: Iterable[bytes | memoryview], content_type: str = "application/octet-stream",
                   status: int = 200, headers: Mapping[str, str] | None = None) -> "Response":
        """A body given as the buffers it concatenates (kept, not copied: nobody may change them)."""
        resp = cls.from_bytes(b"", content_type, status, headers)
        kept = []
        for p in parts:
            if isinstance(p, memoryview) and not (p.readonly and p.c_contiguous):
                raise TypeError("Response.from_parts: a memoryview part must be read-only and contiguous")
            kept.append(p if isinstance(p, (bytes, memoryview)) else bytes(p))
        resp._parts = tuple(kept)
        return resp

    @classmethod
    def from_json(cls, obj: Any, status: int = 200, headers: Mapping[str, str] | None = None) -> "Response":
        h = Headers(headers or {})
        h["Content-Type"] = "application/json"
        return cls(status, h, _json.dumps(obj, separators=(",", ":")).encode("utf-8"))

    @classmethod
    def from_text(cls, text: str, status: int = 200, headers: Mapping[str, str] | None = None) -> "Response":
        h = Headers(headers or {})
        h.setdefault("Content-Type", "text/plain; charset=utf-8")
        return cls(status, h, text.encode("utf-8"))

    @classmethod
    def from_bytes(cls, body: bytes, content_type: str = "application/octet-stream", status: int = 200,
                   headers: Mapping[str, str] | None = None) -> "Response":
        h = Headers(headers or {})
        h["Content-Type"] = content_type
        return cls(status, h, body)

    @classmethod
    def from_stream(cls, chunks: AsyncIterator[bytes], content_type: str = "application/octet-stream",
                    status: int = 200, headers: Mapping[str, str] | None = None) -> "Response":
        """A streaming reply: `chunks` is iterated by the host, and closed (aclose) if it stops early."""
        h = Headers(headers or {})
        h["Content-Type"] = content_type
        return cls(status, h, b"", chunks)

    @property
    def ok(self) -> bool:
        return 200 <= self.status < 300

    def text(self) -> str:
        return str(self.body, "utf-8")

    def json(self) -> Any:
        return _json.loads(bytes(self.body) if isinstance(self.body, memoryview) else self.body)


async def aclose_stream(stream: Any) -> None:
    """Close a response stream (run its producer's cleanup); a no-op for iterators without aclose."""
    close = getattr(stream, "aclose", None)
    if close is not None:
        await close()


# ---------------------------------------------------------------- errors -> HTTP status
# The one place that maps errors to statuses; the local host and the Cloudflare adapter both
# turn exceptions into responses through error_response().


class HttpError(Exception):
    status = 500

    def __init__(self, message: str, *, headers: Mapping[str, str] | None = None):
        super().__init__(message)
        self.headers = dict(headers or {})


class BadRequest(HttpError):
    status = 400


class Unauthorized(HttpError):
    """A call without valid credentials: an internal call unsigned or signed wrongly, a public call
    without the API key."""

    status = 401


class Forbidden(HttpError):
    status = 403


class NotFound(HttpError):
    status = 404


class MethodNotAllowed(HttpError):
    status = 405


class Conflict(HttpError):
    status = 409


class PreconditionFailed(HttpError):
    """A conditional read (Bucket.get with if_match) found another version of the object."""

    status = 412


class PayloadTooLarge(HttpError):
    status = 413


class RangeNotSatisfiable(HttpError):
    status = 416


class InternalError(HttpError):
    status = 500


class BadGateway(HttpError):
    """A peer or binding answered, but wrongly (bad status, malformed reply)."""

    status = 502


class ServiceUnavailable(HttpError):
    """A peer or binding could not be reached, or this service is not ready."""

    status = 503


class GatewayTimeout(HttpError):
    status = 504


def status_for(exc: BaseException) -> int:
    if isinstance(exc, HttpError):
        return exc.status
    if isinstance(exc, TimeoutError):  # asyncio.TimeoutError is TimeoutError since 3.11
        return GatewayTimeout.status
    return InternalError.status


def error_response(exc: BaseException, request_id: str | None = None) -> Response:
    """JSON error body {"error": type, "message": str, "request_id": ...} with the mapped status."""
    status = status_for(exc)
    body: dict[str, Any] = {"error": type(exc).__name__, "message": str(exc) or type(exc).__name__}
    if request_id:
        body["request_id"] = request_id
    headers = exc.headers if isinstance(exc, HttpError) else None
    return Response.from_json(body, status=status, headers=headers)


def raise_for_status(resp: Response, what: str) -> Response:
    """A peer's non-2xx reply -> the same HttpError class locally (5xx -> BadGateway)."""
    if resp.ok:
        return resp
    try:
        detail = resp.json().get("message", "")
    except (ValueError, AttributeError):
        detail = bytes(resp.body[:200]).decode("utf-8", "replace")  # a large body is a memoryview
    cls = next((c for c in _BY_STATUS if c.status == resp.status), BadGateway)
    if resp.status >= 500:
        cls = BadGateway
    raise cls(f"{what}: HTTP {resp.status}: {detail}")


_BY_STATUS = (BadRequest, Unauthorized, Forbidden, NotFound, MethodNotAllowed, Conflict, PreconditionFailed,
              PayloadTooLarge, RangeNotSatisfiable)


# ---------------------------------------------------------------- bindings (protocols)


@dataclass(frozen=True)
class ObjectMeta:
    key: str
    size: int  # bytes of the whole object
    etag: str


@dataclass(frozen=True)
class ObjectBody:
    key: str
    size: int  # bytes of the whole object, not of the body
    etag: str
    body: bytes
    range: tuple[int, int] | None = None  # [start, end) that body holds; None = whole object


ByteRange = tuple[int, int]  # [start, end_exclusive)


class Bucket(Protocol):
    """R2-like object store. A range must satisfy 0 <= start < end <= size, else RangeNotSatisfiable.

    get(..., if_match=etag) reads only that version of the object (S3 If-Match, R2 onlyIf
    {etagMatches}): when the object now has another etag it raises PreconditionFailed, and the
    body returned always carries the etag of the version it was read from.
    """

    async def get(self, key: str, range: ByteRange | None = None,
                  if_match: str | None = None) -> ObjectBody | None: ...
    async def head(self, key: str) -> ObjectMeta | None: ...
    async def put(self, key: str, value: bytes) -> ObjectMeta: ...
    async def list(self, prefix: str = "", limit: int = 1000) -> list[ObjectMeta]: ...


class KVNamespace(Protocol):
    """Workers-KV-like store of bytes. Cloudflare needs expiration_ttl >= 60 s."""

    async def get(self, key: str) -> bytes | None: ...
    async def put(self, key: str, value: bytes, expiration_ttl: int | None = None) -> None: ...
    async def delete(self, key: str) -> None: ...


@dataclass(frozen=True)
class DurableObjectId:
    name: str  # the name it was derived from
    hex: str  # stable 64-hex-digit id, the same for the same (namespace, name)

    def __str__(self) -> str:
        return self.hex


class DurableObjectStub(Protocol):
    async def fetch(self, request: Request) -> Response: ...


class DurableObjectNamespace(Protocol):
    def id_from_name(self, name: str) -> DurableObjectId: ...
    def get(self, id: DurableObjectId) -> DurableObjectStub: ...


class Service(Protocol):
    """A service binding: another Worker's fetch."""

    async def fetch(self, request: Request) -> Response: ...


class Ctx(Protocol):
    def wait_until(self, awaitable: Awaitable[Any]) -> None: ...


class DurableObjectState(Protocol):
    """What a Durable Object class gets as `state`: its id and a wait_until."""

    id: DurableObjectId

    def wait_until(self, awaitable: Awaitable[Any]) -> None: ...


class Context:
    """A Ctx that hands wait_until work to an owner (the host's task tracker)."""

    def __init__(self, wait_until: Callable[[Awaitable[Any]], None]):
        self._wait_until = wait_until

    def wait_until(self, awaitable: Awaitable[Any]) -> None:
        self._wait_until(awaitable)


class State(Context):
    def __init__(self, id: DurableObjectId, wait_until: Callable[[Awaitable[Any]], None]):
        super().__init__(wait_until)
        self.id = id


class Env:
    """Bindings and plain vars by attribute: env.KNOT_BUCKET, env.MEMORY_BUDGET_BYTES.

    A missing name raises AttributeError naming what is there, so a missing binding fails loudly.
    """

    def __init__(self, bindings: Mapping[str, Any] | None = None, vars: Mapping[str, str] | None = None):
        self._items: dict[str, Any] = {**(vars or {}), **(bindings or {})}

    def __getattr__(self, name: str) -> Any:
        try:
            return self.__dict__["_items"][name]
        except KeyError:
            have = ", ".join(sorted(self.__dict__["_items"])) or "nothing"
            raise AttributeError(f"env has no binding or var {name!r} (it has: {have})") from None

    def get(self, name: str, default: Any = None) -> Any:
        return self._items.get(name, default)

    def __contains__(self, name: str) -> bool:
        return name in self._items

    def names(self) -> list[str]:
        return sorted(self._items)

    def update(self, items: Mapping[str, Any]) -> None:
        """For hosts wiring bindings that point at each other; handlers never call this."""
        self._items.update(items)


Handler = Callable[[Request, Env, Ctx], Awaitable[Response]]


async def call_handler(handler: Handler, request: Request, env: Env, ctx: Ctx,
                       request_id: str | None = None) -> Response:
    """Run a handler; any exception becomes error_response(). Hosts and adapters use this."""
    try:
        resp = await handler(request, env, ctx)
    except Exception as e:  # noqa: BLE001 - the one mapping point: every error becomes a status
        return error_response(e, request_id)
    if not isinstance(resp, Response):
        return error_response(InternalError(f"handler returned {type(resp).__name__}, not Response"), request_id)
    return resp


# ---------------------------------------------------------------- small helpers for handlers


def int_param(value: str | None, what: str, *, minimum: int = 0) -> int:
    """Parse a non-negative integer from a header/query value; BadRequest naming `what`."""
    if value is None or value == "":
        raise BadRequest(f"{what} is missing")
    try:
        n = int(value)
    except ValueError:
        raise BadRequest(f"{what} must be an integer, got {value!r}") from None
    if n < minimum:
        raise BadRequest(f"{what} must be >= {minimum}, got {n}")
    return n
