"""Large replies through shared memory, between the local processes of one cluster (KNOT_SHM_DIR).

A fluid 7B station moves ~1.9 GB per token out of its LayerWarden. Over loopback TCP each byte is
copied into the kernel by the warden and out by the station, and the TCP stack's work on both
sides is most of the CPU the two spend per token (docs/performance.md). Here the warden's host
copies a large reply body once into a file of the shared directory (tmpfs), and the station's
binding copies it once out: two memcpys and no socket.

The protocol, on the HTTP/1.1 exchange buffered_fetch already makes (deploy/local/bindings.py):
- the caller, whose KNOT_SHM_DIR is set, adds `X-Knot-Shm: <that directory>` to its request: it
  can read replies from there;
- a host whose KNOT_SHM_DIR is the same directory, answering with a body of SHM_MIN_BYTES or more
  (not a stream), writes the body into the reply buffer of that connection and sends no body, but
  `X-Knot-Shm: <file name>` and `X-Knot-Shm-Length: <bytes>`;
- the caller copies those bytes out of the file before it sends anything else on the connection.

Why this is safe without locks: a buffer belongs to one connection, whose next request (the only
thing that makes the host write it again) the caller sends only after its copy. The host creates
every file it writes (O_EXCL, mode 600) and unlinks it when the connection goes; the caller opens
only plain names in its own directory (no separators, O_NOFOLLOW), regular files of its own user,
read-only. Nothing here is trusted more than the socket's bytes: the frames inside carry their
crc32s, checked by the station as before. A host without the directory, or with every buffer in use
(MAX_BUFFERS), answers over the socket as always, so callers and hosts mix freely (docker compose
and Cloudflare never set it).

Shared blocks (the env binding SHARED_BLOCKS): the copy into a reply buffer was still a pass over
every streamed byte, and it was the LayerWarden's whole cost (~1 s of CPU per 7B token, both
stations' 3.9 GB). So a host can keep long-lived bytes in files of the directory from the start:
SharedBlocks.keep() copies a buffer once into a new file (a block) and returns a read-only view of
it, which the LayerWarden caches in place of the bytes. A reply whose parts include such views names
them instead of copying them: `X-Knot-Shm-Pieces: 12,knot-blk-7-3:56623150,...`, the body in order,
where `<n>` is the next n bytes of the reply's own body (the socket's, or the connection's buffer
when they reach SHM_MIN_BYTES) and `<name>:<n>` is a whole block. The caller copies every piece into
one private buffer, as it copies a reply buffer now: one copy, the caller's, where there were two.

A block is written once, before anyone can name it, and never again; its file is unlinked when the
last view of it goes (the cache evicted it, and no reply still pins it). The host pins a reply's
blocks with its connection until that connection carries its next request or closes, so the caller
always finds what a reply names. Nothing here trusts a block more than a reply buffer: a caller
copies it to private memory first, and the frames' crc32s are checked on that copy.
"""
from __future__ import annotations

import itertools
import logging
import mmap
import os
import re
import stat
import threading
import weakref
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from common.integrity import crc32, crc32_combine

log = logging.getLogger(__name__)

SHM_HEADER = "X-Knot-Shm"
SHM_LENGTH_HEADER = "X-Knot-Shm-Length"
PIECES_HEADER = "X-Knot-Shm-Pieces"
SHM_MIN_BYTES = 1 << 20  # smaller bodies go over the socket: a file's round trip costs more than they do
MAX_BUFFERS = 8  # a host's buffers at once (one per connection that got a large reply), ~a phase each
_NAME = re.compile(r"\Aknot-shm-[0-9]+-[0-9]+\Z")
_BLOCK_NAME = re.compile(r"\Aknot-blk-[0-9]+-[0-9]+\Z")
_names = itertools.count()
MAX_PIECES = 1024  # a reply's pieces (a LayerWarden batch is at most 256 frames and a header)
MAX_PIECES_CHARS = 16 << 10  # longer piece lists are not sent: the blocks' bytes go into the buffer instead
MAX_ASSEMBLED_BYTES = 16 << 30  # what a caller allocates for one reply's pieces, at most


