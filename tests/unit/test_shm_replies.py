"""deploy/local/shm.py: large replies through a shared directory between a host and buffered_fetch
(issue 15, the fluid path). Against the real host (build_app) on a real socket: the bytes equal the
socket's, a connection reuses its buffer and the buffer goes with it, callers or hosts without the
directory get the socket, and a reply naming a file the caller may not read is a BadGateway."""
from __future__ import annotations

import os

import pytest

from common.runtime import BadGateway, Env, Request, Response
from deploy.local.bindings import Connections, buffered_fetch
from deploy.local.host import ServiceRuntime, app_runner, build_app
from deploy.local.shm import SHM_MIN_BYTES, MAX_BUFFERS, ReplyBuffers, ReplyReader
from deploy.local.tasks import BackgroundTasks

BIG = os.urandom(3 * SHM_MIN_BYTES + 4321)


async def handler(request: Request, env, ctx) -> Response:
    if request.path == "/big":
        return Response.from_bytes(BIG, "application/x-knot-tensor-batch")
    if request.path == "/bigger":
        return Response.from_bytes(BIG + BIG[::-1], "application/x-knot-tensor-batch")
    if request.path == "/parts":  # a warden's batch: the frames it holds, copied into the buffer one by one
        return Response.from_parts([BIG[:9], b"", memoryview(BIG)[9:SHM_MIN_BYTES + 1].toreadonly(),
                                    BIG[SHM_MIN_BYTES + 1:]], "application/x-knot-tensor-batch")
    return Response.from_json({"path": request.path})


async def _serve(shm: ReplyBuffers | None):
    from aiohttp import web

    rt = ServiceRuntime("layer-warden", handler, Env(), BackgroundTasks("test"), shm=shm)
    runner = app_runner(build_app(rt))
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    return runner, f"http://127.0.0.1:{runner.addresses[0][1]}"


@pytest.fixture
async def shm_host(tmp_path):
    buffers = ReplyBuffers(tmp_path, max_buffers=2)
    runner, url = await _serve(buffers)
    yield url, buffers, tmp_path
    await runner.cleanup()
    buffers.close()


async def test_a_large_reply_comes_through_the_connections_buffer(shm_host):
    url, buffers, d = shm_host
    conns = Connections(shm=ReplyReader(d))
    for path, want in (("/big", BIG), ("/bigger", BIG + BIG[::-1]), ("/big", BIG), ("/parts", BIG)):
        r = await buffered_fetch(url + path, Request("GET", path), 30, connections=conns)
        assert r.status == 200 and r.body == want and r.body.readonly
        assert "X-Knot-Shm" not in r.headers and r.headers["Content-Type"] == "application/x-knot-tensor-batch"
    assert (buffers.replies, conns.shm.replies, conns.opened) == (4, 4, 1), "one connection, one buffer"
    files = os.listdir(d)
    assert len(files) == 1 and os.path.getsize(d / files[0]) == 2 * len(BIG), "it grew to the largest reply"
    r = await buffered_fetch(url + "/small", Request("GET", "/small"), 30, connections=conns)
    assert r.json() == {"path": "/small"} and buffers.replies == 4, "a small reply takes the socket"
    health = (await buffered_fetch(url + "/healthz", Request("GET", "/healthz"), 30)).json()["shm_replies"]
    assert health == {"replies": 4, "bytes": 5 * len(BIG), "buffers": 1, "failures": 0}
    conns.close()  # the connection goes, and the host drops its buffer
    import gc
    for _ in range(50):
        gc.collect()
        if not os.listdir(d):
            break
        await __import__("asyncio").sleep(0.02)
    assert os.listdir(d) == [], "the buffer's file is unlinked with its connection"


async def test_callers_and_hosts_without_the_directory_use_the_socket(shm_host, tmp_path):
    url, buffers, d = shm_host
    r = await buffered_fetch(url + "/big", Request("GET", "/big"), 30, connections=Connections())
    assert r.body == BIG and buffers.replies == 0, "the caller did not ask"
    other = tmp_path / "other"
    other.mkdir()
    conns = Connections(shm=ReplyReader(other))
    r = await buffered_fetch(url + "/big", Request("GET", "/big"), 30, connections=conns)
    assert r.body == BIG and buffers.replies == 0 and os.listdir(other) == [], "another cluster's directory"
    conns.close()
    for host_shm in (None, ReplyBuffers(tmp_path / "gone")):  # none, and one whose directory is missing
        runner, plain = await _serve(host_shm)
        try:
            conns = Connections(shm=ReplyReader(tmp_path / "gone" if host_shm else d))
            r = await buffered_fetch(plain + "/big", Request("GET", "/big"), 30, connections=conns)
            assert r.status == 200 and r.body == BIG and conns.shm.replies == 0, host_shm
            conns.close()
        finally:
            await runner.cleanup()
    assert host_shm.failures == 1


