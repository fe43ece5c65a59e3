"""Issue 53 on real processes: a request's trace across the cluster's hops (GET /traces/<id>), the
client's traceparent kept, a bad one ignored, and the cluster page's data (GET /, GET /cluster),
including a killed shard's health: restarting until it is started again, then ready."""
from __future__ import annotations

import json
import os
import signal

import pytest

from deploy import servers
from tests.integration.conftest import http, page_replica, wait_for
from tests.integration.test_pipeline_cluster import cluster, engine  # noqa: F401 - the same real cluster

TID, SID = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"


def generate(cluster, headers=None, max_tokens=3):  # noqa: F811
    status, h, raw = http("POST", cluster.url("coordinator") + "/generate",
                          {"prompt": "the def the", "max_tokens": max_tokens, "temperature": 0}, headers)
    assert status == 200, raw
    return h, json.loads(raw)


def trace(cluster, trace_id):  # noqa: F811
    status, _, raw = http("GET", cluster.url("coordinator") + "/traces/" + trace_id)
    assert status == 200, raw
    return json.loads(raw)


def test_a_request_trace_lists_its_hops_in_order_with_timings(cluster):  # noqa: F811
    h, body = generate(cluster)
    t = trace(cluster, h["X-Trace-Id"])
    spans = t["spans"]
    root = spans[0]
    assert (root["name"], root["peer"], root["status"], root["parent_id"]) == ("POST /generate", "coordinator", "200",
                                                                              None)
    hops = [s for s in spans if s["parent_id"] == root["span_id"]]
    assert all(s["status"] in ("200", "ok") and s["duration_ms"] >= 0 for s in hops)
    # inside the request's span, but for the stations' KV releases, which run after its reply
    outside = [(s["name"], s["peer"]) for s in hops if not root["start_ms"] <= s["start_ms"]
               or s["start_ms"] + s["duration_ms"] > root["start_ms"] + root["duration_ms"] + 1e-3]
    assert {n.rpartition("/")[0] for n, _ in outside} <= {"/release"}, outside
    hops = [s for s in hops if not s["name"].startswith("/release/")]
    # first the bucket's version check (one HEAD of the knot), the coordinator's own binding call
    bucket = [s for s in hops if s["peer"] == "KNOT_BUCKET"]
    assert [s["name"] for s in bucket] == ["head pipeline.knot"] and bucket[0]["status"] == "ok", bucket
    assert hops[0] is bucket[0]
    hops = hops[1:]
    # the first trip: the prompt's embedding on the shards, station 0, station 1, then the LM head
    first = [(s["name"], s["peer"]) for s in hops if s["name"] != "/embed" or s["start_ms"] < hops[0]["start_ms"]
             + hops[0]["duration_ms"]]
    names = [n for n, _ in first]
    i0, i1 = first.index(("/forward", "STATION_0")), first.index(("/forward", "STATION_1"))
    assert names[0] == "/embed" and i0 < i1 and names[i1 + 1] in ("/logits", "/sample"), first[:12]
    s0, s1 = (next(s for s in hops if s["peer"] == peer) for peer in ("STATION_0", "STATION_1"))
    assert s0["start_ms"] + s0["duration_ms"] <= s1["start_ms"] + 1e-3  # the chain is sequential
    # every decode trip runs both stations: tokens - 1 decode trips + the prompt's chunk(s)
    forwards = [s for s in hops if s["name"] == "/forward"]
    assert len(forwards) >= 2 * len(body["tokens"]), (len(forwards), body)
    # the stations' own calls (their LayerWarden reads, their bucket reads) come back under their hop
    station_hops = {s["span_id"] for s in forwards}
    children = [s for s in spans if s["parent_id"] in station_hops]
    assert children and all(s["span_id"] is None and s["count"] >= 1 for s in children)
    assert {s["peer"].split("/")[0] for s in children} <= {"LAYER_WARDEN", "KNOT_BUCKET"}
    status, _, raw = http("GET", cluster.url("coordinator") + "/traces")
    assert status == 200 and h["X-Trace-Id"] in [x["trace_id"] for x in json.loads(raw)["traces"]]


def test_a_client_traceparent_is_kept(cluster):  # noqa: F811
    h, _ = generate(cluster, {"traceparent": f"00-{TID}-{SID}-01"}, max_tokens=1)
    assert h["X-Trace-Id"] == TID
    root = trace(cluster, TID)["spans"][0]
    assert (root["name"], root["parent_id"]) == ("POST /generate", SID)


@pytest.mark.parametrize("bad", ["nonsense", f"00-{TID}-{SID}", f"ff-{TID}-{SID}-01", f"00-{'0' * 32}-{SID}-01",
                                 f"00-{TID.upper()}-{SID}-01"])
