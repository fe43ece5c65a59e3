"""GET /metrics: Prometheus text format through prometheus-client, one registry per coordinator.

Counted here as requests run: requests, tokens, generations by outcome, time to first token,
inter-token latency, per-hop latency (embed, station_i, logits), shard degradations, replays,
queue wait, and speculative decoding (decode trips and their tokens, drafted and accepted tokens). Gathered at scrape time from the services through the coordinator's bindings
(GET /stats of every station and shard): where their tensors and embedding rows came from
(warden vs R2), hence the warden hit ratios, the stations' live KV sessions, and integrity:
cached weight bytes found bad at each tier (each a miss, refetched), R2 reads that disagreed
with the knot's crc32, and knot version reloads.

prometheus_client is optional: where it does not import (a Python Worker bundle without it),
the instruments below count nothing and GET /metrics answers 503 naming the missing package.
"""
from __future__ import annotations

import asyncio
import logging
from typing import Any, Iterable

from common.runtime import HttpError, Response, ServiceUnavailable

try:
    from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
    from prometheus_client.exposition import CONTENT_TYPE_LATEST
except ImportError:
    CollectorRegistry = None

log = logging.getLogger(__name__)

PREFIX = "knot"
STATS_TIMEOUT_S = 2.0
LATENCY_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
TTFT_BUCKETS_S = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)


# /stats field -> cache tier, for knot_cache_rejects: entries found bad (wrong version or crc32), refetched.
STATION_REJECTS = {"invalidations": "layer_warden_frame", "warden_rejects_ram": "layer_warden_ram",
                   "kept_rejected": "station_kept"}
SHARD_REJECTS = {"row_cache_rejects": "shard_lru", "warden_rows_rejected": "cobordism_warden_frame",
                 "warden_rejects_ram": "cobordism_warden_ram", "warden_rejects_kv": "kv"}


def _ratio(hits: float, misses: float) -> float:
    total = hits + misses
    return hits / total if total else float("nan")


