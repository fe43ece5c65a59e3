"""Real bindings: S3 through boto3, KV through Redis, services and Durable Objects over HTTP.

Every call has a timeout; failures become the runtime's typed errors (ServiceUnavailable when a
server cannot be reached, GatewayTimeout when it is too slow, BadGateway when it answers wrongly).
"""
from __future__ import annotations

import asyncio
import functools
import secrets
import socket
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable
from urllib.parse import urlsplit

import aiohttp
import boto3
import botocore.exceptions
import redis.asyncio as aioredis
import redis.exceptions
import yarl
from botocore.config import Config

from common import signing
from common.runtime import (BadGateway, BadRequest, DurableObjectId, GatewayTimeout, Headers, ObjectBody, ObjectMeta,
                            PreconditionFailed, RangeNotSatisfiable, Request, Response, ServiceUnavailable)
from deploy.local.durable import DO_NAME_HEADER, DO_ROUTE_PREFIX, object_id
from deploy.local.embedded_bindings import check_etag, check_range
from deploy.local.logs import REQUEST_ID_HEADER, request_id_var
from deploy.local.shm import PID_NS_HEADER, PIECES_HEADER, SHM_HEADER, SHM_LENGTH_HEADER, ReplyReader, ShmError



@dataclass(frozen=True)
class S3Settings:
    endpoint_url: str | None
    access_key_id: str | None
    secret_access_key: str | None
    region: str = "us-east-1"
    connect_timeout_s: float = 5.0
    read_timeout_s: float = 30.0


def s3_client(s: S3Settings):
    """A boto3 S3 client with socket timeouts and bounded retries (path-style, for MinIO/SeaweedFS)."""
    config = Config(connect_timeout=s.connect_timeout_s, read_timeout=s.read_timeout_s,
                    retries={"max_attempts": 2, "mode": "standard"}, s3={"addressing_style": "path"},
                    max_pool_connections=16)
    return boto3.client("s3", endpoint_url=s.endpoint_url, aws_access_key_id=s.access_key_id,
                        aws_secret_access_key=s.secret_access_key, region_name=s.region, config=config)


