"""The operator's view: per-request traces and the cluster's live state, for the page at GET /.

    GET /                 the cluster page (page.py): static HTML, CSS and JS, no data in it
    GET /cluster          the topology, each service's health and /stats, the coordinator's counters and
                          the requests in flight; gathered at most every SNAPSHOT_TTL_S, however many poll
    GET /traces           the ring's traces, newest first: id, root span, spans, in flight
    GET /traces/<id>      one trace's spans, in start order

A generation request's trace (services/tracing.py) starts in traced(): under the client's traceparent
or a new one, its id in the reply's X-Trace-Id header.

The topology is a list of nodes, each a role (station, shard, ...) with its place in the model (a
layer range, a vocabulary slice) and its replicas, one per binding (ClusterLayout replicas), with
the generations pinned to each; the page draws each. A station's or shard's health is health()'s rule: a
peer that stopped answering is "restarting" for PEER_WAIT_S (what requests wait for a supervised
restart), then "down"; a replica's `restarts` counts the times it came back as another process.
"""
from __future__ import annotations

import asyncio
import math
import re
import time
from dataclasses import dataclass
from typing import Any, Awaitable, Callable

from common.runtime import BadRequest, Env, MethodNotAllowed, NotFound, Request, Response, aclose_stream
from services import tracing
from services.coordinator import page
from services.coordinator.pipeline import PeerState, Replica

SNAPSHOT_TTL_S = 1.0  # pollers within this share one gathering of the services' /stats
TRACES = tracing.Ring()
_TRACE_PATH = re.compile(r"/traces/([0-9a-f]{32})")


async def traced(request: Request, name: str, run: Callable[[], Awaitable[Response]]) -> Response:
    """run() as a request's server span in TRACES; a streamed reply's span ends with its stream. A
    client's unsampled traceparent (flags 00) turns the request's trace off."""
    scope = tracing.begin(TRACES, request.headers, name)
    if scope is None:
        return await run()
    try:
        resp = await run()
    except BaseException as e:
        tracing.end(TRACES, scope, tracing.outcome(e))
        raise
    resp.headers[tracing.TRACE_ID_HEADER] = scope.trace_id
    if resp.stream is None:
        tracing.end(TRACES, scope, str(resp.status))
    else:
        resp.stream = _ending(resp.stream, scope, str(resp.status))
    return resp


async def _ending(stream, scope: tracing.Scope, status: str):
    try:
        async for chunk in stream:
            yield chunk
    except BaseException as e:
        status = tracing.outcome(e)
        raise
    finally:
        await aclose_stream(stream)
        tracing.end(TRACES, scope, status)


def serves(request: Request) -> bool:
    return request.path in ("/cluster", "/traces") or request.path.startswith("/traces/")


def page_response() -> Response:
    # no-store: a new deployment's page is never served from a stale cache
    return Response.from_bytes(page.HTML.encode("utf-8"), "text/html; charset=utf-8",
                               headers={"Cache-Control": "no-store"})


async def fetch(request: Request, env: Env, coordinator: Callable[[], Awaitable[Any]]) -> Response:
    if request.method != "GET":
        raise MethodNotAllowed(f"{request.method} {request.path}: use GET")
    path = request.path
    if path == "/traces":
        return Response.from_json({"traces": [_brief(t) for t in TRACES.recent()]})
    if path.startswith("/traces/"):
        m = _TRACE_PATH.fullmatch(path)
        if m is None:
            raise BadRequest(f"{path}: a trace id is 32 lowercase hex digits")
        trace = TRACES.get(m.group(1))
        if trace is None:
            raise NotFound(f"trace {m.group(1)} is not in the last {TRACES.size} traces")
        return Response.from_json(trace.as_json())
    return Response.from_json(await snapshot(await coordinator()))


