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
"""
from __future__ import annotations

import itertools
import logging
import mmap
import os
import re
import stat
import weakref
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Sequence

import numpy as np

log = logging.getLogger(__name__)

SHM_HEADER = "X-Knot-Shm"
SHM_LENGTH_HEADER = "X-Knot-Shm-Length"
SHM_MIN_BYTES = 1 << 20  # smaller bodies go over the socket: a file's round trip costs more than they do
MAX_BUFFERS = 8  # a host's buffers at once (one per connection that got a large reply), ~a phase each
_NAME = re.compile(r"\Aknot-shm-[0-9]+-[0-9]+\Z")
_names = itertools.count()


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


class ReplyBuffers:
    """A host's side: each connection's reply buffer, made on its first large reply and dropped
    with the connection (its transport)."""

    def __init__(self, directory: str | Path, max_buffers: int = MAX_BUFFERS):
        self.directory = Path(directory)
        self.offer = str(self.directory)  # what a caller of the same directory sends in SHM_HEADER
        self.max_buffers = max_buffers
        self._by_transport: weakref.WeakKeyDictionary[Any, _Buffer] = weakref.WeakKeyDictionary()
        self.replies = 0  # bodies sent through a buffer
        self.bytes = 0
        self.failures = 0  # buffers the directory refused (logged once)

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
                "buffers": len(self._by_transport), "failures": self.failures}

    def close(self) -> None:
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

    def read(self, name: str, length: int) -> memoryview:
        """A copy of the reply's bytes (read-only), taken before the connection carries anything else."""
        if not _NAME.match(name):
            raise ShmError(f"{SHM_HEADER} {name[:80]!r} is not a reply buffer's name")
        _, _, m = self._map(name, length)
        out = np.empty(length, np.uint8)  # not zeroed first, as a bytearray would be: every byte is copied in
        _copy(out, m, length)
        self.replies += 1
        return memoryview(out).toreadonly()

    def _map(self, name: str, length: int) -> tuple[int, int, mmap.mmap]:
        try:
            fd = os.open(self.directory / name, os.O_RDONLY | os.O_NOFOLLOW)
        except OSError as e:
            raise ShmError(f"reply buffer {name}: {e.strerror}") from None
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid():
                raise ShmError(f"reply buffer {name} is not a regular file of this user")
            if st.st_size < length:
                raise ShmError(f"reply buffer {name} holds {st.st_size} bytes, the reply says {length}")
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
