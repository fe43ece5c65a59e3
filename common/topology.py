"""Cluster topology as data: layer ranges of stations, vocabulary slices of shards (seed section 1).

Pure functions, tested by exact equality.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Sequence

from common.settings import TABLE, default_text

ROLES = TABLE["SPECIALIZATION_ROLE"].choices  # entry, middle, exit, solo


class TopologyError(ValueError):
    pass


@dataclass(frozen=True)
class StationSpec:
    index: int
    layer_start: int
    layer_end: int  # exclusive
    role: str  # entry / middle / exit; "solo" when one station holds every layer

    @property
    def n_layers(self) -> int:
        return self.layer_end - self.layer_start


@dataclass(frozen=True)
class ShardSpec:
    index: int
    vocab_start: int
    vocab_end: int  # exclusive

    def owns(self, token: int) -> bool:
        return self.vocab_start <= token < self.vocab_end

    @property
    def n_rows(self) -> int:
        return self.vocab_end - self.vocab_start


def role_of(index: int, n_stations: int) -> str:
    if n_stations == 1:
        return "solo"
    return "entry" if index == 0 else "exit" if index == n_stations - 1 else "middle"


def split_layers(n_layers: int, n_stations: int = 2) -> list[StationSpec]:
    """Contiguous, near-equal layer ranges: 24 layers / 2 -> [0,12) [12,24); 28 / 2 -> [0,14) [14,28)."""
    if not 1 <= n_stations <= n_layers:
        raise TopologyError(f"{n_stations} stations for {n_layers} layers: need 1 <= stations <= layers")
    bounds = [n_layers * i // n_stations for i in range(n_stations + 1)]
    return [StationSpec(i, bounds[i], bounds[i + 1], role_of(i, n_stations)) for i in range(n_stations)]


def split_vocab(vocab_size: int, n_shards: int = 8) -> list[ShardSpec]:
    """Contiguous vocabulary slices: 151,936 / 8 = 18,992 rows each; a remainder goes to the last ones."""
    if not 1 <= n_shards <= vocab_size:
        raise TopologyError(f"{n_shards} shards for a vocabulary of {vocab_size}")
    bounds = [vocab_size * i // n_shards for i in range(n_shards + 1)]
    return [ShardSpec(i, bounds[i], bounds[i + 1]) for i in range(n_shards)]


def check_station_chain(stations: Sequence[StationSpec], n_layers: int) -> None:
    """Stations must chain [0, n_layers) in order, each non-empty."""
    if not stations:
        raise TopologyError("no stations configured: need at least 1")
    at = 0
    for s in stations:
        if s.layer_start != at:
            raise TopologyError(f"station {s.index} starts at layer {s.layer_start}, expected {at} "
                                f"(stations must chain [0, {n_layers}) with no gap or overlap)")
        if s.layer_end <= s.layer_start:
            raise TopologyError(f"station {s.index} has an empty layer range [{s.layer_start}, {s.layer_end})")
        at = s.layer_end
    if at != n_layers:
        raise TopologyError(f"stations end at layer {at}, the model has {n_layers}")


def check_vocab_tiling(shards: Iterable[ShardSpec], vocab_size: int) -> list[ShardSpec]:
    """Shard ranges must tile [0, vocab_size) with no gap and no overlap. Returns them sorted."""
    ordered = sorted(shards, key=lambda s: (s.vocab_start, s.vocab_end))
    if not ordered:
        raise TopologyError("no shards configured: need at least 1")
    at = 0
    for s in ordered:
        if s.vocab_end <= s.vocab_start:
            raise TopologyError(f"shard {s.index} has an empty range [{s.vocab_start}, {s.vocab_end})")
        if s.vocab_start > at:
            raise TopologyError(f"vocabulary gap: tokens [{at}, {s.vocab_start}) belong to no shard")
        if s.vocab_start < at:
            raise TopologyError(f"vocabulary overlap: shard {s.index} starts at {s.vocab_start}, "
                                f"tokens before {at} already belong to another shard")
        at = s.vocab_end
    if at != vocab_size:
        raise TopologyError(f"vocabulary gap: tokens [{at}, {vocab_size}) belong to no shard"
                            if at < vocab_size else
                            f"shards reach token {at}, beyond the vocabulary of {vocab_size}")
    return ordered


def parse_range(text: str, what: str = "range") -> tuple[int, int]:
    """'a-b' or 'a:b' -> (a, b), b exclusive."""
    for sep in ("-", ":"):
        if sep in text:
            a, b = text.split(sep, 1)
            try:
                return int(a), int(b)
            except ValueError:
                break
    raise TopologyError(f"{what} {text!r}: expected START-END with integers, END exclusive")


# ---------------------------------------------------------------- the cluster layout
# One object, built from the model's dimensions and the counts of stations and shards, from which
# every deployment file is written: docker-compose.yml (deploy/compose_writer.py), the launcher's
# processes (deploy/launcher.py) and, later, the wrangler configs. Plain data: a writer renders a
# service's role, vars, bindings and dependencies in its own terms.

SERVICE_ROLES = ("bucket", "kv", "init", "layer_warden", "cobordism_warden", "station", "shard", "drafter",
                 "coordinator")
BINDING_KINDS = ("bucket", "kv", "durable_object", "service")
CONDITIONS = ("started", "healthy", "completed")  # what a dependency must have reached first
BUCKET_NAME = "knots"


@dataclass(frozen=True)
class Knob:
    """A value the deployer may override at deploy time (compose: ${NAME:-default}).

    NAME is declared in the settings table (a compose mirror: deploy/deploy_settings.py); default None:
    the table's default for "compose"."""

    name: str
    default: str | None = None