# A copy of SPLIT_COPY_BYTES or more runs as two halves, one on a helper thread (numpy's copyto
# releases the GIL). One thread's memcpy does not fill the memory bus: a 56 MB phase took 9.7 ms on
# one thread and 4.6 ms on two, on this 2-core machine. Each copy is a link of a fluid phase's chain
# (the warden's into the buffer, the station's out of it), which runs while little else does.
SPLIT_COPY_BYTES = 8 << 20
_helper = ThreadPoolExecutor(1, thread_name_prefix="shm-copy")


def _copy(dst: Any, src: Any, n: int, at: int = 0) -> None:
    """n bytes from src to dst[at:] (numpy's memcpy: 4-7 GB/s a thread here, where a slice of an
    mmap assigned from bytes ran at 0.4-2.4)."""
    d, s = np.frombuffer(dst, np.uint8, n, at), np.frombuffer(src, np.uint8, n)
    if n < SPLIT_COPY_BYTES:
        np.copyto(d, s)
        return
    half = n // 2
    other = _helper.submit(np.copyto, d[half:], s[half:])
    try:
        np.copyto(d[:half], s[:half])
    finally:
        other.result()


# A block is checked as it is copied: chunk by chunk, the crc32 of what just landed in the caller's
# memory, while it is still in cache. Copy then crc32 was two passes over memory (the crc32 alone
# ~9 GB/s from memory here, ~20 from cache); on one thread a 56 MB phase went 3.8 -> 4.2 GB/s.
CHECK_CHUNK_BYTES = 256 << 10


def _copy_run(dst: np.ndarray, src: np.ndarray) -> int:
    crc = 0
    for a in range(0, dst.nbytes, CHECK_CHUNK_BYTES):
        out = dst[a:a + CHECK_CHUNK_BYTES]
        np.copyto(out, src[a:a + CHECK_CHUNK_BYTES])
        crc = crc32(out, crc)
    return crc


def _copy_checked(dst: Any, src: Any, n: int, at: int = 0) -> int:
    """_copy, returning the crc32 of the n bytes as they are in dst (read back from dst, so a src
    that changes meanwhile cannot make the two differ)."""
    d, s = np.frombuffer(dst, np.uint8, n, at), np.frombuffer(src, np.uint8, n)
    if n < SPLIT_COPY_BYTES:
        return _copy_run(d, s)
    half = n // 2
    other = _helper.submit(_copy_run, d[half:], s[half:])
    try:
        first = _copy_run(d[:half], s[:half])
    finally:
        second = other.result()
    return crc32_combine(first, second, n - half)


class _Buffer:
    """One connection's reply file, mapped read-write; it grows to the largest reply sent through it."""

    def __init__(self, directory: Path):
        self.name = f"knot-shm-{os.getpid()}-{next(_names)}"
        self.path = directory / self.name
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        self.map: mmap.mmap | None = None
        self.size = 0

    def write(self, parts: Sequence[Any]) -> int:
        """The body the parts concatenate (Response.parts), each copied once to its place."""
        sizes = [memoryview(p).nbytes for p in parts]
        n = sum(sizes)
        if n > self.size:
            if self.map is not None:
                self.map.close()
            # Allocated now, not on the first write through the map: a tmpfs that is full refuses
            # here (ENOSPC, the socket then), where a write to an unbacked page would be SIGBUS.
            os.posix_fallocate(self.fd, 0, n)
            self.map, self.size = mmap.mmap(self.fd, n), n
        at = 0
        for p, size in zip(parts, sizes):
            _copy(self.map, p, size, at)
            at += size
        return n

    def close(self) -> None:
        """Idempotent: the host's close, a sweep of closed connections and the transport's
        finalizer may each call it."""
        if self.fd < 0:
            return
        if self.map is not None:
            self.map.close()
        os.close(self.fd)
        self.fd = -1
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass


