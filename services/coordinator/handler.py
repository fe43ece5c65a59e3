"""Coordinator: the public API. Tokenizes, fans embeddings out to the shards, chains the
stations, gathers the LM-head slices and samples (seed sections 1-3).

    POST /generate               {"prompt": str | "messages": [...], "max_tokens", sampling params, "stop"}
                                 -> {"text", "tokens", "prompt_tokens", "finish_reason", "timings",
                                     "degraded_shards", "replays", "usage"}
    POST /v1/completions         OpenAI-compatible (openai_api.py, docs/api.md), stream=true: SSE
    POST /v1/chat/completions    the same, with the model's own chat template
    GET  /v1/models              the one model served
    POST /tokenize               {"prompt" | "messages", "suffix", "add_generation_prompt"}
                                 -> {"count", "max_model_len", "tokens"}: the ids a generation would run on
    POST /detokenize             {"tokens"} -> {"prompt"}
    GET  /metrics                Prometheus text format (metrics.py)
    GET  /topology               the stations and shards it chains
    GET  /                       the cluster page; GET /cluster, /traces, /traces/<id>: its data (console.py)

Every generation goes through coordinator.Coordinator.events() and the admission queue, has a
deadline (REQUEST_TIMEOUT_S) and runs under a shard-failure policy (SHARD_FAILURE, or the body's
shard_failure): its reply says which in X-Knot-Shard-Failure, and names the shards it was degraded
around, if any (pipeline.py). With KNOT_API_KEY set, every endpoint wants
`Authorization: Bearer KEY` and answers 401 without it (OpenAI's error shape under /v1).

Knot versions: a generation request first asks the bucket which version of the knot it holds (one
head()); when that is not the version the coordinator loaded, it loads the new one (tokenizer,
hyperparameters, topology checks), keeping its metrics and admission queue. Every hop of the
generation then names that version (pipeline.py), so the whole cluster follows, and a generation
never computes with two versions: it completes on one, or fails with 503.

The event loop stays free for every request (docs/runtime.md, "Huge requests"): bodies over
MAX_BODY_BYTES are refused by the host (413) before they are read in full, a prompt whose length
alone rules it out is refused before tokenizing, tokenizing stops as soon as the prompt is longer
than the context, and parsing and tokenizing run off the event loop (services/offload.py).

Env: KNOT_KEY; STATIONS = binding names in chain order ("STATION_0,STATION_1");
SHARDS = "BINDING:START-END,..." (must tile [0, vocab)); a station's or shard's replicas joined
by | ("STATION_0|STATION_0_R1", "SHARD_0|SHARD_0_R1:0-18992"); the rest in docs/configuration.md;
bindings KNOT_BUCKET and the named service bindings.
"""
from __future__ import annotations

import asyncio
import hashlib
import hmac
import logging
import time
from dataclasses import dataclass
from typing import Awaitable, Callable

from common.knot import TOKENIZER_BLOB, decode_tokenizer_blob
from common.runtime import (BadRequest, Env, HttpError, MethodNotAllowed, NotFound, Request, Response,
                            ServiceUnavailable, status_for)
from common.settings import default, read
from common.tokenizer import Tokenizer
from common.topology import ShardSpec, StationSpec, TopologyError, check_station_chain, check_vocab_tiling, parse_range
from services.boot import BootCache
from services.coordinator import console, openai_api, subrequests
from services.coordinator.subrequests import counted
from services.coordinator.errors import InvalidAPIKey, openai_error_response
from services.coordinator.cluster_engine import StationCapacity
from services.coordinator.coordinator import Coordinator, policy_headers, summary
from services.coordinator.params import parse_detokenize, parse_generate, parse_tokenize
from services.coordinator.pipeline import AFFINITY_HEADER, MAX_AFFINITY_BYTES, Pipeline, session_affinity
from services.drafter.drafter_client import DrafterClient
from services.knot_source import KnotSource, read_pin, serving_version
from services.offload import off_loop