class S3Bucket:
    """R2-like bucket over S3. boto3 blocks, so every call runs in this binding's thread pool."""

    def __init__(self, settings: S3Settings, bucket: str, max_threads: int = 8):
        self.bucket = bucket
        self._client = s3_client(settings)
        self._pool = ThreadPoolExecutor(max_workers=max_threads, thread_name_prefix=f"s3-{bucket}")
        # Overall deadline per call, above botocore's per-socket ones (connect + read, 2 attempts).
        self._timeout_s = 2 * (settings.connect_timeout_s + settings.read_timeout_s)

    async def _call(self, what: str, fn: Callable, **kwargs) -> Any:
        loop = asyncio.get_running_loop()
        try:
            return await asyncio.wait_for(loop.run_in_executor(self._pool, functools.partial(fn, **kwargs)),
                                          self._timeout_s)
        except (TimeoutError, botocore.exceptions.ReadTimeoutError, botocore.exceptions.ConnectTimeoutError):
            raise GatewayTimeout(f"S3 {what}: no answer within {self._timeout_s:.0f} s") from None
        except botocore.exceptions.EndpointConnectionError as e:
            raise ServiceUnavailable(f"S3 {what}: cannot reach the endpoint: {e}") from None

    @staticmethod
    def _code(e: botocore.exceptions.ClientError) -> str:
        return str(e.response.get("Error", {}).get("Code", ""))

    async def head(self, key: str) -> ObjectMeta | None:
        try:
            r = await self._call(f"head {key}", self._client.head_object, Bucket=self.bucket, Key=key)
        except botocore.exceptions.ClientError as e:
            if self._code(e) in ("404", "NoSuchKey", "NotFound"):
                return None
            raise BadGateway(f"S3 head {self.bucket}/{key}: {self._code(e)}: {e}") from None
        return ObjectMeta(key, int(r["ContentLength"]), r.get("ETag", "").strip('"'))

    async def get(self, key: str, range: tuple[int, int] | None = None,
                  if_match: str | None = None) -> ObjectBody | None:
        kwargs: dict[str, Any] = {"Bucket": self.bucket, "Key": key}
        if if_match is not None:
            kwargs["IfMatch"] = f'"{if_match}"'  # an entity tag is quoted on the wire
        if range is not None:
            start, end = range
            if not 0 <= start < end:
                raise RangeNotSatisfiable(f"{key}: invalid byte range [{start}, {end})")
            kwargs["Range"] = f"bytes={start}-{end - 1}"  # HTTP Range: bytes=a-b includes byte b

        def fetch(**kw):
            r = self._client.get_object(**kw)
            with r["Body"] as stream:
                return r, stream.read()

        try:
            r, body = await self._call(f"get {key}", fetch, **kwargs)
        except botocore.exceptions.ClientError as e:
            code = self._code(e)
            if code in ("NoSuchKey", "404", "NotFound"):
                return None
            if code in ("InvalidRange", "416"):
                raise RangeNotSatisfiable(f"{key}: byte range {range} is outside the object") from None
            if code in ("PreconditionFailed", "412"):
                raise PreconditionFailed(f"{key}: the object is no longer version {if_match!r}") from None
            raise BadGateway(f"S3 get {self.bucket}/{key}: {code}: {e}") from None
        etag = r.get("ETag", "").strip('"')
        check_etag(key, if_match, etag)  # a server that ignored If-Match still names what it sent
        if range is None:
            return ObjectBody(key, len(body), etag, body)
        # "bytes a-b/size": the whole object's size comes from Content-Range.
        size = int(str(r.get("ContentRange", "")).rpartition("/")[2] or -1)
        check_range(key, range, size)
        if len(body) != range[1] - range[0]:
            raise BadGateway(f"S3 get {key} {range}: got {len(body)} bytes, expected {range[1] - range[0]}")
        return ObjectBody(key, size, etag, body, range)

    async def put(self, key: str, value: bytes) -> ObjectMeta:
        try:
            r = await self._call(f"put {key}", self._client.put_object, Bucket=self.bucket, Key=key,
                                 Body=bytes(value))
        except botocore.exceptions.ClientError as e:
            raise BadGateway(f"S3 put {self.bucket}/{key}: {self._code(e)}: {e}") from None
        return ObjectMeta(key, len(value), r.get("ETag", "").strip('"'))

    async def list(self, prefix: str = "", limit: int = 1000) -> list[ObjectMeta]:
        try:
            r = await self._call(f"list {prefix}", self._client.list_objects_v2, Bucket=self.bucket,
                                 Prefix=prefix, MaxKeys=limit)
        except botocore.exceptions.ClientError as e:
            raise BadGateway(f"S3 list {self.bucket}/{prefix}: {self._code(e)}: {e}") from None
        return [ObjectMeta(o["Key"], int(o["Size"]), o.get("ETag", "").strip('"')) for o in r.get("Contents", [])]

    async def ping(self) -> None:
        try:
            await self._call("head_bucket", self._client.head_bucket, Bucket=self.bucket)
        except botocore.exceptions.ClientError as e:
            raise ServiceUnavailable(f"S3 bucket {self.bucket}: {self._code(e)}") from None

    async def close(self) -> None:
        self._pool.shutdown(wait=True)
        self._client.close()


