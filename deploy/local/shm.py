"""Large replies through shared memory, between the local processes of one cluster (KNOT_SHM_DIR).

A fluid 7B station moves ~1.9 GB per token out of its LayerWarden. Over loopback TCP each byte is
copied into the kernel by the warden and out by the station, and the TCP stack's work on both
sides is most of the CPU the two spend per token (benchmarks/warden_transfer.py). Here the warden's host
copies a large reply body once into a file of the shared directory (tmpfs), and the station's
binding copies it once out: two memcpys and no socket.

The protocol, on the HTTP/1.1 exchange buffered_fetch already makes (deploy/local/server_bindings.py):
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
read-only. The directory is private: a host refuses to start on one that is not a directory of its
own user closed to every other (check_private: mode 700, as `knot cluster up` makes it), so only
the cluster's user (or root) can write a reply there. Nothing here is trusted more than the socket's
bytes: the frames inside carry their crc32s, checked by the station against the knot's as before
(what a process of the cluster's user could still do: docs/reliability.md, "Keyed caches"). A host without the directory, or with every buffer in use
(MAX_BUFFERS), answers over the socket as always, so callers and hosts mix freely (docker compose
and Cloudflare never set it).

Shared blocks (the env binding SHARED_BLOCKS): the copy into a reply buffer was still a pass over
every streamed byte, and it was the LayerWarden's whole cost (~1 s of CPU per 7B token, both
stations' 3.9 GB). So a host can keep long-lived bytes in shared memory from the start:
SharedBlocks.keep() writes a buffer once into a new memfd (a block), seals it and returns a read-only
view of it, which the LayerWarden caches in place of the bytes. A reply whose parts include such
views names them instead of copying them: `X-Knot-Shm-Pieces: 12,knot-blk-7-31-4096:56623150,...`,
the body in order, where `<n>` is the next n bytes of the reply's own body (the socket's, or the
connection's buffer when they reach SHM_MIN_BYTES) and `knot-blk-<pid>-<fd>-<inode>:<n>` is a whole
block, which the caller opens as /proc/<pid>/fd/<fd>.

Why the caller may compute straight from a peer's memory (no copy at all): a block is sealed
(F_SEAL_WRITE, F_SEAL_SHRINK, F_SEAL_GROW, then F_SEAL_SEAL) before anyone can name it, and the
kernel then refuses every write and every resize of that file, by anyone, for as long as it lives.
The caller checks the seals itself, maps the file read-only and takes its crc32 once. While the
caller holds that map, the file (its inode) cannot go, so a later reply naming the same inode names
the same bytes: the caller uses its map and its crc32 again, with no pass over the bytes. A peer can
still name a wrong block; the frames' crc32s catch that as they catch a wrong reply buffer. What the
caller holds goes once unused for HOLD_SECONDS (or past MAX_HELD_BYTES), or once its host has closed
the descriptor that named it (the host dropped it, e.g. a LayerWarden that loaded a new knot
version: no reply can name it again), at its next reply naming blocks. Why the last: a resident
station's LayerWarden names each block once per version, so without it the station held the old
version's blocks beside the new ones after a reload (~120 MB more for a 0.5B's half).

The host pins a reply's blocks with its connection until that connection carries its next request
or closes, so the caller always finds what a reply names; the block's descriptor closes when the
last view of it goes (the cache evicted it, and no reply still pins it).
"""
from __future__ import annotations

import fcntl
import itertools
import logging
import mmap
import os
import re
import stat
import threading
import time
import weakref
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np

from common.integrity import crc32, crc32_combine

log = logging.getLogger(__name__)