log = logging.getLogger(__name__)

# The host refuses larger request bodies (413) before reading them (KNOT_MAX_BODY_BYTES overrides).
# A 32k-token prompt is a few hundred KB of JSON, even as escaped CJK text or token ids.
MAX_BODY_BYTES = 4 << 20

# The public API (clients, not other services): the host cancels a request whose client hung up.
PUBLIC = True
# Its requests' traces (console.py); a host exports them where OTEL_EXPORTER_OTLP_ENDPOINT is set.
TRACES = console.TRACES

def _replicas(item: str, var: str) -> tuple[str, ...]:
    """"STATION_0|STATION_0_R1" -> its replicas' binding names."""
    names = tuple(n.strip() for n in item.split("|"))
    if not all(names):
        raise TopologyError(f"{var} entry {item!r}: an empty binding name (replicas are joined by |)")
    if len(set(names)) != len(names):
        raise TopologyError(f"{var} entry {item!r}: a binding named twice")
    return names


@dataclass(frozen=True)
class CoordinatorSettings:
    knot_key: str
    stations: tuple[tuple[str, ...], ...]  # per station in chain order, its replicas' binding names
    shards: tuple[tuple[tuple[str, ...], int, int], ...]  # (replicas' binding names, vocab_start, vocab_end)
    shard_timeout_s: float
    station_timeout_s: float
    peer_wait_s: float  # how long requests wait for a peer that is down (a restart)
    request_timeout_s: float  # every request's deadline
    shard_failure: str  # "fail" | "degrade"
    max_concurrent: int  # generations at once
    max_queued: int  # requests waiting beyond those; more get 429
    retry_after_s: int
    model_name: str | None  # None: KNOT_KEY without ".knot"
    speculation: str = default("SPECULATION", "coordinator")  # for requests that do not choose
    max_draft: int | None = default("SPEC_MAX_DRAFT", "coordinator")  # None: by source (default_max_draft)
    sample_top: int = default("SHARD_SAMPLE_TOP", "coordinator")  # 0: the shards send full slices
    row_cache_bytes: int = default("EMBED_ROW_CACHE_BYTES", "coordinator")  # 0: every embed is a hop
    drafter_timeout_s: float = default("DRAFTER_TIMEOUT_S", "coordinator")  # and auto's wait after a drafter fault
    bucket_check_timeout_s: float = default("BUCKET_CHECK_TIMEOUT_S", "coordinator")  # the knot version's HEAD
    bucket_check_backoff_s: float = default("BUCKET_CHECK_BACKOFF_S", "coordinator")  # no HEAD after one failed
    step_batch: int = default("STEP_BATCH", "coordinator")  # generations stepped together; 0: each alone

    @classmethod
    def from_env(cls, env: Env) -> "CoordinatorSettings":
        def get(name: str):
            return read(env, name, "coordinator")

        stations = tuple(_replicas(item, "STATIONS") for item in get("STATIONS"))
        shards = []
        for item in get("SHARDS").split(","):
            names, _, rng = item.strip().partition(":")
            if not rng:
                raise TopologyError(f"SHARDS entry {item!r}: expected BINDING:START-END")
            a, b = parse_range(rng, f"SHARDS entry {item!r}")
            shards.append((_replicas(names, "SHARDS"), a, b))
        return cls(get("KNOT_KEY"), stations, tuple(shards), get("SHARD_TIMEOUT_S"), get("STATION_TIMEOUT_S"),
                   get("PEER_WAIT_S"), get("REQUEST_TIMEOUT_S"), get("SHARD_FAILURE"),
                   get("MAX_CONCURRENT_REQUESTS"), get("MAX_QUEUED_REQUESTS"), get("RETRY_AFTER_S"), get("MODEL_NAME"),
                   get("SPECULATION"), get("SPEC_MAX_DRAFT"), get("SHARD_SAMPLE_TOP"), get("EMBED_ROW_CACHE_BYTES"),
                   get("DRAFTER_TIMEOUT_S"), get("BUCKET_CHECK_TIMEOUT_S"), get("BUCKET_CHECK_BACKOFF_S"),
                   get("STEP_BATCH"))

    @property
    def model_id(self) -> str:
        return self.model_name or self.knot_key.rsplit("/", 1)[-1].removesuffix(".knot")


