"""CPython doubles of the Web APIs a Python Worker reaches through `js` (Object, Headers, Request,
Response, ReadableStream, workerd's IdentityTransformStream) and of pyodide.http's FetchResponse,
which workers.Response builds on.
They follow the FFI rules of fakejs.py: inits must be plain objects (a Map is ignored, a Python
object refused), bodies must be bytes-like JS values, and a ReadableStream pulls its source only
when a read waits (what highWaterMark 0 asks for).
"""
from __future__ import annotations

import asyncio
import types
from typing import Any

from tests.cloudflare.fakejs import (ArrayBuffer, JsArray, JsBuffer, JsException, JsObject, JsPromise, JsProxy, PyProxy,
                                     Uint8Array, js_function, type_error)


# ---------------------------------------------------------------- js: Web API doubles


class JsObjectStatics:
    """js.Object"""

    @staticmethod
    def fromEntries(entries: Any) -> JsObject:
        return JsObject({k: v for k, v in entries})

    @staticmethod
    def new() -> JsObject:
        return JsObject()


def _init_props(init: Any, what: str) -> dict:
    """A RequestInit / ResponseInit: a plain object's properties. A Map has none (silently ignored,
    as in JS); a Python object passed without to_js is refused as workerd refuses it."""
    if init is None:
        return {}
    if isinstance(init, PyProxy):
        raise type_error(f"Failed to construct '{what}': the init is a Python object (a PyProxy), not a JS "
                         f"object; convert it with to_js(init, dict_converter=Object.fromEntries)")
    if isinstance(init, JsObject):
        return dict(init._props)
    return {}


def _body_bytes(body: Any, what: str) -> bytes | None:
    if body is None:
        return None
    if isinstance(body, str):
        return body.encode("utf-8")
    if isinstance(body, JsBuffer):
        return body.to_bytes()
    raise type_error(f"Failed to construct '{what}': body is a {type(body).__name__}, not a BodyInit "
                     f"(pass bytes through to_js)")


class Headers(JsProxy):
    JS_TYPE = "Headers"

    def __init__(self) -> None:
        self._h: dict[str, str] = {}

    @classmethod
    @js_function
    def new(cls, init: Any = None) -> "Headers":
        h = cls()
        if init is None:
            return h
        if isinstance(init, Headers):
            h._h = dict(init._h)
        elif isinstance(init, JsObject):
            for k, v in init._props.items():
                h.set(k, v)
        elif isinstance(init, (JsArray, PyProxy)):
            for pair in init:
                if isinstance(pair, str) or len(list(pair)) != 2:
                    raise type_error("Failed to construct 'Headers': expected name/value pairs of length 2")
                k, v = list(pair)
                h.append(k, v)
        else:
            raise type_error(f"Failed to construct 'Headers': cannot take a {type(init).__name__}")
        return h

    def get(self, name: str) -> str | None:
        return self._h.get(name.lower())

    def has(self, name: str) -> bool:
        return name.lower() in self._h

    def set(self, name: str, value: Any) -> None:
        self._h[str(name).lower()] = str(value)

    def append(self, name: str, value: Any) -> None:
        k = str(name).lower()
        self._h[k] = f"{self._h[k]}, {value}" if k in self._h else str(value)

    def getSetCookie(self) -> JsArray:
        return JsArray([])

    def __iter__(self):
        return (JsArray([k, v]) for k, v in sorted(self._h.items()))


class _Body(JsProxy):
    def _init_body(self, body: Any, what: str) -> None:
        self._stream = body if isinstance(body, ReadableStream) else None
        self._bytes = None if self._stream is not None else _body_bytes(body, what)
        self.bodyUsed = False

    @property
    def body(self) -> Any:
        if self._stream is None and self._bytes is not None:
            self._stream = ReadableStream.of_bytes(self._bytes)
        return self._stream

    async def _read(self) -> bytes:
        if self.bodyUsed:
            raise type_error("Body has already been used")
        self.bodyUsed = True
        if self._stream is not None:
            return await self._stream.read_all()
        return self._bytes or b""

    def arrayBuffer(self) -> JsPromise:
        return JsPromise.of(self._array_buffer())

    async def _array_buffer(self) -> ArrayBuffer:
        return ArrayBuffer(await self._read())

    def text(self) -> JsPromise:
        async def text() -> str:
            return (await self._read()).decode("utf-8", "replace")
        return JsPromise.of(text())


