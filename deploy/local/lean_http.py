"""A lean HTTP/1.1 server for the internal services that host no Durable Object: the layer
stations, the cobordism shards and the drafter. It serves the same handler, env and ctx as the
aiohttp app of deploy/local/host.py, and answers the same way, without aiohttp's web layer.

Why: a decode step of the 0.5B makes ten such calls in series (two stations, eight shards), and
the cluster is CPU-bound on 2 cores, so every call's CPU is the token's. aiohttp's request and
response objects, router and middlewares cost a shard about as much CPU as the product of its
vocabulary slice in the cluster (a perf profile). This server in their place cuts the shards'
CPU a token and raises decode a few percent (benchmarks/cluster_profile.py --only hops,cpu,
KNOT_HTTP_SERVER=aiohttp against the default; docs/lab/2026-12-05-internal-hops-lean-http-server.md).

The request line and headers are parsed by httptools (llhttp, Node's parser: request smuggling,
bad lengths and chunked bodies are its job). Per request, as the aiohttp app:
    - 413 (before the body is read) for a Content-Length, or a chunked body, past max_body_bytes;
    - GET /healthz and /readyz, the same JSON (host.health_body, host.ready_body);
    - any other path needs the cluster's signature (401 without it), then goes to the handler
      with X-Request-Id (the caller's or a new one) in the logging context and the reply;
    - large replies through shared memory to callers that offer it (host.shm_plan), else the
      socket; a streaming reply in chunked encoding.
Requests on one connection are answered in order. A malformed request gets a 400 naming what
is wrong and the connection is closed. A request's head must arrive within KNOT_HEADER_TIMEOUT_S
of the connection's start or previous reply (else the connection is closed), its body within
KNOT_BODY_TIMEOUT_S of its head (else 408). The Host header, which no signature covers, never enters
the URL a handler sees; a reply header holding a line break is never sent (a 500 instead). An internal handler is never cancelled when its caller
goes away (the aiohttp app does the same for internal services): it finishes what it started.

The public coordinator and the wardens (Durable Object routes, their streamed blocks) stay on
aiohttp; KNOT_HTTP_SERVER=aiohttp puts every service there.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from typing import TYPE_CHECKING

import httptools

from common.runtime import (BadRequest, Context, Headers, HttpError, InternalError, PayloadTooLarge, Request, Response,
                            aclose_stream, call_handler, error_response)
from deploy.local.host import (UNSIGNED_PATHS, BodyTimeout, health_body, log_access, must_be_signed, ready_body, reply_headers,
                               shm_plan, signature_refusal)
from deploy.local.logs import REQUEST_ID_HEADER, new_request_id, request_id_var, service_var

if TYPE_CHECKING:
    from deploy.local.host import ServiceRuntime

log = logging.getLogger(__name__)

MAX_HEADER_BYTES = 64 << 10  # the request line and headers together (aiohttp: 8190 a line)
MAX_HEADERS = 100
JOIN_BODY_BYTES = 256 << 10  # a reply up to this size goes out with its head in one write
_REASONS = {200: "OK", 400: "Bad Request", 401: "Unauthorized", 404: "Not Found", 408: "Request Timeout",
            413: "Payload Too Large",
            500: "Internal Server Error", 503: "Service Unavailable"}


class _Parsed:
    """One request as the parser delivers it."""
    __slots__ = ("method", "target", "headers", "body", "keep_alive", "error")

    def __init__(self) -> None:
        self.method, self.target, self.keep_alive = "", b"", False
        self.headers: list[tuple[str, str]] = []
        self.body: list[bytes] = []
        self.error: HttpError | None = None  # answer this instead, then close


class _Connection(asyncio.Protocol):
    """One client connection: parse, queue, answer in order."""

    def __init__(self, server: "LeanServer"):
        self.server, self.rt = server, server.rt
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpRequestParser(self)
        self.current: _Parsed | None = None
        self.header_bytes = self.body_bytes = 0
        self.queue: deque[_Parsed] = deque()
        self.worker: asyncio.Task | None = None
        self.closing = False  # no more requests are read; close once the queue is answered
        self.idle: asyncio.TimerHandle | None = None  # closes the connection: no whole request head in time
        self.body_timer: asyncio.TimerHandle | None = None  # refuses a body that does not arrive in time (408)
        self.can_write: asyncio.Future | None = None  # set while the transport's buffer is full

    # ---------------------------------------------------------------- asyncio.Protocol

    def connection_made(self, transport) -> None:
        self.transport = transport
        self.server.connections.add(self)
        self._arm_idle()

    def connection_lost(self, exc) -> None:
        self.server.connections.discard(self)
        self.closing = True
        for timer in (self.idle, self.body_timer):
            if timer is not None:
                timer.cancel()
        if self.can_write is not None and not self.can_write.done():
            self.can_write.set_result(None)  # a writer waiting on it finds the transport closing (_drain)

    def pause_writing(self) -> None:
        self.can_write = asyncio.get_running_loop().create_future()

    def resume_writing(self) -> None:
        if self.can_write is not None and not self.can_write.done():
            self.can_write.set_result(None)
        self.can_write = None

    def data_received(self, data: bytes) -> None:
        if self.closing:
            return
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserCallbackError:
            pass  # a callback refused the request (its error is queued)
        except httptools.HttpParserUpgrade:
            self._refuse(BadRequest("protocol upgrades are not served here"))
        except httptools.HttpParserError as e:
            self._refuse(BadRequest(f"malformed HTTP request: {e}"))
        if self.worker is None and self.current is None:
            self._arm_idle()  # between requests; a head that stops arriving half way keeps its first deadline

    def eof_received(self) -> bool:
        self.closing = True
        if self.worker is None:
            self.transport.close()
        return True  # answer what was queued; the worker closes

    # ---------------------------------------------------------------- httptools callbacks

    def on_message_begin(self) -> None:
        self.current = _Parsed()
        self.header_bytes = self.body_bytes = 0

    def on_url(self, url: bytes) -> None:
        self.current.target += url
        self._count_header(len(url))

    def on_header(self, name: bytes, value: bytes) -> None:
        self._count_header(len(name) + len(value))
        if len(self.current.headers) >= MAX_HEADERS:
            self._refuse(BadRequest(f"more than {MAX_HEADERS} headers"), stop=True)
        self.current.headers.append((name.decode("latin-1"), value.decode("latin-1")))

    def on_headers_complete(self) -> None:
        p = self.current
        if self.idle is not None:  # the head is in; its body has body_timeout_s
            self.idle.cancel()
            self.idle = None
        self.body_timer = asyncio.get_running_loop().call_later(self.rt.body_timeout_s, self._body_late)
        p.method = self.parser.get_method().decode("ascii", "replace")
        p.keep_alive = self.parser.should_keep_alive()
        length = next((v for k, v in p.headers if k.lower() == "content-length"), None)
        if length is not None and length.isdigit() and int(length) > self.rt.max_body_bytes:
            self._refuse(PayloadTooLarge(f"request body of {length} bytes is over the {self.rt.max_body_bytes}-byte "
                                         "limit"), stop=True)
        if (self.worker is None and not self.queue  # never inside another request's reply
                and any(k.lower() == "expect" and v.lower() == "100-continue" for k, v in p.headers)):
            self.transport.write(b"HTTP/1.1 100 Continue\r\n\r\n")  # curl waits a second for it otherwise

    def on_body(self, body: bytes) -> None:
        self.body_bytes += len(body)
        if self.body_bytes > self.rt.max_body_bytes:  # a chunked body, past the limit
            self._refuse(PayloadTooLarge(f"request body over the {self.rt.max_body_bytes}-byte limit"), stop=True)
        self.current.body.append(body)

    def on_message_complete(self) -> None:
        if self.body_timer is not None:
            self.body_timer.cancel()
            self.body_timer = None
        self._queue(self.current)
        self.current = None

    # ---------------------------------------------------------------- answering

    def _count_header(self, n: int) -> None:
        self.header_bytes += n
        if self.header_bytes > MAX_HEADER_BYTES:
            self._refuse(BadRequest(f"request line and headers over {MAX_HEADER_BYTES} bytes"), stop=True)

    def _refuse(self, err: HttpError, stop: bool = False) -> None:
        """Answer err after what is queued, read nothing more, close. stop: raise out of the parser."""
        if not self.closing:
            p = _Parsed()
            p.error = err
            self._queue(p)
            self.closing = True
            self.transport.pause_reading()
        if stop:
            raise httptools.HttpParserCallbackError(str(err))

    def _queue(self, p: _Parsed) -> None:
        self.queue.append(p)
        if self.worker is None:
            self.worker = asyncio.get_running_loop().create_task(self._answer_all())
            self.server.workers.add(self.worker)
            self.worker.add_done_callback(self.server.workers.discard)

    async def _answer_all(self) -> None:
        try:
            while self.queue and not self.transport.is_closing():
                p = self.queue.popleft()
                await self._answer(p)
                if p.error is not None or not p.keep_alive:
                    self.closing = True
                    break
        except ConnectionError:
            pass  # the client went away mid-reply
        except Exception:  # noqa: BLE001 - a bug here must not leave the connection hanging
            log.exception("lean server: answering a request failed")
        finally:
            self.worker = None
            if self.closing or self.transport.is_closing():
                self.transport.close()
            else:
                self._arm_idle()

    def _arm_idle(self) -> None:
        """The next request's head must arrive within header_timeout_s (idle and slow clients alike)."""
        if self.idle is None and self.body_timer is None and not self.closing:
            self.idle = asyncio.get_running_loop().call_later(self.rt.header_timeout_s, self.transport.close)

    def _body_late(self) -> None:
        self.body_timer = None
        self._refuse(BodyTimeout(f"the request body did not arrive within {self.rt.body_timeout_s:g} s "
                                 f"(KNOT_BODY_TIMEOUT_S)"))

    async def _answer(self, p: _Parsed) -> None:
        headers = Headers(p.headers)
        rid = headers.get(REQUEST_ID_HEADER) or new_request_id()
        rid_token, service_token = request_id_var.set(rid), service_var.set(self.rt.name)
        t0 = time.perf_counter()
        path = p.target.split(b"?", 1)[0].decode("latin-1")
        try:
            try:
                resp = await self._respond(p, headers, path, rid)
            except Exception as e:  # noqa: BLE001 - ours, not the handler's (call_handler maps those): still a reply
                log.exception("lean server: %s %s failed", p.method, path)
                resp = error_response(e, rid)
            resp.headers[REQUEST_ID_HEADER] = rid
            log_access(self.rt, p.method, path, resp.status, t0)
            await self._send(resp, headers, p.method == "HEAD")
        finally:
            request_id_var.reset(rid_token)
            service_var.reset(service_token)

    async def _respond(self, p: _Parsed, headers: Headers, path: str, rid: str) -> Response:
        if p.error is not None:
            return error_response(p.error, rid)
        if not p.target.startswith(b"/"):
            return error_response(BadRequest(f"request target {p.target[:80]!r} is not a path"), rid)
        rt = self.rt
        if path in UNSIGNED_PATHS and p.method in ("GET", "HEAD"):
            if path == "/healthz":
                return Response.from_json(health_body(rt))
            body, status = await ready_body(rt)
            return Response.from_json(body, status)
        body = b"".join(p.body)
        target = p.target.decode("latin-1")
        if must_be_signed(rt, path) and (err := signature_refusal(rt, p.method, target, body, headers)) is not None:
            return error_response(err, rid)
        # Not the Host header: the signature does not cover it, and a handler reads its path from this URL
        request = Request(p.method, f"http://{self.server.host}:{self.server.port}{target}", headers, body)
        return await call_handler(rt.handler, request, rt.env, Context(rt.tasks.add), rid)

    async def _send(self, resp: Response, request_headers: Headers, head_only: bool) -> None:
        out = reply_headers(resp)
        bad = next((k for k, v in out.items() if "\r" in k + v or "\n" in k + v), None)
        if bad is not None:  # it would forge headers or a reply
            await aclose_stream(resp.stream)
            resp = error_response(InternalError(f"the handler's reply header {bad[:40]!r} holds a line break"),
                                  request_id_var.get())
            resp.headers[REQUEST_ID_HEADER] = request_id_var.get()
            out = reply_headers(resp)
        status = f"HTTP/1.1 {resp.status} {_REASONS.get(resp.status, 'Status')}\r\n"
        if resp.stream is not None:
            lines = "".join(f"{k}: {v}\r\n" for k, v in out.items())
            self.transport.write(f"{status}Transfer-Encoding: chunked\r\n{lines}\r\n".encode("utf-8"))
            try:
                async for chunk in resp.stream:
                    if chunk:
                        self.transport.write(b"%x\r\n" % len(chunk))
                        self.transport.writelines((chunk, b"\r\n"))
                        await self._drain()
                self.transport.write(b"0\r\n\r\n")
            except ConnectionError as e:
                log.info("client disconnected mid-stream: %s; closing the stream", e or type(e).__name__)
                self.closing = True
            finally:
                await aclose_stream(resp.stream)
            return
        parts = resp.parts
        plan = shm_plan(self.rt, request_headers, self.transport, resp)
        if plan is not None:
            out |= plan[0]
            parts = plan[1]
        n = sum(memoryview(x).nbytes for x in parts)
        lines = "".join(f"{k}: {v}\r\n" for k, v in out.items())
        head = f"{status}Content-Length: {n}\r\n{lines}\r\n".encode("utf-8")  # as aiohttp encodes them
        if head_only:
            self.transport.write(head)
        elif n <= JOIN_BODY_BYTES:  # one send: a reply in two segments wakes its reader twice
            self.transport.write(head + b"".join(parts))
        else:
            self.transport.write(head)
            for part in parts:
                if memoryview(part).nbytes:
                    self.transport.write(part)
                    await self._drain()

    async def _drain(self) -> None:
        if self.can_write is not None:
            await self.can_write
        if self.transport.is_closing():
            raise ConnectionResetError("the client closed the connection")


class LeanServer:
    """Serves one ServiceRuntime on host:port until close()."""

    def __init__(self, rt: "ServiceRuntime", host: str, port: int):
        self.rt, self.host, self.port = rt, host, port
        self.connections: set[_Connection] = set()
        self.workers: set[asyncio.Task] = set()
        self._server: asyncio.AbstractServer | None = None

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(lambda: _Connection(self), self.host, self.port)
        self.port = self._server.sockets[0].getsockname()[1]  # the one the kernel chose for port 0

    async def close(self, timeout_s: float = 30.0) -> None:
        """Stop accepting, let the requests in progress finish (up to timeout_s), close every connection."""
        if self._server is not None:
            self._server.close()
        for c in list(self.connections):
            c.closing = True
            if c.worker is None:
                c.transport.close()
        if self.workers:
            await asyncio.wait(list(self.workers), timeout=timeout_s)
        for c in list(self.connections):
            c.transport.close()
        if self._server is not None:
            await self._server.wait_closed()