@dataclass(frozen=True)
class _Booted:
    co: Coordinator
    source: KnotSource  # pinned to the version co was loaded from
    tokenizer_sha256: bytes = b""  # of the tokenizer blob co.tokenizer was built from


_booted: BootCache[_Booted] = BootCache()


async def coordinator_for(env: Env, check_version: bool = False) -> Coordinator:
    """The booted coordinator; with check_version (every generation), first reloaded if the bucket
    now holds another version of the knot."""
    try:
        settings = CoordinatorSettings.from_env(env)
    except TopologyError as e:
        raise ServiceUnavailable(f"coordinator config: {e}") from None
    key = repr(settings)

    async def boot(pin: str) -> _Booted:
        source = KnotSource(counted(env.KNOT_BUCKET), settings.knot_key, pin)
        header, cfg = await source.header(), (await source.model()).cfg
        shards = [ShardSpec(i, a, b) for i, (_, a, b) in enumerate(settings.shards)]
        check_vocab_tiling(shards, cfg.vocab_size)
        bindings = {i: [(n, counted(_binding(env, n))) for n in names] for i, (names, _, _) in enumerate(settings.shards)}
        ordered = [(s, bindings[s.index]) for s in sorted(shards, key=lambda s: s.vocab_start)]
        stations = [[(n, counted(_binding(env, n))) for n in names] for names in settings.stations]
        pipeline = Pipeline(stations, ordered, cfg.dim, cfg.vocab_size, settings.shard_timeout_s,
                            settings.station_timeout_s, settings.peer_wait_s, settings.retry_after_s, source.etag,
                            settings.row_cache_bytes, settings.step_batch)
        station_stats = await _check_stations(pipeline, cfg.n_layer)
        drafter = await _drafter(env, settings, cfg.vocab_size)
        capacity = [StationCapacity(i, int(s["max_session_tokens"]), int(s["budget_bytes"]))
                    for i, s in enumerate(station_stats)]
        blob = await source.read_tensor(TOKENIZER_BLOB)  # checked against the knot's crc32
        blob_sha256 = hashlib.sha256(blob).digest()
        previous = _booted.peek(key)
        if previous is not None and previous.tokenizer_sha256 == blob_sha256:
            # A reload whose tokenizer is the same bytes keeps the one built: each new build beside the
            # previous one left its heap fragmented for good, malloc_trim or not, and the coordinator's
            # RSS grew with every reload (benchmarks/reload_rss.py measures it).
            tokenizer = previous.co.tokenizer
        else:
            tokenizer = Tokenizer(decode_tokenizer_blob(blob, header.blobs[TOKENIZER_BLOB].encoding))
        co = Coordinator(settings, cfg, tokenizer, pipeline, settings.model_id, drafter, capacity, header.digest)
        co.note_station_stats(station_stats)
        await off_loop(lambda: tokenizer.max_token_bytes)  # a pass over the vocabulary, once
        log.info("coordinator booted on knot version %s: %d stations, %d shards, vocab %d, sequences up to %d "
                 "tokens%s", source.etag, len(stations), len(shards), cfg.vocab_size, co.context_tokens,
                 ", a draft model" if drafter else "")
        if previous is not None:  # a reload on a new knot version: counters and the queue carry on
            co.admission, co.metrics, co.in_flight = previous.co.admission, previous.co.metrics, previous.co.in_flight
            co.metrics.knot_reloads.inc()
        co.metrics.watch_bucket(source)
        return _Booted(co, source, blob_sha256)

    try:
        return (await serving_version(_booted, key, boot, lambda b: b.source, check_bucket=check_version,
                                      check_timeout_s=settings.bucket_check_timeout_s,
                                      check_backoff_s=settings.bucket_check_backoff_s,
                                      pin=read_pin(env, "coordinator"))).co
    except TopologyError as e:  # a misconfigured cluster: not the client's fault, and not ready
        raise ServiceUnavailable(f"coordinator topology: {e}") from None