class RedisKV:
    """Workers-KV-like namespace on Redis: keys under `prefix`, TTL through SET EX. `password` is the
    cluster's (deploy/cluster_secrets.py); it is sent as AUTH, never put into the URL or a message."""

    def __init__(self, url: str, prefix: str, timeout_s: float = 5.0, *, password: str | None = None):
        self.prefix = prefix
        self._timeout_s = timeout_s
        self._r = aioredis.from_url(url, password=password, socket_timeout=timeout_s,
                                    socket_connect_timeout=timeout_s)

    async def _call(self, what: str, coro) -> Any:
        try:
            async with asyncio.timeout(self._timeout_s):
                return await coro
        except (TimeoutError, redis.exceptions.TimeoutError):
            raise GatewayTimeout(f"KV {what}: no answer within {self._timeout_s} s") from None
        except redis.exceptions.ConnectionError as e:
            raise ServiceUnavailable(f"KV {what}: cannot reach Redis: {e}") from None

    async def get(self, key: str) -> bytes | None:
        return await self._call(f"get {key}", self._r.get(self.prefix + key))

    async def put(self, key: str, value: bytes, expiration_ttl: int | None = None) -> None:
        if expiration_ttl is not None and expiration_ttl <= 0:
            raise ValueError(f"KV put {key}: expiration_ttl must be > 0 s, got {expiration_ttl}")
        await self._call(f"put {key}", self._r.set(self.prefix + key, bytes(value), ex=expiration_ttl))

    async def delete(self, key: str) -> None:
        await self._call(f"delete {key}", self._r.delete(self.prefix + key))

    async def ping(self) -> None:
        await self._call("ping", self._r.ping())

    async def close(self) -> None:
        await self._r.aclose()


# ---------------------------------------------------------------- HTTP: services and DO stubs

_HOP_BY_HOP = {"host", "content-length", "transfer-encoding", "connection", "keep-alive"}


class Signer:
    """Signs this host's calls to one service (`to`: its name, the destination the signature names)
    with the cluster's secret (common/signing.py); never shows it."""

    def __init__(self, secret: str, to: str):
        if not to:
            raise ValueError("a signer needs its destination's name (the service its calls go to)")
        self._secret, self.to = signing.check_secret(secret), to

    def __repr__(self) -> str:
        return f"Signer(<secret>, to={self.to!r})"

    def header(self, method: str, target: str, body: bytes, do_name: str = "") -> str:
        """target: the request line's path and query exactly as sent. Signed now, at every send."""
        return signing.sign(self._secret, method, target, body, time.time(), secrets.token_hex(16), to=self.to,
                            do_name=do_name)


def _outgoing(url: str, request: Request, extra_headers: dict[str, str] | None,
              signer: Signer | None) -> tuple[yarl.URL, dict[str, str]]:
    """The target as it is sent and the headers of one call: the caller's end-to-end headers, its
    request id, extra_headers, and with a signer the signature over what is sent."""
    headers = {k: v for k, v in request.headers.items() if k.lower() not in _HOP_BY_HOP}
    rid = request_id_var.get()
    if rid and REQUEST_ID_HEADER.lower() not in {k.lower() for k in headers}:
        headers[REQUEST_ID_HEADER] = rid  # propagate the caller's request id
    headers.update(extra_headers or {})
    target = yarl.URL(url)  # what is sent: the signature covers this path and query, as encoded
    if signer is not None:
        headers[signing.SIGNATURE_HEADER] = signer.header(request.method, target.raw_path_qs, request.body or b"",
                                                          headers.get(DO_NAME_HEADER, ""))
    return target, headers


async def http_fetch(session: aiohttp.ClientSession, url: str, request: Request, timeout_s: float,
                     extra_headers: dict[str, str] | None = None, signer: Signer | None = None) -> Response:
    """One HTTP call; the reply is buffered, so a peer's streamed (chunked) body arrives whole as `body`.
    With a signer, the call carries its signature over what is sent (the peer is one of ours)."""
    target, headers = _outgoing(url, request, extra_headers, signer)
    try:
        async with session.request(request.method, target, headers=headers, data=request.body or None,
                                   timeout=aiohttp.ClientTimeout(total=timeout_s)) as r:
            body = await r.read()
            return Response(r.status, Headers((k, v) for k, v in r.headers.items()
                                              if k.lower() not in _HOP_BY_HOP), body)
    except TimeoutError:
        raise GatewayTimeout(f"{request.method} {url}: no answer within {timeout_s} s") from None
    except aiohttp.ClientConnectionError as e:
        raise ServiceUnavailable(f"{request.method} {url}: {e}") from None
    except aiohttp.ClientError as e:
        raise BadGateway(f"{request.method} {url}: {e}") from None


