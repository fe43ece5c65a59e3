"""A test-only service that exercises the runtime itself, run as a real process by the host.

Bindings (env): KV (Redis), SEQUENCER (DO namespace over HTTP), SELF (service binding).
    POST /seq/<name>?i=N&sleep_s=S   -> the Sequencer DO <name>: append i (start, sleep, end); at its
                                        start, KV key "seq:<name>:<i>" says so (tests order their sends by it)
    POST /deferred?key=K&delay_s=S   -> respond now; ctx.wait_until(sleep S, then KV put K)
    GET  /echo                       -> {"request_id": the X-Request-Id this request carried}
    GET  /echo-via-self              -> /echo called through the SELF service binding
"""
from __future__ import annotations

import asyncio
import uuid

from common.runtime import NotFound, Request, Response


class Sequencer:
    """Logs "start i" / "end i" around a sleep: any interleaving of requests would show."""

    def __init__(self, state, env):
        self.instance = uuid.uuid4().hex
        self.log: list[str] = []
        self.kv = env.KV

    async def fetch(self, request: Request) -> Response:
        i = request.query["i"]
        self.log.append(f"start {i}")
        await self.kv.put(f"seq:{request.query['name']}:{i}", b"started", expiration_ttl=600)
        await asyncio.sleep(float(request.query.get("sleep_s", "0")))
        self.log.append(f"end {i}")
        return Response.from_json({"instance": self.instance, "log": self.log})


DURABLE_OBJECTS = {"Sequencer": Sequencer}


async def _write_later(kv, key: str, delay_s: float) -> None:
    await asyncio.sleep(delay_s)
    await kv.put(key, b"done", expiration_ttl=600)


async def fetch(request: Request, env, ctx) -> Response:
    path, q = request.path, request.query
    if path.startswith("/seq/"):
        ns = env.SEQUENCER
        stub = ns.get(ns.id_from_name(path.removeprefix("/seq/")))
        name = path.removeprefix("/seq/")
        return await stub.fetch(Request("POST", f"/append?i={q['i']}&sleep_s={q.get('sleep_s', '0')}&name={name}"))
    if path == "/deferred":
        ctx.wait_until(_write_later(env.KV, q["key"], float(q["delay_s"])))
        return Response.from_json({"scheduled": q["key"]})
    if path == "/echo":
        return Response.from_json({"request_id": request.headers.get("X-Request-Id")})
    if path == "/echo-via-self":
        return await env.SELF.fetch(Request("GET", "/echo"))
    raise NotFound(f"probe has no route {path}")