SHM_HEADER = "X-Knot-Shm"
SHM_LENGTH_HEADER = "X-Knot-Shm-Length"
PIECES_HEADER = "X-Knot-Shm-Pieces"
# The caller's pid namespace: blocks are named by /proc/<pid>/fd/<fd>, which means something only
# to a caller that sees the host's pids (a directory shared between containers would not).
PID_NS_HEADER = "X-Knot-Shm-Pid-Ns"
SHM_MIN_BYTES = 1 << 20  # smaller bodies go over the socket: a file's round trip costs more than they do
MAX_BUFFERS = 8  # a host's buffers at once (one per connection that got a large reply), ~a phase each
_NAME = re.compile(r"\Aknot-shm-[0-9]+-[0-9]+\Z")
_BLOCK_NAME = re.compile(r"\Aknot-blk-([0-9]{1,10})-([0-9]{1,10})-([0-9]{1,20})\Z")  # pid, fd, inode
# What makes a block immutable, checked by every caller on the file itself: no write, no resize.
BLOCK_SEALS = fcntl.F_SEAL_WRITE | fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW
HOLD_SECONDS = 30.0  # a checked block nobody named for this long is let go (its host may have dropped it)
MAX_HELD_BYTES = 16 << 30  # and the least recently named go past this many bytes (address space, not copies)
ALIVE_CHECK_S = 1.0  # at most this often, held blocks whose host closed their descriptor are let go
_names = itertools.count()
MAX_PIECES = 1024  # a reply's pieces (a LayerWarden batch is at most 256 frames and a header)
MAX_PIECES_CHARS = 16 << 10  # longer piece lists are not sent: the blocks' bytes go into the buffer instead
MAX_ASSEMBLED_BYTES = 16 << 30  # what a caller allocates for one reply's pieces, at most


# A copy of SPLIT_COPY_BYTES or more runs as two halves, one on a helper thread (numpy's copyto
# releases the GIL). One thread's memcpy does not fill the memory bus: two threads copy a phase in
# about half the time (benchmarks/fluid_copy.py). Each copy is a link of a fluid phase's chain
# (the warden's into the buffer, the station's out of it), which runs while little else does.
SPLIT_COPY_BYTES = 8 << 20
_helper = ThreadPoolExecutor(1, thread_name_prefix="shm-copy")


def _in_halves(n: int, run: Callable[[int, int], Any]) -> tuple[Any, Any]:
    """run(0, n) on this thread below SPLIT_COPY_BYTES, as (its result, None); else run on [0, n/2)
    here and [n/2, n) on the helper thread at once -> both results."""
    if n < SPLIT_COPY_BYTES:
        return run(0, n), None
    half = n // 2
    other = _helper.submit(run, half, n)
    try:
        first = run(0, half)
    finally:
        second = other.result()
    return first, second


def _copy(dst: Any, src: Any, n: int, at: int = 0) -> None:
    """n bytes from src to dst[at:] (numpy's memcpy: several times faster than assigning bytes to a
    slice of an mmap)."""
    d, s = np.frombuffer(dst, np.uint8, n, at), np.frombuffer(src, np.uint8, n)
    _in_halves(n, lambda a, b: np.copyto(d[a:b], s[a:b]))