class Request(_Body):
    JS_TYPE = "Request"

    @classmethod
    @js_function
    def new(cls, input: Any, init: Any = None) -> "Request":
        r = cls()
        props = _init_props(init, "Request")
        if isinstance(input, Request):
            r.url, r.method, r.headers = input.url, input.method, Headers.new(input.headers)
            if input._stream is not None:
                raise type_error("test double: cloning a streamed request body is not modelled")
            body = None if input._bytes is None else Uint8Array(input._bytes)
        else:
            if not isinstance(input, str) or "://" not in input:
                raise type_error(f"Failed to construct 'Request': Invalid URL {input!r}")
            r.url, r.method, r.headers, body = input, "GET", Headers.new(), None
        r.method = str(props.get("method", r.method)).upper()
        if "headers" in props:
            r.headers = Headers.new(props["headers"])
        if "body" in props:
            body = props["body"]
        if body is not None and r.method in ("GET", "HEAD"):
            raise type_error("Failed to construct 'Request': Request with GET/HEAD method cannot have body.")
        r._init_body(body, "Request")
        return r

    def clone(self) -> "Request":
        return Request.new(self)


class Response(_Body):
    JS_TYPE = "Response"

    @classmethod
    @js_function
    def new(cls, body: Any = None, init: Any = None) -> "Response":
        r = cls()
        props = _init_props(init, "Response")
        r.status = int(props.get("status", 200))
        r.statusText = str(props.get("statusText", ""))
        r.headers = Headers.new(props.get("headers"))
        r.url, r.type, r.redirected = "", "default", False
        if body is not None and r.status in (101, 103, 204, 205, 304):
            raise type_error(f"Response with null body status {r.status} cannot have body")
        r._init_body(body, "Response")
        return r

    @property
    def ok(self) -> bool:
        return 200 <= self.status < 300


class ReadableStream(JsProxy):
    """Enough of a WHATWG ReadableStream: pulls its underlying source only when a read waits and
    the queue is empty (highWaterMark 0), and checks that chunks are bytes (Uint8Array)."""

    JS_TYPE = "ReadableStream"

    def __init__(self) -> None:
        self._queue: list[bytes] = []
        self._closed = False
        self._error: JsException | None = None
        self._source: Any = None
        self._pulling: asyncio.Future | None = None
        self.pulls = 0
        self.cancelled_with: Any = None

    @classmethod
    @js_function
    def new(cls, source: Any = None, strategy: Any = None) -> "ReadableStream":
        s = cls()
        s._source = _init_props(source, "ReadableStream")
        s.high_water_mark = _init_props(strategy, "ReadableStream").get("highWaterMark", 1)
        return s

    @classmethod
    def of_bytes(cls, data: bytes) -> "ReadableStream":
        s = cls()
        s._queue, s._closed = ([data] if data else []), True
        return s

    # the controller the source sees
    def enqueue(self, chunk: Any) -> None:
        if not isinstance(chunk, (Uint8Array, ArrayBuffer)):
            raise type_error(f"This ReadableStream did not return bytes (a {type(chunk).__name__})")
        if self._closed:
            raise type_error("Cannot enqueue into a closed stream")
        self._queue.append(chunk.to_bytes())

    def close(self) -> None:
        self._closed = True

    def error(self, e: Any = None) -> None:
        self._error = JsException("Error", getattr(e, "message", str(e)))

    async def _pull(self) -> None:
        pull = self._source.get("pull") if self._source else None
        if pull is None:
            self._closed = True
            return
        self.pulls += 1
        try:
            result = pull(self)
            if isinstance(result, JsPromise):
                await result
        except JsException as e:
            self._error = e

    async def read(self) -> JsObject:
        while not self._queue and not self._closed and self._error is None:
            if self._pulling is None or self._pulling.done():
                self._pulling = asyncio.ensure_future(self._pull())
            await self._pulling
        if self._queue:
            return JsObject({"done": False, "value": Uint8Array(self._queue.pop(0))})
        if self._error is not None:
            raise self._error
        return JsObject({"done": True, "value": None})

    async def read_all(self) -> bytes:
        out = []
        while True:
            got = await self.read()
            if got.done:
                return b"".join(out)
            out.append(got.value.to_bytes())

    def cancel(self, reason: Any = None) -> JsPromise:
        async def cancel() -> None:
            self.cancelled_with = reason
            self._queue.clear()
            if self._closed or self._error is not None:
                return
            self._closed = True
            fn = self._source.get("cancel") if self._source else None
            if fn is not None:
                result = fn(reason)
                if isinstance(result, JsPromise):
                    await result
        return JsPromise.of(cancel())

    def getReader(self) -> Any:
        return types.SimpleNamespace(read=lambda: JsPromise.of(self.read()), cancel=self.cancel,
                                     releaseLock=lambda: None)

    def pipeTo(self, writable: "IdentityTransformStream") -> JsPromise:
        """Into an IdentityTransformStream: a chunk read from here when its readable side is read; a
        cancel of that side cancels this stream with the reason (pipeTo's error propagated back),
        and the promise fails with it."""
        if not isinstance(writable, IdentityTransformStream):
            raise type_error("test double: pipeTo into an IdentityTransformStream's writable only")
        writable.upstream = self
        return JsPromise(writable.done)


