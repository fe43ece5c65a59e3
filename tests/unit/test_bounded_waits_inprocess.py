"""Every wait bounded (issue 52 item 6), in one process: a station that hangs (a stopped process
takes the call and answers nothing) is a 503 naming it after PEER_WAIT_S, one that computes long
but answers its probes is waited for, and a request past REQUEST_TIMEOUT_S is a 504, not "down".
The same on real processes with SIGSTOP: tests/integration/test_bounded_waits.py."""
from __future__ import annotations

import asyncio
import time

import pytest

from common.runtime import Request, Response
from services.coordinator import handler as co
from tests.inprocess import build_cluster

PROMPT = "the def the"


class Stopped:
    """A station whose process is stopped while `stopped` is set: every call, /healthz included,
    waits (the kernel accepted the connection, nobody reads it); SIGCONT (clear) lets them through."""

    def __init__(self, inner):
        self.inner, self.stopped, self.calls = inner, True, 0
        self._cont = asyncio.Event()

    def cont(self) -> None:
        self.stopped = False
        self._cont.set()

    async def fetch(self, request: Request) -> Response:
        self.calls += 1
        if self.stopped:
            await self._cont.wait()
        return await self.inner.fetch(request)


class Busy:
    """A station that computes for `forward_s` per forward; its process answers /healthz meanwhile."""

    def __init__(self, inner, forward_s: float):
        self.inner, self.forward_s, self.probes = inner, forward_s, 0

    async def fetch(self, request: Request) -> Response:
        if request.path == "/healthz":
            self.probes += 1
            return Response.from_json({"ok": True})
        if request.path == "/forward":
            await asyncio.sleep(self.forward_s)
        return await self.inner.fetch(request)


async def _booted(c, **vars):
    c.coordinator.env._items.update(vars)
    co._booted.clear()
    return await co.coordinator_for(c.coordinator.env)  # boots against the live stations


@pytest.fixture
async def cluster(tiny_knot, tmp_path):
    c = await build_cluster(tiny_knot, tmp_path, 2, 2)
    yield c
    co._booted.clear()
    await c.drain()


async def timed(c, **body) -> tuple[Response, float]:
    t0 = time.monotonic()
    r = await c.generate(**body)
    return r, time.monotonic() - t0


async def test_a_stopped_station_is_a_503_after_peer_wait_and_known_at_once(cluster):
    c = cluster
    baseline = (await c.generate(prompt=PROMPT, max_tokens=4)).json()["tokens"]
    booted = await _booted(c, PEER_WAIT_S="0.6")
    stopped = Stopped(booted.pipeline.stations[1].binding)
    booted.pipeline.stations[1].binding = stopped
    r, took = await timed(c, prompt=PROMPT, max_tokens=4)
    assert r.status == 503 and "station 1" in r.json()["message"] and r.headers["Retry-After"] == "1", r.body
    assert "GET /healthz" in r.json()["message"], r.body
    assert 0.6 <= took < 2.0, took  # PEER_WAIT_S, not the hop's timeout (STATION_TIMEOUT_S: 300 s)
    r, took = await timed(c, prompt=PROMPT, max_tokens=4)  # known hung: MIN_SILENCE_S, not PEER_WAIT_S again
    assert r.status == 503 and "station 1" in r.json()["message"] and took < 2.0, (r.body, took)
    stopped.cont()  # SIGCONT: the calls it held go through, and so do new ones
    r = await c.generate(prompt=PROMPT, max_tokens=4)
    assert r.status == 200 and r.json()["tokens"] == baseline, r.body
    assert booted.pipeline.station_state[1].down_since is None


async def test_a_station_computing_longer_than_peer_wait_is_waited_for(cluster):
    c = cluster
    baseline = (await c.generate(prompt=PROMPT, max_tokens=2)).json()["tokens"]
    booted = await _booted(c, PEER_WAIT_S="0.6")
    busy = Busy(booted.pipeline.stations[0].binding, 1.5)
    booted.pipeline.stations[0].binding = busy
    r = await c.generate(prompt=PROMPT, max_tokens=2)
    assert r.status == 200 and r.json()["tokens"] == baseline, r.body
    assert busy.probes >= 2, "the slow hops were probed, and the probes kept them alive"


async def test_a_request_past_its_deadline_is_a_504_not_a_peer_down(cluster):
    c = cluster
    booted = await _booted(c, REQUEST_TIMEOUT_S="0.8", PEER_WAIT_S="5")
    booted.pipeline.stations[0].binding = Busy(booted.pipeline.stations[0].binding, 3.0)
    r, took = await timed(c, prompt=PROMPT, max_tokens=2)
    assert r.status == 504, r.body
    assert "REQUEST_TIMEOUT_S" in r.json()["message"] and "down" not in r.json()["message"], r.body
    assert "Retry-After" not in r.headers and took < 1.5, (r.headers, took)
    assert booted.pipeline.station_state[0].down_since is None, "a station still computing is not down"
    r = await c.coordinator.fetch(Request("POST", "https://coordinator/v1/completions",
                                          {"Content-Type": "application/json"},
                                          b'{"prompt": "the def the", "max_tokens": 2}'))
    assert r.status == 504 and r.json()["error"]["type"] == "server_error", r.body


