"""deploy/local/server_bindings.buffered_fetch, the Durable Object calls' client (issue 15, the fluid
path): a reply's body received straight into one buffer. Against the real host (build_app) and
against raw servers that answer wrongly: the same typed errors as the aiohttp client."""
from __future__ import annotations

import asyncio
import os
import socket
import time

import pytest

from common import signing
from common.runtime import BadGateway, BadRequest, Env, GatewayTimeout, Request, Response, ServiceUnavailable
from deploy import servers
from deploy.local import server_bindings
from deploy.local.server_bindings import BUFFER_BODY_BYTES, HttpNamespace, Signer, buffered_fetch
from deploy.local.host import ServiceRuntime, app_runner, build_app
from deploy.local.tasks import BackgroundTasks

SECRET = "s" * 43
BIG = os.urandom(3 * BUFFER_BODY_BYTES + 12345)  # larger than a socket buffer: many recv_into calls


async def handler(request: Request, env, ctx) -> Response:
    if request.path == "/big":
        return Response.from_bytes(BIG, "application/x-knot-tensor-batch")
    if request.path == "/slow":
        await asyncio.sleep(1)
    return Response.from_json({"path": request.path, "query": request.url.partition("?")[2],
                               "body": request.body.decode()})


@pytest.fixture
async def host():
    from aiohttp import web

    rt = ServiceRuntime("station", handler, Env(), BackgroundTasks("test"),
                        verifier=signing.Verifier(SECRET, "station", booted_at=time.time()))
    runner = app_runner(build_app(rt))
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    yield f"http://127.0.0.1:{runner.addresses[0][1]}"
    await runner.cleanup()


def answering_once(served: list):
    """A peer that answers one request per connection, then closes it (as a server does past its
    keep-alive timeout, or a restarted one); each request it reads is appended to `served`."""
    async def once(reader, writer):
        await reader.readuntil(b"\r\n\r\n")
        served.append(1)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
        await writer.drain()
        writer.close()
    return once


async def test_a_large_reply_arrives_whole_in_one_read_only_buffer_and_a_small_one_as_bytes(host):
    r = await buffered_fetch(host + "/big", Request("GET", "/big"), 30, signer=Signer(SECRET, "station"))
    assert r.status == 200 and isinstance(r.body, memoryview) and r.body.readonly and r.body == BIG
    assert r.headers["Content-Type"] == "application/x-knot-tensor-batch" and "Content-Length" not in r.headers
    # a signed POST with a body and a query: the signature covers what is sent
    r = await buffered_fetch(host + "/echo?a=1&b=%20", Request("POST", "/echo", {}, b"frame"), 30,
                             signer=Signer(SECRET, "station"))
    assert r.status == 200 and isinstance(r.body, bytes) and r.json() == {"path": "/echo", "query": "a=1&b=%20",
                                                                         "body": "frame"}
    # a caller's request id outside latin-1 crosses as aiohttp's client sent it (UTF-8 octets)
    r = await buffered_fetch(host + "/echo", Request("POST", "/echo", {"X-Request-Id": "réq-✓"}, b""), 30,
                             signer=Signer(SECRET, "station"))
    assert r.status == 200, r.body
    # the host's own refusal (no signature) comes back as the 401 it is, with its JSON
    r = await buffered_fetch(host + "/echo", Request("POST", "/echo", {}, b"x"), 30)
    assert r.status == 401 and "X-Knot-Signature" in r.json()["message"]


async def test_the_durable_object_binding_uses_it(host):
    ns = HttpNamespace(None, host, "Echo", 30, Signer(SECRET, "station"))  # no aiohttp session is touched
    r = await ns.get(ns.id_from_name("w")).fetch(Request("GET", "/stats"))
    assert r.status == 400 and "hosts no Durable Objects" in r.json()["message"]


async def test_unreachable_slow_and_wrong_peers_get_the_typed_errors(host):
    dead = f"http://127.0.0.1:{servers.free_ports(1)[0]}/x"
    with pytest.raises(ServiceUnavailable, match="cannot connect"):
        await buffered_fetch(dead, Request("GET", "/x"), 5)
    with pytest.raises(BadRequest, match="'X-Request-Id' holds a line break"):
        await buffered_fetch(host + "/x", Request("GET", "/x", {"X-Request-Id": "a\r\nX-Forged: 1"}), 5)
    with pytest.raises(GatewayTimeout, match="no answer within 0.3 s"):
        await buffered_fetch(host + "/slow", Request("GET", "/slow"), 0.3, signer=Signer(SECRET, "station"))

    async def raw_server(reply: bytes):
        async def serve(reader, writer):
            await reader.readuntil(b"\r\n\r\n")
            writer.write(reply)
            await writer.drain()
            writer.close()
        server = await asyncio.start_server(serve, "127.0.0.1", 0)
        return server, f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}/x"

    for reply, match in [(b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nshort", "after 5 of 10 body bytes"),
                         (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\n\r\n",
                          "Transfer-Encoding chunked"),
                         (b"HTTP/1.1 200 OK\r\n\r\nbody to the close", "without a Content-Length"),
                         (b"SSH-2.0-OpenSSH\r\n\r\n", "not an HTTP/1.x status line"),
                         (b"HTTP/1.1 200 OK\r\nContent-Length: -1\r\n\r\n", "Content-Length '-1'"),
                         (b"HTTP/1.1 200 OK\r\nContent-Le", "before the reply's head ended")]:
        server, url = await raw_server(reply)
        try:
            with pytest.raises(BadGateway, match=match):
                await buffered_fetch(url, Request("GET", "/x"), 5)
        finally:
            server.close()
            await server.wait_closed()


async def test_connections_are_kept_alive_and_a_closed_one_is_replaced(host, monkeypatch):
    from deploy.local.server_bindings import Connections

    conns = Connections()
    try:
        for path in ("/big", "/echo", "/big"):
            r = await buffered_fetch(host + path, Request("GET", path), 30, signer=Signer(SECRET, "station"), connections=conns)
            assert r.status == 200 and (r.body == BIG if path == "/big" else r.json()["path"] == "/echo")
        assert conns.opened == 1, "three calls, one connection"
    finally:
        conns.close()

    # a peer that closes each connection after one answer: the next call finds it dead and makes a new one
    served = []
    server = await asyncio.start_server(answering_once(served), "127.0.0.1", 0)
    url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}/x"
    conns = Connections()
    try:
        for _ in range(3):
            r = await buffered_fetch(url, Request("GET", "/x"), 5, connections=conns)
            assert r.status == 200 and r.body == b"ok"
        assert len(served) == 3 and conns.opened == 3
        # a connection that went dead unnoticed while idle (its close not yet seen): sent again once
        peer = server.sockets[0].getsockname()[:2]
        sock = socket.create_connection(peer)
        sock.setblocking(False)
        sock.shutdown(socket.SHUT_WR)  # the peer reads EOF at once, answers nothing and closes
        await asyncio.sleep(0.1)
        conns.give(peer, sock)
        monkeypatch.setattr(server_bindings, "_quiet", lambda s: True)  # as if its close had not arrived yet
        r = await buffered_fetch(url, Request("GET", "/x"), 5, connections=conns)
        assert r.status == 200 and r.body == b"ok" and conns.opened == 4
    finally:
        conns.close()
        server.close()
        await server.wait_closed()


