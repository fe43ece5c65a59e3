"""deploy/local/shm.py: large replies through a shared directory between a host and buffered_fetch
(issue 15, the fluid path). Against the real host on a real socket, its aiohttp app and its lean server: the bytes equal the
socket's, a connection reuses its buffer and the buffer goes with it, callers or hosts without the
directory get the socket, and a reply naming a file the caller may not read is a BadGateway.
Shared blocks: a reply names them instead of copying them, the caller reads them in place and gets
the same bytes, checks each sealed block once while it holds it, refuses a block that is not
sealed, and a block's descriptor lives exactly as long as its view and the last reply that named it."""
from __future__ import annotations

import os

import pytest

from common.integrity import crc32
from common.runtime import BadGateway, Env, Request, Response
from deploy.local.server_bindings import Connections, buffered_fetch
from deploy.local.host import ServiceRuntime
from deploy.local.shm import SHM_MIN_BYTES, MAX_BUFFERS, ReplyBuffers, ReplyReader
from deploy.local.tasks import BackgroundTasks
from tests.hosts import SERVERS, serve

BIG = os.urandom(3 * SHM_MIN_BYTES + 4321)


BLOCKS: dict[str, memoryview] = {}  # what the /blocks handler holds, as a warden's cache would


async def handler(request: Request, env, ctx) -> Response:
    if request.path == "/blocks":  # a warden's batch with cached frames in shared blocks, and small ones not
        small = int(request.query.get("small", "100"))
        return Response.from_parts([BIG[:12], BLOCKS["a"], BIG[:small], BIG[5:9], BLOCKS["b"]],
                                   "application/x-knot-tensor-batch")
    if request.path == "/big":
        return Response.from_bytes(BIG, "application/x-knot-tensor-batch")
    if request.path == "/bigger":
        return Response.from_bytes(BIG + BIG[::-1], "application/x-knot-tensor-batch")
    if request.path == "/parts":  # a warden's batch: the frames it holds, copied into the buffer one by one
        return Response.from_parts([BIG[:9], b"", memoryview(BIG)[9:SHM_MIN_BYTES + 1].toreadonly(),
                                    BIG[SHM_MIN_BYTES + 1:]], "application/x-knot-tensor-batch")
    return Response.from_json({"path": request.path})


async def _serve(shm: ReplyBuffers | None, server: str = "aiohttp"):
    """-> (close, url) of the handler on either HTTP server (tests/hosts.py): a LayerWarden on the
    aiohttp app, a station's large prefill replies on the lean one."""
    rt = ServiceRuntime("layer-warden", handler, Env(), BackgroundTasks("test"), shm=shm)
    url, close = await serve(rt, server)
    return close, url


@pytest.fixture(params=SERVERS)
async def shm_host(tmp_path, request):
    buffers = ReplyBuffers(tmp_path, max_buffers=2)
    close, url = await _serve(buffers, request.param)
    yield url, buffers, tmp_path
    await close()
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
    assert health == {"replies": 4, "bytes": 5 * len(BIG), "buffers": 1, "failures": 0, "block_replies": 0,
                      "block_bytes_named": 0, "blocks": 0, "block_bytes": 0, "block_failures": 0}
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
    for server in SERVERS:
        for host_shm in (None, ReplyBuffers(tmp_path / "gone")):  # none, and one whose directory is missing
            close, plain = await _serve(host_shm, server)
            try:
                conns = Connections(shm=ReplyReader(tmp_path / "gone" if host_shm else d))
                r = await buffered_fetch(plain + "/big", Request("GET", "/big"), 30, connections=conns)
                assert r.status == 200 and r.body == BIG and conns.shm.replies == 0, (server, host_shm)
                conns.close()
            finally:
                await close()
        assert host_shm.failures == 1, server


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


async def _serve_liar(liar):
    """A host of our own that says what a test makes it say (aiohttp directly, no checks)."""
    from aiohttp import web

    app = web.Application()
    app.router.add_get("/", liar)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    return runner, f"http://127.0.0.1:{runner.addresses[0][1]}/"


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

    runner, url = await _serve_liar(liar)
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