class ServiceStats:
    """A custom collector over the last snapshot of the stations' and shards' /stats."""

    def __init__(self) -> None:
        self.stations: list[dict | None] = []  # per station, the /stats of its first replica that answered
        self.shards: list[dict | None] = []  # per shard, likewise
        # every replica as the pipeline has it (kind, range index, pipeline.Replica) and its /stats
        self.replicas: list[tuple[str, int, Any, dict | None]] = []
        self.steps: dict | None = None  # Pipeline.step_stats() at the last scrape

    def collect(self) -> Iterable:
        up = GaugeMetricFamily(f"{PREFIX}_peer_stats_up", "1 if the peer answered GET /stats at the last scrape",
                               labels=["peer"])
        loads = CounterMetricFamily(f"{PREFIX}_station_tensor_loads", "tensors a station loaded, by source",
                                    labels=["station", "source"])
        sessions = GaugeMetricFamily(f"{PREFIX}_station_kv_sessions", "live KV-cache sessions on a station",
                                     labels=["station"])
        rows = CounterMetricFamily(f"{PREFIX}_shard_embedding_rows", "embedding rows a shard read, by source",
                                   labels=["shard", "source"])
        resident = GaugeMetricFamily(f"{PREFIX}_station_resident_fraction",
                                     "share of a station's layer bytes kept between forwards, by memory profile",
                                     labels=["station", "profile"])
        streamed = GaugeMetricFamily(f"{PREFIX}_station_streamed_bytes_per_token",
                                     "layer bytes a station loads again every decode step", labels=["station"])
        budget = GaugeMetricFamily(f"{PREFIX}_station_budget_bytes", "a station's memory budget", labels=["station"])
        prefix = CounterMetricFamily(f"{PREFIX}_station_prompt_cache", "a station's prompt cache: sessions started "
                                     "from its blocks (hit), refused for want of them (miss), blocks kept (stored) "
                                     "and evicted", labels=["station", "event"])
        prefix_bytes = GaugeMetricFamily(f"{PREFIX}_station_prompt_cache_bytes", "bytes a station's prompt cache "
                                         "holds, and its capacity", labels=["station", "of"])
        ratio = GaugeMetricFamily(f"{PREFIX}_warden_hit_ratio",
                                  "share of reads served by the warden cache rather than R2",
                                  labels=["service"])
        rejects = CounterMetricFamily(f"{PREFIX}_cache_rejects", "cached weight bytes found bad (another knot "
                                      "version or a crc32 mismatch): a miss, refetched", labels=["service", "tier"])
        corrupt = CounterMetricFamily(f"{PREFIX}_r2_corrupt_reads", "R2 reads that disagreed with the knot's checksums",
                                      labels=["service"])
        reloads = CounterMetricFamily(f"{PREFIX}_service_version_reloads", "reloads on a new knot version in the "
                                      "service's process (per service kind there)", labels=["service"])
        for name, s, fields in ([(f"station_{i}", s, STATION_REJECTS) for i, s in enumerate(self.stations)]
                                + [(f"shard_{i}", s, SHARD_REJECTS) for i, s in enumerate(self.shards)]):
            if s is None:
                continue
            for field, tier in fields.items():
                rejects.add_metric([name, tier], s.get(field, 0))
            corrupt.add_metric([name], s.get("r2_corrupt_reads", 0))
            reloads.add_metric([name], s.get("knot_reloads", 0))
        yield from (rejects, corrupt, reloads)
        tot = {"station": [0, 0], "shard": [0, 0]}
        for i, s in enumerate(self.stations):
            up.add_metric([f"station_{i}"], 0 if s is None else 1)
            if s is None:
                continue
            w, r = s.get("warden_tensors", 0), s.get("r2_tensors", 0)
            loads.add_metric([str(i), "warden"], w)
            loads.add_metric([str(i), "r2"], r)
            sessions.add_metric([str(i)], s.get("sessions", 0))
            if "memory" in s:
                m = s["memory"]
                resident.add_metric([str(i), m["profile"]], m["resident_fraction"])
                streamed.add_metric([str(i)], m["streamed_bytes_per_token"])
                budget.add_metric([str(i)], m["budget_bytes"])
            if "prefix_cache" in s:
                p = s["prefix_cache"]
                for event, field in (("hit", "hits"), ("miss", "misses"), ("stored", "stored"),
                                     ("evicted", "evictions")):
                    prefix.add_metric([str(i), event], p.get(field, 0))
                prefix_bytes.add_metric([str(i), "held"], p.get("bytes", 0))
                prefix_bytes.add_metric([str(i), "capacity"], p.get("capacity_bytes", 0))
            ratio.add_metric([f"station_{i}"], _ratio(w, r))
            tot["station"][0] += w
            tot["station"][1] += r
        for i, s in enumerate(self.shards):
            up.add_metric([f"shard_{i}"], 0 if s is None else 1)
            if s is None:
                continue
            w, r = s.get("rows_from_warden", 0), s.get("rows_from_r2", 0)
            rows.add_metric([str(i), "warden"], w)
            rows.add_metric([str(i), "r2"], r)
            ratio.add_metric([f"shard_{i}"], _ratio(w, r))
            tot["shard"][0] += w
            tot["shard"][1] += r
        ratio.add_metric(["stations"], _ratio(*tot["station"]))
        ratio.add_metric(["shards"], _ratio(*tot["shard"]))
        yield from (up, loads, sessions, resident, streamed, budget, prefix, prefix_bytes, rows, ratio)
        state = GaugeMetricFamily(f"{PREFIX}_replica_up", "1 while the coordinator takes a replica of a station or "
                                  "shard to be up (its last call or probe answered), 0 while it is down",
                                  labels=["range", "binding"])
        pinned = GaugeMetricFamily(f"{PREFIX}_replica_generations", "generations pinned to a replica",
                                   labels=["range", "binding"])
        outages = CounterMetricFamily(f"{PREFIX}_replica_outages", "times the coordinator found a replica down",
                                      labels=["range", "binding"])
        for kind, i, r, _ in self.replicas:
            labels = [f"{kind}_{i}", r.binding]
            state.add_metric(labels, 1 if r.state.down_since is None else 0)
            pinned.add_metric(labels, r.load)
            outages.add_metric(labels, r.state.outages)
        yield from (state, pinned, outages)
        if self.steps is not None:  # continuous batching (STEP_BATCH)
            steps = CounterMetricFamily(f"{PREFIX}_step_batches", "decode steps run together, and the generations' "
                                        "steps they carried (items / batches = the mean batch)", labels=["count"])
            steps.add_metric(["batches"], self.steps["steps"]["batches"])
            steps.add_metric(["items"], self.steps["steps"]["batched_items"])
            bundles = CounterMetricFamily(f"{PREFIX}_bundles", "calls that carried several generations' steps, by "
                                          "hop (station, shard)", labels=["hop"])
            for hop, n in self.steps["bundles"].items():
                bundles.add_metric([hop], n)
            alone = CounterMetricFamily(f"{PREFIX}_bundle_parts_alone", "generations' parts of a bundle that failed "
                                        "and were made as their own calls")
            alone.add_metric([], self.steps["made_alone"])
            yield from (steps, bundles, alone)


