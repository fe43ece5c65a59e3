"""deploy/local/lean_http.py, the internal services' HTTP server, against the aiohttp app
(deploy/local/host.py build_app) as its oracle: each test runs the same requests on a real socket
against both and expects the same answers. Signed calls reach the handler with their method,
path, query, headers and body; unsigned ones are 401; health and readiness answer unsigned;
requests on one connection (pipelined too) are answered in order; a body over the limit is 413
before it is read, a malformed request is a 400 naming the problem, and the server goes on serving."""
from __future__ import annotations

import asyncio
import json
import os
import time

import pytest

from common import signing
from common.runtime import BadRequest, Env, Request, Response
from deploy.local.server_bindings import Connections, Signer, buffered_fetch
from deploy.local.host import ServiceRuntime
from deploy.local.tasks import BackgroundTasks
from tests.hosts import SERVERS, serve
from tests.waits import until

SECRET = "k" * 43
BIG = os.urandom(5 * (1 << 20) + 777)  # more than a socket takes at once: the writes wait for the reader
CALLS: list[Request] = []


async def handler(request: Request, env, ctx) -> Response:
    CALLS.append(request)
    if request.path == "/big":
        return Response.from_bytes(BIG, "application/octet-stream")
    if request.path == "/stream":
        async def chunks():
            for i in range(5):
                yield f"chunk {i};".encode()
        return Response.from_stream(chunks(), "text/plain")
    if request.path == "/refuse":
        raise BadRequest("this handler refuses /refuse by name")
    if request.path == "/crash":
        raise RuntimeError("a bug")
    if request.path == "/inject":  # a header value a bug let a line break into
        return Response.from_text("x", headers={"X-Bad": "a\r\nX-Forged: 1"})
    if request.path == "/slow":
        await asyncio.sleep(0.3)
    return Response.from_json({"method": request.method, "path": request.path, "query": request.query,
                               "body": bytes(request.body).decode(), "x-test": request.headers.get("X-Test")},
                              headers={"X-Reply": "yes"})


def runtime(max_body_bytes: int = 1 << 20, ready_fails: bool = False) -> ServiceRuntime:
    async def ready(env) -> None:
        if ready_fails:
            raise ConnectionError("the bucket does not answer")

    return ServiceRuntime("shard-0", handler, Env(), BackgroundTasks("test"), ready=ready,
                          max_body_bytes=max_body_bytes, access_log="errors",
                          verifier=signing.Verifier(SECRET, "shard-0", booted_at=time.time()))


@pytest.fixture(params=SERVERS)
async def host(request):
    CALLS.clear()
    url, close = await serve(runtime(), request.param)
    yield url
    await close()


def signed(method: str, target: str, body: bytes = b"", **headers: str) -> bytes:
    """A raw request with the cluster's signature."""
    sig = Signer(SECRET, "shard-0").header(method, target, body)
    lines = [f"{method} {target} HTTP/1.1", "Host: test", f"Content-Length: {len(body)}",
             f"{signing.SIGNATURE_HEADER}: {sig}", *(f"{k.replace('_', '-')}: {v}" for k, v in headers.items())]
    return "\r\n".join(lines).encode() + b"\r\n\r\n" + body


async def read_reply(reader: asyncio.StreamReader, head: bool = False) -> tuple[int, dict[str, str], bytes]:
    status = int((await reader.readline()).split()[1])
    headers = {}
    while (line := (await reader.readline()).rstrip(b"\r\n")):
        k, _, v = line.decode().partition(":")
        headers[k.strip().lower()] = v.strip()
    if headers.get("transfer-encoding") == "chunked":
        body = b""
        while (n := int((await reader.readline()).strip(), 16)):
            body += await reader.readexactly(n)
            await reader.readline()
        await reader.readline()
        return status, headers, body
    return status, headers, b"" if head else await reader.readexactly(int(headers.get("content-length", "0")))


async def exchange(url: str, data: bytes, replies: int = 1) -> tuple[list, bool]:
    """Send raw bytes, read `replies` replies -> (their (status, headers, body)s, whether the server then closed)."""
    host, port = url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    try:
        writer.write(data)
        out = [await asyncio.wait_for(read_reply(reader, data.startswith(b"HEAD")), 10) for _ in range(replies)]
        try:
            closed = await asyncio.wait_for(reader.read(1), 0.5) == b""
        except TimeoutError:
            closed = False
        return out, closed
    finally:
        writer.close()


async def test_a_signed_call_reaches_the_handler_and_its_reply_comes_back(host):
    body = b'{"rows": [1, 2]}'
    [(status, headers, reply)], closed = await exchange(host, signed("POST", "/sample?x=1&y=two", body, X_Test="t",
                                                                     X_Request_Id="rid-42"))
    assert status == 200 and not closed, "kept alive"
    assert json.loads(reply) == {"method": "POST", "path": "/sample", "query": {"x": "1", "y": "two"},
                                 "body": body.decode(), "x-test": "t"}
    assert headers["x-reply"] == "yes" and headers["content-type"] == "application/json"
    assert headers["x-request-id"] == "rid-42", "the caller's request id"
    [(_, headers, _)], _ = await exchange(host, signed("GET", "/other"))
    assert len(headers["x-request-id"]) >= 16, "a new one"