class IdentityTransformStream(JsProxy):
    """workerd's IdentityTransformStream: no buffer, what is written is what its readable side reads.
    `writable` is the object itself (the end a pipeTo takes)."""

    JS_TYPE = "IdentityTransformStream"

    def __init__(self) -> None:
        self.upstream: ReadableStream | None = None
        self.done: asyncio.Future = asyncio.get_event_loop().create_future()
        self.writable = self
        self.readable = ReadableStream.new(JsObject({"pull": self._pull, "cancel": self._cancel}),
                                           JsObject({"highWaterMark": 0}))

    @classmethod
    @js_function
    def new(cls) -> "IdentityTransformStream":
        return cls()

    def _pull(self, controller: ReadableStream) -> JsPromise:
        async def pull() -> None:
            assert self.upstream is not None, "nothing is piped into this IdentityTransformStream"
            try:
                got = await self.upstream.read()
            except JsException as e:
                controller.error(e)
                self.done.set_exception(e)
                return
            if got.done:
                controller.close()
                self.done.set_result(None)
            else:
                controller.enqueue(got.value)
        return JsPromise.of(pull())

    def _cancel(self, reason: Any = None) -> JsPromise:
        async def cancel() -> None:
            if self.upstream is not None:
                await self.upstream.cancel(reason)
            if not self.done.done():
                self.done.set_exception(JsException("Error", str(reason)))
        return JsPromise.of(cancel())


# ---------------------------------------------------------------- pyodide.http


class FetchResponse:
    """pyodide.http.FetchResponse, the part workers.Response builds on."""

    def __init__(self, url: str, js_response: Any):
        self._url, self.js_response = url, js_response

    @property
    def body_used(self) -> bool:
        return self.js_response.bodyUsed

    @property
    def ok(self) -> bool:
        return self.js_response.ok

    @property
    def status(self) -> int:
        return self.js_response.status

    @property
    def status_text(self) -> str:
        return self.js_response.statusText

    @property
    def url(self) -> str:
        return self.js_response.url

    def _raise_if_failed(self) -> None:
        if self.js_response.bodyUsed:
            raise OSError("Body already used")

    async def buffer(self) -> Any:
        self._raise_if_failed()
        return await self.js_response.arrayBuffer()

    async def bytes(self) -> bytes:
        return (await self.buffer()).to_bytes()

    async def text(self) -> str:
        self._raise_if_failed()
        return await self.js_response.text()


async def pyfetch(url: str, **kwargs: Any) -> FetchResponse:
    raise JsException("TypeError", f"fetch({url!r}): the test doubles have no network")