# A reply body from this size on is handed over as the buffer it was received into (a read-only
# memoryview), not copied into bytes: a LayerWarden's phase batch is tens of MB.
BUFFER_BODY_BYTES = 1 << 20
_RECV_BYTES = 1 << 18
_MAX_HEAD_BYTES = 64 << 10
_JOIN_BODY_BYTES = 64 << 10  # a request body up to this size goes out in one send with its head


class _Malformed(Exception):
    pass


class Connections:
    """buffered_fetch's idle HTTP/1.1 connections, by (host, port), kept alive between calls: a fluid
    7B station makes ~330 calls per forward to its LayerWarden, and a coordinator ten per token to
    its stations and shards; a fresh connection per call would cost a connect each and leave a
    closed socket in TIME_WAIT each.

    A connection idle for max_idle_s is closed rather than reused: our hosts' aiohttp servers close
    theirs after 75 s idle (keepalive_timeout), and a call sent just as the peer closes it is lost
    (a service call is not sent again: buffered_fetch's replay_stale)."""

    def __init__(self, max_idle_per_peer: int = 4, shm: ReplyReader | None = None, max_idle_s: float = 30.0,
                 clock: Callable[[], float] = time.monotonic):
        self.max_idle_per_peer, self.max_idle_s, self._clock = max_idle_per_peer, max_idle_s, clock
        self._idle: dict[tuple[str, int], list[tuple[socket.socket, float]]] = {}
        self.opened = 0  # connections made
        self.shm = shm  # large replies read from shared memory where the peer writes them there

    def take(self, peer: tuple[str, int]) -> socket.socket | None:
        """An idle connection to peer that is still open, quiet and not idle too long, or None."""
        idle = self._idle.get(peer, [])
        while idle:
            sock, since = idle.pop()
            if self._clock() - since < self.max_idle_s and _quiet(sock):
                return sock
            sock.close()
        return None

    def give(self, peer: tuple[str, int], sock: socket.socket) -> None:
        idle = self._idle.setdefault(peer, [])
        if len(idle) < self.max_idle_per_peer:
            idle.append((sock, self._clock()))
        else:
            sock.close()

    def close(self) -> None:
        for idle in self._idle.values():
            for sock, _ in idle:
                sock.close()
        self._idle.clear()
        if self.shm is not None:
            self.shm.close()


def _quiet(sock: socket.socket) -> bool:
    """An idle connection is reusable only if nothing arrived on it: not the peer's close (EOF), nor
    stray bytes, which would be read as the next reply."""
    try:
        sock.recv(1, socket.MSG_PEEK)
    except BlockingIOError:
        return True
    except OSError:
        return False
    return False


class _Stale(Exception):
    """A kept-alive connection the peer had closed before our request: nothing of it was answered."""


