"""Issue 53's OTLP export across a real cluster of processes (the default layout, the tiny model): with
OTEL_EXPORTER_OTLP_ENDPOINT set, one chat completion under a client's traceparent reaches an OTLP/HTTP
receiver (tests/otlp_receiver.py) as one tree of spans under the client's trace id, holding every hop
to the stations and shards and their own calls; without it, nothing is sent.

What is true in the code (deploy/otlp.py, services/tracing.py): the coordinator exports all of them.
The stations and shards keep no traces: they send their calls' summed spans back to the coordinator
(X-Knot-Spans), and ignore the setting (deploy/local/host.py export_traces), which two of them get here.
"""
from __future__ import annotations

import collections
import json

import pytest

from tests.integration.conftest import http, pipeline_services, wait_for
from tests.integration.test_pipeline_cluster import KNOT_KEY
from tests.otlp_receiver import Receiver

OTEL = "OTEL_EXPORTER_OTLP_ENDPOINT"
SID = "00f067aa0ba902b7"  # the client's span
TID_OFF, TID_ON = "a" * 31 + "1", "4bf92f3577b34da6a3ce929d0e0e4736"
SHARDS = [f"SHARD_{i}" for i in range(8)]


@pytest.fixture(scope="module")
def receiver():
    with Receiver() as r:
        yield r


@pytest.fixture(scope="module")
def cluster(procs, upload, knot, receiver):
    """The default layout; the endpoint set for a station and a shard only (the coordinator's is set in
    the test, after a request without it)."""
    with pipeline_services(procs, knot.path, upload(KNOT_KEY),
                           {"station-1": {OTEL: receiver.url}, "shard-0": {OTEL: receiver.url}}) as p:
        yield p


def chat(cluster, trace_id: str) -> dict:
    status, _, raw = http("GET", cluster.url("coordinator") + "/v1/models")
    assert status == 200, raw
    model = json.loads(raw)["data"][0]["id"]
    status, headers, raw = http("POST", cluster.url("coordinator") + "/v1/chat/completions",
                                {"model": model, "max_tokens": 3, "temperature": 0,
                                 "messages": [{"role": "user", "content": "the def the"}]},
                                {"traceparent": f"00-{trace_id}-{SID}-01"}, timeout_s=120)
    assert status == 200 and headers["X-Trace-Id"] == trace_id, raw
    status, _, raw = http("GET", cluster.url("coordinator") + "/traces/" + trace_id)
    assert status == 200, raw
    return json.loads(raw)


def test_one_request_is_exported_as_one_tree_from_the_coordinator_and_none_without_the_setting(cluster, receiver):
    chat(cluster, TID_OFF)
    co = cluster.specs["coordinator"].environment
    co[OTEL] = receiver.url
    try:
        cluster.restart("coordinator")  # SIGTERM: a configured exporter would flush trace TID_OFF now
        for name in ("station-1", "shard-0"):  # booted afresh by the next request: their own calls
            cluster.restart(name)
        assert receiver.posts == [], "sent without the coordinator's setting"
        ring = chat(cluster, TID_ON)
        # what the export holds: the coordinator's own trace (GET /traces/<id>) but for what ran after
        # the reply (the stations' KV releases), which the export of the ended request cannot hold
        after = {s["span_id"] for s in ring["spans"] if s["name"].startswith("/release/")}
        want = [s for s in ring["spans"] if s["span_id"] not in after and s["parent_id"] not in after]
        exported = wait_for(lambda: len(x := receiver.spans()) >= len(want) and x, timeout_s=30, poll_s=0.2,
                            what=f"the request's {len(want)} spans at the receiver (the SDK sends every 5 s)")
    finally:
        del co[OTEL]
    # a KV release that ended before the reply's span did is exported with it (it was in the trace
    # then, so GET /traces, read later, has it too); both sides are compared without the releases
    released = {e.span.span_id.hex() for e in exported if e.span.name.startswith("/release/")}
    assert released <= after, (released, after)
    got = [e for e in exported if e.span.span_id.hex() not in released
           and e.span.parent_span_id.hex() not in released]
    assert {path for path, _, _ in receiver.posts} == {"/v1/traces"}
    assert {ctype for _, ctype, _ in receiver.posts} == {"application/x-protobuf"}
    assert {e.service for e in got} == {"coordinator"}  # station-1 and shard-0 have the setting: no spans
    assert {e.span.trace_id.hex() for e in got} == {TID_ON}

    # one tree: the request's server span under the client's, every other span under a span in it
    by_id = {e.span.span_id.hex(): e for e in got}
    assert len(by_id) == len(got), "span ids repeat"
    [top] = [e for e in got if e.span.parent_span_id.hex() == SID]
    root = next(s for s in ring["spans"] if s["parent_id"] == SID)
    assert (top.span.name, top.span.span_id.hex(), top.attribute("peer.service")) == \
        ("POST /v1/chat/completions", root["span_id"], "coordinator")
    for e in got:
        hops, x = 0, e
        while x is not top:
            x = by_id[x.span.parent_span_id.hex()]  # KeyError: a parent outside the tree
            hops += 1
            assert hops <= 3, "too deep: the coordinator's span, its hop, the callee's calls"
        assert top.span.start_time_unix_nano <= e.span.start_time_unix_nano
    children = collections.defaultdict(list)
    for e in got:
        children[e.span.parent_span_id.hex()].append(e)

    # the hops to every station and shard are there, and what the stations and shards called for them
    hops = children[top.span.span_id.hex()]
    peers = {e.attribute("peer.service") for e in hops}
    assert {"STATION_0", "STATION_1", *SHARDS} <= peers, peers
    forwards = [e for e in hops if e.span.name == "/forward"]
    assert {e.attribute("peer.service") for e in forwards} == {"STATION_0", "STATION_1"}
    # station-1 and shard-0 booted in this request: their reads come back summed under their hop
    calls = {peer: {(c.attribute("peer.service").split("/")[0], c.span.name) for e in hops
                    if e.attribute("peer.service") == peer for c in children[e.span.span_id.hex()]}
             for peer in ("STATION_1", "SHARD_0")}
    assert ("LAYER_WARDEN", "/tensors") in calls["STATION_1"], calls
    assert ("COBORDISM_WARDEN", "/tensors") in calls["SHARD_0"], calls
    assert {p for c in calls.values() for p, _ in c} <= {"LAYER_WARDEN", "COBORDISM_WARDEN", "KNOT_BUCKET"}, calls
    summed = [c for e in hops for c in children[e.span.span_id.hex()]]
    assert all(c.attribute("knot.calls") >= 1 and c.attribute("knot.busy_ms") is not None for c in summed)

    # the same spans as the coordinator's own trace, the summed ones with ids of their own
    assert sorted(s["span_id"] for s in want if s["span_id"]) == sorted(
        e.span.span_id.hex() for e in got if e.attribute("knot.calls") == 1 and e.attribute("knot.busy_ms") is None)
    assert collections.Counter((s["name"], s["peer"], s["status"]) for s in want) == collections.Counter(
        (e.span.name, e.attribute("peer.service"), e.attribute("knot.status")) for e in got)