async def test_more_connections_than_buffers_fall_back_to_the_socket(shm_host):
    url, buffers, d = shm_host
    many = [Connections(shm=ReplyReader(d)) for _ in range(3)]
    held = []
    for c in many:  # each its own connection, all kept open
        r = await buffered_fetch(url + "/big", Request("GET", "/big"), 30, connections=c)
        assert r.body == BIG
        held.append(c)
    assert buffers.replies == 2 and sum(c.shm.replies for c in many) == 2, "the third reply took the socket"
    for c in many:
        c.close()


async def test_a_reply_naming_a_file_the_caller_may_not_read_is_a_bad_gateway(tmp_path):
    from aiohttp import web

    secret = tmp_path / "secret"
    secret.write_bytes(b"x" * 100)
    reader_dir = tmp_path / "shm"
    reader_dir.mkdir()
    os.symlink(secret, reader_dir / "knot-shm-1-1")

    async def liar(request):
        name = request.query["name"]
        return web.Response(headers={"X-Knot-Shm": name, "X-Knot-Shm-Length": request.query.get("n", "10")})

    app = web.Application()
    app.router.add_get("/", liar)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    url = f"http://127.0.0.1:{runner.addresses[0][1]}/"
    try:
        for query, needle in (("name=../secret", "not a reply buffer"), ("name=knot-shm-1-1", "reply buffer"),
                              ("name=knot-shm-2-2", "No such file"), ("name=knot-shm-1-1&n=x", "X-Knot-Shm-Length")):
            with pytest.raises(BadGateway, match=needle):
                await buffered_fetch(url + "?" + query, Request("GET", "/"), 5,
                                     connections=Connections(shm=ReplyReader(reader_dir)))
        with pytest.raises(BadGateway, match="did not ask"):
            await buffered_fetch(url + "?name=knot-shm-1-1", Request("GET", "/"), 5, connections=Connections())
        (reader_dir / "knot-shm-3-3").write_bytes(b"y" * 5)
        with pytest.raises(BadGateway, match="holds 5 bytes"):
            await buffered_fetch(url + "?name=knot-shm-3-3&n=10", Request("GET", "/"), 5,
                                 connections=Connections(shm=ReplyReader(reader_dir)))
    finally:
        await runner.cleanup()
    assert MAX_BUFFERS >= 4, "two stations' prefetching connections"


async def test_a_full_directory_sends_the_reply_over_the_socket(shm_host, monkeypatch):
    """posix_fallocate reserves a buffer's pages before the copy: a full tmpfs refuses there
    (ENOSPC), and the reply takes the socket, where a write to an unbacked page would kill the host."""
    import errno

    url, buffers, d = shm_host

    def full(fd, offset, length):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "posix_fallocate", full)
    conns = Connections(shm=ReplyReader(d))
    r = await buffered_fetch(url + "/big", Request("GET", "/big"), 30, connections=conns)
    assert r.status == 200 and r.body == BIG and buffers.failures == 1 and conns.shm.replies == 0
    assert os.listdir(d) == [], "the refused buffer's file is gone"
    conns.close()


def test_a_large_copy_in_two_halves_is_byte_exact():
    """_copy splits a copy of SPLIT_COPY_BYTES or more between two threads: every byte lands, at
    its offset, with nothing written outside [at, at + n)."""
    import numpy as np

    from deploy.local.shm import SPLIT_COPY_BYTES, _copy

    n = SPLIT_COPY_BYTES + 12345  # odd: the halves differ by a byte
    src = np.random.default_rng(1).bytes(n)
    dst = bytearray(b"\xaa" * (n + 7))
    _copy(dst, src, n, at=3)
    assert dst[3:3 + n] == src and dst[:3] == b"\xaa" * 3 and dst[3 + n:] == b"\xaa" * 4
    small = bytearray(10)
    _copy(small, b"abcdef", 6, at=2)
    assert small == b"\0\0abcdef\0\0"
