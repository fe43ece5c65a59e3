"""Per-request traces: W3C `traceparent` on every internal call, each hop a span on the caller's side.

    scope = begin(ring, request.headers, "POST /v1/completions")   # the coordinator: a trace's root
    traced(binding, "STATION_0")      # a host's binding: its calls carry traceparent and become spans
    serving(handler)                   # a host's handler: a call that came with traceparent collects
                                       # the spans of its own calls and returns them (SPANS_HEADER)

A span is (name, peer, start, duration, status). The coordinator keeps whole traces in a bounded ring
(Ring: GET /traces); every other service keeps nothing: the spans of the calls it made for one request
(a station's warden reads, a shard's KV reads) are summed by (name, peer, status) and go back to its
caller in SPANS_HEADER, at most MAX_SUMMARY of them, and the caller puts them under its own hop's
span. Nothing is recorded for a call without a trace (the contextvar is unset): one lookup per call.

Times: a span's start is seconds after its trace's first span, on the recording process's
perf_counter; a callee's summaries are placed by their offset from its handler's start, so a hop's
children sit inside it up to the network's latency.
"""
from __future__ import annotations

import collections
import itertools
import json
import re
import time
import uuid
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any, Awaitable, Callable, Mapping

from common.runtime import Response, status_for

TRACEPARENT = "traceparent"
SPANS_HEADER = "X-Knot-Spans"  # a callee's summed spans, JSON: [[name, peer, start_s, end_s, busy_s, count, status]]
TRACE_ID_HEADER = "X-Trace-Id"  # on the coordinator's replies: where GET /traces/<id> finds the request
MAX_SUMMARY = 32  # (name, peer, status) groups a callee returns; more are counted as dropped
MAX_SPANS = 4096  # spans one trace keeps in the coordinator's ring; more are counted as dropped
RING_TRACES = 64  # traces the coordinator keeps, the oldest dropped first

# version "00": 2 hex, trace id 32 lowercase hex, parent id 16, flags 2 (W3C Trace Context, 3.2)
_TRACEPARENT = re.compile(r"([0-9a-f]{2})-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})(-.*)?")


@dataclass(frozen=True)
class Parent:
    trace_id: str
    span_id: str
    sampled: bool = True  # flags bit 0: the caller records this trace; 0 asks that nothing be recorded


def parse_traceparent(value: str | None) -> Parent | None:
    """A traceparent header -> its trace and parent span ids; None when absent or invalid (W3C: an
    invalid header is ignored and a new trace starts), never an error."""
    if not value or len(value) > 512:
        return None
    m = _TRACEPARENT.fullmatch(value.strip())
    if m is None:
        return None
    version, trace_id, span_id, flags, rest = m.groups()
    # version ff is invalid; version 00 has nothing after the flags; ids of all zeros are invalid
    if version == "ff" or (version == "00" and rest) or trace_id == "0" * 32 or span_id == "0" * 16:
        return None
    return Parent(trace_id, span_id, bool(int(flags, 16) & 1))


def traceparent(trace_id: str, span_id: str) -> str:
    return f"00-{trace_id}-{span_id}-01"  # sampled: every span is recorded


# A span id is this process's random prefix and a counter: unique within a trace as W3C asks, and no
# random draw per call (a coordinator makes ten calls a token). The prefix is drawn at the first span,
# not at import: a Cloudflare Worker may not draw random bytes outside a request (workerd raises).
_span_prefix: str | None = None
_span_counter = itertools.count(1)


def new_span_id() -> str:
    global _span_prefix
    if _span_prefix is None:
        _span_prefix = uuid.uuid4().hex[:8]
    return f"{_span_prefix}{next(_span_counter) & 0xFFFFFFFF:08x}"