class SharedBlocks:
    """A host's immutable buffers in files of the shared directory (the env binding SHARED_BLOCKS):
    what keep() returns is sent by name, not copied, to callers of the same directory."""

    def __init__(self, directory: str | Path, min_bytes: int = SHM_MIN_BYTES):
        self.directory = Path(directory)
        self.min_bytes = min_bytes
        # id(array) -> (a weak reference to it, file name, bytes): only while the array lives (the
        # finalizer removes the entry before the id can be reused)
        self._live: dict[int, tuple[weakref.ref, str, int]] = {}
        self.bytes = 0  # in live blocks
        self.failures = 0  # blocks the directory refused (logged once)

    def keep(self, data: Any) -> memoryview | None:
        """A read-only copy of data (any contiguous buffer) in a new block, or None: data is smaller
        than min_bytes, or the directory refused (full or gone). The caller then keeps data itself."""
        n = memoryview(data).nbytes
        if n < self.min_bytes:
            return None
        name = f"knot-blk-{os.getpid()}-{next(_names)}"
        path = self.directory / name
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        except OSError as e:
            return self._refused(e)
        try:
            os.posix_fallocate(fd, 0, n)  # a full tmpfs refuses here, not with SIGBUS on a write
            m = mmap.mmap(fd, n)
        except OSError as e:
            os.unlink(path)
            return self._refused(e)
        finally:
            os.close(fd)
        _copy(m, data, n)
        array = np.frombuffer(m, np.uint8)
        array.flags.writeable = False
        key = id(array)
        self._live[key] = (weakref.ref(array), name, n)
        self.bytes += n
        weakref.finalize(array, self._release, key, path, n)
        return memoryview(array)

    def _refused(self, e: OSError) -> None:
        if not self.failures:
            log.warning("shared block in %s: %s; keeping bytes in the process", self.directory, e)
        self.failures += 1
        return None

    def _release(self, key: int, path: Path, n: int) -> None:
        self._live.pop(key, None)
        self.bytes -= n
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass

    def region(self, part: Any) -> tuple[str, int] | None:
        """(file name, bytes) when part is a whole block keep() returned; None for any other buffer."""
        if not isinstance(part, memoryview):
            return None
        live = self._live.get(id(part.obj))
        if live is None or live[0]() is not part.obj or part.nbytes != live[2]:
            return None
        return live[1], live[2]

    def stats(self) -> dict:
        return {"blocks": len(self._live), "block_bytes": self.bytes, "block_failures": self.failures}


