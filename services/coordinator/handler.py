"""Coordinator: the public API. Tokenizes, fans embeddings out to the shards, chains the
stations, gathers the LM-head slices and samples (seed sections 1-3).

    POST /generate   {"prompt": str | "messages": [...], "max_tokens", sampling params, "stop"}
                     -> {"text", "tokens", "prompt_tokens", "finish_reason", "timings",
                         "degraded_shards", "replays", "usage"}
    GET  /topology   the stations and shards it chains

Env: KNOT_KEY; STATIONS = binding names in chain order ("STATION_0,STATION_1");
SHARDS = "BINDING:START-END,..." (must tile [0, vocab)); SHARD_TIMEOUT_S, STATION_TIMEOUT_S,
STATION_RETRY_S (how long an unreachable station is retried);
bindings KNOT_BUCKET and the named service bindings.
"""
from __future__ import annotations

import logging
import time
import uuid
from dataclasses import dataclass

from common.generation import StopText
from common.knot import TOKENIZER_BLOB, decode_tokenizer_blob
from common.kvcache import prefill_chunks
from common.qwen2 import Qwen2Config
from common.runtime import BadRequest, Env, NotFound, Request, Response, ServiceUnavailable
from common.sampling import Sampler
from common.tokenizer import Tokenizer
from common.topology import ShardSpec, StationSpec, TopologyError, check_station_chain, check_vocab_tiling, parse_range
from services.coordinator.params import GenerateRequest, parse_generate
from services.coordinator.pipeline import Degradation, Hops, Pipeline, SessionLost
from services.boot import BootCache
from services.knot_source import KnotSource

log = logging.getLogger(__name__)

MAX_REPLAYS = 3


@dataclass(frozen=True)
class CoordinatorSettings:
    knot_key: str
    stations: tuple[str, ...]
    shards: tuple[tuple[str, int, int], ...]  # (binding, vocab_start, vocab_end)
    shard_timeout_s: float
    station_timeout_s: float
    station_retry_s: float

    @classmethod
    def from_env(cls, env: Env) -> "CoordinatorSettings":
        def need(name: str) -> str:
            v = env.get(name)
            if v is None or str(v).strip() == "":
                raise TopologyError(f"coordinator config {name!r} is missing, and has no default")
            return str(v)

        stations = tuple(s.strip() for s in need("STATIONS").split(",") if s.strip())
        shards = []
        for item in need("SHARDS").split(","):
            name, _, rng = item.strip().partition(":")
            if not rng:
                raise TopologyError(f"SHARDS entry {item!r}: expected BINDING:START-END")
            a, b = parse_range(rng, f"SHARDS entry {item!r}")
            shards.append((name, a, b))
        return cls(need("KNOT_KEY"), stations, tuple(shards), float(env.get("SHARD_TIMEOUT_S", 30)),
                   float(env.get("STATION_TIMEOUT_S", 300)), float(env.get("STATION_RETRY_S", 60)))


class Coordinator:
    def __init__(self, settings: CoordinatorSettings, cfg: Qwen2Config, tokenizer: Tokenizer, pipeline: Pipeline):
        self.settings, self.cfg, self.tokenizer, self.pipeline = settings, cfg, tokenizer, pipeline

    async def generate(self, g: GenerateRequest, ctx) -> dict:
        tok, cfg = self.tokenizer, self.cfg
        prompt_ids = tok.encode(tok.render_chat(g.messages) if g.messages is not None else g.prompt)
        if not prompt_ids:
            raise BadRequest("the prompt encodes to no tokens")
        if len(prompt_ids) + g.max_tokens > cfg.context_length:
            raise BadRequest(f"prompt of {len(prompt_ids)} tokens + max_tokens {g.max_tokens} exceeds the context "
                             f"length {cfg.context_length}")
        rid = uuid.uuid4().hex
        hops, degraded, replays = Hops(), [], 0
        sampler = Sampler(g.sampling)
        stream = tok.stream(skip_special=True)
        stop = StopText(g.stop)
        out_ids: list[int] = []
        history = list(prompt_ids)
        finish = "length"
        t0 = time.perf_counter()
        try:
            logits = await self._prefill(rid, history, hops, degraded)
            t_first = time.perf_counter()
            for i in range(g.max_tokens):
                tid = sampler(logits, history)
                if tid in tok.eog_ids:
                    finish = "stop"
                    break
                out_ids.append(tid)
                history.append(tid)
                _, stopped = stop.push(stream.push(tid))
                if stopped:
                    finish = "stop"
                    break
                if i + 1 == g.max_tokens:
                    break
                try:
                    logits = await self._step(rid, tid, len(history) - 1, hops, degraded)
                except SessionLost as e:
                    # A station restarted or evicted us: replay everything so far as one prefill.
                    replays += 1
                    if replays > MAX_REPLAYS:
                        raise ServiceUnavailable(f"request {rid}: stations lost the session {replays} times: {e}")
                    log.warning("request %s: %s; replaying %d tokens", rid, e, len(history))
                    logits = await self._prefill(rid, history, hops, degraded)
            if not stop.stopped:
                stop.finish(stream.flush())
        finally:
            ctx.wait_until(self.pipeline.release(rid))  # free the stations' KV caches after the response
        t_end = time.perf_counter()
        n_decode = max(0, len(out_ids) - 1)
        return {
            "id": rid,
            "text": stop.text,
            "tokens": out_ids,
            "prompt_tokens": prompt_ids,
            "finish_reason": finish,
            "usage": {"prompt_tokens": len(prompt_ids), "completion_tokens": len(out_ids),
                      "total_tokens": len(prompt_ids) + len(out_ids)},
            "timings": {"time_to_first_token_ms": round((t_first - t0) * 1e3, 3),
                        "decode_ms": round((t_end - t_first) * 1e3, 3),
                        "decode_tok_s": round(n_decode / (t_end - t_first), 3) if n_decode and t_end > t_first else None,
                        "hops": hops.summary()},
            "degraded_shards": [d.as_json() for d in degraded],
            "replays": replays,
        }

    async def _prefill(self, rid: str, ids: list[int], hops: Hops, degraded: list[Degradation]):
        h = None
        for a, b in prefill_chunks(len(ids)):
            x = await self.pipeline.embed(rid, ids[a:b], a, hops, degraded)
            for attempt in range(2):
                try:
                    h = await self.pipeline.stations_forward(rid, "prefill", a, x, hops)
                    break
                except SessionLost:
                    # a station restarted between our chunks: start over from position 0
                    if attempt or a == 0:
                        raise
                    return await self._prefill(rid, ids, hops, degraded)
        return await self.pipeline.logits(rid, h, len(ids) - 1, hops, degraded)

    async def _step(self, rid: str, tid: int, pos: int, hops: Hops, degraded: list[Degradation]):
        x = await self.pipeline.embed(rid, [tid], pos, hops, degraded)
        h = await self.pipeline.stations_forward(rid, "decode", pos, x, hops)
        return await self.pipeline.logits(rid, h, pos, hops, degraded)