def _binding(env: Env, name: str):
    try:
        return getattr(env, name)
    except AttributeError:
        raise TopologyError(f"no binding {name} (STATIONS and SHARDS name it)") from None


async def _check_stations(pipeline: Pipeline, n_layers: int) -> list[dict]:
    """Ask each station's replicas for their layer range; together the stations must chain
    [0, n_layers), and a station's replicas must all hold its range. -> per station the /stats of
    its first replica that answered (the least max_session_tokens of those that did). A station
    none of whose replicas answers fails the boot; a replica that does not is marked down (it
    rejoins once it answers, pipeline.ReplicaSet)."""
    if not pipeline.station_sets:
        raise TopologyError("STATIONS is empty: need at least 1 station")
    specs, stats = [], []
    for i, rset in enumerate(pipeline.station_sets):
        answers = await asyncio.gather(*(r.client.stats() for r in rset.replicas), return_exceptions=True)
        got = []
        for r, a in zip(rset.replicas, answers):
            if isinstance(a, BaseException):
                if not isinstance(a, (HttpError, TimeoutError)):
                    raise a
                if len(rset.replicas) == 1:
                    raise ServiceUnavailable(f"station {i} {a}") from None
                log.warning("%s (%s) did not answer at boot: %s; marked down", r.state.name, r.binding, a)
                r.state.down(time.monotonic())
                continue
            got.append((r, a))
        if not got:
            raise ServiceUnavailable(f"station {i}: none of its {len(rset.replicas)} replicas answers: "
                                     f"{'; '.join(str(a) for a in answers)}")
        ranges = {(int(a["layer_start"]), int(a["layer_end"])) for _, a in got}
        if len(ranges) > 1:
            raise TopologyError(f"station {i}'s replicas hold different layer ranges: " + ", ".join(
                f"{r.binding} [{a['layer_start']}, {a['layer_end']})" for r, a in got))
        first = dict(got[0][1])
        first["max_session_tokens"] = min(int(a["max_session_tokens"]) for _, a in got)
        specs.append(StationSpec(i, int(first["layer_start"]), int(first["layer_end"]), str(first["role"])))
        stats.append(first)
    check_station_chain(specs, n_layers)
    return stats


async def _drafter(env: Env, settings: CoordinatorSettings, vocab_size: int) -> DrafterClient | None:
    """The DRAFTER binding's client; None when unbound. A drafter of another vocabulary is a
    TopologyError, as a misconfigured station is. One that does not answer (down, still booting, or
    refusing a corrupt model) does not stop the coordinator's boot: the drafter only speeds
    generations up. The first generation that drafts checks it again (RemoteDraftModel); if that
    fails, the generation goes without drafts and `auto` leaves the drafter out for
    DRAFTER_TIMEOUT_S (DrafterClient.cooling)."""
    binding = read(env, "DRAFTER", "coordinator")
    if binding is None:
        return None
    client = DrafterClient(counted(binding), settings.drafter_timeout_s, vocab_size=vocab_size)
    try:  # a hung drafter holds the boot no longer than a peer that is down holds a request
        await client.check(min(settings.drafter_timeout_s, settings.peer_wait_s))
    except (HttpError, TimeoutError) as e:  # not a fault yet (cooling): it may still be booting
        log.warning("the drafter did not answer /stats (%s: %s): the first generation that drafts asks it again, "
                    "and goes without drafts if it still does not", type(e).__name__, e)
    return client