@dataclass(slots=True)
class Span:
    span_id: str | None  # None: a callee's summary of several calls
    parent_id: str | None
    name: str
    peer: str
    start_s: float  # after the trace's first span started
    duration_s: float
    status: str  # an HTTP status, "ok", or the error's kind
    count: int = 1  # calls summed into this span
    busy_s: float | None = None  # their summed durations (a summary's calls may overlap or leave gaps)

    def as_json(self) -> dict:
        return {"span_id": self.span_id, "parent_id": self.parent_id, "name": self.name, "peer": self.peer,
                "start_ms": round(self.start_s * 1e3, 3), "duration_ms": round(self.duration_s * 1e3, 3),
                "status": self.status, "count": self.count,
                "busy_ms": None if self.busy_s is None else round(self.busy_s * 1e3, 3)}


class Trace:
    """One trace's spans in the coordinator, as they are recorded (a request in flight is readable)."""

    def __init__(self, trace_id: str, clock: Callable[[], float] = time.perf_counter,
                 wall: Callable[[], float] = time.time, max_spans: int = MAX_SPANS):
        self.trace_id, self.clock, self.max_spans = trace_id, clock, max_spans
        self.t0, self.started_at = clock(), wall()
        self.spans: list[Span] = []
        self.dropped = 0
        self.open = 0  # server spans not yet ended
        self.name = ""  # the last request's, as it began (its span is recorded as it ends)

    def add(self, span: Span) -> None:
        if len(self.spans) < self.max_spans:
            self.spans.append(span)
        else:
            self.dropped += 1

    def record(self, parent_id: str | None, span_id: str | None, name: str, peer: str, t0: float, t1: float,
               status: str, summary: str | None = None) -> None:
        """A call from t0 to t1 (this process's clock); summary: the callee's SPANS_HEADER, put under it."""
        self.add(Span(span_id, parent_id, name, peer, t0 - self.t0, t1 - t0, status))
        if summary:
            for name_, peer_, a, b, busy, n, st in parse_summary(summary):
                self.add(Span(None, span_id, name_, peer_, t0 - self.t0 + a, b - a, st, n, busy))

    def as_json(self) -> dict:
        return {"trace_id": self.trace_id, "started_at": self.started_at, "in_flight": self.open > 0,
                "dropped": self.dropped, "spans": [s.as_json() for s in sorted(self.spans, key=lambda s: s.start_s)]}


class Ring:
    """The coordinator's last RING_TRACES traces by id; on_end hooks see each request's trace as it
    ends (the OTLP exporter, when one is configured)."""

    def __init__(self, size: int = RING_TRACES, clock: Callable[[], float] = time.perf_counter):
        self.size, self.clock = size, clock
        self._traces: collections.OrderedDict[str, Trace] = collections.OrderedDict()
        self.on_end: list[Callable[[Trace, Span], None]] = []

    def trace(self, trace_id: str) -> Trace:
        """The trace of that id, new or kept (a client may send several requests in one trace)."""
        t = self._traces.pop(trace_id, None) or Trace(trace_id, self.clock)
        self._traces[trace_id] = t  # the most recent last
        while len(self._traces) > self.size:
            self._traces.popitem(last=False)
        return t

    def get(self, trace_id: str) -> Trace | None:
        return self._traces.get(trace_id)

    def recent(self) -> list[Trace]:
        return list(reversed(self._traces.values()))


@dataclass
class Scope:
    """Where this task's calls record their spans: into a Trace (the coordinator), or a Summary."""

    trace_id: str
    span_id: str  # the span the calls are children of
    sink: Any  # Trace | Summary
    t0: float = 0.0
    name: str = ""
    peer: str = ""
    parent_id: str | None = None  # the client's span, for the coordinator's server span
    ended: bool = False


_current: ContextVar[Scope | None] = ContextVar("knot_trace", default=None)


def current() -> Scope | None:
    return _current.get()


def enter(scope: Scope | None) -> None:
    """Make scope current again (a generation resumed from another task, as subrequests.enter)."""
    if scope is not None and _current.get() is not scope:
        _current.set(scope)


def leave() -> None:
    """No trace is current in this task (a call made for several generations: each records its own span)."""
    _current.set(None)