_booted: BootCache[Coordinator] = BootCache()


async def coordinator_for(env: Env) -> Coordinator:
    try:
        settings = CoordinatorSettings.from_env(env)
    except TopologyError as e:
        raise ServiceUnavailable(f"coordinator config: {e}") from None

    async def boot() -> Coordinator:
        source = KnotSource(env.KNOT_BUCKET, settings.knot_key)
        header = await source.header()
        cfg = Qwen2Config.from_hparams(header.hparams)
        shards = [ShardSpec(i, a, b) for i, (_, a, b) in enumerate(settings.shards)]
        check_vocab_tiling(shards, cfg.vocab_size)
        bindings = {i: getattr(env, name) for i, (name, _, _) in enumerate(settings.shards)}
        ordered = [(s, bindings[s.index]) for s in sorted(shards, key=lambda s: s.vocab_start)]
        stations = [getattr(env, name) for name in settings.stations]
        await _check_stations(stations, cfg.n_layer)
        a, b = header.blob_range(TOKENIZER_BLOB)
        tokenizer = Tokenizer(decode_tokenizer_blob(await source.read(a, b), header.blobs[TOKENIZER_BLOB].encoding))
        log.info("coordinator booted: %d stations, %d shards, vocab %d", len(stations), len(shards), cfg.vocab_size)
        return Coordinator(settings, cfg, tokenizer,
                           Pipeline(stations, ordered, cfg.dim, cfg.vocab_size, settings.shard_timeout_s,
                                    settings.station_timeout_s, settings.station_retry_s))

    try:
        return await _booted.get(repr(settings), boot)
    except TopologyError as e:  # a misconfigured cluster: not the client's fault, and not ready
        raise ServiceUnavailable(f"coordinator topology: {e}") from None


async def _check_stations(stations: list, n_layers: int) -> None:
    """Ask each station for its layer range; together they must chain [0, n_layers)."""
    if not stations:
        raise TopologyError("STATIONS is empty: need at least 1 station")
    specs = []
    for i, st in enumerate(stations):
        resp = await st.fetch(Request("GET", "https://peer/stats"))
        if not resp.ok:
            raise ServiceUnavailable(f"station {i} /stats: HTTP {resp.status}: {resp.body[:200]!r}")
        s = resp.json()
        specs.append(StationSpec(i, int(s["layer_start"]), int(s["layer_end"]), str(s["role"])))
    check_station_chain(specs, n_layers)


async def ready(env: Env) -> None:
    """Readiness: the configuration parses and the topology checks pass (boots the coordinator)."""
    await coordinator_for(env)


async def fetch(request: Request, env: Env, ctx) -> Response:
    path = request.path
    if path == "/generate" and request.method == "POST":
        g = parse_generate(request.json())
        co = await coordinator_for(env)
        return Response.from_json(await co.generate(g, ctx))
    if path == "/topology" and request.method == "GET":
        co = await coordinator_for(env)
        return Response.from_json({
            "stations": list(co.settings.stations),
            "shards": [{"index": s.index, "vocab_start": s.vocab_start, "vocab_end": s.vocab_end}
                       for s, _ in co.pipeline.shards],
            "hparams": {"n_layer": co.cfg.n_layer, "dim": co.cfg.dim, "vocab_size": co.cfg.vocab_size,
                        "context_length": co.cfg.context_length},
        })
    raise NotFound(f"{request.method} {path}: the coordinator serves POST /generate, GET /topology")