class _Uncounted:
    """Stands in for every instrument when prometheus_client is absent: accepts the calls, keeps nothing."""

    def labels(self, *_args) -> "_Uncounted":
        return self

    def inc(self, _amount: float = 1) -> None:
        pass

    def observe(self, _value: float) -> None:
        pass


class CoordinatorMetrics:
    def __init__(self, admission) -> None:
        self.enabled = CollectorRegistry is not None
        self.services = ServiceStats()  # the stations' and shards' last /stats, whether or not they are exposed
        self.source = None  # the KnotSource of the version served (watch_bucket)
        if not self.enabled:
            return  # every instrument is an _Uncounted (__getattr__)
        r = self.registry = CollectorRegistry()  # per coordinator, never the process-global one
        self.requests = Counter(f"{PREFIX}_requests", "HTTP requests by endpoint and status", ["endpoint", "status"],
                                registry=r)
        self.tokens = Counter(f"{PREFIX}_tokens", "tokens processed, by kind (prompt, completion; prompt_cached: "
                              "the prompt positions taken from the stations' prompt caches)", ["kind"], registry=r)
        self.generations = Counter(f"{PREFIX}_generations", "generations by outcome (stop, length, cancelled, error)",
                                   ["outcome"], registry=r)
        self.ttft = Histogram(f"{PREFIX}_time_to_first_token_seconds", "from admission to the first sampled token",
                              buckets=TTFT_BUCKETS_S, registry=r)
        self.itl = Histogram(f"{PREFIX}_inter_token_latency_seconds", "between two consecutive sampled tokens",
                             buckets=LATENCY_BUCKETS_S, registry=r)
        self.hops = Histogram(f"{PREFIX}_hop_latency_seconds", "one hop of the pipeline (embed, station_i, logits; "
                              "draft: a call to the drafter)", ["hop"], buckets=LATENCY_BUCKETS_S, registry=r)
        self.queue_wait = Histogram(f"{PREFIX}_queue_wait_seconds", "time a request waited for a generation slot",
                                    buckets=LATENCY_BUCKETS_S, registry=r)
        self.degradations = Counter(f"{PREFIX}_shard_degradations", "shard failures merged as zeros / -inf",
                                    ["shard", "stage"], registry=r)
        self.trips = Counter(f"{PREFIX}_decode_trips", "engine trips after the prompt (one verifies all its drafts)",
                             registry=r)
        self.decoded = Counter(f"{PREFIX}_decode_tokens", "tokens sampled from those trips (tokens per trip = "
                               "decode_tokens / decode_trips)", registry=r)
        self.drafted = Counter(f"{PREFIX}_spec_drafted_tokens", "draft tokens verified, by source", ["source"],
                               registry=r)
        self.accepted = Counter(f"{PREFIX}_spec_accepted_tokens", "draft tokens accepted, by source", ["source"],
                                registry=r)
        self.backed_off = Counter(f"{PREFIX}_spec_backed_off_trips", "trips that drafted nothing because the "
                                  "drafts before them all failed or gave their tokens slower than plain trips "
                                  "(common/speculative.DraftLength), by source",
                                  ["source"], registry=r)
        self.drafter_faults = Counter(f"{PREFIX}_spec_drafter_faults", "generations that went on without drafts "
                                      "after the drafter failed them (their tokens are the same)", registry=r)
        self.tokens_per_trip = Histogram(f"{PREFIX}_tokens_per_trip", "a generation's tokens per decode trip",
                                         buckets=(1, 1.25, 1.5, 2, 2.5, 3, 4, 6, 8, 12, 16, 33), registry=r)
        self.prompt_cache = Counter(f"{PREFIX}_prompt_cache_lookups", "prompts by what prompt caching did: hit "
                                    "(started after blocks the stations keep), miss (a station no longer held them "
                                    "when the prompt reached it: run from 0), none (no block of it held), off "
                                    "(cache_prompt false, or a station keeps no blocks)", ["result"], registry=r)
        self.replays = Counter(f"{PREFIX}_session_replays", "prompts replayed after a station lost a KV session",
                               registry=r)
        self.knot_reloads = Counter(f"{PREFIX}_version_reloads", "coordinator reloads on a new knot version",
                                    registry=r)
        self.row_cache = Gauge(f"{PREFIX}_embed_row_cache", "the coordinator's embedding rows (EMBED_ROW_CACHE_BYTES) "
                               "for the knot version it serves: hits, misses, rejected, rows, bytes", ["what"],
                               registry=r)
        Gauge(f"{PREFIX}_requests_active", "generations running", registry=r).set_function(lambda: admission.active)
        Gauge(f"{PREFIX}_requests_queued", "requests waiting for a slot", registry=r).set_function(
            lambda: admission.queued)
        bucket = Gauge(f"{PREFIX}_bucket_version_check", "the bucket's knot version check (every generation's, "
                       "BUCKET_CHECK_*): failing 1 while the loaded version is served unverified; failures and "
                       "skipped (requests served without a check) count since that version was loaded", ["what"],
                       registry=r)
        for what in ("failing", "failures", "skipped"):
            bucket.labels(what).set_function(lambda what=what: self._bucket_check(what))
        r.register(self.services)

    def __getattr__(self, name: str):
        """Only for attributes that do not exist: without prometheus_client, each instrument counts nothing."""
        if name.startswith("_") or self.__dict__.get("enabled", True):
            raise AttributeError(f"{type(self).__name__} has no attribute {name!r}")
        return _Uncounted()

    def watch_bucket(self, source) -> None:
        """Report source's bucket version checks (services/knot_source.py BucketCheck) from now on."""
        self.source = source

    def _bucket_check(self, what: str) -> float:
        check = None if self.source is None else self.source.bucket_check
        if check is None:
            return 0.0
        return float(check.failed_at is not None) if what == "failing" else float(getattr(check, what))

    def observe_speculation(self, gen) -> None:
        """A finished generation's decode trips, and its drafts by source (common.generation.Generation)."""
        if gen.drafter_error is not None:  # a fault at /prime may end a generation before any trip
            self.drafter_faults.inc()
        if not gen.trips:
            return
        self.trips.inc(gen.trips)
        self.decoded.inc(gen.decode_steps)
        self.tokens_per_trip.observe(gen.decode_steps / gen.trips)
        if gen.drafted:
            self.drafted.labels(gen.speculation.source).inc(gen.drafted)
            self.accepted.labels(gen.speculation.source).inc(gen.accepted)
        if gen.backed_off:
            self.backed_off.labels(gen.speculation.source).inc(gen.backed_off)

    def note_row_cache(self, pipeline) -> None:
        """The serving pipeline's row cache (services/coordinator/pipeline.py Pipeline.rows)."""
        lru = pipeline.rows
        for what, v in (("hits", lru.stats.hits), ("misses", lru.stats.misses), ("rejected", pipeline.row_rejects),
                        ("rows", len(lru)), ("bytes", lru.bytes_used)):
            self.row_cache.labels(what).set(v)

    def observe_hop(self, name: str, seconds: float) -> None:
        self.hops.labels(name).observe(seconds)

    async def gather(self, pipeline) -> None:
        """Refresh the services' snapshot: GET /stats of every replica of each station and shard, concurrently."""
        if not self.enabled:
            return  # nothing would show them: exposition() answers 503

        async def one(client) -> dict | None:
            try:
                return await client.stats(STATS_TIMEOUT_S)
            except (HttpError, TimeoutError, ValueError) as e:
                log.warning("metrics: /stats failed: %s", e)
                return None

        pipeline.probe_down()  # a replica that came back rejoins even while no generation starts
        self.services.steps = pipeline.step_stats()
        replicas = pipeline.replicas()
        got = await asyncio.gather(*(one(r.client) for _, _, r in replicas))
        self.services.replicas = [(kind, i, r, st) for (kind, i, r), st in zip(replicas, got)]
        first: dict[tuple[str, int], dict | None] = {}
        for kind, i, _, st in self.services.replicas:
            if first.get((kind, i)) is None:
                first[(kind, i)] = st
        self.services.stations = [first[("station", i)] for i in range(len(pipeline.station_sets))]
        self.services.shards = [first[("shard", spec.index)] for spec, _ in pipeline.shard_sets]

    def exposition(self) -> Response:
        if not self.enabled:
            raise ServiceUnavailable("GET /metrics needs the prometheus_client package, which this host lacks")
        return Response.from_bytes(generate_latest(self.registry), CONTENT_TYPE_LATEST)