class ReplyBuffers:
    """A host's side: each connection's reply buffer, made on its first large reply and dropped
    with the connection (its transport)."""

    def __init__(self, directory: str | Path, max_buffers: int = MAX_BUFFERS):
        self.directory = Path(directory)
        self.offer = str(self.directory)  # what a caller of the same directory sends in SHM_HEADER
        self.max_buffers = max_buffers
        self._by_transport: weakref.WeakKeyDictionary[Any, _Buffer] = weakref.WeakKeyDictionary()
        # the blocks of each connection's last reply, kept until its caller has copied them
        self._pinned: weakref.WeakKeyDictionary[Any, list] = weakref.WeakKeyDictionary()
        self.blocks = SharedBlocks(self.directory)  # the host's SHARED_BLOCKS binding
        self.replies = 0  # bodies sent through a buffer
        self.bytes = 0
        self.block_replies = 0  # replies that named blocks
        self.block_bytes = 0  # bytes of the blocks they named (copied by nobody but the caller)
        self.failures = 0  # buffers the directory refused (logged once)

    def reply(self, transport: Any, parts: Sequence[Any]) -> tuple[dict[str, str], list] | None:
        """How to send a body (the buffers it concatenates) to a caller of this directory: (headers,
        the parts still to send over the socket), or None when all of it goes over the socket.

        Blocks are named (PIECES_HEADER), the rest is copied into the connection's buffer when it
        reaches SHM_MIN_BYTES and sent over the socket otherwise."""
        self._pinned.pop(transport, None)  # its caller copied the last reply before sending this request
        pieces: list[int | tuple[str, int]] = []
        inline, named = [], []
        for p in parts:
            region = self.blocks.region(p)
            if region is not None:
                pieces.append(region)
                named.append(p)
                continue
            n = memoryview(p).nbytes
            if not n:
                continue
            inline.append(p)
            if pieces and isinstance(pieces[-1], int):
                pieces[-1] += n  # neighbouring inline parts are one piece
            else:
                pieces.append(n)
        headers: dict[str, str] = {}
        if named:
            spec = ",".join(str(x) if isinstance(x, int) else f"{x[0]}:{x[1]}" for x in pieces)
            if len(pieces) <= MAX_PIECES and len(spec) <= MAX_PIECES_CHARS:
                headers[PIECES_HEADER] = spec
                self._pinned[transport] = named
                self.block_replies += 1
                self.block_bytes += sum(n for _, n in (x for x in pieces if not isinstance(x, int)))
            else:
                inline, named = list(parts), []
        if sum(memoryview(p).nbytes for p in inline) >= SHM_MIN_BYTES:
            put = self.write(transport, inline)
            if put is not None:
                headers[SHM_HEADER], headers[SHM_LENGTH_HEADER] = put[0], str(put[1])
                return headers, []
        return (headers, inline) if named else None

    def write(self, transport: Any, parts: Sequence[Any]) -> tuple[str, int] | None:
        """Copy a body (the buffers it concatenates, Response.parts) into the connection's buffer ->
        (file name, bytes); None when no buffer is free, or the directory refuses one (the body then
        goes over the socket)."""
        buf = self._by_transport.get(transport)
        try:
            if buf is None:
                if len(self._by_transport) >= self.max_buffers:
                    for t in [t for t in self._by_transport if t.is_closing()]:
                        self._by_transport.pop(t).close()
                if len(self._by_transport) >= self.max_buffers:
                    return None
                buf = _Buffer(self.directory)
                self._by_transport[transport] = buf
                weakref.finalize(transport, buf.close)
            n = buf.write(parts)
        except OSError as e:  # a full or missing directory: the socket, as without one
            if not self.failures:
                log.warning("reply buffer in %s: %s; replies go over the socket", self.directory, e)
            self.failures += 1
            if buf is not None:
                self._by_transport.pop(transport, None)
                buf.close()
            return None
        self.replies += 1
        self.bytes += n
        return buf.name, n

    def stats(self) -> dict:
        """For the host's /healthz: the replies and bytes sent through buffers, the buffers now, refusals."""
        return {"replies": self.replies, "bytes": self.bytes,
                "buffers": len(self._by_transport), "failures": self.failures,
                "block_replies": self.block_replies, "block_bytes_named": self.block_bytes, **self.blocks.stats()}

    def close(self) -> None:
        self._pinned.clear()
        for t in list(self._by_transport):
            self._by_transport.pop(t).close()


class ShmError(Exception):
    """A reply that names a file the caller may not, or cannot, read."""


