"""The local host and the embedded bindings, in-process (the integration tests use real servers)."""
import asyncio
import logging

import pytest
from aiohttp.test_utils import TestClient, TestServer
from hypothesis import given, settings, strategies as st

from common.runtime import Env, NotFound, RangeNotSatisfiable, Response
from deploy.local.durable import DurableObjectHost, LocalNamespace
from deploy.local.embedded_bindings import DirectoryBucket, MemoryKV
from deploy.local.host import ServiceRuntime, build_app
from deploy.local.tasks import BackgroundTasks

DATA = bytes(range(256)) * 40 + b"tail"


@pytest.fixture(scope="module")
def bucket(tmp_path_factory):
    b = DirectoryBucket(tmp_path_factory.mktemp("bucket"))
    asyncio.run(b.put("models/x.knot", DATA))
    return b


@settings(max_examples=150, deadline=None)
@given(st.integers(0, len(DATA) - 1), st.integers(1, len(DATA)))
def test_directory_bucket_range_equals_slice(bucket, start, n):
    end = min(start + n, len(DATA))
    obj = asyncio.run(bucket.get("models/x.knot", range=(start, end)))
    assert obj.body == DATA[start:end] and obj.size == len(DATA) and obj.range == (start, end)


async def test_directory_bucket_contract(bucket):
    assert (await bucket.get("models/x.knot")).body == DATA
    assert await bucket.get("nope") is None and await bucket.head("nope") is None
    assert (await bucket.head("models/x.knot")).size == len(DATA)
    assert [m.key for m in await bucket.list("models/")] == ["models/x.knot"]
    with pytest.raises(RangeNotSatisfiable, match=r"\[10, 99999\) runs past the object's 10244 bytes"):
        await bucket.get("models/x.knot", range=(10, 99999))
    with pytest.raises(RangeNotSatisfiable):
        await bucket.get("models/x.knot", range=(5, 5))


async def test_memory_kv_ttl_with_injected_clock():
    now = [1000.0]
    kv = MemoryKV(clock=lambda: now[0])
    await kv.put("a", b"1", expiration_ttl=60)
    await kv.put("b", b"2")
    now[0] += 59.9
    assert await kv.get("a") == b"1"
    now[0] += 0.1
    assert await kv.get("a") is None and await kv.get("b") == b"2"
    await kv.delete("b")
    assert await kv.get("b") is None


class Recorder:
    """A test DO: logs start/end around a sleep, so interleaving would show."""

    instances = 0

    def __init__(self, state, env):
        Recorder.instances += 1
        self.log = []
        self.name = state.id.name

    async def fetch(self, request):
        i = request.query["i"]
        self.log.append(f"start {i}")
        await asyncio.sleep(0.01)
        self.log.append(f"end {i}")
        return Response.from_json({"name": self.name, "log": self.log})


async def test_durable_object_is_unique_and_serializes_requests_in_order():
    from common.runtime import Request

    Recorder.instances = 0
    host = DurableObjectHost({"Recorder": Recorder}, BackgroundTasks(), Env())
    ns = LocalNamespace(host, "Recorder")
    stub = ns.get(ns.id_from_name("a"))
    assert ns.id_from_name("a") == stub.id and ns.id_from_name("a").hex != ns.id_from_name("b").hex
    replies = await asyncio.gather(*(stub.fetch(Request("GET", f"/?i={i}")) for i in range(8)))
    log = replies[-1].json()["log"]
    assert log == [f"{e} {i}" for i in range(8) for e in ("start", "end")]
    other = await ns.get(ns.id_from_name("b")).fetch(Request("GET", "/?i=0"))
    assert other.json() == {"name": "b", "log": ["start 0", "end 0"]}
    assert Recorder.instances == 2
    missing = await host.fetch("Nope", "a", Request("GET", "/"))
    assert missing.status == 404 and "Recorder" in missing.json()["message"]


async def test_background_tasks_drain_waits_for_late_work_and_logs_failures(caplog):
    tasks = BackgroundTasks()
    done = []

    async def later(n):
        await asyncio.sleep(0.01)
        if n == 0:
            tasks.add(later(1))  # work that spawns work during the drain
        done.append(n)

    async def fails():
        raise RuntimeError("kv write refused")

    tasks.add(later(0))
    tasks.add(fails())
    with caplog.at_level(logging.ERROR):
        await tasks.drain(5)
    assert sorted(done) == [0, 1]
    assert tasks.stats() == {"running": 0, "started": 3, "completed": 2, "failed": 1}
    assert "kv write refused" in caplog.text


async def test_background_tasks_drain_cancels_at_the_deadline(caplog):
    tasks = BackgroundTasks()
    tasks.add(asyncio.sleep(10))
    with caplog.at_level(logging.ERROR):
        await tasks.drain(0.05)
    assert tasks.stats()["failed"] == 1 and "1 tasks still running" in caplog.text


# ---------------------------------------------------------------- the aiohttp host


async def handler(request, env, ctx):
    if request.path == "/boom":
        raise NotFound("tensor blk.9.attn_q.weight: no such tensor")
    if request.path == "/later":
        ctx.wait_until(env.KV.put("k", b"v"))
        return Response.from_text("ok")
    return Response.from_json({"rid": request.headers.get("x-request-id"), "body": request.body.decode()})


@pytest.fixture
async def client():
    tasks = BackgroundTasks()

    async def bad_check():
        raise ConnectionError("redis down")

    env = Env({"KV": MemoryKV()})
    rt = ServiceRuntime("probe", handler, env, tasks, DurableObjectHost({"Recorder": Recorder}, tasks, env))
    app = build_app(rt)
    async with TestClient(TestServer(app)) as c:
        c.rt = rt
        c.bad_check = bad_check
        yield c


async def test_host_translates_requests_and_propagates_request_ids(client):
    r = await client.post("/echo", data=b"hello", headers={"X-Request-Id": "abc123"})
    assert r.status == 200 and r.headers["X-Request-Id"] == "abc123"
    assert await r.json() == {"rid": "abc123", "body": "hello"}
    r = await client.get("/echo")
    assert len(r.headers["X-Request-Id"]) == 16


async def test_host_maps_errors_and_runs_wait_until(client):
    r = await client.get("/boom")
    assert r.status == 404 and (await r.json())["message"] == "tensor blk.9.attn_q.weight: no such tensor"
    r = await client.get("/later")
    assert r.status == 200
    await client.rt.tasks.drain(1)
    assert await client.rt.env.KV.get("k") == b"v"


async def test_host_health_ready_and_durable_object_route(client):
    r = await client.get("/healthz")
    assert (await r.json())["service"] == "probe"
    assert (await client.get("/readyz")).status == 200
    client.rt.checks["KV"] = client.bad_check
    r = await client.get("/readyz")
    assert r.status == 503 and (await r.json())["checks"]["KV"] == "ConnectionError: redis down"
    r = await client.get("/__do/Recorder/x?i=7", headers={"X-Durable-Object-Name": "n1"})
    assert await r.json() == {"name": "n1", "log": ["start 7", "end 7"]}
    r = await client.get("/__do/Recorder/x?i=7")
    assert r.status == 400 and "X-Durable-Object-Name" in (await r.json())["message"]