def test_a_crc32_in_two_halves_is_the_crc32():
    """_crc32_split: from SPLIT_COPY_BYTES on, two halves (one on the helper thread) joined by
    crc32_combine, equal to one pass over the bytes."""
    import numpy as np

    from deploy.local.shm import SPLIT_COPY_BYTES, _crc32_split

    rng = np.random.default_rng(2)
    for n in (0, 1, SPLIT_COPY_BYTES - 1, SPLIT_COPY_BYTES, SPLIT_COPY_BYTES + 12345):
        src = rng.bytes(n)
        assert _crc32_split(np.frombuffer(src, np.uint8)) == crc32(src), n


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


def _expected(small: int) -> bytes:
    return BIG[:12] + bytes(BLOCKS["a"]) + BIG[:small] + BIG[5:9] + bytes(BLOCKS["b"])


def _block_fds() -> int:
    """The shared blocks this process has open (memfds named knot-blk-*; a map holds a descriptor
    of its own, so one block may have two)."""
    inodes = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            if os.readlink(f"/proc/self/fd/{fd}").startswith("/memfd:knot-blk-"):
                inodes.add(os.stat(f"/proc/self/fd/{fd}").st_ino)
        except OSError:  # the listing's own descriptor, closed by now
            pass
    return len(inodes)


async def _settle(predicate) -> bool:
    import asyncio
    import gc
    for _ in range(50):
        gc.collect()
        if predicate():
            return True
        await asyncio.sleep(0.02)
    return False


async def test_shared_blocks_are_named_not_copied_and_live_as_long_as_their_views(shm_host):
    import numpy as np

    url, buffers, d = shm_host
    blocks = buffers.blocks
    fds_before = _block_fds()
    BLOCKS["a"] = blocks.keep(BIG)
    BLOCKS["b"] = blocks.keep(BIG[::-1][:SHM_MIN_BYTES])
    assert blocks.keep(BIG[:SHM_MIN_BYTES - 1]) is None, "a small buffer stays in the process"
    assert BLOCKS["a"].readonly and bytes(BLOCKS["a"]) == BIG and blocks.stats()["blocks"] == 2
    assert _block_fds() == fds_before + 2 and os.listdir(d) == [], "memfds, not files of the directory"
    with pytest.raises(TypeError):
        BLOCKS["a"][0] = 1  # nothing writes a block again
    name_a = blocks.region(BLOCKS["a"])[0]
    pid, fd, inode = (int(x) for x in name_a.removeprefix("knot-blk-").split("-"))
    assert (pid, inode) == (os.getpid(), os.fstat(fd).st_ino) and blocks.region(BLOCKS["a"]) == (name_a, len(BIG))
    with pytest.raises(PermissionError):
        os.pwrite(fd, b"!", 0)  # sealed: the kernel refuses every write, the host's own too
    assert blocks.region(BLOCKS["a"][1:]) is None and blocks.region(memoryview(BIG)) is None, "whole blocks only"
    try:
        conns = Connections(shm=ReplyReader(d))
        for small in (100, 2 * SHM_MIN_BYTES):  # the rest over the socket, then through the connection's buffer
            r = await buffered_fetch(url + f"/blocks?small={small}", Request("GET", "/blocks"), 30, connections=conns)
            assert r.status == 200 and not any(h.startswith("X-Knot-Shm") for h in r.headers)
            mapped = [p for p in r.parts if p.nbytes in (len(BIG), SHM_MIN_BYTES) and isinstance(p.obj, np.ndarray)]
            assert len(mapped) == 2 and all(p.readonly for p in r.parts), "the blocks themselves, read in place"
            a, b = 12, 12 + len(BIG) + small + 4  # each block's crc32, taken by the reader
            assert r.body_crc32s == {a: (len(BIG), crc32(BIG)), b: (SHM_MIN_BYTES, crc32(bytes(BLOCKS["b"])))}
            assert r.body == _expected(small)
        assert (buffers.block_replies, buffers.replies, conns.shm.replies) == (2, 1, 3)
        assert buffers.block_bytes == 2 * (len(BIG) + SHM_MIN_BYTES)
        assert conns.shm.stats()["checked_blocks"] == 2 and conns.shm.stats()["held_hits"] == 2, "checked once each"
        plain = await buffered_fetch(url + "/blocks", Request("GET", "/blocks"), 30, connections=Connections())
        assert plain.body == _expected(100) and buffers.block_replies == 2, "a caller without the directory: the socket"
        elsewhere = Connections(shm=ReplyReader(d))
        elsewhere.shm.pid_ns = "1"  # another pid namespace (a container sharing the directory)
        r2 = await buffered_fetch(url + "/blocks", Request("GET", "/blocks"), 30, connections=elsewhere)
        assert r2.body == _expected(100) and r2.parts == (r2.body,) and buffers.block_replies == 2
        assert (buffers.replies, elsewhere.shm.replies) == (2, 1), "the whole body through its reply buffer"
        elsewhere.close()
        del r2

        # The cache drops block a while the last reply on the connection still names it: its
        # descriptor stays until that connection's next large reply, then goes.
        del BLOCKS["a"]
        assert await _settle(lambda: blocks.stats()["blocks"] == 2) and _block_fds() == fds_before + 2, "pinned"
        r = await buffered_fetch(url + "/big", Request("GET", "/big"), 30, connections=conns)
        assert r.body == BIG
        assert await _settle(lambda: blocks.stats()["blocks"] == 1), "unpinned by the next reply"
        assert blocks.stats()["block_bytes"] == SHM_MIN_BYTES and _fd_inode(fd) != inode, "its descriptor closed"
        assert _block_fds() == fds_before + 2, "the reader still holds block a's map: its bytes live on"
        conns.close()
        del r, mapped
    finally:
        BLOCKS.clear()
    assert await _settle(lambda: blocks.stats()["blocks"] == 0 and _block_fds() == fds_before)