def _brief(t: tracing.Trace) -> dict:
    roots = [s for s in t.spans if s.peer == "coordinator" and s.span_id is not None]
    return {"trace_id": t.trace_id, "started_at": t.started_at, "in_flight": t.open > 0, "spans": len(t.spans),
            "name": t.name,
            "duration_ms": round(roots[-1].duration_s * 1e3, 3) if roots else None,
            "status": roots[-1].status if roots else None}


# ---------------------------------------------------------------- GET /cluster


class _Snapshots:
    """The last snapshot and when it was taken; one gathering at a time."""

    def __init__(self) -> None:
        self.value: dict | None = None
        self.at = -math.inf
        self.lock = asyncio.Lock()


_snapshots = _Snapshots()


async def snapshot(co) -> dict:
    async with _snapshots.lock:
        if time.monotonic() - _snapshots.at >= SNAPSHOT_TTL_S:
            await co.metrics.gather(co.pipeline)
            co.note_station_stats(co.metrics.services.stations)
            co.metrics.note_row_cache(co.pipeline)
            _snapshots.value, _snapshots.at = _gathered(co), time.monotonic()
        return {**_snapshots.value, "in_flight": _in_flight(co), "now": time.time()}


@dataclass
class Seen:
    """One station's or shard's answers to the snapshots' GET /stats, as the page reports them."""

    instance: str | None = None  # the process that answered last (its BootCache.instance)
    answered_at: float = -math.inf  # time.monotonic() of its last answer
    lost_since: float | None = None  # time.monotonic() of the first unanswered /stats of this outage
    restarts: int = 0  # times it came back as another process than the one before


def observe(seen: Seen, stats: dict | None, now: float) -> None:
    """Note one /stats answer (None: none). An answer from another instance than the last is a restart."""
    if stats is None:
        if seen.lost_since is None:
            seen.lost_since = now
        return
    instance = stats.get("instance")
    if seen.instance is not None and instance != seen.instance:
        seen.restarts += 1
    seen.instance, seen.answered_at, seen.lost_since = instance, now, None


def down_for(seen: Seen, peer: PeerState, now: float) -> float | None:
    """Seconds since the peer stopped answering: since the first unanswered /stats, or since a
    request's hop found it down (PeerState.down_since) if that came first and after its last
    answer; None while it answers."""
    if seen.lost_since is None:
        return None
    since = seen.lost_since
    if peer.down_since is not None and seen.answered_at < peer.down_since < since:
        since = peer.down_since
    return now - since


def health(stats: dict | None, down_for_s: float | None, peer_wait_s: float) -> str:
    """A station's or shard's health. No answer to /stats: restarting while it has been down for
    less than peer_wait_s (PEER_WAIT_S: how long requests wait for a supervised restart), down
    after that (requests fail with 503 naming it). Answering: streaming for a station whose layers
    do not fit its budget (it loads some of them again on every forward), ready otherwise."""
    if stats is None:
        return "restarting" if down_for_s is not None and down_for_s < peer_wait_s else "down"
    return "streaming" if (stats.get("memory") or {}).get("fits") is False else "ready"


_seen: dict[str, Seen] = {}  # binding name -> what its /stats said, across snapshots


def _replica(co, r: Replica, stats: dict | None, now: float) -> dict:
    seen = _seen.setdefault(r.binding, Seen())
    observe(seen, stats, now)
    lost_s = down_for(seen, r.state, now)
    return {"binding": r.binding, "health": health(stats, lost_s, co.pipeline.peer_wait_s), "stats": stats,
            "down_for_s": None if lost_s is None else round(lost_s, 1), "restarts": seen.restarts,
            "generations": r.load}