@dataclass(frozen=True)
class Binding:
    name: str  # what the handler reads from env, e.g. "LAYER_WARDEN"
    kind: str  # one of BINDING_KINDS
    service: str  # the service behind it: the store (bucket, kv), the Durable Object's host, the peer
    resource: str = ""  # the bucket's name, the KV namespace or the Durable Object class


@dataclass(frozen=True)
class Service:
    name: str  # e.g. "station-1"
    role: str  # one of SERVICE_ROLES
    module: str | None  # the handler module (KNOT_SERVICE); None for stores and the init job
    vars: dict  # name -> str | Knob: the handler's plain vars
    bindings: tuple[Binding, ...] = ()
    durable_objects: tuple[str, ...] = ()  # Durable Object classes this service hosts
    depends_on: dict = field(default_factory=dict)  # service -> one of CONDITIONS
    public: bool = False  # the one service with a public address

    @property
    def is_worker(self) -> bool:
        return self.module is not None


MAX_REPLICAS = 8


def replica_name(base: str, k: int, sep: str = "-r") -> str:
    """Replica k of a service or binding: replica 0 keeps the name (station-0, STATION_0), the others
    add their index (station-0-r1, STATION_0_R1)."""
    return base if k == 0 else f"{base}{sep}{k}"


def replica_service(binding: str) -> str:
    """The service behind a station's or shard's binding: STATION_1_R1 -> station-1-r1 (replica_name's inverse)."""
    return binding.lower().replace("_r", "-r").replace("_", "-")


def _dims(model) -> tuple[int, int]:
    """(n_layers, vocab_size) from hparams (block_count, vocab_size) or a config object."""
    if isinstance(model, dict):
        return int(model["block_count"]), int(model["vocab_size"])
    for layers in ("n_layer", "n_layers", "block_count"):
        if hasattr(model, layers):
            return int(getattr(model, layers)), int(model.vocab_size)
    raise TypeError(f"{type(model).__name__}: need hparams or a config with n_layer and vocab_size")


