"""services/tracing.py: the W3C traceparent rules, the bounded records, and traced bindings in one process."""
import asyncio
import json

import pytest

from common.runtime import Request, Response
from services import tracing

TID, SID = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"


def test_a_valid_traceparent_is_read():
    assert tracing.parse_traceparent(f"00-{TID}-{SID}-01") == tracing.Parent(TID, SID)
    assert tracing.parse_traceparent(f"01-{TID}-{SID}-01-later-fields") == tracing.Parent(TID, SID)  # future version
    assert tracing.parse_traceparent(f"00-{TID}-{SID}-00") == tracing.Parent(TID, SID, sampled=False)


@pytest.mark.parametrize("bad", [None, "", "garbage", f"00-{TID}-{SID}", f"00-{TID.upper()}-{SID}-01",
                                 f"ff-{TID}-{SID}-01", f"00-{'0' * 32}-{SID}-01", f"00-{TID}-{'0' * 16}-01",
                                 f"00-{TID}-{SID}-01-extra", f"00-{TID[:-1]}-{SID}-01", "00-" + "a" * 600])
def test_an_invalid_traceparent_is_ignored(bad):
    assert tracing.parse_traceparent(bad) is None


def test_a_callee_sums_its_calls_by_name_peer_and_status():
    s = tracing.Summary(t0=10.0)
    s.record(None, None, "get x", "KV", 10.1, 10.2, "ok")
    s.record(None, None, "get x", "KV", 10.3, 10.6, "ok")
    s.record(None, None, "get x", "KV", 10.4, 10.5, "503")
    rows = tracing.parse_summary(s.header())
    assert [(n, p, round(a, 3), round(b, 3), round(busy, 3), c, st) for n, p, a, b, busy, c, st in rows] == [
        ("get x", "KV", 0.1, 0.6, 0.4, 2, "ok"), ("get x", "KV", 0.4, 0.5, 0.1, 1, "503")]
    for i in range(tracing.MAX_SUMMARY):
        s.record(None, None, f"n{i}", "KV", 10.0, 10.1, "ok")
    assert len(s.groups) == tracing.MAX_SUMMARY and s.dropped == 2


@pytest.mark.parametrize("bad", ["not json", "[1,2]", '[["a","b","x",0,0,1,"ok"]]', "{}"])
def test_a_malformed_summary_gives_no_spans(bad):
    assert tracing.parse_summary(bad) == []


def test_the_ring_and_a_trace_are_bounded():
    ring = tracing.Ring(size=2)
    a, b, c = (ring.trace(x * 32) for x in "abc")
    assert ring.get("a" * 32) is None and [t.trace_id for t in ring.recent()] == ["c" * 32, "b" * 32]
    t = tracing.Trace("d" * 32, max_spans=3)
    for i in range(5):
        t.record(None, str(i), "/x", "P", t.t0, t.t0 + 1, "200")
    assert len(t.spans) == 3 and t.dropped == 2


class Peer:
    """A service that answers with the traceparent it got and a callee's summary."""

    def __init__(self):
        self.seen = []

    async def fetch(self, request):
        self.seen.append(request.headers.get(tracing.TRACEPARENT))
        s = tracing.Summary(0.0)
        s.record(None, None, "get row", "KV", 0.001, 0.002, "ok")
        return Response.from_json({}, headers={tracing.SPANS_HEADER: s.header()})


def test_traced_calls_carry_traceparent_and_become_spans_under_the_request():
    ring, peer = tracing.Ring(), Peer()
    service = tracing.traced(peer, "STATION_0")

    async def run():
        await service.fetch(Request("POST", "/untraced"))  # no trace current: nothing recorded, no header
        scope = tracing.begin(ring, {tracing.TRACEPARENT: f"00-{TID}-{SID}-01"}, "POST /generate")
        await service.fetch(Request("POST", "/forward"))
        tracing.end(ring, scope, "200")
        return scope

    scope = asyncio.run(run())
    assert peer.seen[0] is None
    parent = tracing.parse_traceparent(peer.seen[1])
    assert parent.trace_id == TID
    spans = ring.get(TID).as_json()["spans"]
    assert [(s["name"], s["peer"], s["parent_id"], s["status"]) for s in spans] == [
        ("POST /generate", "coordinator", SID, "200"), ("/forward", "STATION_0", scope.span_id, "200"),
        ("get row", "KV", parent.span_id, "ok")]
    assert spans[1]["span_id"] == parent.span_id and not ring.get(TID).as_json()["in_flight"]


def test_serving_returns_the_spans_of_the_calls_it_made():
    kv = tracing.traced(type("KV", (), {"get": None, "put": None, "delete": None})(), "EMBED_CACHE")

    class Store:
        async def get(self, key):
            return b"v"
    kv.inner = Store()

    async def handler(request, env, ctx):
        await kv.get("row/1")
        return Response.from_json({})

    served = tracing.serving(handler)
    plain = asyncio.run(served(Request("GET", "/x"), None, None))
    assert tracing.SPANS_HEADER not in plain.headers
    traced = asyncio.run(served(Request("GET", "/x", {tracing.TRACEPARENT: f"00-{TID}-{SID}-01"}), None, None))
    [row] = json.loads(traced.headers[tracing.SPANS_HEADER])
    assert row[0:2] == ["get row/1", "EMBED_CACHE"] and row[5:] == [1, "ok"]


def test_an_unsampled_traceparent_records_nothing_and_propagates_nothing():
    ring, peer = tracing.Ring(), Peer()
    service = tracing.traced(peer, "STATION_0")

    async def run():
        scope = tracing.begin(ring, {tracing.TRACEPARENT: f"00-{TID}-{SID}-00"}, "POST /generate")
        await service.fetch(Request("POST", "/forward"))
        return scope

    assert asyncio.run(run()) is None
    assert peer.seen == [None] and ring.recent() == []
