"""CPython doubles of workerd's bindings, shaped like the objects a Python Worker gets (constructor
names, argument forms, null results, thrown errors), and a small runtime that wires the Workers
of a `knot deploy cloudflare` output together from their wrangler.json files.

Shapes and pitfalls (measured with workers-runtime-sdk 1.9.5 on workerd-shaped objects):
- R2Bucket.get(key, {range: {offset, length}}): a length past the end is clamped; offset == size
  throws "get: Unspecified error (0)", offset > size throws error 10039; an options Map is no
  object, so its range is ignored and the whole object comes back;
- R2Bucket.get(key, {onlyIf: {etagMatches}}) on an object with another etag resolves to its
  metadata without a body (workerd's HeadResult, an R2Object), not to null and not to an error;
- R2 put / KV put need bytes as a Uint8Array or ArrayBuffer (to_js), not a Python object;
- KV put with expirationTtl < 60 throws (400 from the KV API);
- a service binding's fetch(input, init) needs init as a plain object;
- ctx.waitUntil keeps its argument: a borrowed proxy is destroyed before it is awaited.
"""
from __future__ import annotations

import hashlib
import importlib.util
import json
import sys
from pathlib import Path
from typing import Any

from tests.cloudflare.fakejs import (ArrayBuffer, JsArray, JsBuffer, JsException, JsObject, JsPromise, JsProxy,
                                     PyProxy, Uint8Array, js_function, type_error)
from tests.cloudflare.webapi import Request, _init_props


def _value_bytes(value: Any, what: str) -> bytes:
    if isinstance(value, str):
        return value.encode("utf-8")
    if isinstance(value, JsBuffer):
        return value.to_bytes()
    if value is None:
        return b""
    raise type_error(f"{what}: parameter 2 is not of type 'ReadableStream or ArrayBuffer or ArrayBufferView or "
                     f"string or Blob' (a {type(value).__name__}: pass bytes through to_js)")


class R2Object(JsProxy):
    JS_TYPE = "R2Object"

    def __init__(self, key: str, data: bytes):
        self.key, self.size = key, len(data)
        self.etag = hashlib.md5(data).hexdigest()
        self.httpEtag = f'"{self.etag}"'
        self.version = self.etag[:16]


class R2ObjectBody(R2Object):
    JS_TYPE = "GetResult"  # workerd's class name for get()'s result

    def __init__(self, key: str, data: bytes, offset: int, length: int):
        super().__init__(key, data)
        self.range = JsObject({"offset": offset, "length": length})
        self._body = data[offset:offset + length]
        self.bodyUsed = False

    def arrayBuffer(self) -> JsPromise:
        async def read() -> ArrayBuffer:
            if self.bodyUsed:
                raise type_error("Body has already been used")
            self.bodyUsed = True
            return ArrayBuffer(self._body)
        return JsPromise.of(read())


class R2Bucket(JsProxy):
    JS_TYPE = "R2Bucket"

    def __init__(self, objects: dict[str, bytes] | None = None):
        self.objects = objects if objects is not None else {}
        self.calls: list[tuple] = []

    @js_function
    def head(self, key: str) -> JsPromise:
        self.calls.append(("head", key))
        data = self.objects.get(key)
        return JsPromise.resolve(None if data is None else R2Object(key, data))

    @js_function
    def get(self, key: str, options: Any = None) -> JsPromise:
        props = _init_props(options, "R2Bucket.get")
        rng, only_if = props.get("range"), props.get("onlyIf")
        etag_matches = None if only_if is None else _init_props(only_if, "R2Conditional").get("etagMatches")
        self.calls.append(("get", key, None if rng is None else (rng.offset, rng.length))
                          + (() if etag_matches is None else (etag_matches,)))

        async def get() -> Any:
            data = self.objects.get(key)
            if data is None:
                return None
            if etag_matches is not None and etag_matches.strip('"') != R2Object(key, data).etag:
                return R2Object(key, data)  # the precondition failed: metadata, no body
            if rng is None:
                return R2ObjectBody(key, data, 0, len(data))
            offset, length = int(rng.offset), int(getattr(rng, "length", len(data)))
            if offset == len(data):
                raise JsException("Error", "get: Unspecified error (0)")
            if offset > len(data):
                raise JsException("Error", "get: The requested range is not satisfiable (10039)")
            return R2ObjectBody(key, data, offset, min(length, len(data) - offset))  # clamped
        return JsPromise.of(get())

    @js_function
    def put(self, key: str, value: Any, options: Any = None) -> JsPromise:
        data = _value_bytes(value, "Failed to execute 'put' on 'R2Bucket'")
        self.objects[key] = data
        self.calls.append(("put", key, len(data)))
        return JsPromise.resolve(R2Object(key, data))

    @js_function
    def list(self, options: Any = None) -> JsPromise:
        props = _init_props(options, "R2Bucket.list")
        prefix, limit = props.get("prefix", ""), int(props.get("limit", 1000))
        keys = sorted(k for k in self.objects if k.startswith(prefix))[:limit]
        return JsPromise.resolve(JsObject({"objects": JsArray([R2Object(k, self.objects[k]) for k in keys]),
                                           "truncated": False}))