async def test_a_bucket_that_hangs_is_checked_once_then_left_off_the_request_path(cluster):
    """Every generation asks the bucket for the knot's version (one HEAD). A bucket that hangs (S3
    stopped) costs one request BUCKET_CHECK_TIMEOUT_S; the next ones serve the loaded version at
    once for BUCKET_CHECK_BACKOFF_S, and /readyz and /metrics say so. Then one request checks again."""
    c = cluster
    baseline = (await c.generate(prompt=PROMPT, max_tokens=3)).json()["tokens"]
    await _booted(c, BUCKET_CHECK_TIMEOUT_S="0.4", BUCKET_CHECK_BACKOFF_S="1.5")
    real_head, heads, cont = c.bucket.head, [], asyncio.Event()

    async def stopped(key):
        heads.append(key)
        await cont.wait()
        return await real_head(key)

    c.bucket.head = stopped
    r, took = await timed(c, prompt=PROMPT, max_tokens=3)
    assert r.status == 200 and r.json()["tokens"] == baseline, r.body
    assert 0.4 <= took < 2.0 and len(heads) == 1, (took, heads)
    for _ in range(3):
        r, took = await timed(c, prompt=PROMPT, max_tokens=3)
        assert r.status == 200 and r.json()["tokens"] == baseline and took < 0.4, (r.body, took)
    assert len(heads) == 1, "no HEAD on the request path within the backoff"
    note = await co.ready(c.coordinator.env)
    assert note is not None and "unverified" in note and "3 requests served without it" in note, note
    metrics = (await c.coordinator.fetch(Request("GET", "https://coordinator/metrics"))).text()
    assert 'knot_bucket_version_check{what="failing"} 1.0' in metrics, metrics
    assert 'knot_bucket_version_check{what="skipped"} 3.0' in metrics
    cont.set()  # SIGCONT
    c.bucket.head = real_head
    await asyncio.sleep(1.5)  # the backoff: the next request checks again, and passes
    r = await c.generate(prompt=PROMPT, max_tokens=3)
    assert r.status == 200 and r.json()["tokens"] == baseline
    assert await co.ready(c.coordinator.env) is None
    metrics = (await c.coordinator.fetch(Request("GET", "https://coordinator/metrics"))).text()
    assert 'knot_bucket_version_check{what="failing"} 0.0' in metrics


# ---------------------------------------------------------------- slow clients, on both HTTP servers


async def echo(request: Request, env, ctx) -> Response:
    return Response.from_json({"body": bytes(request.body).decode()})


def slow_runtime(public: bool) -> "ServiceRuntime":
    from common.runtime import Env
    from deploy.local.host import ServiceRuntime
    from deploy.local.tasks import BackgroundTasks

    return ServiceRuntime("svc", echo, Env(), BackgroundTasks("test"), public=public, access_log="errors",
                          header_timeout_s=0.6, body_timeout_s=0.6)


async def closed_within(reader: asyncio.StreamReader, bound_s: float) -> tuple[bytes, float]:
    """Everything the server sends until it closes -> (the bytes, seconds it took); fails past bound_s."""
    t0, got = time.monotonic(), b""
    async with asyncio.timeout(bound_s):
        while chunk := await reader.read(65536):
            got += chunk
    return got, time.monotonic() - t0


@pytest.mark.parametrize("server,public", [("aiohttp", True), ("aiohttp", False), ("lean", False)])
async def test_slow_clients_are_cut_off_after_the_header_and_body_bounds(server, public):
    from tests.hosts import serve

    url, close = await serve(slow_runtime(public), server)
    host, port = url.removeprefix("http://").split(":")
    try:
        # a slowloris: a byte of the head every 0.2 s, never done
        reader, writer = await asyncio.open_connection(host, int(port))
        t0 = time.monotonic()
        for b in b"POST /x HTTP/1.1\r\nHost: t\r\nX-Slow: ":
            if reader.at_eof() or writer.is_closing() or time.monotonic() - t0 > 3:
                break
            writer.write(bytes([b]))
            await asyncio.sleep(0.2)
        got, _ = await closed_within(reader, 3.0)
        assert got == b"" and time.monotonic() - t0 < 2.0, (got, time.monotonic() - t0)
        writer.close()
        # half-open: connected, nothing sent
        reader, writer = await asyncio.open_connection(host, int(port))
        got, took = await closed_within(reader, 3.0)
        assert got == b"" and 0.5 <= took < 1.5, took
        writer.close()
        # a head in full, then a body that never comes: 408 (then aiohttp drains what still comes for
        # its lingering_time, 10 s, before it closes; the lean server closes at once)
        reader, writer = await asyncio.open_connection(host, int(port))
        t0 = time.monotonic()
        writer.write(b"POST /x HTTP/1.1\r\nHost: t\r\nContent-Length: 100\r\n\r\nabc")
        async with asyncio.timeout(3.0):
            got = await reader.readuntil(b"KNOT_BODY_TIMEOUT_S")
        assert got.startswith(b"HTTP/1.1 408") and 0.5 <= time.monotonic() - t0 < 1.5, (got, time.monotonic() - t0)
        if server == "lean":
            await closed_within(reader, 1.0)
        writer.close()
        # a prompt client is served, and its kept-alive connection closes after the idle bound
        reader, writer = await asyncio.open_connection(host, int(port))
        writer.write(b"POST /x HTTP/1.1\r\nHost: t\r\nContent-Length: 2\r\n\r\nhi")
        got, took = await closed_within(reader, 3.0)
        assert got.startswith(b"HTTP/1.1 200") and b'{"body":"hi"}' in got and 0.5 <= took < 1.5, (got, took)
        writer.close()
    finally:
        await close()


async def test_no_probes_under_a_subrequest_limit(cluster):
    """On Cloudflare (SUBREQUEST_LIMIT) a probe would spend the generation's subrequests: none is sent."""
    c = cluster
    booted = await _booted(c, SUBREQUEST_LIMIT="10000")
    busy = Busy(booted.pipeline.stations[0].binding, 0.8)
    booted.pipeline.stations[0].binding = busy
    r = await c.generate(prompt=PROMPT, max_tokens=2)
    assert r.status == 200 and busy.probes == 0, (r.body, busy.probes)