def _crc32_split(a: np.ndarray) -> int:
    """crc32 of a's bytes, in two halves from SPLIT_COPY_BYTES on (ISA-L's crc32 releases the GIL),
    joined by crc32_combine."""
    n = a.nbytes
    first, second = _in_halves(n, lambda i, j: crc32(a[i:j]))
    return first if second is None else crc32_combine(first, second, n - n // 2)


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
    """A host's immutable buffers in sealed memfds (the env binding SHARED_BLOCKS): what keep()
    returns is sent by name, not copied, to callers of the same shared directory (one cluster's
    processes on one machine)."""

    def __init__(self, min_bytes: int = SHM_MIN_BYTES):
        self.min_bytes = min_bytes
        # id(array) -> (a weak reference to it, block name, bytes): only while the array lives (the
        # finalizer removes the entry before the id can be reused)
        self._live: dict[int, tuple[weakref.ref, str, int]] = {}
        self.bytes = 0  # in live blocks
        self.failures = 0  # blocks the kernel refused (logged once)

    def keep(self, data: Any) -> memoryview | None:
        """A read-only copy of data (any contiguous buffer) in a new sealed block, or None: data is
        smaller than min_bytes, or the kernel refused (out of memory). The caller then keeps data itself."""
        src = memoryview(data).cast("B")
        n = src.nbytes
        if n < self.min_bytes:
            return None
        try:
            fd = os.memfd_create(f"knot-blk-{next(_names)}", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        except OSError as e:
            return self._refused(e)
        try:
            at = 0
            while at < n:  # write(2), not a writable map: the write seal needs none to exist
                at += os.pwrite(fd, src[at:], at)
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, BLOCK_SEALS | fcntl.F_SEAL_SEAL)
            m = mmap.mmap(fd, n, prot=mmap.PROT_READ)
            name = f"knot-blk-{os.getpid()}-{fd}-{os.fstat(fd).st_ino}"
        except OSError as e:
            os.close(fd)
            return self._refused(e)
        array = np.frombuffer(m, np.uint8)  # read-only, as the map is
        key = id(array)
        self._live[key] = (weakref.ref(array), name, n)
        self.bytes += n
        weakref.finalize(array, self._release, key, fd, n)
        return memoryview(array)

    def _refused(self, e: OSError) -> None:
        if not self.failures:
            log.warning("shared block: %s; keeping bytes in the process", e)
        self.failures += 1
        return None

    def _release(self, key: int, fd: int, n: int) -> None:
        """The block's last view went: its name goes with the descriptor (a caller's map keeps the
        bytes until that caller lets go)."""
        self._live.pop(key, None)
        self.bytes -= n
        os.close(fd)

    def region(self, part: Any) -> tuple[str, int] | None:
        """(block name, bytes) when part is a whole block keep() returned; None for any other buffer."""
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
        self.pid_ns = pid_namespace()  # blocks are named only to callers that send the same (PID_NS_HEADER)
        self.max_buffers = max_buffers
        self._by_transport: weakref.WeakKeyDictionary[Any, _Buffer] = weakref.WeakKeyDictionary()
        # the blocks of each connection's last reply, kept until its caller has copied them
        self._pinned: weakref.WeakKeyDictionary[Any, list] = weakref.WeakKeyDictionary()
        self.blocks = SharedBlocks()  # the host's SHARED_BLOCKS binding
        self.replies = 0  # bodies sent through a buffer
        self.bytes = 0
        self.block_replies = 0  # replies that named blocks
        self.block_bytes = 0  # bytes of the blocks they named (copied by nobody but the caller)
        self.failures = 0  # buffers the directory refused (logged once)

    def reply(self, transport: Any, parts: Sequence[Any], name_blocks: bool = True) -> tuple[dict[str, str], list] | None:
        """How to send a body (the buffers it concatenates) to a caller of this directory: (headers,
        the parts still to send over the socket), or None when all of it goes over the socket.

        Blocks are named (PIECES_HEADER) where name_blocks (the caller shares this pid namespace),
        the rest is copied into the connection's buffer when it reaches SHM_MIN_BYTES and sent over
        the socket otherwise."""
        self._pinned.pop(transport, None)  # its caller mapped the last reply's blocks before sending this request
        pieces: list[int | tuple[str, int]] = []
        inline, named = [], []
        for p in parts:
            region = self.blocks.region(p) if name_blocks else None
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


def allow_descriptors(want: int = 1 << 16) -> int:
    """Raise this process's soft limit on open descriptors toward `want` (never past the hard
    limit), and return it. Each block is a descriptor or two: a host's own and its map's, a caller's
    map of each block it holds; a 7B LayerWarden keeps ~200 blocks, a station holds its ~100, and a
    soft limit of 1,024 is common."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = want if hard == resource.RLIM_INFINITY else min(want, hard)
    if soft != resource.RLIM_INFINITY and soft < target:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        soft = target
    return soft


class ShmError(Exception):
    """A reply that names a file the caller may not, or cannot, read; a directory that is not private."""


def check_private(directory: str | Path) -> None:
    """ShmError unless directory is a directory (not a symlink) of this process's user that no other
    user may enter, list or write (mode 700 or less): another user could otherwise write replies."""
    try:
        st = os.lstat(directory)
    except OSError as e:
        raise ShmError(f"{directory}: {e.strerror}") from None
    if not stat.S_ISDIR(st.st_mode):
        raise ShmError(f"{directory} is not a directory (a symlink or another file)")
    if st.st_uid != os.getuid():
        raise ShmError(f"{directory} belongs to uid {st.st_uid}, not this process's {os.getuid()}")
    if st.st_mode & 0o077:
        raise ShmError(f"{directory} has mode {stat.S_IMODE(st.st_mode):03o}: other users could write replies "
                       f"there (chmod 700 it)")


def pid_namespace() -> str | None:
    """This process's pid namespace (the inode of /proc/self/ns/pid), or None where /proc does not say."""
    try:
        return str(os.stat("/proc/self/ns/pid").st_ino)
    except OSError:
        return None


_readers: weakref.WeakSet = weakref.WeakSet()  # this process's readers (one per binding), for /healthz


def reader_stats() -> dict | None:
    """What this process's readers counted, summed (the host's /healthz); None without any."""
    readers = list(_readers)
    if not readers:
        return None
    out: dict[str, int] = {}
    for r in readers:
        for k, v in r.stats().items():
            out[k] = out.get(k, 0) + v
    return out


class ReplyReader:
    """A caller's side: the bytes of a reply the host left in the shared directory."""

    def __init__(self, directory: str | Path):
        self.directory = Path(directory)
        self.offer = str(self.directory)  # SHM_HEADER's value: a host of another directory ignores it
        self.pid_ns = pid_namespace()  # PID_NS_HEADER's: a host names blocks only to its own namespace
        _readers.add(self)
        self._maps: dict[str, tuple[int, int, mmap.mmap]] = {}  # name -> (inode, size, read-only map)
        # (st_dev, st_ino) of each sealed block checked -> [read-only view of its map, crc32, bytes,
        # when last named, its host's descriptor as /proc/<pid>/fd/<fd>], least recently named first
        self._held: OrderedDict[tuple[int, int], list] = OrderedDict()
        self.held_bytes = 0
        self._alive_checked = 0.0  # time.monotonic() of _let_go's last look at the hosts' descriptors
        self.checked_blocks = 0  # blocks mapped and checked (a crc32 pass each)
        self.held_hits = 0  # blocks named again while held (no pass over their bytes)
        self.replies = 0
        # The buffer of a reply buffer's copy nobody holds any more, kept for the next one (the
        # largest such, one at a time). A fresh buffer's pages are faulted in and zeroed by the kernel
        # before the copy writes them: into a used one a copy and check takes about half the time
        # (benchmarks/fluid_copy.py).
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

    def assemble(self, spec: str, inline: Any, checked: dict[int, tuple[int, int]] | None = None) -> list[memoryview]:
        """The body a PIECES_HEADER spec describes, as its parts in order (Response.parts): `<n>`
        pieces are views of `inline` (the reply's own body), `<name>:<n>` pieces read-only views of
        the sealed blocks of those names, not copied. Each block's crc32 (taken once per block this
        reader holds) goes into `checked` (offset -> (length, crc32)): Response.body_crc32s."""
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
        inline = memoryview(inline).cast("B").toreadonly()
        if own != inline.nbytes:
            raise ShmError(f"{PIECES_HEADER} names {own} bytes of the reply's own body, which has {inline.nbytes}")
        now = time.monotonic()
        parts: list[memoryview] = []
        at = taken = 0
        for name, n in pieces:
            if name is None:
                if n:
                    parts.append(inline[taken:taken + n])
                taken += n
            else:
                view, crc = self._block(name, n, now)
                parts.append(memoryview(view))
                if checked is not None:
                    checked[at] = (n, crc)
            at += n
        self._let_go(now)
        self.replies += 1
        return parts

    def _block(self, name: str, n: int, now: float) -> tuple[np.ndarray, int]:
        """A read-only map of the sealed block a reply names, and its crc32: taken now, or the ones
        this reader took when it first saw that very file (it still holds its map)."""
        pid, fd_number, inode = _BLOCK_NAME.match(name).groups()
        try:
            # O_NONBLOCK: a peer could name a FIFO of its own, whose open would wait for a writer
            fd = os.open(f"/proc/{pid}/fd/{fd_number}", os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK | os.O_NOCTTY)
        except OSError as e:
            raise ShmError(f"block {name}: {e.strerror}") from None
        try:
            st = os.fstat(fd)
            if st.st_ino != int(inode):
                raise ShmError(f"block {name}: that descriptor is inode {st.st_ino} now")
            key = (st.st_dev, st.st_ino)
            held = self._held.get(key)
            if held is not None:
                # This reader maps that inode, so it is the file checked then (an inode's number is
                # not reused while the inode lives), and its seals kept every byte as it was.
                if held[2] != n:
                    raise ShmError(f"block {name} holds {held[2]} bytes, the reply says {n}")
                held[3] = now
                self._held.move_to_end(key)
                self.held_hits += 1
                return held[0], held[1]
            if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid():
                raise ShmError(f"block {name} is not a regular file of this user")
            try:
                seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
            except OSError:  # not a memfd (nor any file that takes seals)
                seals = 0
            if seals & BLOCK_SEALS != BLOCK_SEALS:
                raise ShmError(f"block {name} is not sealed against writes and resizing (seals 0x{seals:x}): "
                               "its bytes could change after they were checked")
            if st.st_size != n or n == 0:
                raise ShmError(f"block {name} holds {st.st_size} bytes, the reply says {n}")
            m = mmap.mmap(fd, n, mmap.MAP_SHARED | mmap.MAP_POPULATE, mmap.PROT_READ)
        finally:
            os.close(fd)
        view = np.frombuffer(m, np.uint8)  # read-only, as the map is
        crc = _crc32_split(view)
        self._held[key] = [view, crc, n, now, f"/proc/{pid}/fd/{fd_number}"]
        self.held_bytes += n
        self.checked_blocks += 1
        return view, crc

    def _let_go(self, now: float) -> None:
        """Drop the blocks nobody named for HOLD_SECONDS, the least recently named past
        MAX_HELD_BYTES, and (every ALIVE_CHECK_S) those whose host closed the descriptor that named
        them (the views handed out keep their own maps)."""
        while self._held:
            key, held = next(iter(self._held.items()))
            if held[3] >= now - HOLD_SECONDS and self.held_bytes <= MAX_HELD_BYTES:
                break
            del self._held[key]
            self.held_bytes -= held[2]
        if now - self._alive_checked < ALIVE_CHECK_S:
            return
        self._alive_checked = now
        for key, held in list(self._held.items()):
            try:
                st = os.stat(held[4])
                alive = (st.st_dev, st.st_ino) == key
            except OSError:  # the host closed it, or exited
                alive = False
            if not alive:  # its name now means another file, or none: no reply can name this block again
                del self._held[key]
                self.held_bytes -= held[2]

    def stats(self) -> dict:
        return {"replies": self.replies, "reused": self.reused, "checked_blocks": self.checked_blocks,
                "held_hits": self.held_hits, "held_blocks": len(self._held), "held_bytes": self.held_bytes}

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
        self._held.clear()
        self.held_bytes = 0
        with self._spare_lock:
            self._spare, self._closed = None, True