def _fd_inode(fd: int) -> int | None:
    try:
        return os.fstat(fd).st_ino
    except OSError:
        return None


async def test_a_block_the_kernel_refuses_stays_in_the_process(monkeypatch):
    import errno

    from deploy.local.shm import SharedBlocks

    blocks = SharedBlocks()
    fds = len(os.listdir("/proc/self/fd"))
    monkeypatch.setattr(os, "pwrite", lambda *a: (_ for _ in ()).throw(OSError(errno.ENOMEM, "Cannot allocate memory")))
    assert blocks.keep(BIG) is None and blocks.failures == 1 and blocks.stats()["blocks"] == 0
    assert len(os.listdir("/proc/self/fd")) == fds, "the refused memfd is closed"
    monkeypatch.setattr(os, "memfd_create", lambda *a: (_ for _ in ()).throw(OSError(errno.EMFILE, "Too many open files")))
    assert blocks.keep(BIG) is None and blocks.failures == 2


def _memfd(data: bytes, seals: int | None) -> int:
    """A memfd of this process holding data, with these seals added (None: none, nor sealable)."""
    import fcntl

    fd = os.memfd_create("knot-blk-test", os.MFD_CLOEXEC | (os.MFD_ALLOW_SEALING if seals is not None else 0))
    os.pwrite(fd, data, 0)
    if seals:
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, seals)
    return fd


