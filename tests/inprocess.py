"""A whole cluster in one process with embedded bindings, for unit tests of the pipeline:
any number of stations and shards, the same handlers as the real processes."""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from common.integrity import CacheKey
from common.models import model_for
from common.runtime import Env, Request, Response
from common.topology import split_layers, split_vocab
from deploy.local.durable import DurableObjectHost, LocalNamespace
from deploy.local.embedded_bindings import DirectoryBucket, LocalService, MemoryKV
from deploy.local.tasks import BackgroundTasks
from services.coordinator import handler as coordinator
from services.drafter import handler as drafter
from services.shard import handler as shard
from services.station import handler as station
from services.cobordism_warden import CobordismWarden
from services.layer_warden import LayerWarden

KNOT_KEY = "model.knot"
INTERNAL_SECRET = "the-in-process-clusters-internal-secret-43ch"  # what keys the KV rows (KNOT_INTERNAL_SECRET)
KV_KEY = CacheKey(INTERNAL_SECRET)  # the key a test reads and forges KV rows with
DRAFT_KEY = "draft.knot"
# A station budget just above what short prompts of the tiny synthetic model need on a station of
# both its layers (matmul's tile, one phase's tensors, a KV block, the activations): the stations
# keep little between phases and stream the rest from their wardens (fluid).
FLUID_BUDGET_BYTES = 1792 << 10
# The same for a station of one tiny layer (two stations): about the least its forwards need
# (1,330,176 bytes, bisected), so every decode step reads most of its phases again, where 1792 KiB
# would keep the whole layer.
FLUID_ONE_LAYER_BUDGET_BYTES = 1344 << 10


@dataclass
class Cluster:
    coordinator: LocalService
    stations: list[LocalService]
    shards: list[LocalService]
    station_envs: list[Env]
    bucket: DirectoryBucket
    kv: MemoryKV
    tasks: BackgroundTasks
    layer_wardens: DurableObjectHost
    cobordism_wardens: DurableObjectHost
    shard_ranges: list[tuple[int, int]] = field(default_factory=list)

    async def generate(self, **body) -> Response:
        return await self.coordinator.fetch(Request("POST", "https://coordinator/generate",
                                                    {"Content-Type": "application/json"}, json.dumps(body).encode()))

    async def drain(self) -> None:
        await self.tasks.drain()


async def build_cluster(knot_path: Path, tmp: Path, n_stations: int = 2, n_shards: int = 8,
                        station_budget_bytes: int = 128 << 20, wardens: bool = True,
                        station_vars: dict | None = None, draft_knot: Path | None = None,
                        coordinator_vars: dict | None = None, drafter_vars: dict | None = None,
                        shard_vars: dict | None = None) -> Cluster:
    """draft_knot: also a drafter serving that model (with drafter_vars), bound to the coordinator as DRAFTER."""
    from deploy.knotfile import open_model

    cfg = model_for(open_model(knot_path).header).cfg
    for svc in (station, shard, coordinator, drafter):  # a new cluster starts with fresh isolates
        svc._booted.clear()
    bucket = DirectoryBucket(tmp / "bucket")
    await bucket.put(KNOT_KEY, knot_path.read_bytes())
    kv = MemoryKV()
    tasks = BackgroundTasks("test wait_until")
    base = {"KNOT_BUCKET": bucket}
    lw = DurableObjectHost({"LayerWarden": LayerWarden}, tasks, Env(base))
    cw = DurableObjectHost({"CobordismWarden": CobordismWarden}, tasks,
                           Env({**base, "EMBED_CACHE": kv}, {"KNOT_INTERNAL_SECRET": INTERNAL_SECRET}))
    bindings: dict = {}
    stations, station_envs = [], []
    for s in split_layers(cfg.n_layer, n_stations):
        env = Env({**base, **({"LAYER_WARDEN": LocalNamespace(lw, "LayerWarden")} if wardens else {})},
                  {"KNOT_KEY": KNOT_KEY, "SPECIALIZATION_START_LAYER": str(s.layer_start),
                   "SPECIALIZATION_END_LAYER": str(s.layer_end), "SPECIALIZATION_ROLE": s.role,
                   "MEMORY_BUDGET_BYTES": str(station_budget_bytes), **(station_vars or {})})
        station_envs.append(env)
        stations.append(LocalService(station.fetch, env, tasks))
        bindings[f"STATION_{s.index}"] = stations[-1]
    shards, ranges = [], []
    for s in split_vocab(cfg.vocab_size, n_shards):
        env = Env({**base, **({"COBORDISM_WARDEN": LocalNamespace(cw, "CobordismWarden")} if wardens else {})},
                  # No warm-up unless a test asks (shard_vars): the tier tests count the warden's misses,
                  # KV reads and writes, and a warm-up racing their requests would make those counts
                  # depend on the event loop's order.
                  {"KNOT_KEY": KNOT_KEY, "VOCAB_START": str(s.vocab_start), "VOCAB_END": str(s.vocab_end),
                   "WARM_WARDEN": "off", **(shard_vars or {})})
        shards.append(LocalService(shard.fetch, env, tasks))
        bindings[f"SHARD_{s.index}"] = shards[-1]
        ranges.append((s.vocab_start, s.vocab_end))
    if draft_knot is not None:
        await bucket.put(DRAFT_KEY, draft_knot.read_bytes())
        bindings["DRAFTER"] = LocalService(drafter.fetch, Env(base, {"KNOT_KEY": DRAFT_KEY, **(drafter_vars or {})}),
                                          tasks)
    co_env = Env({**base, **bindings}, {
        "KNOT_KEY": KNOT_KEY,
        "STATIONS": ",".join(f"STATION_{i}" for i in range(len(stations))),
        "SHARDS": ",".join(f"SHARD_{i}:{a}-{b}" for i, (a, b) in enumerate(ranges)),
        **(coordinator_vars or {}),
    })
    return Cluster(LocalService(coordinator.fetch, co_env, tasks), stations, shards, station_envs, bucket, kv,
                   tasks, lw, cw, ranges)
