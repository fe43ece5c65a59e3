"""CPython test doubles of Pyodide's FFI (`pyodide.ffi`) and of the JS values the adapter and
workers-runtime-sdk touch (Object, Array, Uint8Array, ArrayBuffer, Promise, Error; the Web APIs are
in webapi.py), so the real SDK imports and runs in CPython; install() puts them into sys.modules.

Modelled on Pyodide 0.27's rules, because the adapter's pitfalls come from them:
- to_js(dict) is a Map unless dict_converter=Object.fromEntries gives a plain object; a Map's
  entries are not properties, so a Request init that is a Map is silently ignored;
- a Python object passed to a JS function without to_js becomes a *borrowed* proxy, destroyed when
  the JS function returns: JS that keeps it (waitUntil, a later read) finds it destroyed;
- a Web API given such a proxy where it wants bytes or a RequestInit throws TypeError;
- JS async functions return Promises; a Python coroutine returned to JS becomes one;
- ArrayBuffer / Uint8Array proxies give bytes by .to_bytes() and a memoryview by .to_py().
The real FFI runs in the Pyodide layer (tests/cloudflare/test_pyodide.py); these keep the CPython
layer honest about the same rules.
"""
from __future__ import annotations

import asyncio
import functools
import inspect
import sys
import types
from typing import Any, Callable


class JsException(Exception):
    def __init__(self, name: str, message: str = ""):
        super().__init__(f"{name}: {message}" if message else name)
        self.name, self.message = name, message


def type_error(message: str) -> JsException:
    return JsException("TypeError", message)


class JsProxy:
    """A JS value seen from Python. Subclasses set JS_TYPE (what `constructor.name` says)."""

    JS_TYPE = "Object"

    @property
    def constructor(self) -> Any:
        return types.SimpleNamespace(name=self.JS_TYPE)

    @property
    def typeof(self) -> str:
        return "object"

    def to_py(self, *, default_converter: Callable | None = None, **_: Any) -> Any:
        return default_converter(self, None, None) if default_converter else self


class JsBuffer(JsProxy):
    pass


class JsObject(JsProxy):
    """A plain JS object: its properties are attributes; a missing one raises AttributeError."""

    def __init__(self, props: dict | None = None):
        object.__setattr__(self, "_props", dict(props or {}))

    def __getattr__(self, name: str) -> Any:
        try:
            return self.__dict__["_props"][name]
        except KeyError:
            raise AttributeError(name) from None

    def __setattr__(self, name: str, value: Any) -> None:
        self._props[name] = value

    def __repr__(self) -> str:
        return f"[object Object {self._props!r}]"

    def to_py(self, **_: Any) -> dict:
        return {k: v.to_py() if isinstance(v, JsProxy) else v for k, v in self._props.items()}


class JsMap(JsProxy):
    JS_TYPE = "Map"

    def __init__(self, entries: dict):
        self.entries_ = dict(entries)

    def get(self, key: Any) -> Any:
        return self.entries_.get(key)


class JsArray(JsProxy):
    JS_TYPE = "Array"

    def __init__(self, items: list | None = None):
        self.items = list(items or [])

    @classmethod
    def new(cls, *items: Any) -> "JsArray":
        return cls(list(items))

    def __iter__(self):
        return iter(self.items)

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> Any:
        return self.items[i]

    @property
    def length(self) -> int:
        return len(self.items)

    def push(self, item: Any) -> int:
        self.items.append(item)
        return len(self.items)

    def to_py(self, **_: Any) -> list:
        return [v.to_py() if isinstance(v, JsProxy) else v for v in self.items]


class ArrayBuffer(JsBuffer):
    JS_TYPE = "ArrayBuffer"

    def __init__(self, data: bytes = b""):
        self._data = bytearray(data)

    @property
    def byteLength(self) -> int:
        return len(self._data)

    def to_bytes(self) -> bytes:
        return bytes(self._data)

    def to_py(self, **_: Any) -> memoryview:
        return memoryview(self._data)


class Uint8Array(JsBuffer):
    JS_TYPE = "Uint8Array"

    def __init__(self, data: bytes | bytearray | memoryview = b""):
        self._data = bytearray(data)

    @classmethod
    def new(cls, arg: Any) -> "Uint8Array":
        if isinstance(arg, int):
            return cls(bytes(arg))
        if isinstance(arg, JsBuffer):
            return cls(arg.to_bytes())
        raise type_error("Uint8Array: expected a length or a buffer")

    @property
    def length(self) -> int:
        return len(self._data)

    byteLength = length

    @property
    def buffer(self) -> ArrayBuffer:
        return ArrayBuffer(bytes(self._data))

    def to_bytes(self) -> bytes:
        return bytes(self._data)

    def to_py(self, **_: Any) -> memoryview:
        return memoryview(self._data)


