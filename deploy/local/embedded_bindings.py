"""Embedded bindings: the whole topology in one process, no servers (`knot serve --embedded`).

Same protocols as the real bindings (common.runtime), same error behaviour:
- DirectoryBucket: a directory as the bucket, keys as relative paths;
- MemoryKV: a dict with TTLs against an injected clock;
- LocalService: a service binding that calls another handler in-process.
In-process Durable Object namespaces are durable.LocalNamespace.
"""
from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path
from typing import Callable

from common.runtime import (BadRequest, Context, Env, Handler, ObjectBody, ObjectMeta, PreconditionFailed,
                            RangeNotSatisfiable, Request, Response, call_handler)
from deploy.local.logs import REQUEST_ID_HEADER, request_id_var
from deploy.local.tasks import BackgroundTasks


def check_range(key: str, range: tuple[int, int], size: int) -> None:
    start, end = range
    if not 0 <= start < end:
        raise RangeNotSatisfiable(f"{key}: invalid byte range [{start}, {end})")
    if end > size:
        raise RangeNotSatisfiable(f"{key}: byte range [{start}, {end}) runs past the object's {size} bytes")


def check_etag(key: str, if_match: str | None, etag: str) -> None:
    if if_match is not None and etag != if_match:
        raise PreconditionFailed(f"{key}: the object is now version {etag!r}, not {if_match!r}")


class DirectoryBucket:
    def __init__(self, root: str | os.PathLike):
        self.root = Path(root).resolve()
        self.root.mkdir(parents=True, exist_ok=True)

    def _path(self, key: str) -> Path:
        p = (self.root / key).resolve()
        if not key or self.root not in p.parents:
            raise BadRequest(f"bucket key {key!r} escapes the bucket directory")
        return p

    @staticmethod
    def _meta(key: str, st: os.stat_result) -> ObjectMeta:
        # The etag names one version of the file: a replace (new inode) or a write (new mtime) changes it.
        return ObjectMeta(key, st.st_size, f"{st.st_size:x}-{st.st_mtime_ns:x}-{st.st_ino:x}")

    async def head(self, key: str) -> ObjectMeta | None:
        p = self._path(key)
        return self._meta(key, p.stat()) if p.is_file() else None

    async def get(self, key: str, range: tuple[int, int] | None = None,
                  if_match: str | None = None) -> ObjectBody | None:
        p = self._path(key)

        def read() -> ObjectBody | None:
            try:
                f = open(p, "rb")
            except (FileNotFoundError, IsADirectoryError):
                return None
            with f:
                # The etag of the open file, before and after the read: the bytes are that version's
                # (a replace makes a new inode, which this descriptor does not see).
                meta = self._meta(key, os.fstat(f.fileno()))
                check_etag(key, if_match, meta.etag)
                if range is not None:
                    check_range(key, range, meta.size)
                    f.seek(range[0])
                body = f.read() if range is None else f.read(range[1] - range[0])
                if self._meta(key, os.fstat(f.fileno())) != meta:
                    raise PreconditionFailed(f"{key}: the file was written while it was read")
            return ObjectBody(key, meta.size, meta.etag, body, range)

        return await asyncio.to_thread(read)  # file reads block; keep them off the loop

    async def put(self, key: str, value: bytes) -> ObjectMeta:
        p = self._path(key)

        def write() -> ObjectMeta:
            p.parent.mkdir(parents=True, exist_ok=True)
            tmp = p.with_name(p.name + ".partial")
            tmp.write_bytes(value)
            os.replace(tmp, p)
            return self._meta(key, p.stat())

        return await asyncio.to_thread(write)

    async def list(self, prefix: str = "", limit: int = 1000) -> list[ObjectMeta]:
        out = []
        for p in sorted(self.root.rglob("*")):
            key = p.relative_to(self.root).as_posix()
            if p.is_file() and key.startswith(prefix) and not key.endswith(".partial"):
                out.append(self._meta(key, p.stat()))
                if len(out) >= limit:
                    break
        return out


class MemoryKV:
    def __init__(self, clock: Callable[[], float] = time.monotonic):
        self._clock = clock
        self._data: dict[str, tuple[bytes, float | None]] = {}  # key -> (value, expires_at)

    async def get(self, key: str) -> bytes | None:
        item = self._data.get(key)
        if item is None:
            return None
        value, expires_at = item
        if expires_at is not None and self._clock() >= expires_at:
            del self._data[key]
            return None
        return value

    async def put(self, key: str, value: bytes, expiration_ttl: int | None = None) -> None:
        if expiration_ttl is not None and expiration_ttl <= 0:
            raise BadRequest(f"KV put {key}: expiration_ttl must be > 0 s, got {expiration_ttl}")
        expires_at = None if expiration_ttl is None else self._clock() + expiration_ttl
        self._data[key] = (bytes(value), expires_at)

    async def delete(self, key: str) -> None:
        self._data.pop(key, None)


class LocalService:
    """Service binding to a handler in this process; its wait_until work goes to `tasks`.

    A streaming Response passes through as it is: the caller iterates it, and closes it (aclose)
    if it stops early, exactly as the host would.
    """

    def __init__(self, handler: Handler, env: Env, tasks: BackgroundTasks):
        self.handler, self.env, self.tasks = handler, env, tasks

    async def fetch(self, request: Request) -> Response:
        req = request.with_url(request.url)
        rid = request_id_var.get()
        if rid and REQUEST_ID_HEADER not in req.headers:
            req.headers[REQUEST_ID_HEADER] = rid
        return await call_handler(self.handler, req, self.env, Context(self.tasks.add), rid)