async def ready(env: Env) -> str | None:
    """Readiness: the configuration parses and the topology checks pass (boots the coordinator). ->
    a note for /readyz while the loaded knot version is served unverified (the bucket's version
    check failed), else None."""
    source = (await coordinator_for(env)).metrics.source
    return None if source is None else source.bucket_check.note(source.etag)


async def _counted(co: Coordinator, endpoint: str, run: Callable[[], Awaitable[Response]]) -> Response:
    """Run an endpoint and count it by status (a streamed reply counts as its status line)."""
    try:
        resp = await run()
    except Exception as e:
        co.metrics.requests.labels(endpoint, str(status_for(e))).inc()
        raise
    co.metrics.requests.labels(endpoint, str(resp.status)).inc()
    return resp


async def _generate(request: Request, co: Coordinator, ctx) -> Response:
    g = parse_generate(await off_loop(request.json))
    gen = await off_loop(co.prepare, g)
    async with co.slot(gen):
        async for _ in co.events(gen, ctx):
            pass
    return Response.from_json(summary(gen), headers=policy_headers(gen))


async def _tokenize(request: Request, co: Coordinator) -> Response:
    """POST /tokenize -> {"count", "max_model_len", "tokens"}: the ids a generation of the same prompt
    would run on (Coordinator.encode, its 400s included); POST /detokenize -> {"prompt"}. vLLM's shapes."""
    body = await off_loop(request.json)
    if request.path == "/detokenize":
        ids = parse_detokenize(body, co.cfg.vocab_size, co.context_tokens)
        return Response.from_json({"prompt": await off_loop(co.tokenizer.decode, ids)})
    g, add_generation_prompt = parse_tokenize(body)
    ids, _ = await off_loop(co.encode, g, add_generation_prompt)
    return Response.from_json({"count": len(ids), "max_model_len": co.context_tokens, "tokens": ids})