class KvNamespace(JsProxy):
    JS_TYPE = "KvNamespace"

    def __init__(self) -> None:
        self.values: dict[str, bytes] = {}
        self.ttls: dict[str, int] = {}

    @js_function
    def get(self, key: str, options: Any = None) -> JsPromise:
        kind = options if isinstance(options, str) else _init_props(options, "KvNamespace.get").get("type", "text")
        data = self.values.get(key)
        if data is None:
            return JsPromise.resolve(None)
        if kind == "arrayBuffer":
            return JsPromise.resolve(ArrayBuffer(data))
        return JsPromise.resolve(data.decode("utf-8", "replace"))

    @js_function
    def put(self, key: str, value: Any, options: Any = None) -> JsPromise:
        data = _value_bytes(value, "Failed to execute 'put' on 'KvNamespace'")
        ttl = _init_props(options, "KvNamespace.put").get("expirationTtl")
        if ttl is not None and int(ttl) < 60:
            raise JsException("Error", f"KV PUT failed: 400 Invalid expiration_ttl of {ttl}. "
                                       f"Expiration TTL must be at least 60.")
        self.values[key] = data
        if ttl is not None:
            self.ttls[key] = int(ttl)
        return JsPromise.resolve(None)

    @js_function
    def delete(self, key: str) -> JsPromise:
        self.values.pop(key, None)
        return JsPromise.resolve(None)


class ExecutionContext(JsProxy):
    JS_TYPE = "ExecutionContext"

    def __init__(self) -> None:
        self.promises: list[Any] = []

    @js_function
    def waitUntil(self, promise: Any) -> None:
        # workerd keeps the value and resolves it later: a borrowed proxy is gone by then.
        self.promises.append(JsPromise.resolve(promise))

    def passThroughOnException(self) -> None:
        pass


class DurableObjectId(JsProxy):
    JS_TYPE = "DurableObjectId"

    def __init__(self, class_key: str, name: str):
        self._hex = hashlib.sha256(f"{class_key}\x00{name}".encode()).hexdigest()
        self.name = name

    def toString(self) -> str:
        return self._hex

    def equals(self, other: Any) -> bool:
        return isinstance(other, DurableObjectId) and other._hex == self._hex


class DurableObjectState(ExecutionContext):
    JS_TYPE = "DurableObjectState"

    def __init__(self, id: DurableObjectId):
        super().__init__()
        # Inside the object workerd's id carries no name; the adapter learns it from the stub's header.
        self.id = JsObject({"toString": id.toString, "equals": id.equals})
        self.storage = JsObject({})


class Fetcher(JsProxy):
    """A service binding: fetch(input, init?) runs the target Worker's entrypoint on a copy."""

    JS_TYPE = "Fetcher"

    def __init__(self, cloud: "Cloud", worker: str):
        self.cloud, self.worker = cloud, worker

    @js_function
    def fetch(self, input: Any, init: Any = None) -> JsPromise:
        request = Request.new(input, init)  # a Python dict as init throws here, as in workerd
        return JsPromise.of(self.cloud.dispatch(self.worker, request))


class DurableObjectStub(Fetcher):
    JS_TYPE = "DurableObject"

    def __init__(self, namespace: "DurableObjectNamespace", id: DurableObjectId):
        super().__init__(namespace.cloud, namespace.worker)
        self.namespace, self.id = namespace, id

    @js_function
    def fetch(self, input: Any, init: Any = None) -> JsPromise:
        request = Request.new(input, init)
        return JsPromise.of(self.namespace.deliver(self.id, request))