async def test_bad_pieces_are_a_bad_gateway(tmp_path):
    """A reply's piece list is the peer's word: names that are not blocks, lengths that do not add
    up, descriptors that are not there, not what the name says, too short or not sealed, or too
    many pieces, each a BadGateway that names it."""
    import fcntl

    from aiohttp import web

    from deploy.local.shm import BLOCK_SEALS

    d = tmp_path / "shm"
    d.mkdir()
    me = os.getpid()
    sealed = _memfd(b"z" * 64, BLOCK_SEALS)
    open_ = _memfd(b"z" * 64, None)  # could be written after the check
    no_shrink = _memfd(b"z" * 64, fcntl.F_SEAL_WRITE | fcntl.F_SEAL_GROW)
    plain = os.open(tmp_path / "plain", os.O_RDWR | os.O_CREAT)  # a file of a directory takes no seals
    os.pwrite(plain, b"z" * 64, 0)
    fifo_path = tmp_path / "fifo"
    os.mkfifo(fifo_path)
    fifo = os.open(fifo_path, os.O_RDONLY | os.O_NONBLOCK)  # a peer's FIFO: opening it must not wait
    name = {fd: f"knot-blk-{me}-{fd}-{os.fstat(fd).st_ino}" for fd in (sealed, open_, no_shrink, plain, fifo)}

    async def liar(request):
        pieces = ",".join([request.query["p"]] * int(request.query.get("k", "1")))  # k times: no long URLs
        return web.Response(headers={"X-Knot-Shm-Pieces": pieces}, body=b"x" * int(request.query["n"]))

    runner, url = await _serve_liar(liar)
    from urllib.parse import quote
    good = name[sealed]
    try:
        r = await buffered_fetch(url + "?n=3&p=" + quote(f"2,{good}:64,1"), Request("GET", "/"), 5,
                                 connections=Connections(shm=ReplyReader(d)))
        assert r.body == b"xx" + b"z" * 64 + b"x", "the liar's honest reply"
        wrong_inode = f"knot-blk-{me}-{sealed}-{os.fstat(sealed).st_ino + 1}"
        for pieces, n, needle in (("../secret:10", 0, "neither"), ("knot-shm-1-1:10", 0, "neither"),
                                  (f"knot-blk-{me}-{sealed}:64", 0, "neither"), (f"{good}:x", 0, "neither"),
                                  (f"3,{good}:64", 2, "has 2"), (f"{good}:65", 0, "holds 64 bytes"),
                                  (f"knot-blk-{me}-99999-1:1", 0, "No such file"),
                                  (f"{wrong_inode}:64", 0, "inode"),
                                  (f"{name[open_]}:64", 0, "not sealed"), (f"{name[no_shrink]}:64", 0, "not sealed"),
                                  (f"{name[plain]}:64", 0, "not sealed"),
                                  (f"{name[fifo]}:64", 0, "not a regular file"),
                                  (f"{good}:1&k=1025", 0, "1025 pieces"),
                                  (f"{good}:99999999999", 0, "bytes, over")):
            with pytest.raises(BadGateway, match=needle):
                await buffered_fetch(url + f"?n={n}&p=" + quote(pieces, safe="&="), Request("GET", "/"), 5,
                                     connections=Connections(shm=ReplyReader(d)))
        with pytest.raises(BadGateway, match="did not ask"):
            await buffered_fetch(url + "?n=0&p=" + quote(f"{good}:64"), Request("GET", "/"), 5,
                                 connections=Connections())
        held = Connections(shm=ReplyReader(d))
        await buffered_fetch(url + "?n=0&p=" + quote(f"{good}:64"), Request("GET", "/"), 5, connections=held)
        with pytest.raises(BadGateway, match="holds 64 bytes"):  # held, and named with another length
            await buffered_fetch(url + "?n=0&p=" + quote(f"{good}:63"), Request("GET", "/"), 5, connections=held)
        held.close()
    finally:
        await runner.cleanup()
        for fd in name:
            os.close(fd)