def _authorized(request: Request, env: Env) -> None:
    """With KNOT_API_KEY set, the request must carry `Authorization: Bearer <key>`; 401 otherwise."""
    key = read(env, "KNOT_API_KEY", "coordinator")
    if not key:
        return
    scheme, _, given = request.headers.get("Authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not given:
        raise InvalidAPIKey("this server needs an API key: send Authorization: Bearer <key>")
    if not hmac.compare_digest(given.strip().encode(), key.encode()):
        raise InvalidAPIKey("incorrect API key provided")


async def _openai(request: Request, env: Env, ctx) -> Response:
    """The /v1 routes; every error in OpenAI's shape."""
    path, method = request.path.rstrip("/"), request.method
    routes = {"/v1/completions": "POST", "/v1/chat/completions": "POST", "/v1/models": "GET"}
    try:
        _authorized(request, env)
        want = routes.get(path, "GET" if path.startswith("/v1/models/") else None)
        if want is None:
            raise NotFound(f"{method} {request.path}: no such endpoint; the coordinator serves POST /v1/completions, "
                           f"POST /v1/chat/completions, GET /v1/models")
        if method != want:
            raise MethodNotAllowed(f"{method} {request.path}: use {want}")
        if method == "POST":  # the completions; their trace holds the bucket's version check too
            parse = openai_api.parse_chat if path == "/v1/chat/completions" else openai_api.parse_completion
            endpoint = "chat_completions" if path == "/v1/chat/completions" else "completions"

            async def complete() -> Response:
                co = await coordinator_for(env, check_version=True)

                async def run() -> Response:
                    session_affinity.set(_affinity(request))
                    g, opts = parse(await off_loop(request.json))
                    return await openai_api.complete(co, g, opts, ctx)

                return await _counted(co, endpoint, run)

            return await console.traced(request, f"POST {path}", complete)
        co = await coordinator_for(env)
        if path == "/v1/models":
            return openai_api.models(co)
        if path.startswith("/v1/models/"):
            if path.removeprefix("/v1/models/") != co.model_id:
                raise NotFound(f"model {path.removeprefix('/v1/models/')!r} does not exist; this server has "
                               f"{co.model_id!r}")
        return Response.from_json(openai_api.model_card(co))
    except Exception as e:  # noqa: BLE001 - OpenAI's error shape, with the runtime's status mapping
        if status_for(e) >= 500:
            log.warning("%s %s failed: %s: %s", method, request.path, type(e).__name__, e)
        return openai_error_response(e)


def _affinity(request: Request) -> bytes | None:
    """X-Session-Affinity: requests that carry the same value share station replicas, so a session's
    prompts find the blocks the earlier ones left (pipeline.ReplicaSet.choose)."""
    hint = request.headers.get(AFFINITY_HEADER)
    if hint is None:
        return None
    raw = hint.encode("utf-8", "surrogateescape")
    if not raw.strip() or len(raw) > MAX_AFFINITY_BYTES:
        raise BadRequest(f"{AFFINITY_HEADER}: {len(raw)} bytes; give 1 to {MAX_AFFINITY_BYTES} bytes naming the "
                         f"session, or leave the header out")
    return b"hint:" + raw


async def fetch(request: Request, env: Env, ctx) -> Response:
    # this invocation's subrequests, counted through the bindings (counted() at boot) and bounded
    subrequests.begin(read(env, "SUBREQUEST_LIMIT", "coordinator"))
    path = request.path
    if path.startswith("/v1/"):
        return await _openai(request, env, ctx)
    if path == "/" and request.method == "GET":
        # The page is code, no data: everything it shows comes through the endpoints below, each with
        # the API key, which its login form keeps in the tab's sessionStorage (docs/operations.md).
        return console.page_response()
    _authorized(request, env)
    # a request's trace holds the bucket's version check (and a boot or reload, if it waits for one)
    if path == "/generate" and request.method == "POST":
        async def generate() -> Response:
            session_affinity.set(_affinity(request))
            co = await coordinator_for(env, check_version=True)
            return await _counted(co, "generate", lambda: _generate(request, co, ctx))

        return await console.traced(request, "POST /generate", generate)
    if path in ("/tokenize", "/detokenize") and request.method == "POST":
        async def tokenize() -> Response:
            co = await coordinator_for(env, check_version=True)
            return await _counted(co, path.lstrip("/"), lambda: _tokenize(request, co))

        return await console.traced(request, f"POST {path}", tokenize)
    if path == "/metrics" and request.method == "GET":
        co = await coordinator_for(env)
        await co.metrics.gather(co.pipeline)
        co.note_station_stats(co.metrics.services.stations)
        co.metrics.note_row_cache(co.pipeline)
        return co.metrics.exposition()
    if path == "/topology" and request.method == "GET":
        co = await coordinator_for(env)
        return Response.from_json({
            "stations": [{"index": i, "replicas": [r.binding for r in rs.replicas]}
                         for i, rs in enumerate(co.pipeline.station_sets)],
            "shards": [{"index": s.index, "vocab_start": s.vocab_start, "vocab_end": s.vocab_end,
                        "replicas": [r.binding for r in rs.replicas]} for s, rs in co.pipeline.shard_sets],
            "hparams": {"n_layer": co.cfg.n_layer, "dim": co.cfg.dim, "vocab_size": co.cfg.vocab_size,
                        "context_length": co.cfg.context_length},
            "max_sequence_tokens": co.context_tokens,
        })
    if console.serves(request):
        return await console.fetch(request, env, lambda: coordinator_for(env))
    raise NotFound(f"{request.method} {path}: the coordinator serves POST /generate, POST /v1/completions, "
                   f"POST /v1/chat/completions, GET /v1/models, POST /tokenize, POST /detokenize, GET /metrics, "
                   f"GET /topology, GET /traces, GET / (the cluster page), GET /cluster")