class JsError(JsProxy):
    JS_TYPE = "Error"

    def __init__(self, message: str = ""):
        self.message, self.name = message, "Error"

    @classmethod
    def new(cls, message: str = "") -> "JsError":
        return cls(str(message))

    def toString(self) -> str:
        return f"Error: {self.message}"


# ---------------------------------------------------------------- Python objects seen from JS


class PyProxy(JsProxy):
    """create_proxy(obj): a Python object JS may keep until .destroy()."""

    JS_TYPE = "PyProxy"
    _borrowed = False

    def __init__(self, target: Any):
        self._target, self._destroyed = target, False

    def _check(self) -> Any:
        if self._destroyed:
            what = "borrowed proxy was automatically destroyed at the end of a function call" if self._borrowed \
                else "proxy has already been destroyed"
            raise JsException("Error", f"This {what}. Try using create_proxy or create_once_callable.")
        return self._target

    def destroy(self) -> None:
        self._destroyed = True

    def __call__(self, *args: Any) -> Any:
        try:
            result = self._check()(*args)
        except JsException:
            raise
        except Exception as e:  # a Python exception crossing into JS
            raise JsException("PythonError", f"{type(e).__name__}: {e}") from e
        if inspect.isawaitable(result):
            return JsPromise.of(result)
        return result

    def getBuffer(self) -> Any:
        data = self._check()
        view = Uint8Array(bytes(data))  # Pyodide shares wasm memory; a copy is indistinguishable here
        return types.SimpleNamespace(data=view, release=lambda: None)

    def __iter__(self):
        return iter(self._check())

    def then(self, on_ok: Callable, on_err: Callable | None = None) -> "JsPromise":
        return JsPromise.of(self._check()).then(on_ok, on_err)


class BorrowedProxy(PyProxy):
    _borrowed = True


def _as_js_arg(value: Any, borrowed: list) -> Any:
    if value is None or isinstance(value, (JsProxy, str, bool, int, float)):
        return value
    proxy = BorrowedProxy(value)
    borrowed.append(proxy)
    return proxy


def js_function(fn: Callable) -> Callable:
    """A JS function: Python arguments arrive as borrowed proxies (destroyed once it returns),
    keyword arguments as a trailing plain object, a returned coroutine as a Promise."""

    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> Any:
        borrowed: list = []
        this, rest = (args[0], args[1:]) if args and isinstance(args[0], (JsProxy, type)) else (None, args)
        conv = [_as_js_arg(a, borrowed) for a in rest]
        if kwargs:
            conv.append(JsObject({k: _as_js_arg(v, borrowed) for k, v in kwargs.items()}))
        try:
            result = fn(this, *conv) if this is not None else fn(*conv)
            if inspect.iscoroutine(result):
                result = JsPromise.of(result)
            return result
        finally:
            for b in borrowed:
                b.destroy()

    return call


class JsPromise(JsProxy):
    JS_TYPE = "Promise"

    def __init__(self, future: asyncio.Future):
        self._future = future

    @classmethod
    def of(cls, awaitable: Any) -> "JsPromise":
        if isinstance(awaitable, JsPromise):
            return awaitable
        return cls(asyncio.ensure_future(awaitable))

    @classmethod
    def new(cls, executor: Callable) -> "JsPromise":
        fut = asyncio.get_event_loop().create_future()

        def resolve(value: Any = None) -> None:
            if not fut.done():
                fut.set_result(value)

        def reject(reason: Any = None) -> None:
            if not fut.done():
                msg = reason.message if isinstance(reason, JsError) else str(reason)
                fut.set_exception(JsException("Error", msg))

        executor(resolve, reject)
        return cls(fut)

    @classmethod
    def resolve(cls, value: Any = None) -> "JsPromise":
        if isinstance(value, (JsPromise, PyProxy)):  # a thenable: its .then runs in a later job
            async def later() -> Any:
                await asyncio.sleep(0)
                got = value.then(lambda v: v) if isinstance(value, PyProxy) else value
                return await got
            return cls(asyncio.ensure_future(later()))
        fut = asyncio.get_event_loop().create_future()
        fut.set_result(value)
        return cls(fut)

    def __await__(self):
        return self._future.__await__()

    def then(self, on_ok: Callable, on_err: Callable | None = None) -> "JsPromise":
        async def chain() -> Any:
            try:
                value = await self._future
            except Exception as e:  # noqa: BLE001
                if on_err is None:
                    raise
                return on_err(e)
            return on_ok(value)
        return JsPromise(asyncio.ensure_future(chain()))

    def done(self) -> bool:
        return self._future.done()