def test_a_held_block_is_checked_once_and_let_go_when_unused(tmp_path, monkeypatch):
    """The reader takes a block's crc32 when it first maps it, and not while it holds that map: the
    same inode, sealed, is the same bytes. Unused for HOLD_SECONDS, or past MAX_HELD_BYTES, it is
    let go, and checked again when named again."""
    import numpy as np

    from deploy.local import shm

    passes = []
    real = shm._crc32_split
    monkeypatch.setattr(shm, "_crc32_split", lambda a: passes.append(a.nbytes) or real(a))
    blocks = shm.SharedBlocks()
    rng = np.random.default_rng(3)
    datas = [rng.bytes(shm.SPLIT_COPY_BYTES + 100), rng.bytes(SHM_MIN_BYTES)]
    kept = [blocks.keep(x) for x in datas]
    spec = ",".join(f"{blocks.region(k)[0]}:{len(x)}" for k, x in zip(kept, datas))
    reader = ReplyReader(tmp_path)
    for _ in range(3):
        checked: dict = {}
        parts = reader.assemble("3," + spec, b"abc", checked)
        assert [bytes(p) for p in parts] == [b"abc", *datas]
        assert checked == {3: (len(datas[0]), crc32(datas[0])), 3 + len(datas[0]): (len(datas[1]), crc32(datas[1]))}
    assert passes == [len(datas[0]), len(datas[1])], "one pass per block, the first time"
    assert reader.stats()["held_blocks"] == 2 and reader.stats()["held_hits"] == 4
    reader._let_go(shm.time.monotonic() + shm.HOLD_SECONDS + 1)
    assert reader.stats()["held_blocks"] == 0 and reader.held_bytes == 0
    assert bytes(parts[1]) == datas[0], "a view handed out keeps its own map"
    reader.assemble(spec, b"")
    assert len(passes) == 4, "named again after it was let go: checked again"
    monkeypatch.setattr(shm, "MAX_HELD_BYTES", len(datas[1]))
    reader.assemble(spec, b"")
    assert reader.stats()["held_blocks"] == 1 and reader.held_bytes == len(datas[1]), "the least recent went"
    reader.close()


def test_a_held_block_whose_host_closed_it_is_let_go_at_the_next_reply(tmp_path, monkeypatch):
    """A block its host dropped (the descriptor that named it closed: a LayerWarden on a new knot
    version) can never be named again: the reader lets it go at its next reply naming blocks, not
    HOLD_SECONDS later, so a reload does not leave the old version's blocks mapped (issue 52)."""
    import gc

    import numpy as np

    from deploy.local import shm

    monkeypatch.setattr(shm, "ALIVE_CHECK_S", 0.0)
    blocks = shm.SharedBlocks()
    rng = np.random.default_rng(5)
    datas = [rng.bytes(SHM_MIN_BYTES), rng.bytes(SHM_MIN_BYTES + 8)]
    kept = [blocks.keep(x) for x in datas]
    names = [blocks.region(k)[0] for k in kept]
    reader = ReplyReader(tmp_path)
    parts = reader.assemble(",".join(f"{n}:{len(x)}" for n, x in zip(names, datas)), b"")
    assert reader.stats()["held_blocks"] == 2
    del kept[0]  # the host's last view of block 0: its descriptor closes
    gc.collect()
    assert blocks.stats()["blocks"] == 1
    reader.assemble(f"{names[1]}:{len(datas[1])}", b"")
    assert reader.stats()["held_blocks"] == 1 and reader.held_bytes == len(datas[1])
    assert bytes(parts[0]) == datas[0], "a view handed out keeps its own map"
    reader.close()


def test_a_reply_buffer_copy_reuses_a_buffer_only_once_nothing_holds_it(tmp_path):
    """The reader copies a reply buffer into the buffer of an earlier copy only after every view of
    that copy (a frame's payload, an array over it) is gone: a body still held is never written over."""
    import gc

    import numpy as np

    from deploy.local.shm import SPLIT_COPY_BYTES, _Buffer

    rng = np.random.default_rng(3)
    datas = [rng.bytes(SPLIT_COPY_BYTES + 100) for _ in range(3)]
    buf = _Buffer(tmp_path)
    reader = ReplyReader(tmp_path)

    def read(data):
        return reader.read(buf.name, buf.write([data]))

    a = read(datas[0])
    held = np.frombuffer(a[50:], np.uint8)[10:].reshape(-1, 2)  # a payload's array, as a QTensor holds it
    del a
    gc.collect()
    b = read(datas[1])
    assert reader.reused == 0 and bytes(held.reshape(-1)) == datas[0][60:], "a held body is never reused"
    assert not np.shares_memory(np.frombuffer(b, np.uint8), held)
    del held, b
    gc.collect()
    c = read(datas[2])
    assert reader.reused == 1 and c == datas[2], "the spare, once nothing held it"
    reader.close()
    buf.close()