async def test_unsigned_or_forged_calls_are_refused_before_the_handler(host):
    [(status, _, reply)], _ = await exchange(host, b"POST /sample HTTP/1.1\r\nHost: t\r\nContent-Length: 2\r\n\r\nhi")
    assert status == 401 and "signature" in json.loads(reply)["message"].lower()
    forged = signed("POST", "/sample", b"hi").replace(b"\r\n\r\nhi", b"\r\n\r\nho")  # another body, the same signature
    [(status, _, _)], _ = await exchange(host, forged)
    assert status == 401 and CALLS == []


async def test_health_and_readiness_answer_unsigned(host):
    [(status, _, reply)], _ = await exchange(host, b"GET /healthz HTTP/1.1\r\nHost: t\r\n\r\n")
    body = json.loads(reply)
    assert status == 200 and body["ok"] is True and body["service"] == "shard-0" and body["pid"] == os.getpid()
    [(status, _, reply)], _ = await exchange(host, b"GET /readyz HTTP/1.1\r\nHost: t\r\n\r\n")
    assert status == 200 and json.loads(reply) == {"ready": True, "service": "shard-0", "checks": {"service": "ok"}}
    [(status, headers, reply)], _ = await exchange(host, b"HEAD /healthz HTTP/1.1\r\nHost: t\r\n\r\n")
    assert status == 200 and reply == b"" and CALLS == []


@pytest.mark.parametrize("server", SERVERS)
async def test_a_failing_check_makes_readiness_503(server):
    url, close = await serve(runtime(ready_fails=True), server)
    try:
        [(status, _, reply)], _ = await exchange(url, b"GET /readyz HTTP/1.1\r\nHost: t\r\n\r\n")
        assert status == 503
        assert json.loads(reply)["checks"]["service"] == "ConnectionError: the bucket does not answer"
    finally:
        await close()


async def test_pipelined_requests_are_answered_in_order_on_one_connection(host):
    data = signed("GET", "/slow?n=1") + signed("POST", "/a?n=2", b"two") + signed("GET", "/b?n=3")
    replies, closed = await exchange(host, data, replies=3)
    assert [json.loads(b)["query"]["n"] for _, _, b in replies] == ["1", "2", "3"] and not closed
    assert [r.path for r in CALLS] == ["/slow", "/a", "/b"]


async def test_a_caller_that_expects_100_continue_gets_it_before_sending_the_body(host):
    body = b"after the interim reply"
    head, _, _ = signed("POST", "/e", body, Expect="100-continue").partition(b"\r\n\r\n")
    hostname, port = host.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(hostname, int(port))
    try:
        writer.write(head + b"\r\n\r\n")
        assert (await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)).startswith(b"HTTP/1.1 100")
        writer.write(body)
        status, _, reply = await asyncio.wait_for(read_reply(reader), 5)
        assert status == 200 and json.loads(reply)["body"] == body.decode()
    finally:
        writer.close()


async def test_connection_close_and_http_1_0_close_after_the_reply(host):
    [(status, _, _)], closed = await exchange(host, signed("GET", "/x", Connection="close"))
    assert status == 200 and closed
    [(status, _, _)], closed = await exchange(host, signed("GET", "/x").replace(b"HTTP/1.1", b"HTTP/1.0", 1))
    assert status == 200 and closed


@pytest.mark.parametrize("server", SERVERS)
async def test_a_body_over_the_limit_is_413_and_never_reaches_the_handler(server):
    CALLS.clear()
    url, close = await serve(runtime(max_body_bytes=1000), server)
    try:
        [(status, _, reply)], closed = await exchange(url, signed("POST", "/sample", b"x" * 1001))
        assert status == 413 and CALLS == []
        if server == "lean":  # it reads no more of a refused request, and says what the limit is
            assert closed and "1001 bytes is over the 1000-byte limit" in json.loads(reply)["message"]
        chunked = (b"POST /sample HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: chunked\r\n\r\n"
                   + b"".join(b"100\r\n" + b"y" * 256 + b"\r\n" for _ in range(5)) + b"0\r\n\r\n")
        [(status, _, _)], closed = await exchange(url, chunked)
        assert status == 413 and CALLS == []
        [(status, _, _)], _ = await exchange(url, signed("POST", "/sample", b"x" * 1000))
        assert status == 200 and len(CALLS) == 1, "at the limit, and the server goes on"
    finally:
        await close()


async def test_a_chunked_body_reaches_the_handler_whole(host):
    body = b"part one;part two"
    sig = Signer(SECRET, "shard-0").header("POST", "/c", body)
    data = (f"POST /c HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: chunked\r\n{signing.SIGNATURE_HEADER}: {sig}\r\n\r\n"
            .encode() + b"9\r\npart one;\r\n8\r\npart two\r\n0\r\n\r\n")
    [(status, _, reply)], _ = await exchange(host, data)
    assert status == 200 and json.loads(reply)["body"] == body.decode()