def shared_span(scope: Scope | None, path: str, peer: str, t0: float, t1: float, status: str) -> None:
    """A call made for several generations (a bundle): its span in one generation's trace."""
    if scope is not None:
        scope.sink.record(scope.span_id, new_span_id(), path, peer, t0, t1, status)


def begin(ring: Ring, headers: Mapping[str, str], name: str, peer: str = "coordinator") -> Scope | None:
    """A request's server span in ring: under the client's traceparent (same trace id) or a new trace
    when it sent none or an invalid one. Current from here on; end() closes it. None, and nothing
    recorded, when the client's traceparent is not sampled (flags 00): its calls carry no traceparent."""
    parent = parse_traceparent(headers.get(TRACEPARENT))
    if parent is not None and not parent.sampled:
        _current.set(None)
        return None
    trace = ring.trace(parent.trace_id if parent else uuid.uuid4().hex)
    trace.open += 1
    trace.name = name
    scope = Scope(trace.trace_id, new_span_id(), trace, ring.clock(), name, peer, parent.span_id if parent else None)
    _current.set(scope)
    return scope


def end(ring: Ring, scope: Scope, status: str) -> None:
    """Close the request's server span (once)."""
    if scope.ended:
        return
    scope.ended = True
    trace = scope.sink
    span = Span(scope.span_id, scope.parent_id, scope.name, scope.peer, scope.t0 - trace.t0,
                ring.clock() - scope.t0, status)
    trace.add(span)
    trace.open -= 1
    for hook in ring.on_end:
        hook(trace, span)


def outcome(e: BaseException) -> str:
    """A failed call's status: its HTTP status, or "cancelled"."""
    return "cancelled" if not isinstance(e, Exception) else str(status_for(e))


# ---------------------------------------------------------------- a callee's side


class Summary:
    """The spans of one served request's calls, summed by (name, peer, status): first start, last
    end, summed duration and count, at most MAX_SUMMARY groups. Times from the handler's start."""

    def __init__(self, t0: float):
        self.t0 = t0
        self.groups: dict[tuple[str, str, str], list[float]] = {}
        self.dropped = 0

    def record(self, parent_id, span_id, name: str, peer: str, t0: float, t1: float, status: str,
               summary: str | None = None) -> None:
        key = (name, peer, status)
        g = self.groups.get(key)
        if g is None:
            if len(self.groups) >= MAX_SUMMARY:
                self.dropped += 1
                return
            self.groups[key] = [t0 - self.t0, t1 - self.t0, t1 - t0, 1]
        else:
            g[1], g[2], g[3] = max(g[1], t1 - self.t0), g[2] + t1 - t0, g[3] + 1

    def header(self) -> str:
        return json.dumps([[n, p, round(a, 6), round(b, 6), round(busy, 6), int(c), s]
                           for (n, p, s), (a, b, busy, c) in self.groups.items()], separators=(",", ":"))


def parse_summary(value: str) -> list[tuple[str, str, float, float, float, int, str]]:
    """A callee's SPANS_HEADER -> its groups; a malformed one (a peer's reply is untrusted) gives none:
    a trace misses detail rather than failing the request it describes."""
    try:
        rows = json.loads(value)
        out = [(str(n), str(p), float(a), float(b), float(busy), int(c), str(s)) for n, p, a, b, busy, c, s in rows]
    except (ValueError, TypeError):
        return []
    return out[:MAX_SUMMARY]


def serving(handler: Callable[..., Awaitable[Response]]) -> Callable[..., Awaitable[Response]]:
    """A host's handler: a request that came with a valid traceparent collects its calls' spans and
    returns them in SPANS_HEADER; any other runs as it is."""

    async def fetch(request, env, ctx) -> Response:
        parent = parse_traceparent(request.headers.get(TRACEPARENT))
        if parent is None or not parent.sampled:
            return await handler(request, env, ctx)
        summary = Summary(time.perf_counter())
        token = _current.set(Scope(parent.trace_id, parent.span_id, summary))
        try:
            resp = await handler(request, env, ctx)
        finally:
            _current.reset(token)
        if summary.groups and isinstance(resp, Response):
            resp.headers[SPANS_HEADER] = summary.header()
        return resp

    return fetch