def _gathered(co) -> dict:
    stations, shards = co.metrics.services.stations, co.metrics.services.shards
    nodes: list[dict] = [{"role": "coordinator", "name": "coordinator", "replicas": [
        {"binding": "coordinator", "health": "ready", "stats": {"model": co.model_id, "knot_etag": co.pipeline.knot_etag,
                                                                "context_tokens": co.context_tokens,
                                                                "step_batching": co.pipeline.step_stats()}}]}]
    now = time.monotonic()
    answers = {id(r): st for _, _, r, st in co.metrics.services.replicas}
    for i, rset in enumerate(co.pipeline.station_sets):
        st = stations[i] if i < len(stations) else None
        rng = [int(st["layer_start"]), int(st["layer_end"])] if st else None
        nodes.append({"role": "station", "name": f"station {i}", "layers": rng,
                      "replicas": [_replica(co, r, answers.get(id(r)), now) for r in rset.replicas]})
    for spec, rset in co.pipeline.shard_sets:
        nodes.append({"role": "shard", "name": f"shard {spec.index}", "vocab": [spec.vocab_start, spec.vocab_end],
                      "replicas": [_replica(co, r, answers.get(id(r)), now) for r in rset.replicas]})
    # The wardens are the stations' and shards' peers, not the coordinator's: seen through their /stats.
    for role, peers in (("layer_warden", stations), ("cobordism_warden", shards)):
        seen = [s for s in peers if s is not None and any(k.startswith("warden_") for k in s)]
        nodes.append({"role": role, "name": role.replace("_", " "), "replicas": [
            {"binding": role.upper(), "health": "ready" if seen else "unknown",
             "stats": {k: sum(s[k] for s in seen if isinstance(s.get(k), (int, float)))
                       for k in sorted({k for s in seen for k in s if k.startswith("warden_")})}}]})
    source = co.metrics.source
    note = None if source is None else source.bucket_check.note(source.etag)
    nodes.append({"role": "bucket", "name": "bucket", "replicas": [
        {"binding": "KNOT_BUCKET", "health": "degraded" if note else "ready", "stats": {"note": note}}]})
    if co.drafter_client is not None:
        nodes.append({"role": "drafter", "name": "drafter", "replicas": [
            {"binding": "DRAFTER", "health": "degraded" if co.drafter_client.cooling() else "ready", "stats": None}]})
    return {"model": co.model_id, "hparams": {"n_layer": co.cfg.n_layer, "vocab_size": co.cfg.vocab_size},
            "nodes": nodes, "samples": _samples(co.metrics)}


# histograms whose buckets the page reads (a recent quantile from two snapshots' difference)
QUANTILE_HISTOGRAMS = ("knot_hop_latency_seconds_bucket", "knot_time_to_first_token_seconds_bucket")


def _samples(metrics) -> dict[str, dict[str, float]]:
    """The coordinator's Prometheus samples (histogram buckets only of QUANTILE_HISTOGRAMS):
    name -> {"k=v,...": value}."""
    out: dict[str, dict[str, float]] = {}
    if not metrics.enabled:
        return out
    for family in metrics.registry.collect():
        for s in family.samples:
            if (s.name.endswith("_bucket") and s.name not in QUANTILE_HISTOGRAMS) or s.name.endswith("_created"):
                continue
            v = float(s.value)
            labels = ",".join(f"{k}={v_}" for k, v_ in sorted(s.labels.items()))
            out.setdefault(s.name, {})[labels] = v if math.isfinite(v) else None
    return out


def _in_flight(co) -> list[dict]:
    now = time.perf_counter()
    return [{"request_id": rid, "trace_id": g.trace.trace_id if g.trace else None,
             "prompt_tokens": len(g.prompt_ids), "tokens": len(g.token_ids), "max_tokens": g.max_tokens,
             "elapsed_s": round(now - g.t0, 3), "replays": g.replays,
             "at": _where(g.trace)} for rid, g in list(co.in_flight.items())]


def _where(scope: tracing.Scope | None) -> str | None:
    """The request's last recorded hop: where it is now, about."""
    if scope is None:
        return None
    spans = scope.sink.spans
    last = next((s for s in reversed(spans[-64:]) if s.parent_id == scope.span_id), None)
    return None if last is None else f"{last.peer} {last.name}"