async def buffered_fetch(url: str, request: Request, timeout_s: float | None,
                         extra_headers: dict[str, str] | None = None, signer: Signer | None = None,
                         connections: Connections | None = None, replay_stale: bool = True) -> Response:
    """One HTTP/1.1 call, the reply's body received straight into one buffer; on a connection kept
    alive in `connections` (else its own, closed after the reply).

    Why not aiohttp here: its parser copies every fragment of a body and read() joins them, three
    passes over each byte a fluid station streams from its LayerWarden (1.9 GB per token for the
    seed's 7B shape), where recv_into() into one preallocated buffer is the kernel's copy alone
    (benchmarks/warden_transfer.py: "client a bare socket, one buffer"). The same errors as
    http_fetch: ServiceUnavailable when the peer cannot be reached, GatewayTimeout past timeout_s,
    BadGateway for a reply that is not HTTP/1.1 with a Content-Length, a chunked body, or one that
    ends at the close. A kept-alive connection the peer closed meanwhile is replaced once where
    replay_stale: a Durable Object's reads and invalidations may be sent again. A service's call
    (a station's forward appends to its KV cache) is not: ServiceUnavailable, as aiohttp's client
    gives for a POST on such a connection.

    Why services come here too: a coordinator makes ten calls per decode step, on the token's path
    between its hops, and this client costs its caller ~0.6x aiohttp's CPU per small call
    (benchmarks/hop_client.py)."""
    target, headers = _outgoing(url, request, extra_headers, None)
    if signer is not None:  # signed below, per attempt; never a signature the request came with
        headers = {k: v for k, v in headers.items() if k.lower() != signing.SIGNATURE_HEADER.lower()}
    if target.scheme != "http" or target.host is None:
        raise ValueError(f"buffered_fetch: {url}: plain http:// only")
    body = request.body or b""
    for k, v in headers.items():  # aiohttp refuses these too: a line break would forge a header
        if any(c in f"{k}{v}" for c in "\r\n\0"):
            raise BadRequest(f"header {k!r} holds a line break or NUL and cannot be sent to {target.host}")
    shm = connections.shm if connections is not None else None
    head = [f"{request.method} {target.raw_path_qs} HTTP/1.1", f"Host: {target.raw_authority}",
            *([] if connections is not None else ["Connection: close"]), f"Content-Length: {len(body)}",
            *(f"{k}: {v}" for k, v in headers.items()), *([f"{SHM_HEADER}: {shm.offer}"] if shm is not None else []),
            *([f"{PID_NS_HEADER}: {shm.pid_ns}"] if shm is not None and shm.pid_ns is not None else [])]
    join = len(body) <= _JOIN_BODY_BYTES  # one send; a prefill chunk's hidden states (MBs) are not copied

    def message() -> bytes:
        """The request's head (and a small body), signed now: after the connection is made, so a
        connect that waits for a restarting peer (a SYN resent a second later) cannot carry a call
        signed before the peer's boot, which it refuses as a replay (common/signing.py)."""
        signed = head if signer is None else [*head, f"{signing.SIGNATURE_HEADER}: " + signer.header(
            request.method, target.raw_path_qs, body, headers.get(DO_NAME_HEADER, ""))]
        return "\r\n".join(signed).encode("utf-8") + b"\r\n\r\n" + (body if join else b"")

    peer = (target.host, target.port)
    loop = asyncio.get_running_loop()
    sock = None
    try:
        async with asyncio.timeout(timeout_s):
            for attempt in range(2):
                sock = connections.take(peer) if connections is not None and attempt == 0 else None
                reused = sock is not None
                if sock is None:
                    sock = await _connect(loop, peer, f"{request.method} {url}")
                    if connections is not None:
                        connections.opened += 1
                try:
                    await loop.sock_sendall(sock, message())
                    if body and not join:
                        await loop.sock_sendall(sock, body)
                    status, reply_headers, body_out, keep = await _read_reply(loop, sock)
                except (_Stale, ConnectionResetError, BrokenPipeError) as e:
                    sock.close()
                    sock = None
                    if reused and replay_stale:
                        continue  # the peer closed it while it was idle: once more, on a new one
                    raise ServiceUnavailable(f"{request.method} {url}: connection lost: "
                                             f"{e or type(e).__name__}") from None
                except OSError as e:
                    raise ServiceUnavailable(f"{request.method} {url}: connection lost: {e}") from None
                except _Malformed as e:
                    raise BadGateway(f"{request.method} {url}: {e}") from None
                checked: dict[int, tuple[int, int]] = {}
                if SHM_HEADER in reply_headers or PIECES_HEADER in reply_headers:  # copied out before the
                    # connection carries anything else
                    body_out = _shm_body(shm, reply_headers, body_out, f"{request.method} {url}", checked)
                if keep and connections is not None:
                    connections.give(peer, sock)
                    sock = None
                if isinstance(body_out, list):  # a reply naming blocks: its parts, never joined here
                    resp = Response.from_parts(body_out, reply_headers.get("Content-Type", "application/octet-stream"),
                                               status, reply_headers)
                else:
                    resp = Response(status, reply_headers, body_out)
                resp.body_crc32s = checked
                return resp
            raise AssertionError("unreachable: the second attempt is on a new connection")
    except TimeoutError:
        raise GatewayTimeout(f"{request.method} {url}: no answer within {timeout_s} s") from None
    finally:
        if sock is not None:  # not handed back: closed (an error, a timeout, or the peer's close)
            sock.close()