# ---------------------------------------------------------------- a caller's side: traced bindings


class TracedService:
    """A Service (or a Durable Object stub): each call carries traceparent and is a span."""

    def __init__(self, inner: Any, peer: str):
        self.inner, self.peer = inner, peer

    async def fetch(self, request):
        scope = _current.get()
        if scope is None:
            return await self.inner.fetch(request)
        span_id = new_span_id()
        request.headers[TRACEPARENT] = traceparent(scope.trace_id, span_id)
        t0 = time.perf_counter()
        try:
            resp = await self.inner.fetch(request)
        except BaseException as e:
            scope.sink.record(scope.span_id, span_id, request.path, self.peer, t0, time.perf_counter(), outcome(e))
            raise
        summary = resp.headers.get(SPANS_HEADER)
        if summary is not None:
            del resp.headers[SPANS_HEADER]
        scope.sink.record(scope.span_id, span_id, request.path, self.peer, t0, time.perf_counter(),
                          str(resp.status), summary)
        return resp

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


class TracedNamespace:
    """A Durable Object namespace whose stubs are TracedService (peer "BINDING/instance")."""

    def __init__(self, inner: Any, peer: str):
        self.inner, self.peer = inner, peer

    def get(self, id: Any) -> TracedService:
        return TracedService(self.inner.get(id), f"{self.peer}/{getattr(id, 'name', id)}")

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


async def _stored(peer: str, what: str, call: Awaitable) -> Any:
    """A bucket's or KV namespace's call, a span when a trace is current."""
    scope = _current.get()
    if scope is None:
        return await call
    t0 = time.perf_counter()
    try:
        out = await call
    except BaseException as e:
        scope.sink.record(scope.span_id, new_span_id(), what, peer, t0, time.perf_counter(), outcome(e))
        raise
    scope.sink.record(scope.span_id, new_span_id(), what, peer, t0, time.perf_counter(), "ok")
    return out


class TracedBucket:
    """A Bucket whose calls are spans named "<method> <key>"."""

    def __init__(self, inner: Any, peer: str):
        self.inner, self.peer = inner, peer

    async def head(self, key, *args, **kwargs):
        return await _stored(self.peer, f"head {key}", self.inner.head(key, *args, **kwargs))

    async def get(self, key, *args, **kwargs):
        return await _stored(self.peer, f"get {key}", self.inner.get(key, *args, **kwargs))

    async def put(self, key, *args, **kwargs):
        return await _stored(self.peer, f"put {key}", self.inner.put(key, *args, **kwargs))

    async def list(self, *args, **kwargs):
        return await _stored(self.peer, "list", self.inner.list(*args, **kwargs))

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


class TracedKV:
    """A KV namespace whose calls are spans named "<method> <key>"."""

    def __init__(self, inner: Any, peer: str):
        self.inner, self.peer = inner, peer

    async def get(self, key, *args, **kwargs):
        return await _stored(self.peer, f"get {key}", self.inner.get(key, *args, **kwargs))

    async def put(self, key, *args, **kwargs):
        return await _stored(self.peer, f"put {key}", self.inner.put(key, *args, **kwargs))

    async def delete(self, key, *args, **kwargs):
        return await _stored(self.peer, f"delete {key}", self.inner.delete(key, *args, **kwargs))

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def traced(binding: Any, name: str) -> Any:
    """A host's binding, its calls traced (peer: the binding's name). Other objects (a plain var, the
    shared blocks) are returned as they are."""
    if hasattr(binding, "fetch"):
        return TracedService(binding, name)
    if hasattr(binding, "id_from_name"):
        return TracedNamespace(binding, name)
    if hasattr(binding, "head") and hasattr(binding, "get"):
        return TracedBucket(binding, name)
    if hasattr(binding, "get") and hasattr(binding, "put") and hasattr(binding, "delete"):
        return TracedKV(binding, name)
    return binding
