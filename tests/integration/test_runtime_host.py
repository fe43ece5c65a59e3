"""The host as a real process: DO instances over HTTP, wait_until, request ids, health endpoints."""
import asyncio
import json
import os
import signal
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

from deploy import launcher, servers
from deploy.local.server_bindings import RedisKV

from .conftest import http, wait_for


def kv_get(redis_server, prefix: str, key: str) -> bytes | None:
    """One read with a fresh client (a redis.asyncio client belongs to the loop that made it)."""
    async def get():
        kv = RedisKV(redis_server.url, prefix, password=redis_server.password)
        try:
            return await kv.get(key)
        finally:
            await kv.close()
    return asyncio.run(get())


def test_health_and_readiness(procs):
    for name in ("layer-warden", "cobordism-warden", "probe"):
        status, _, body = http("GET", procs.url(name) + "/readyz")
        assert status == 200, body
    status, _, body = http("GET", procs.url("cobordism-warden") + "/readyz")
    checks = json.loads(body)["checks"]
    assert checks == {"KNOT_BUCKET": "ok", "EMBED_CACHE": "ok"}  # S3 head_bucket, Redis PING


def test_request_id_propagates_through_a_service_binding(procs):
    status, headers, body = http("GET", procs.url("probe") + "/echo-via-self", headers={"X-Request-Id": "rid-42"})
    assert status == 200 and headers["X-Request-Id"] == "rid-42"
    assert body == b'{"request_id":"rid-42"}'
    log = (procs.run_dir / "logs" / "probe.log").read_text()
    assert '"request_id": "rid-42"' in log and '"path": "/echo"' in log


def test_durable_object_is_unique_and_keeps_request_order(procs, redis_server):
    """8 requests, each holding the instance 300 ms and each sent once the one before it has started
    (so it arrives while that one holds the instance): no interleaving, arrival order."""
    name = f"seq-{uuid.uuid4().hex[:8]}"

    def send(i):
        if i:
            wait_for(lambda: kv_get(redis_server, "probe:", f"seq:{name}:{i - 1}"), 60, f"request {i - 1} started")
        return http("POST", procs.url("probe") + f"/seq/{name}?i={i}&sleep_s=0.3")

    with ThreadPoolExecutor(8) as pool:
        replies = list(pool.map(send, range(8)))
    bodies = [json.loads(b) for s, _, b in replies]
    assert all(s == 200 for s, _, _ in replies)
    assert len({b["instance"] for b in bodies}) == 1  # one live instance per name
    final = max(bodies, key=lambda b: len(b["log"]))["log"]
    assert final == [f"{e} {i}" for i in range(8) for e in ("start", "end")]
    status, _, body = http("POST", procs.url("probe") + f"/seq/{name}-other?i=0")
    assert json.loads(body)["instance"] != bodies[0]["instance"]


def test_wait_until_completes_after_the_response(procs, redis_server):
    key = f"deferred-{uuid.uuid4().hex[:8]}"
    t0 = time.monotonic()
    status, _, _ = http("POST", procs.url("probe") + f"/deferred?key={key}&delay_s=0.5")
    assert status == 200 and time.monotonic() - t0 < 0.5
    assert kv_get(redis_server, "probe:", key) is None  # not yet: it runs after the response
    wait_for(lambda: kv_get(redis_server, "probe:", key) == b"done", 5, "deferred KV write")


def test_wait_until_completes_on_graceful_shutdown(procs, redis_server):
    r = launcher.start_process(procs.specs["probe-2"], procs.addresses, procs.run_dir)
    launcher.wait_ready(r, procs.url("probe-2") + "/readyz", 60)
    key = f"shutdown-{uuid.uuid4().hex[:8]}"
    status, _, _ = http("POST", procs.url("probe-2") + f"/deferred?key={key}&delay_s=1.0")
    assert status == 200
    os.killpg(r.pid, signal.SIGTERM)  # right away: the task is still sleeping
    assert launcher.wait_exit(r.pid, 30) == 0
    assert kv_get(redis_server, "probe:", key) == b"done"
    assert not servers.pid_alive(r.pid)