def _shm_body(shm: ReplyReader | None, headers: Headers, body: bytes | memoryview, what: str,
              checked: dict[int, tuple[int, int]]) -> memoryview | list[memoryview]:
    """The body of a reply the peer left in shared memory (deploy/local/shm.py), its headers removed:
    a reply buffer's bytes; or, where its pieces name blocks, the parts it concatenates (views of
    the sealed blocks, their crc32s into `checked`, and of its own bytes)."""
    name, length = headers.pop(SHM_HEADER, None), headers.pop(SHM_LENGTH_HEADER, None)
    pieces = headers.pop(PIECES_HEADER, None)
    if shm is None:
        raise BadGateway(f"{what}: a reply in shared memory ({(name or pieces)[:80]!r}), which this call did not "
                         "ask for")
    if name is not None and (len(body) or length is None or not length.isdigit()):
        raise BadGateway(f"{what}: a reply in shared memory with {len(body)} body bytes and "
                         f"{SHM_LENGTH_HEADER} {length!r}")
    try:
        own = shm.read(name, int(length)) if name is not None else body
        return own if pieces is None else shm.assemble(pieces, own, checked)
    except ShmError as e:
        raise BadGateway(f"{what}: {e}") from None


async def _connect(loop: asyncio.AbstractEventLoop, peer: tuple[str, int], what: str) -> socket.socket:
    sock = None
    try:
        infos = await loop.getaddrinfo(*peer, type=socket.SOCK_STREAM)
        sock = socket.socket(infos[0][0], socket.SOCK_STREAM)
        sock.setblocking(False)
        await loop.sock_connect(sock, infos[0][4])
        return sock
    except OSError as e:
        if sock is not None:
            sock.close()
        raise ServiceUnavailable(f"{what}: cannot connect: {e}") from None


async def _read_reply(loop: asyncio.AbstractEventLoop,
                      sock: socket.socket) -> tuple[int, Headers, bytes | memoryview, bool]:
    """The status, headers and body of an HTTP/1.1 reply with a Content-Length, and whether the
    connection may carry another request (not HTTP/1.0, no "Connection: close")."""
    raw = bytearray()
    while (end := raw.find(b"\r\n\r\n")) < 0:
        if len(raw) > _MAX_HEAD_BYTES:
            raise _Malformed(f"reply head longer than {_MAX_HEAD_BYTES} bytes")
        got = await loop.sock_recv(sock, _RECV_BYTES)
        if not got:
            if not raw:
                raise _Stale("the peer closed the connection before replying")
            raise _Malformed("the peer closed the connection before the reply's head ended")
        raw += got
    lines = raw[:end].decode("latin-1").split("\r\n")
    version, _, rest = lines[0].partition(" ")
    code = rest[:3]
    if not version.startswith("HTTP/1.") or not code.isdigit():
        raise _Malformed(f"not an HTTP/1.x status line: {lines[0][:80]!r}")
    headers = Headers()
    length = None
    keep = version == "HTTP/1.1"
    for line in lines[1:]:
        k, sep, v = line.partition(":")
        if not sep:
            raise _Malformed(f"malformed header line {line[:80]!r}")
        k, v = k.strip(), v.strip()
        if k.lower() == "transfer-encoding" and v.lower() != "identity":
            raise _Malformed(f"Transfer-Encoding {v} (a buffered call reads Content-Length replies only)")
        if k.lower() == "content-length":
            if not v.isdigit():
                raise _Malformed(f"Content-Length {v[:40]!r}")
            length = int(v)
        elif k.lower() == "connection":
            keep = keep and "close" not in v.lower()
        elif k.lower() not in _HOP_BY_HOP:
            headers[k] = v
    if length is None:
        raise _Malformed("reply without a Content-Length")
    buf = bytearray(length)
    view = memoryview(buf)
    have = len(raw) - end - 4
    if have > length:
        raise _Malformed(f"{have - length} bytes after the reply's {length}-byte body")
    buf[:have] = raw[end + 4:]
    while have < length:
        got = await loop.sock_recv_into(sock, view[have:])
        if not got:
            raise _Malformed(f"the peer closed the connection after {have} of {length} body bytes")
        have += got
    return int(code), headers, (view.toreadonly() if length >= BUFFER_BODY_BYTES else bytes(buf)), keep