class DurableObjectNamespace(JsProxy):
    JS_TYPE = "DurableObjectNamespace"

    def __init__(self, cloud: "Cloud", worker: str, class_name: str):
        self.cloud, self.worker, self.class_name = cloud, worker, class_name

    def idFromName(self, name: str) -> DurableObjectId:
        return DurableObjectId(f"{self.worker}/{self.class_name}", name)

    def get(self, id: DurableObjectId) -> DurableObjectStub:
        return DurableObjectStub(self, id)

    async def deliver(self, id: DurableObjectId, request: Request) -> Any:
        key = (self.worker, self.class_name, id.toString())
        inst = self.cloud.objects.get(key)
        if inst is None:
            cls = getattr(self.cloud.module(self.worker), self.class_name)
            state = DurableObjectState(id)
            inst = self.cloud.objects[key] = (cls(state, self.cloud.env(self.worker)), state)
        obj, state = inst
        response = await obj.fetch(request)
        self.cloud.pending += state.promises
        state.promises = []
        return getattr(response, "js_object", response)


class Cloud:
    """The Workers of a `knot deploy cloudflare` output, wired by their wrangler.json, in one process."""

    def __init__(self, out: Path, secrets: dict[str, str] | None = None):
        self.out = out
        self.secrets = dict(secrets or {})  # what `wrangler secret put` gives every Worker's env
        self.configs = {d.name: json.loads((d / "wrangler.json").read_text())
                        for d in sorted(out.iterdir()) if (d / "wrangler.json").is_file()}
        self.buckets: dict[str, R2Bucket] = {}
        self.kvs: dict[str, Any] = {}
        self.objects: dict[tuple, tuple] = {}
        self.pending: list[Any] = []
        self._envs: dict[str, JsObject] = {}
        self._modules: dict[str, Any] = {}

    def bucket(self, name: str) -> R2Bucket:
        return self.buckets.setdefault(name, R2Bucket())

    def module(self, worker: str) -> Any:
        """The Worker's generated main module (src/entry.py), loaded under its own name."""
        if worker not in self._modules:
            path = self.out / worker / "src" / "entry.py"
            name = f"entry_{worker.replace('-', '_')}"
            spec = importlib.util.spec_from_file_location(name, path)
            mod = importlib.util.module_from_spec(spec)
            sys.modules[name] = mod
            spec.loader.exec_module(mod)
            self._modules[worker] = mod
        return self._modules[worker]

    def env(self, worker: str) -> JsObject:
        if worker not in self._envs:
            cfg = self.configs[worker]
            props: dict[str, Any] = {**cfg.get("vars", {}), **self.secrets}
            for b in cfg.get("r2_buckets", []):
                props[b["binding"]] = self.bucket(b["bucket_name"])
            for b in cfg.get("kv_namespaces", []):
                props[b["binding"]] = self.kvs.setdefault(b["id"], KvNamespace())
            for b in cfg.get("durable_objects", {}).get("bindings", []):
                props[b["name"]] = DurableObjectNamespace(self, b.get("script_name", worker), b["class_name"])
            for b in cfg.get("services", []):
                props[b["binding"]] = Fetcher(self, b["service"])
            self._envs[worker] = JsObject(props)
        return self._envs[worker]

    async def dispatch(self, worker: str, request: Request) -> Any:
        """What workerd does per request: a new entrypoint instance with a new ctx."""
        ctx = ExecutionContext()
        instance = self.module(worker).Default(ctx, self.env(worker))
        response = await instance.fetch(request)
        self.pending += ctx.promises
        return getattr(response, "js_object", response)

    async def drain(self) -> list[BaseException]:
        """Await every waitUntil promise; returns their failures."""
        failures = []
        while self.pending:
            batch, self.pending = self.pending, []
            for p in batch:
                try:
                    await p
                except Exception as e:  # noqa: BLE001 - collected for the test to assert on
                    failures.append(e)
        return failures

    async def fetch(self, worker: str, url: str, method: str = "GET", body: bytes | None = None,
                    headers: dict | None = None) -> Any:
        init = {"method": method, "headers": JsObject(headers or {})}
        if body is not None:
            init["body"] = Uint8Array(body)
        return await self.dispatch(worker, Request.new(url, JsObject(init)))


__all__ = ["Cloud", "DurableObjectNamespace", "ExecutionContext", "Fetcher", "KvNamespace", "PyProxy", "R2Bucket"]