async def test_a_service_binding_keeps_its_connections_and_never_sends_a_call_twice(host, monkeypatch):
    """HttpService (a coordinator's hops to its stations and shards) over plain http: kept-alive
    connections through buffered_fetch. A connection the peer closed unnoticed fails the call with
    ServiceUnavailable rather than sending it again: a station's forward appends to its KV cache."""
    from deploy.local.server_bindings import HttpService

    svc = HttpService(None, host, 30, Signer(SECRET, "station"))  # no aiohttp session is touched over http
    try:
        for i in range(3):
            r = await svc.fetch(Request("POST", f"https://peer/forward?i={i}", {}, b"frame %d" % i))
            assert r.status == 200 and r.json() == {"path": "/forward", "query": f"i={i}", "body": f"frame {i}"}
        assert svc._connections.opened == 1, "three calls, one connection"
    finally:
        await svc.close()

    served = []
    server = await asyncio.start_server(answering_once(served), "127.0.0.1", 0)
    peer = server.sockets[0].getsockname()[:2]
    svc = HttpService(None, f"http://{peer[0]}:{peer[1]}", 5)
    try:
        sock = socket.create_connection(peer)
        sock.setblocking(False)
        sock.shutdown(socket.SHUT_WR)  # the peer reads EOF at once, answers nothing and closes
        await asyncio.sleep(0.1)
        svc._connections.give(peer, sock)
        monkeypatch.setattr(server_bindings, "_quiet", lambda s: True)  # as if its close had not arrived yet
        with pytest.raises(ServiceUnavailable, match="connection lost"):
            await svc.fetch(Request("POST", "/forward", {}, b"frame"))
        assert served == [] and svc._connections.opened == 0, "the call was not sent again on a new connection"
        r = await svc.fetch(Request("POST", "/forward", {}, b"frame"))  # the next call: a new connection
        assert r.status == 200 and r.body == b"ok" and served == [1] and svc._connections.opened == 1
    finally:
        await svc.close()
        server.close()
        await server.wait_closed()


async def test_a_connection_idle_past_max_idle_s_is_closed_not_reused(host):
    from deploy.local.server_bindings import Connections

    now = [1000.0]
    conns = Connections(max_idle_s=30.0, clock=lambda: now[0])
    try:
        for dt in (0.0, 29.0, 31.0):  # reused after 29 s idle; after 31 s a new one
            now[0] += dt
            r = await buffered_fetch(host + "/echo", Request("GET", "/echo"), 30, signer=Signer(SECRET, "station"),
                                     connections=conns)
            assert r.status == 200
        assert conns.opened == 2
    finally:
        conns.close()


async def test_a_call_is_signed_after_its_connect_so_a_peer_booting_meanwhile_takes_it(monkeypatch):
    """The compose CI's restart case: a connect to a restarting peer waits (its SYN resent a second
    later) while the peer boots; a signature made before the connect would predate the peer's boot
    and be refused as a replay of its previous incarnation's calls."""
    from aiohttp import web

    real_connect = server_bindings._connect
    peer: dict = {}

    async def connect_while_it_boots(loop, addr, what):
        # The peer boots only now, as our SYN waits: its boot time is after the call began.
        await asyncio.sleep(2 * signing.BOOT_SKEW_S)
        rt = ServiceRuntime("station", handler, Env(), BackgroundTasks("test"),
                            verifier=signing.Verifier(SECRET, "station", booted_at=time.time()))
        peer["runner"] = runner = app_runner(build_app(rt))
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", addr[1]).start()
        return await real_connect(loop, addr, what)

    with socket.socket() as s:  # a free port for the peer to come up on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setattr(server_bindings, "_connect", connect_while_it_boots)
    try:
        r = await buffered_fetch(f"http://127.0.0.1:{port}/echo", Request("POST", "/echo", {}, b"x"), 30,
                                 signer=Signer(SECRET, "station"), connections=server_bindings.Connections())
    finally:
        await peer["runner"].cleanup()
    assert r.status == 200, r.body
    assert r.json()["body"] == "x"