def _path_and_query(url: str) -> str:
    u = urlsplit(url)
    return (u.path or "/") + (f"?{u.query}" if u.query else "")


class HttpService:
    """Service binding: the request goes to base_url with the caller's path and query. Over plain
    http (the cluster's own hops) on kept-alive connections through buffered_fetch, never sent
    twice; over https through aiohttp."""

    def __init__(self, session: aiohttp.ClientSession, base_url: str, timeout_s: float, signer: Signer | None = None):
        self.base_url = base_url.rstrip("/")
        self._session, self._timeout_s, self._signer = session, timeout_s, signer
        # up to 16 kept per peer: a coordinator's concurrent generations each hold one while their call is out
        self._connections = Connections(16) if self.base_url.startswith("http://") else None

    async def fetch(self, request: Request) -> Response:
        url = self.base_url + _path_and_query(request.url)
        if self._connections is not None:
            return await buffered_fetch(url, request, self._timeout_s, signer=self._signer,
                                        connections=self._connections, replay_stale=False)
        return await http_fetch(self._session, url, request, self._timeout_s, signer=self._signer)

    async def close(self) -> None:
        if self._connections is not None:
            self._connections.close()

    async def ping(self) -> None:
        resp = await http_fetch(self._session, self.base_url + "/healthz", Request("GET", "/healthz"),
                                self._timeout_s)
        if not resp.ok:
            raise ServiceUnavailable(f"{self.base_url}/healthz: HTTP {resp.status}")


class HttpStub:
    def __init__(self, ns: "HttpNamespace", id: DurableObjectId):
        self._ns, self.id = ns, id

    async def fetch(self, request: Request) -> Response:
        ns = self._ns
        url = f"{ns.base_url}{DO_ROUTE_PREFIX}{ns.class_name}{_path_and_query(request.url)}"
        if ns.base_url.startswith("http://"):
            # A warden's replies are the cluster's bulk bytes (a LayerWarden's phases): received
            # into one buffer, not through aiohttp's copies.
            return await buffered_fetch(url, request, ns.timeout_s, {DO_NAME_HEADER: self.id.name}, ns.signer,
                                        ns.connections)
        return await http_fetch(ns.session, url, request, ns.timeout_s, {DO_NAME_HEADER: self.id.name}, ns.signer)


class HttpNamespace:
    """DO namespace binding onto the process that hosts the class (its /__do/{class} route)."""

    def __init__(self, session: aiohttp.ClientSession, base_url: str, class_name: str, timeout_s: float,
                 signer: Signer | None = None, shm: ReplyReader | None = None):
        self.session, self.base_url = session, base_url.rstrip("/")
        self.class_name, self.timeout_s, self.signer = class_name, timeout_s, signer
        self.connections = Connections(shm=shm)  # the stubs' kept-alive connections (buffered_fetch)

    async def close(self) -> None:
        self.connections.close()

    def id_from_name(self, name: str) -> DurableObjectId:
        return object_id(self.class_name, name)

    def get(self, id: DurableObjectId) -> HttpStub:
        return HttpStub(self, id)

    async def ping(self) -> None:
        resp = await http_fetch(self.session, self.base_url + "/healthz", Request("GET", "/healthz"),
                                self.timeout_s)
        if not resp.ok:
            raise ServiceUnavailable(f"{self.base_url}/healthz: HTTP {resp.status}")