@dataclass(frozen=True)
class ClusterLayout:
    n_layers: int
    vocab_size: int
    stations: tuple[StationSpec, ...]
    shards: tuple[ShardSpec, ...]
    services: tuple[Service, ...]  # in start order: a service after everything it depends on
    replicas: int = 1  # processes serving each station range and each shard slice

    @classmethod
    def build(cls, model, n_stations: int = 2, n_shards: int = 8, *, knot_key: str = "model.knot",
              model_source: str = "", draft_knot_key: str | None = None, draft_source: str = "",
              replicas: int = 1) -> "ClusterLayout":
        """The cluster for a model (hparams or config) split over n_stations and n_shards.

        replicas: processes per station range and per shard slice: station-0, station-0-r1, ...
        (bindings STATION_0, STATION_0_R1, ...); the coordinator spreads generations over them and
        moves a generation to another replica when one fails (services/coordinator/pipeline.py).

        knot_key: the object key of its .knot; model_source: what the init job fetches (a name or path).
        draft_knot_key, draft_source: a draft model for speculative decoding (the drafter service,
        uploaded by its own init job, bound to the coordinator as DRAFTER); None: no drafter.
        TopologyError when the counts do not fit the model (1 <= stations <= layers, 1 <= shards <= vocab)."""
        n_layers, vocab = _dims(model)
        if not 1 <= replicas <= MAX_REPLICAS:
            raise TopologyError(f"{replicas} replicas: need 1 <= replicas <= {MAX_REPLICAS}")
        stations = tuple(split_layers(n_layers, n_stations))
        shards = tuple(split_vocab(vocab, n_shards))
        key = Knob("KNOT_KEY", knot_key)
        pin = Knob("KNOT_DIGEST", "")  # the knot's digest the services serve; empty: the first they load
        bucket = Binding("KNOT_BUCKET", "bucket", "minio", BUCKET_NAME)
        layer_ns = Binding("LAYER_WARDEN", "durable_object", "layer-warden", "LayerWarden")
        row_ns = Binding("COBORDISM_WARDEN", "durable_object", "cobordism-warden", "CobordismWarden")
        def dflt(name: str, reader: str) -> str:  # the table's default, written out as today's files do
            return default_text(name, reader)

        services = [
            Service("minio", "bucket", None, {}),
            Service("redis", "kv", None, {}),
            Service("init", "init", None, {"KNOT_MODEL": Knob("KNOT_MODEL", model_source), "KNOT_KEY": key,
                                           "KNOT_DIGEST": pin},
                    (bucket,), depends_on={"minio": "healthy"}),
            Service("layer-warden", "layer_warden", "services.layer_warden",
                    {"MEMORY_BUDGET_BYTES": Knob("KNOT_LAYER_WARDEN_BUDGET_BYTES"), "KNOT_DIGEST": pin},
                    (bucket, layer_ns), ("LayerWarden",),
                    {"init": "completed"}),
            Service("cobordism-warden", "cobordism_warden", "services.cobordism_warden",
                    {"MEMORY_BUDGET_BYTES": dflt("MEMORY_BUDGET_BYTES", "cobordism_warden"), "KNOT_DIGEST": pin},
                    (bucket, Binding("EMBED_CACHE", "kv", "redis", "embed-cache"), row_ns), ("CobordismWarden",),
                    {"init": "completed", "redis": "healthy"}),
        ]
        for s in stations:
            for k in range(replicas):
                services.append(Service(replica_name(f"station-{s.index}", k), "station", "services.station", {
                    "KNOT_KEY": key, "KNOT_DIGEST": pin, "SPECIALIZATION_START_LAYER": str(s.layer_start),
                    "SPECIALIZATION_END_LAYER": str(s.layer_end), "SPECIALIZATION_ROLE": s.role,
                    "MEMORY_BUDGET_BYTES": Knob("STATION_MEMORY_BUDGET_BYTES"),
                    "MEMORY_PROFILE": Knob("KNOT_PROFILE"), "RESIDENT_MAX_BYTES": Knob("KNOT_RESIDENT_MAX_BYTES"),
                    "SESSION_TTL_S": dflt("SESSION_TTL_S", "station"),
                    "MAX_BATCH": dflt("MAX_BATCH", "station"), "PREFETCH": Knob("KNOT_PREFETCH"),
                    "INTERLEAVE_ROWS": Knob("KNOT_INTERLEAVE_ROWS")},
                    (bucket, layer_ns), depends_on={"layer-warden": "healthy"}))
        for s in shards:
            for k in range(replicas):
                services.append(Service(replica_name(f"shard-{s.index}", k), "shard", "services.shard", {
                    "KNOT_KEY": key, "KNOT_DIGEST": pin, "VOCAB_START": str(s.vocab_start),
                    "VOCAB_END": str(s.vocab_end), "MEMORY_BUDGET_BYTES": dflt("MEMORY_BUDGET_BYTES", "shard"),
                    "ROW_CACHE_BYTES": dflt("ROW_CACHE_BYTES", "shard"), "WARM_WARDEN": Knob("KNOT_WARM_WARDEN")},
                    (bucket, row_ns), depends_on={"cobordism-warden": "healthy"}))
        def replicas_of(kind: str, index: int) -> list[tuple[str, str]]:  # (binding, service) per replica
            return [(replica_name(f"{kind.upper()}_{index}", k, "_R"), replica_name(f"{kind}-{index}", k, "-r"))
                    for k in range(replicas)]

        peers = [p for s in stations for p in replicas_of("station", s.index)] + \
                [p for s in shards for p in replicas_of("shard", s.index)]
        if draft_knot_key is not None:
            services.insert(3, Service("init-draft", "init", None, {
                "KNOT_MODEL": Knob("KNOT_DRAFT_MODEL", draft_source), "KNOT_KEY": draft_knot_key,
                "KNOT_DIGEST": ""},  # the pin is the model's, not the draft model's
                (bucket,), depends_on={"minio": "healthy"}))
            services.append(Service("drafter", "drafter", "services.drafter", {
                "KNOT_KEY": draft_knot_key, "MEMORY_BUDGET_BYTES": dflt("MEMORY_BUDGET_BYTES", "drafter"),
                "DRAFT_HEAD_IDS": Knob("DRAFT_HEAD_IDS")},
                (bucket,), depends_on={"init-draft": "completed"}))
            peers.append(("DRAFTER", "drafter"))
        services.append(Service("coordinator", "coordinator", "services.coordinator", {
            "KNOT_KEY": key, "KNOT_DIGEST": pin,
            "STATIONS": ",".join("|".join(b for b, _ in replicas_of("station", s.index)) for s in stations),
            "SHARDS": ",".join("|".join(b for b, _ in replicas_of("shard", s.index)) + f":{s.vocab_start}-{s.vocab_end}"
                               for s in shards),
            **{n: dflt(n, "coordinator") for n in ("SHARD_TIMEOUT_S", "STATION_TIMEOUT_S", "DRAFTER_TIMEOUT_S",
                                                   "RETRY_AFTER_S", "SPECULATION", "BUCKET_CHECK_TIMEOUT_S",
                                                   "BUCKET_CHECK_BACKOFF_S")},
            # what a deployer chooses per cluster: how long to wait for a restart, the deadline, the
            # shard-failure policy, the public API's key, how many generations at once (replicas
            # serve more)
            **{n: Knob(n) for n in ("PEER_WAIT_S", "REQUEST_TIMEOUT_S", "SHARD_FAILURE", "KNOT_API_KEY",
                                    "SHARD_SAMPLE_TOP", "EMBED_ROW_CACHE_BYTES", "MAX_CONCURRENT_REQUESTS",
                                    "MAX_QUEUED_REQUESTS", "STEP_BATCH")},
            "SPEC_MAX_DRAFT": Knob("SPEC_MAX_DRAFT", ""),  # empty: by source (common/speculative.DEFAULT_MAX_DRAFT)
            "MODEL_NAME": Knob("KNOT_MODEL_NAME")},
            (bucket, *(Binding(b, "service", peer) for b, peer in peers)),
            depends_on={peer: "healthy" for _, peer in peers}, public=True))
        return cls(n_layers, vocab, stations, shards, tuple(services), replicas)

    def service(self, name: str) -> Service:
        for s in self.services:
            if s.name == name:
                return s
        raise KeyError(f"no service {name!r} in the layout ({', '.join(s.name for s in self.services)})")

    def by_role(self, role: str) -> list[Service]:
        return [s for s in self.services if s.role == role]