# ---------------------------------------------------------------- pyodide.ffi


def to_js(obj: Any, *, dict_converter: Callable | None = None, default_converter: Callable | None = None,
          depth: int = -1, create_pyproxies: bool = True, **_: Any) -> Any:
    def conv(x: Any) -> Any:
        if x is None or isinstance(x, (JsProxy, str, bool, int, float)):
            return x
        if isinstance(x, dict):
            entries = [(k, conv(v)) for k, v in x.items()]
            return dict_converter(JsArray([JsArray([k, v]) for k, v in entries])) if dict_converter \
                else JsMap(dict(entries))
        if isinstance(x, (list, tuple)):
            return JsArray([conv(v) for v in x])
        if isinstance(x, (bytes, bytearray, memoryview)):
            return Uint8Array(bytes(x))
        if default_converter is not None:
            return default_converter(x, conv, {})
        if not create_pyproxies:
            raise type_error(f"to_js: cannot convert {type(x).__name__} without creating a proxy")
        return PyProxy(x)

    return conv(obj)


def create_proxy(obj: Any, **_: Any) -> PyProxy:
    return PyProxy(obj)


def create_once_callable(fn: Callable, **_: Any) -> PyProxy:
    proxy = PyProxy(None)

    def once(*args: Any) -> Any:
        proxy.destroy()
        return fn(*args)

    proxy._target = once
    return proxy


def destroy_proxies(proxies: Any) -> None:
    for p in proxies:
        p.destroy()


# ---------------------------------------------------------------- installing the modules


def install() -> None:
    """Put `js`, `pyodide`, `pyodide.ffi`, `pyodide.http` and the runtime's helper modules into
    sys.modules (the SDK imports them at import time). Idempotent."""
    if getattr(sys.modules.get("js"), "__knot_double__", False):
        return
    from tests.cloudflare.webapi import (FetchResponse, Headers, IdentityTransformStream, JsObjectStatics, ReadableStream,
                                        Request, Response, pyfetch)

    js = types.ModuleType("js")
    js.__knot_double__ = True
    js.Object = JsObjectStatics
    js.Array = JsArray
    js.Uint8Array = Uint8Array
    js.ArrayBuffer = ArrayBuffer
    js.Error = JsError
    js.Promise = JsPromise
    js.Headers = Headers
    js.Request = Request
    js.Response = Response
    js.ReadableStream = ReadableStream
    js.IdentityTransformStream = IdentityTransformStream
    js.queueMicrotask = lambda fn: asyncio.get_event_loop().call_soon(fn)

    pyodide = types.ModuleType("pyodide")
    pyodide.__version__ = "0.27.7"
    pyodide.__path__ = []
    ffi = types.ModuleType("pyodide.ffi")
    for name, value in {"JsException": JsException, "JsProxy": JsProxy, "JsBuffer": JsBuffer, "to_js": to_js,
                        "create_proxy": create_proxy, "create_once_callable": create_once_callable,
                        "destroy_proxies": destroy_proxies}.items():
        setattr(ffi, name, value)
    http = types.ModuleType("pyodide.http")
    http.FetchResponse, http.pyfetch = FetchResponse, pyfetch
    pyodide.ffi, pyodide.http = ffi, http

    helper = types.ModuleType("_pyodide_entrypoint_helper")
    helper.patchWaitUntil = lambda ctx: None  # workerd's; the adapter does not rely on it
    helper.cloudflareWorkersModule = types.SimpleNamespace(env=None, waitUntil=None)
    helper.cloudflareSocketsModule = None
    flags = types.ModuleType("_cloudflare_compat_flags")
    flags.python_workflows_implicit_dependencies = False
    flags.python_request_headers_preserve_commas = False
    sys.modules.update({"js": js, "pyodide": pyodide, "pyodide.ffi": ffi, "pyodide.http": http,
                        "_pyodide_entrypoint_helper": helper, "_cloudflare_compat_flags": flags})