@pytest.mark.parametrize("bad", [b"NOT HTTP AT ALL\r\n\r\n", b"GET /x HTTP/1.1\r\nContent-Length: -1\r\n\r\n",
                                 b"GET /x HTTP/1.1\r\nContent-Length: 1\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n",
                                 b"GET /x HTTP/1.1\r\nBad Header Line\r\n\r\n"])
async def test_a_malformed_request_is_a_400_and_the_server_goes_on(host, bad):
    [(status, _, _)], closed = await exchange(host, bad)
    assert status == 400 and closed
    [(status, _, _)], _ = await exchange(host, signed("GET", "/after"))
    assert status == 200 and [r.path for r in CALLS] == ["/after"]


async def test_too_many_or_too_long_headers_are_refused_by_the_lean_server():
    CALLS.clear()
    url, close = await serve(runtime(), "lean")
    try:
        many = b"GET /x HTTP/1.1\r\n" + b"".join(b"X-H%d: v\r\n" % i for i in range(101)) + b"\r\n"
        [(status, _, reply)], closed = await exchange(url, many)
        assert status == 400 and closed and "more than 100 headers" in json.loads(reply)["message"]
        long = b"GET /x HTTP/1.1\r\nX-Long: " + b"v" * (64 << 10) + b"\r\n\r\n"
        [(status, _, reply)], closed = await exchange(url, long)
        assert status == 400 and closed and "over 65536 bytes" in json.loads(reply)["message"]
        assert CALLS == []
    finally:
        await close()


async def test_handler_errors_are_json_statuses_and_the_server_survives(host):
    [(status, _, reply)], closed = await exchange(host, signed("GET", "/refuse"))
    assert status == 400 and json.loads(reply)["message"] == "this handler refuses /refuse by name" and not closed
    [(status, _, reply)], _ = await exchange(host, signed("GET", "/crash"))
    assert status == 500 and json.loads(reply)["error"]
    [(status, _, _)], _ = await exchange(host, signed("GET", "/fine"))
    assert status == 200


async def test_a_reply_header_with_a_line_break_is_never_sent():
    url, close = await serve(runtime(), "lean")
    try:
        [(status, headers, reply)], _ = await exchange(url, signed("GET", "/inject"))
        assert status == 500 and "x-forged" not in headers and "line break" in json.loads(reply)["message"]
        [(status, _, _)], _ = await exchange(url, signed("GET", "/fine"))
        assert status == 200
    finally:
        await close()


@pytest.mark.parametrize("server", SERVERS)
async def test_the_host_header_never_changes_the_path_a_handler_sees(server):
    """The signature covers the target, not the Host header: the lean server builds the URL from its own
    address, the aiohttp app refuses a Host that is not a host[:port]."""
    CALLS.clear()
    url, close = await serve(runtime(), server)
    try:
        forged = signed("POST", "/sample", b"b").replace(b"Host: test", b"Host: x/evil?")
        [(status, _, reply)], _ = await exchange(url, forged)
        if server == "lean":
            assert status == 200 and json.loads(reply)["path"] == "/sample"
        else:
            assert status == 400 and "Host header" in json.loads(reply)["message"] and CALLS == []
        [(status, _, reply)], _ = await exchange(url, signed("GET", "http://x/sample"))  # the proxies' form
        assert status == 400 and "is not a path" in json.loads(reply)["message"]
        for ok in (b"Host: 127.0.0.1:8000", b"Host: station-0:8080", b"Host: knot_station_1", b"Host: [::1]:8080", b"Host: test"):
            [(status, _, reply)], _ = await exchange(url, signed("POST", "/sample", b"b").replace(b"Host: test", ok))
            assert status == 200 and json.loads(reply)["path"] == "/sample", ok
    finally:
        await close()


async def test_streamed_and_large_replies_arrive_whole(host):
    [(status, headers, body)], _ = await exchange(host, signed("GET", "/stream"))
    assert status == 200 and headers["transfer-encoding"] == "chunked"
    assert body == b"".join(f"chunk {i};".encode() for i in range(5))
    conns = Connections()
    r = await buffered_fetch(host + "/big", Request("GET", "/big"), 30, signer=Signer(SECRET, "shard-0"), connections=conns)
    assert r.status == 200 and bytes(r.body) == BIG
    r = await buffered_fetch(host + "/small?q=1", Request("POST", "/small?q=1", body=b"b"), 30,
                             signer=Signer(SECRET, "shard-0"), connections=conns)
    assert r.json()["query"] == {"q": "1"} and conns.opened == 1, "the same kept-alive connection"
    conns.close()


@pytest.mark.parametrize("server", SERVERS)
async def test_closing_lets_a_request_in_progress_finish(server):
    CALLS.clear()
    url, close = await serve(runtime(), server)
    call = asyncio.ensure_future(exchange(url, signed("GET", "/slow")))
    await until(lambda: any(r.path == "/slow" for r in CALLS), what="the handler under way")  # and asleep
    await close()
    [(status, _, reply)], closed = await call
    assert status == 200 and json.loads(reply)["path"] == "/slow" and closed