def test_a_bad_traceparent_starts_a_new_trace(cluster, bad):  # noqa: F811
    h, _ = generate(cluster, {"traceparent": bad}, max_tokens=1)
    assert h["X-Trace-Id"] != TID.lower() and len(h["X-Trace-Id"]) == 32
    assert trace(cluster, h["X-Trace-Id"])["spans"][0]["parent_id"] is None


def test_an_unknown_or_malformed_trace_id(cluster):  # noqa: F811
    assert http("GET", cluster.url("coordinator") + "/traces/" + "e" * 32)[0] == 404
    assert http("GET", cluster.url("coordinator") + "/traces/nope")[0] == 400


def test_the_page_and_its_data(cluster):  # noqa: F811
    status, h, raw = http("GET", cluster.url("coordinator") + "/")
    assert status == 200 and h["Content-Type"].startswith("text/html") and b"<title>knot cluster</title>" in raw
    status, _, raw = http("GET", cluster.url("coordinator") + "/cluster")
    assert status == 200, raw
    c = json.loads(raw)
    by_role = {}
    for n in c["nodes"]:
        by_role.setdefault(n["role"], []).append(n)
    assert [n["layers"] for n in by_role["station"]] == [[0, 1], [1, 2]] or len(by_role["station"]) == 2
    assert len(by_role["shard"]) == 8 and all(n["replicas"][0]["health"] == "ready" for n in by_role["shard"])
    assert {"coordinator", "layer_warden", "cobordism_warden", "bucket"} <= set(by_role)
    assert c["samples"]["knot_requests_active"] == {"": 0.0}
    # the hops' latency buckets, for the page's recent quantiles; the other histograms' left out
    hop_buckets = c["samples"]["knot_hop_latency_seconds_bucket"]
    assert "hop=station_0,le=+Inf" in hop_buckets and hop_buckets["hop=station_0,le=+Inf"] >= 1
    assert "knot_queue_wait_seconds_bucket" not in c["samples"]


def test_an_unsampled_traceparent_turns_the_trace_off(cluster):  # noqa: F811
    tid = "5" * 32
    h, body = generate(cluster, {"traceparent": f"00-{tid}-{SID}-00"}, max_tokens=2)
    assert "X-Trace-Id" not in h and len(body["tokens"]) == 2
    assert http("GET", cluster.url("coordinator") + "/traces/" + tid)[0] == 404


def test_a_client_learns_nothing_of_the_hops_but_the_trace_id(cluster):  # noqa: F811
    """The coordinator is public: a client's traceparent on any endpoint gets no X-Knot-Spans back."""
    for method, path, body in (("POST", "/generate", {"prompt": "the", "max_tokens": 1}), ("GET", "/metrics", None),
                               ("GET", "/cluster", None)):
        status, h, _ = http(method, cluster.url("coordinator") + path, body, {"traceparent": f"00-{TID}-{SID}-01"})
        assert status == 200 and "X-Knot-Spans" not in h, (path, h)


def replica(cluster, name):  # noqa: F811
    return page_replica(cluster.url("coordinator"), name)


def test_a_killed_shard_is_restarting_then_ready_as_another_process(cluster):  # noqa: F811
    """kill -9 a shard, then start it again as the supervisor does (deploy/supervisor.py: the same
    command, environment and port): /cluster says restarting while it is gone, ready once it
    answers, and counts one restart (its /stats names another process)."""
    before = wait_for(lambda: (r := replica(cluster, "shard 3"))["health"] == "ready" and r, timeout_s=10,
                      what="shard 3 ready")
    assert before["down_for_s"] is None and before["stats"]["instance"]
    pid = cluster.running.pop("shard-3").pid
    os.killpg(pid, signal.SIGKILL)
    try:
        wait_for(lambda: not servers.pid_alive(pid), timeout_s=10, what="shard 3 gone")
        lost = wait_for(lambda: (r := replica(cluster, "shard 3"))["health"] != "ready" and r, timeout_s=10,
                        what="shard 3 seen lost", poll_s=0.2)
        assert lost["health"] == "restarting" and lost["stats"] is None, lost  # PEER_WAIT_S is 15 s here
        assert 0 <= lost["down_for_s"] < 15 and replica(cluster, "shard 2")["health"] == "ready"
    finally:
        cluster.start("shard-3")
    back = wait_for(lambda: (r := replica(cluster, "shard 3"))["health"] == "ready" and r, timeout_s=10,
                    what="shard 3 ready again", poll_s=0.2)
    assert back["down_for_s"] is None and back["restarts"] == before["restarts"] + 1
    assert back["stats"]["instance"] != before["stats"]["instance"]
