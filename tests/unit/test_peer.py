"""services.peer.call: the timeout runs the call in its caller's task; a call with no time left
never starts; a peer's non-2xx reply is a PeerError."""
from __future__ import annotations

import asyncio

import pytest

from common.runtime import Request, Response
from services.peer import PeerError, call


class Binding:
    """A binding whose fetch takes `delay_s` and records the task it ran in."""

    def __init__(self, delay_s: float = 0.0, status: int = 200):
        self.delay_s, self.status = delay_s, status
        self.started: list[asyncio.Task | None] = []

    async def fetch(self, request: Request) -> Response:
        self.started.append(asyncio.current_task())
        await asyncio.sleep(self.delay_s)
        return Response(self.status, {}, b'{"error": "NotFound", "message": "no such path"}')


async def test_the_call_runs_in_the_callers_task():
    b = Binding()
    resp = await call(b, Request("GET", "http://peer/x"), 5.0)
    assert resp.status == 200
    assert b.started == [asyncio.current_task()]  # no task of its own (wait_for made one per call)


async def test_a_slow_peer_times_out():
    b = Binding(delay_s=5.0)
    with pytest.raises(TimeoutError):
        await call(b, Request("GET", "http://peer/x"), 0.05)
    assert len(b.started) == 1


@pytest.mark.parametrize("timeout_s", [0.0, -1.0])
async def test_a_call_with_no_time_left_never_starts(timeout_s):
    b = Binding()
    with pytest.raises(TimeoutError, match="no time left"):
        await call(b, Request("POST", "http://peer/forward"), timeout_s)
    assert b.started == []  # nothing was sent: a station's forward must not half-happen


async def test_a_non_2xx_reply_is_a_peer_error():
    with pytest.raises(PeerError) as e:
        await call(Binding(status=404), Request("GET", "http://peer/x"), None)
    assert e.value.peer_status == 404 and e.value.peer_error == "NotFound"