class ReplyReader:
    """A caller's side: the bytes of a reply the host left in the shared directory."""

    def __init__(self, directory: str | Path):
        self.directory = Path(directory)
        self.offer = str(self.directory)  # SHM_HEADER's value: a host of another directory ignores it
        self._maps: dict[str, tuple[int, int, mmap.mmap]] = {}  # name -> (inode, size, read-only map)
        self.replies = 0
        # The buffer of an assembled body nobody holds any more, kept for the next one (the largest
        # such, one at a time). A fresh buffer's pages are faulted in and zeroed by the kernel
        # before the copy writes them: 56 MB took 17.5 ms to assemble and check into a fresh
        # buffer, 8.4 ms into a used one (benchmarks/fluid_copy.py). A fluid station assembles
        # every phase's weights: ~1.9 GB per 7B token.
        self._spare: np.ndarray | None = None
        self._spare_lock = threading.Lock()
        self._closed = False
        self.reused = 0  # bodies assembled into a spare buffer

    def read(self, name: str, length: int) -> memoryview:
        """A copy of the reply's bytes (read-only), taken before the connection carries anything else."""
        if not _NAME.match(name):
            raise ShmError(f"{SHM_HEADER} {name[:80]!r} is not a reply buffer's name")
        _, _, m = self._map(name, length)
        out = self._buffer(length)  # not zeroed first, as a bytearray would be: every byte is copied in
        _copy(out, m, length)
        self.replies += 1
        return memoryview(out).toreadonly()

    def assemble(self, spec: str, inline: Any, checked: dict[int, tuple[int, int]] | None = None) -> memoryview:
        """A private copy of the body a PIECES_HEADER spec describes: `<n>` pieces from `inline` (the
        reply's own body, in order), `<name>:<n>` pieces from the blocks of those names. Each block's
        crc32, computed on the copy as it was made, goes into `checked` (offset -> (length, crc32)):
        Response.body_crc32s."""
        pieces: list[tuple[str | None, int]] = []
        for item in spec.split(","):
            name, sep, n = item.rpartition(":")
            if not n.isdigit() or (sep and not _BLOCK_NAME.match(name)):
                raise ShmError(f"{PIECES_HEADER} piece {item[:80]!r} is neither <bytes> nor <block name>:<bytes>")
            pieces.append((name if sep else None, int(n)))
        total, own = sum(n for _, n in pieces), sum(n for name, n in pieces if name is None)
        if len(pieces) > MAX_PIECES or total > MAX_ASSEMBLED_BYTES:
            raise ShmError(f"{PIECES_HEADER}: {len(pieces)} pieces of {total} bytes, over this reader's "
                           f"{MAX_PIECES} pieces or {MAX_ASSEMBLED_BYTES} bytes")
        inline = memoryview(inline).cast("B")
        if own != inline.nbytes:
            raise ShmError(f"{PIECES_HEADER} names {own} bytes of the reply's own body, which has {inline.nbytes}")
        out = self._buffer(total)
        at = taken = 0
        for name, n in pieces:
            if name is None:
                _copy(out, inline[taken:taken + n], n, at)
                taken += n
            else:
                crc = _copy_checked(out, self._map(name, n)[2], n, at)
                if checked is not None:
                    checked[at] = (n, crc)
            at += n
        self.replies += 1
        return memoryview(out).toreadonly()

    def _buffer(self, n: int) -> np.ndarray:
        """n bytes to assemble a body into (every byte is written): the spare buffer where it is large
        enough, else a new one. Either comes back as the spare once the body's last view is gone."""
        with self._spare_lock:
            raw = self._spare if self._spare is not None and self._spare.nbytes >= n else None
            if raw is not None:
                self._spare = None
                self.reused += 1
        if raw is None:
            if n < SPLIT_COPY_BYTES:
                return np.empty(n, np.uint8)  # small: the allocator's, not worth keeping
            raw = np.empty(n, np.uint8)
        out = raw[:n]  # the body's views all hold this (memoryviews of it), never raw directly
        weakref.finalize(out, self._give_back, raw)
        return out

    def _give_back(self, raw: np.ndarray) -> None:
        with self._spare_lock:
            if self._closed:
                return
            if self._spare is None or raw.nbytes > self._spare.nbytes:
                self._spare = raw

    def _map(self, name: str, length: int) -> tuple[int, int, mmap.mmap]:
        what = "block" if _BLOCK_NAME.match(name) else "reply buffer"
        try:
            fd = os.open(self.directory / name, os.O_RDONLY | os.O_NOFOLLOW)
        except OSError as e:
            raise ShmError(f"{what} {name}: {e.strerror}") from None
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid():
                raise ShmError(f"{what} {name} is not a regular file of this user")
            if st.st_size < length:
                raise ShmError(f"{what} {name} holds {st.st_size} bytes, the reply says {length}")
            kept = self._maps.get(name)
            if kept is not None and kept[0] == st.st_ino and kept[1] == st.st_size:
                return kept
            if kept is not None:
                self._maps.pop(name)[2].close()
            for old in [o for o in self._maps if not (self.directory / o).exists()]:
                self._maps.pop(old)[2].close()  # its connection is gone: the host unlinked the file
            m = mmap.mmap(fd, st.st_size, prot=mmap.PROT_READ)
            self._maps[name] = (st.st_ino, st.st_size, m)
            return self._maps[name]
        finally:
            os.close(fd)

    def close(self) -> None:
        for _, _, m in self._maps.values():
            m.close()
        self._maps.clear()
        with self._spare_lock:
            self._spare, self._closed = None, True
