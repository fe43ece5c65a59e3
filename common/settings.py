"""Every environment variable the project reads, declared once: name, type, default, readers, meaning.

`read(env, name, reader)` parses one from an injected mapping (os.environ locally, a handler's
Env, the Worker's env on Cloudflare) and raises ConfigError naming the variable. The host runs
`check(env, reader)` before it serves, so a misconfigured service fails at start, not on its
first request. docs/configuration.md is generated from SETTINGS (`knot settings`), and
tests/unit/test_settings.py fails when code reads a variable around this table.

A reader is who reads the variable: a handler ("station", ...), the local host, the compose
file's substitutions, ... (READERS). `read` refuses a reader the table does not list, so the
"read by" column cannot drift from the code.

This module declares what the handlers, the hosts and the kernels read (it runs under Pyodide too).
The deployment tools' variables (compose, docker, the build, the tests, `knot deploy`) are declared in
deploy/deploy_settings.py, which `extend`s the table when deploy/ is imported, so a Worker carries
none of them; among them the compose mirrors, each generated from the handler row it sets.
"""
from __future__ import annotations

import difflib
import re
from dataclasses import dataclass, field, replace
from typing import Any, Mapping

from common.runtime import ServiceUnavailable
from common.speculative import DRAFT_HEAD_IDS, MAX_DRAFT
from common.wire import MAX_SAMPLE_TOP

READERS = {
    "coordinator": "the coordinator handler (a Worker var or binding)",
    "station": "the layer station handler",
    "shard": "the cobordism shard handler",
    "layer_warden": "the LayerWarden Worker and its Durable Objects",
    "cobordism_warden": "the CobordismWarden Worker and its Durable Objects",
    "drafter": "the drafter handler: a small model drafting tokens for speculative decoding",
    "host": "`knot serve`: the local aiohttp host around one handler (deploy/local/)",
    "init": "the compose `init` job: fetch, encode and upload the model once",
    "kernels": "the C matmul kernels, in every `knot` process",
    "models": "the model cache: `knot fetch-model`, init, the tests",
    "launcher": "`knot cluster up` and `knot serve --embedded`",
    "compose": "docker-compose.yml's ${VAR:-default} substitutions (docker compose and `knot cluster up`)",
    "runtime": "Python, glibc or OpenBLAS inside each container (set for them, not read by our code)",
    "tests": "the test suite",
    "bench": "benchmarks/",
    "build": "`pip install` of the C kernels (setup.py)",
    "docker": "scripts/docker-engine.sh, docker-images.sh and test-compose.sh, and the compose override files",
    "deploy": "`knot deploy cloudflare`: the Workers' configs, and the knot's upload to R2 (deploy/r2_upload.py)",
}
HANDLERS = ("coordinator", "station", "shard", "layer_warden", "cobordism_warden", "drafter")
TYPES = ("str", "int", "float", "choice", "names", "binding")


class Required:
    def __repr__(self) -> str:
        return "REQUIRED"


REQUIRED: Any = Required()  # no default: a missing value is a ConfigError


class ConfigError(ServiceUnavailable, ValueError):
    """A missing or invalid setting; the message names the variable. 503 in a handler, exit 1 at start."""

    def __init__(self, message: str, *, name: str | None = None):
        super().__init__(message)
        self.name = name  # the variable, when one is to blame


@dataclass(frozen=True)
class Setting:
    name: str  # "STATION_<i>": a family of names, <i> an integer
    type: str  # one of TYPES
    default: Any  # REQUIRED, None (unset reads as None) or the default as text
    readers: tuple[str, ...]
    meaning: str  # one line
    choices: tuple[str, ...] = ()
    minimum: float | None = None  # inclusive
    maximum: float | None = None  # inclusive
    positive: bool = False  # > 0 (for floats, where a minimum would be inclusive)
    secret: bool = False  # never echoed: not in error messages, not in docs beyond its name
    min_chars: int = 0  # a secret's least length
    reader_defaults: Mapping[str, Any] = field(default_factory=dict)  # where a reader's default differs
    mirror_of: str = ""  # "ROLE NAME": a compose variable that sets the handler variable NAME of every ROLE

    def default_for(self, reader: str) -> Any:
        return self.reader_defaults.get(reader, self.default)

    def parse(self, raw: str) -> Any:
        """Text -> typed value; ConfigError naming the variable."""
        n = self.name
        if self.secret:  # its value never appears in a message
            if len(raw) < self.min_chars:
                raise ConfigError(f"Config {n!r} must be at least {self.min_chars} characters, got {len(raw)}",
                                  name=n)
            return raw
        if self.type == "names":
            return tuple(p.strip() for p in raw.split(",") if p.strip())
        if self.type == "choice":
            if raw not in self.choices:
                raise ConfigError(f"Config {n!r} must be one of {', '.join(self.choices)}, got {raw!r}", name=n)
            return raw
        if self.type not in ("int", "float"):
            return raw
        try:
            v = int(raw) if self.type == "int" else float(raw)
        except ValueError:
            what = "an integer" if self.type == "int" else "a number"
            raise ConfigError(f"Config {n!r} must be {what}, got {raw!r}", name=n) from None
        if self.positive and not v > 0:
            raise ConfigError(f"Config {n!r} must be > 0, got {raw!r}", name=n)
        if self.minimum is not None and v < self.minimum:
            raise ConfigError(f"Config {n!r} must be >= {self.minimum:g}, got {raw!r}", name=n)
        if self.maximum is not None and v > self.maximum:
            raise ConfigError(f"Config {n!r} must be <= {self.maximum:g}, got {raw!r}", name=n)
        return v


def _s(name, type, default, readers, meaning, **kw) -> Setting:
    return Setting(name, type, default, tuple(readers.split()), meaning, **kw)


declare = _s  # a row: name, type, default, readers (space-separated), meaning, **Setting's other fields


MiB = 1 << 20
SETTINGS: list[Setting] = [
    # ------------------------------------------------------------ the model and its bucket
    _s("KNOT_KEY", "str", REQUIRED, "coordinator station shard drafter init launcher compose",
       "object key of the .knot in the bucket (drafter: the draft model's; launcher: default the model's name + "
       ".knot)",
       reader_defaults={"launcher": None}),
    _s("KNOT_MODEL", "str", REQUIRED, "init launcher compose",
       "model to serve: a registered name (`knot fetch-model --list`) or a .gguf/.knot path "
       "(launcher: default qwen2.5-coder-0.5b)", reader_defaults={"launcher": None}),
    _s("KNOT_BUCKET", "binding", REQUIRED, "coordinator station shard layer_warden cobordism_warden drafter init",
       "the bucket holding the .knot (R2 binding; locally s3://BUCKET or dir:PATH)"),
    _s("KNOT_DIGEST", "str", None, "coordinator station shard layer_warden cobordism_warden init launcher compose",
       "the knot the cluster serves: its digest (SHA-256 of the header, which `knot encode` and `knot inspect` "
       "print); another object under KNOT_KEY is refused (503) while the version loaded, if any, is served on. "
       "Unset: the first version a service loads is pinned for the process's life. init: the local knot must "
       "have it, and a bucket object without it is replaced. `knot cluster up` and `knot cluster reload` set "
       "it to the model's (docs/reliability.md)"),
    _s("KNOT_CACHE_DIR", "str", None, "models", "where fetched and encoded models are cached "
       "(default $XDG_CACHE_HOME/knot, else ~/.cache/knot)"),
    _s("XDG_CACHE_HOME", "str", None, "models", "base of the default model cache"),
    # ------------------------------------------------------------ bindings between services
    _s("LAYER_WARDEN", "binding", None, "station layer_warden",
       "LayerWarden Durable Object namespace (station: optional; without it tensors come from the bucket)",
       reader_defaults={"layer_warden": REQUIRED}),
    _s("COBORDISM_WARDEN", "binding", None, "shard cobordism_warden",
       "CobordismWarden Durable Object namespace (shard: optional; without it rows come from the bucket)",
       reader_defaults={"cobordism_warden": REQUIRED}),
    _s("EMBED_CACHE", "binding", None, "cobordism_warden",
       "KV namespace for dequantized embedding rows (optional), the middle level of the row cache"),
    _s("SHARED_BLOCKS", "binding", None, "layer_warden",
       "shared-memory blocks (optional, never configured: the local host offers them where KNOT_SHM_DIR is set); "
       "the LayerWarden keeps large frames there, and its replies name them instead of copying them "
       "(deploy/local/shm.py)"),
    _s("STATION_<i>", "binding", None, "coordinator", "service binding to station i"),
    _s("SHARD_<i>", "binding", None, "coordinator", "service binding to shard i"),
    _s("STATION_<i>_R<i>", "binding", None, "coordinator", "service binding to replica r of station i "
       "(replica 0 is STATION_<i>)"),
    _s("SHARD_<i>_R<i>", "binding", None, "coordinator", "service binding to replica r of shard i "
       "(replica 0 is SHARD_<i>)"),
    _s("DRAFTER", "binding", None, "coordinator", "service binding to the drafter (optional): enables the "
       "speculation source draft_model"),
    # ------------------------------------------------------------ coordinator
    _s("STATIONS", "names", REQUIRED, "coordinator", "station binding names in chain order, e.g. STATION_0,STATION_1; "
       "a station's replicas joined by |, e.g. STATION_0|STATION_0_R1,STATION_1|STATION_1_R1"),
    _s("SHARDS", "str", REQUIRED, "coordinator",
       "BINDING:START-END,... one per shard; the ranges must tile [0, vocab); a shard's replicas joined by |, "
       "e.g. SHARD_0|SHARD_0_R1:0-18992"),
    _s("SHARD_TIMEOUT_S", "float", "30", "coordinator", "timeout of one shard call (a late shard has failed)",
       positive=True),
    _s("STATION_TIMEOUT_S", "float", "300", "coordinator", "timeout of one station forward", positive=True),
    _s("DRAFTER_TIMEOUT_S", "float", "60", "coordinator", "timeout of one call to the drafter (a /draft, or a /prime "
       "of up to 1,024 prompt tokens); a longer one is a drafter fault: that generation goes on without drafts, "
       "with the same tokens, and for this long after a fault auto leaves the draft model out", positive=True),
    _s("PEER_WAIT_S", "float", "15", "coordinator compose",
       "how long requests wait for a station or shard that is unreachable or not ready to come back (a restart), "
       "counted from when it went down; past it they get 503 with Retry-After at once (0: never wait)", minimum=0),
    _s("REQUEST_TIMEOUT_S", "float", "600", "coordinator compose",
       "every request's deadline, queueing included: past it a 504 (a stream ends with an error event)",
       positive=True),
    _s("BUCKET_CHECK_TIMEOUT_S", "float", "2", "coordinator",
       "how long a generation waits for the bucket's knot version (one HEAD, to follow a replaced knot); past it, "
       "or when the bucket fails, the loaded version is served and /readyz says so", positive=True),
    _s("BUCKET_CHECK_BACKOFF_S", "float", "30", "coordinator",
       "after a failed check of the bucket's knot version, requests serve the loaded version without checking "
       "for this long; then one checks again", minimum=0),
    _s("SHARD_FAILURE", "choice", "fail", "coordinator compose",
       "a shard still down after PEER_WAIT_S: fail (503 naming the missing vocabulary range) or degrade (the "
       "seed's allSettled merge: its tokens embed as zeros, its logits are -inf; every reply says so); a request "
       "may choose with its shard_failure field", choices=("fail", "degrade")),
    _s("KNOT_API_KEY", "str", None, "coordinator compose",
       "bearer token the public API requires (Authorization: Bearer KEY; without it 401); unset: no key",
       secret=True, reader_defaults={"compose": ""}),
    _s("MAX_CONCURRENT_REQUESTS", "int", "8", "coordinator compose", "generations run at once", minimum=1),
    _s("MAX_QUEUED_REQUESTS", "int", "16", "coordinator compose",
       "requests waiting beyond those; more get 429", minimum=0),
    _s("RETRY_AFTER_S", "int", "1", "coordinator", "the Retry-After of a 429 (queue full) or a 503 (a peer down)",
       minimum=1),
    _s("MODEL_NAME", "str", None, "coordinator", "the model id /v1/models reports (default: KNOT_KEY without .knot)"),
    _s("SPECULATION", "choice", "auto", "coordinator", "speculative decoding of requests that do not choose: "
       "auto (for greedy requests the draft model where there is a DRAFTER whose budget holds the prompt, else "
       "prompt lookup; off for sampled ones), off, prompt_lookup, draft_model",
       choices=("auto", "off", "prompt_lookup", "draft_model")),
    _s("SPEC_MAX_DRAFT", "int", None, "coordinator compose", "tokens drafted per trip at most (unset: 8 for prompt "
       f"lookup, 6 for the draft model; a request's max_draft may ask for fewer or more, up to {MAX_DRAFT})",
       minimum=1, maximum=MAX_DRAFT),
    _s("EMBED_ROW_CACHE_BYTES", "int", str(4 * MiB), "coordinator compose",
       "embedding rows the coordinator keeps from the shards' replies, so a decode step whose tokens are all "
       "there skips the embed hop (0: off)", minimum=0),
    _s("STEP_BATCH", "int", "16", "coordinator compose",
       "continuous batching: the decode steps of up to this many concurrent generations cross each station and "
       "shard together, one call per hop (POST /forward_many, /sample_many), so each weight is read once for all; "
       "0: each generation makes its own calls (the Cloudflare deploy's: a Worker's subrequest belongs to the "
       "request that made it)", minimum=0, maximum=64),
    _s("SHARD_SAMPLE_TOP", "int", "64", "coordinator compose", "sampling on the shards: candidates per row each shard "
       "sends with its max and log-sum-exp, from which the tokens are decided exactly; 0: full slices of logits",
       minimum=0, maximum=MAX_SAMPLE_TOP),
    _s("SUBREQUEST_LIMIT", "int", None, "coordinator", "subrequests one invocation of the coordinator may make "
       "(its calls through bindings: stations, shards, the drafter, the bucket); a generation ends with "
       "finish_reason length and limited_by subrequests before it would cross it; `knot deploy cloudflare` sets the "
       "plan's (KNOT_CF_SUBREQUESTS_PAID or _FREE); unset: no limit (a local host has none)", minimum=1),
    # ------------------------------------------------------------ drafter
    _s("DRAFT_HEAD_IDS", "int", str(DRAFT_HEAD_IDS), "drafter compose", "the draft model's LM head scores only the ids "
       "below this and the special tokens, and never drafts the others (a token among them costs one rejected "
       "draft, never another output); Qwen2's ids from 100,000 up are CJK and other scripts' words, a third of "
       "the head's bytes; 0: every id", minimum=0),
    # ------------------------------------------------------------ station
    _s("SPECIALIZATION_START_LAYER", "int", REQUIRED, "station", "first layer of the station", minimum=0),
    _s("SPECIALIZATION_END_LAYER", "int", REQUIRED, "station", "end of the station's layers (exclusive)",
       minimum=1),
    _s("SPECIALIZATION_ROLE", "choice", REQUIRED, "station",
       "entry (embeds come in) / middle / exit (emits the normed last row) / solo (all layers)",
       choices=("entry", "middle", "exit", "solo")),
    _s("MEMORY_BUDGET_BYTES", "int", str(128 * MiB), "station shard layer_warden cobordism_warden drafter",
       "bytes the service may hold: kept weights and KV caches (station), its slice (shard), the warden's LRU, "
       "the draft model's tensors, one forward's work and its sessions' KV caches (drafter)", minimum=1,
       reader_defaults={"layer_warden": str(1024 * MiB), "cobordism_warden": str(256 * MiB),
                        "drafter": str(1024 * MiB)}),
    _s("MEMORY_PROFILE", "choice", "worker", "station",
       "worker: MEMORY_BUDGET_BYTES as it is (a Worker's memory); resident: the station's layers plus "
       "MEMORY_BUDGET_BYTES, so they stay between forwards", choices=("worker", "resident")),
    _s("RESIDENT_MAX_BYTES", "int", None, "station", "the most a resident station's budget may grow to "
       "(the launcher sets it from the host's available memory)", minimum=1),
    _s("SESSION_TTL_S", "float", "600", "station", "an idle request's KV cache is dropped after this long",
       positive=True),
    _s("PREFIX_CACHE_BYTES", "int", None, "station", "prompt caching: the most bytes of recent prompts' KV "
       "blocks the station keeps, counted in its budget and evicted first when a forward or a session needs room "
       "(unset: half of what the budget leaves beside the layers it keeps; 0: off; docs/runtime.md)", minimum=0),
    _s("MAX_BATCH", "int", "16", "station", "decode frames of concurrent requests stacked into one forward",
       minimum=1),
    _s("INTERLEAVE_ROWS", "int", "64", "station", "fair scheduling: frames of at most this many rows (decode steps, "
       "short prompts) run between two phases of a longer prefill chunk instead of waiting for all of it "
       "(docs/api.md); 0: every frame waits for the one running", minimum=0),
    _s("PREFETCH", "choice", "on", "station", "a fluid station loads the next phase's tensors while one computes, "
       "when its budget has room for two phases (/stats memory.prefetch says whether it does)",
       choices=("on", "off")),
    # ------------------------------------------------------------ shard
    _s("VOCAB_START", "int", REQUIRED, "shard", "first token id of the shard's vocabulary slice", minimum=0),
    _s("VOCAB_END", "int", REQUIRED, "shard", "end of the slice (exclusive)", minimum=1),
    _s("ROW_CACHE_BYTES", "int", str(4 * MiB), "shard",
       "embedding rows kept in the shard itself, in front of its warden (0: off; at most half the budget)",
       minimum=0),
    _s("WARM_WARDEN", "choice", "on", "shard", "at boot, ask the CobordismWarden to read the shard's slice of "
       "the embedding into its RAM (in the background, once per knot version, where it fits half the warden's "
       "budget), so a new token's row is a RAM hit, not a KV and R2 read", choices=("on", "off")),
    # ------------------------------------------------------------ the local host (knot serve)
    _s("KNOT_SERVICE", "str", REQUIRED, "host", "handler module this process serves, e.g. services.station"),
    _s("KNOT_SERVICE_NAME", "str", None, "host", "name in logs and /healthz (default: the module's last part)"),
    _s("KNOT_DURABLE_OBJECTS", "names", "", "host", "Durable Object classes of the module this process hosts"),
    _s("KNOT_BINDINGS", "names", "", "host launcher", "variables that hold binding URLs: s3://, dir:, redis://, "
       "memory:, do+http://, do+local:, http:// (docs/runtime.md)"),
    _s("KNOT_VARS", "names", "", "host", "variables passed to the handler as plain vars"),
    _s("HOST", "str", "0.0.0.0", "host", "listen address"),
    _s("PORT", "int", "8080", "host", "listen port", minimum=1, maximum=65535),
    _s("S3_ENDPOINT_URL", "str", None, "host init", "S3 endpoint of s3:// buckets (MinIO, SeaweedFS)"),
    _s("AWS_ACCESS_KEY_ID", "str", None, "host init", "S3 credentials"),
    _s("AWS_SECRET_ACCESS_KEY", "str", None, "host init", "S3 credentials"),
    _s("AWS_REGION", "str", "us-east-1", "host init", "S3 region"),
    _s("S3_CONNECT_TIMEOUT_S", "float", "5", "host init", "S3 connect timeout", positive=True),
    _s("S3_READ_TIMEOUT_S", "float", "30", "host init", "S3 read timeout", positive=True),
    _s("KNOT_CALL_TIMEOUT_S", "float", "30", "host", "timeout of a call through a binding (peer, DO, Redis)",
       positive=True),
    _s("KNOT_SHUTDOWN_TIMEOUT_S", "float", "30", "host", "on SIGTERM, how long wait_until work may drain",
       positive=True),
    _s("KNOT_HEADER_TIMEOUT_S", "float", "60", "host", "a connection must deliver a request's line and headers "
       "within this long of its start or of the previous reply (the idle time of a kept-alive connection too), "
       "else it is closed: a slow or half-open client holds a connection no longer", positive=True),
    _s("KNOT_BODY_TIMEOUT_S", "float", "60", "host", "a request's body must arrive in full within this long of its "
       "headers, else 408 and the connection is closed", positive=True),
    _s("KNOT_LOG_FORMAT", "choice", "json", "host launcher", "log lines as json or text", choices=("json", "text"),
       reader_defaults={"launcher": "text"}),
    _s("KNOT_ACCESS_LOG", "choice", "all", "host compose",
       "all: log every request; errors: only 4xx/5xx (internal hops run ~10 requests per token)",
       choices=("all", "errors"), reader_defaults={"compose": "errors"}),
    _s("KNOT_HTTP_SERVER", "choice", "lean", "host compose",
       "lean: the internal services that host no Durable Object (stations, shards, the drafter) answer on "
       "deploy/local/lean_http.py, ~0.15-0.25 ms of CPU less per call (docs/performance.md); aiohttp: every service "
       "on the aiohttp app", choices=("lean", "aiohttp")),
    _s("KNOT_SHM_DIR", "str", None, "host launcher", "a directory of shared memory (tmpfs) where this host writes "
       "large replies to callers of the same directory, and reads theirs, instead of the socket "
       "(deploy/local/shm.py); `knot cluster up` sets one per cluster under /dev/shm, `KNOT_SHM_DIR=` turns it off; "
       "unset: sockets only (docker compose)"),
    _s("OTEL_EXPORTER_OTLP_ENDPOINT", "str", None, "host", "an OpenTelemetry collector's OTLP/HTTP base URL "
       "(e.g. http://127.0.0.1:4318): the coordinator exports each request's trace there (deploy/otlp.py, "
       "docs/operations.md); unset: traces stay in the coordinator (GET /traces)"),
    _s("KNOT_MAX_BODY_BYTES", "int", None, "host", "largest request body accepted, 413 before it is read "
       "(default: the service module's MAX_BODY_BYTES, 4 MiB for the coordinator; else 64 MiB)", minimum=1),
    _s("KNOT_INTERNAL_SECRET", "str", REQUIRED, "host compose launcher cobordism_warden",
       "HMAC key of every internal call (at least 32 characters; common/signing.py): the host signs what its "
       "bindings send and its internal services refuse unsigned calls (401); the host passes it to its handler, "
       "and the CobordismWarden keys its KV rows with it (common/integrity.py CacheKey), so a writer without "
       "it cannot forge one; `knot cluster up` generates one "
       "per cluster (deploy/cluster_secrets.py), `knot secrets` writes one to .env for docker compose, which "
       "refuses to start without it, and on Cloudflare it is a secret of every Worker (`wrangler secret put`); "
       "a host started by hand without it does not authenticate internal calls and its CobordismWarden uses no "
       "KV (a warning at start); never logged", secret=True, min_chars=32,
       reader_defaults={"host": None, "launcher": None, "cobordism_warden": None}),
    # ------------------------------------------------------------ kernels and the container runtime
    _s("KNOT_THREADS", "int", None, "kernels", "threads per matmul, the caller's included "
       "(default: the CPUs this process may run on)", minimum=1, maximum=256),
    _s("KNOT_SPIN_US", "float", None, "kernels compose", "how long an idle kernel worker spins before it "
       "sleeps, in µs (default 1000; many services on few cores want less)", minimum=0, maximum=1e6,
       reader_defaults={"compose": "200"}),
    _s("KNOT_KERNELS", "choice", "auto", "kernels", "the C kernels' ISA: auto (the best this CPU runs), scalar, "
       "avx2 or avx512 (refused when the CPU lacks it); off (or 0, no, numpy) keeps matmul on the numpy "
       "reference path", choices=("auto", "scalar", "avx2", "avx512", "off", "0", "no", "numpy")),
    _s("KNOT_REDIS_PASSWORD", "str", REQUIRED, "host launcher compose",
       "the cluster's Redis password, generated per cluster (deploy/cluster_secrets.py: `knot cluster up` "
       "keeps it in its run directory, `knot secrets` writes .env for docker compose); never logged "
       "(host: required by a redis:// binding)", reader_defaults={"host": None, "launcher": None}),
]

TABLE: dict[str, Setting] = {s.name: s for s in SETTINGS}


def _family(name: str) -> re.Pattern:
    return re.compile(re.escape(name).replace("<i>", r"\d+") + "$")  # STATION_<i> matches STATION_3


_FAMILIES = [(_family(s.name), s) for s in SETTINGS if "<i>" in s.name]
SECTIONS: list[tuple[str, list[Setting]]] = [("Services and hosts (common/settings.py)", list(SETTINGS))]


def extend(heading: str, rows: list[Setting]) -> None:
    """Add another module's rows to the table (deploy/deploy_settings.py), once; a name declared twice
    is a ValueError. docs/configuration.md lists them under `heading`."""
    if any(h == heading for h, _ in SECTIONS):
        return
    twice = [r.name for r in rows if r.name in TABLE]
    if twice:
        raise ValueError(f"declared twice: {', '.join(twice)}")
    SETTINGS.extend(rows)
    TABLE.update((r.name, r) for r in rows)
    _FAMILIES.extend((_family(r.name), r) for r in rows if "<i>" in r.name)
    SECTIONS.append((heading, list(rows)))


def mirror(name: str, role: str, var: str, reader: str | None = None, *, readers: str = "compose",
           note: str = "", **changes) -> Setting:
    """A compose variable that sets `var` in every container of `role` (a Knob in the layout): the
    handler row's type and bounds, and its default for `reader` (default: the role), so the two cannot
    drift. changes: fields that differ (default, reader_defaults)."""
    src = TABLE[var]
    meaning = f"every {role.replace('_', ' ')}'s {var}" + (f" ({note})" if note else "")
    fields = {"default": src.default_for(reader or role), "reader_defaults": {}, **changes}
    return replace(src, name=name, readers=tuple(readers.split()), meaning=meaning, mirror_of=f"{role} {var}",
                   **fields)


def lookup(name: str) -> Setting:
    """The table's entry for a variable (or its family, e.g. STATION_3 -> STATION_<i>); KeyError if none."""
    s = TABLE.get(name)
    if s is not None:
        return s
    for pattern, fam in _FAMILIES:
        if pattern.match(name):
            return fam
    raise KeyError(f"{name} is not in the settings table (common/settings.py)")


def default(name: str, reader: str) -> Any:
    """The typed default of a setting for a reader (None when it has none)."""
    s = lookup(name)
    d = s.default_for(reader)
    return None if d is None or d is REQUIRED else s.parse(d)


def default_text(name: str, reader: str) -> str:
    """The default as the text a deployment file writes; KeyError when there is none."""
    d = lookup(name).default_for(reader)
    if d is None or d is REQUIRED:
        raise KeyError(f"{name} has no default for {reader}")
    return d


def read(env: Mapping[str, Any] | Any, name: str, reader: str) -> Any:
    """One setting from `env` (anything with .get), parsed; an unset or empty value takes the default.

    ConfigError when it is missing with no default, or invalid. A binding comes back as it is
    (the binding object in a handler, its URL on the host)."""
    s = lookup(name)
    if reader not in s.readers:
        raise LookupError(f"{reader} reads {name}, but common/settings.py lists only {', '.join(s.readers)}")
    raw = env.get(name)
    if raw is None or (isinstance(raw, str) and raw == ""):
        d = s.default_for(reader)
        if d is REQUIRED:
            raise ConfigError(f"Config {name!r} is missing, and has no default.", name=name)
        if d is None:
            return None
        raw = d
    if s.type == "binding" or not isinstance(raw, str):
        return raw
    return s.parse(raw)


def check(env: Mapping[str, Any] | Any, reader: str) -> dict[str, Any]:
    """Every setting `reader` reads, parsed (the host's start-up check); the first problem raises."""
    return {s.name: read(env, s.name, reader) for s in SETTINGS if reader in s.readers and "<i>" not in s.name}


def unknown_knot_names(env: Mapping[str, Any]) -> list[tuple[str, str | None]]:
    """Variables in `env` named KNOT_* that the table does not declare, each with the declared name
    it most likely misspells (or None). Why: every KNOT_* variable has a default, so a typo such as
    KNOT_PROFLE=device would otherwise run the default in silence."""
    declared = [s.name for s in SETTINGS if s.name.startswith("KNOT_")]
    unknown = []
    for name in sorted(n for n in env if n.startswith("KNOT_")):
        try:
            lookup(name)
        except KeyError:
            close = difflib.get_close_matches(name, declared, n=1, cutoff=0.8)
            unknown.append((name, close[0] if close else None))
    return unknown


def markdown() -> str:
    """docs/configuration.md."""
    def default_text(s: Setting) -> str:
        d = "required" if s.default is REQUIRED else "unset" if s.default is None else f"`{s.default}`"
        others = [f"{r}: required" if v is REQUIRED else f"{r}: `{v}`" if v else f"{r}: unset"
                  for r, v in s.reader_defaults.items()]
        return d + (f" ({'; '.join(others)})" if others else "")

    def type_text(s: Setting) -> str:
        if s.secret:
            return f"secret (≥{s.min_chars} chars)" if s.min_chars else "secret"
        if s.type == "choice":
            return " \\| ".join(s.choices)
        lo = ">0" if s.positive else None if s.minimum is None else f"≥{s.minimum:g}"
        hi = None if s.maximum is None else f"≤{s.maximum:g}"
        bounds = ", ".join(b for b in (lo, hi) if b)
        return s.type + (f" ({bounds})" if bounds else "")

    lines = [
        "# Configuration",
        "",
        "<!-- Generated from common/settings.py by `knot settings > docs/configuration.md`; "
        "tests/unit/test_settings.py fails when it is stale. -->",
        "",
        "Every environment variable the project reads, declared once: in `common/settings.py` what the",
        "services read, in `deploy/deploy_settings.py` what the deployment tools read. Handlers read",
        "theirs from `env` (plain vars and bindings: the Worker's env on Cloudflare; locally the host passes the",
        "variables named in `KNOT_VARS` and builds the bindings named in `KNOT_BINDINGS`). An unset or empty",
        "variable takes its default. A missing required or invalid value is a `ConfigError` that names the",
        "variable: `knot serve` checks its service's settings before it listens and exits with status 1, and a",
        "handler that meets one answers 503.",
        "",
    ]

    def row(s: Setting) -> str:
        meaning = s.meaning.replace("|", "\\|")
        return f"| `{s.name}` | {type_text(s)} | {default_text(s)} | {', '.join(s.readers)} | {meaning} |"

    header = ["| variable | type | default | read by | meaning |", "|---|---|---|---|---|"]
    for heading, rows in SECTIONS:
        lines += [f"## {heading}", "", *header, *(row(s) for s in rows if not s.mirror_of), ""]
    mirrors = [s for s in SETTINGS if s.mirror_of]
    if mirrors:
        lines += ["## Compose mirrors", "",
                  "Each sets one handler variable in every container of a role (docker-compose.yml's",
                  "`${NAME:-default}`): its type, bounds and default are generated from that variable's row.",
                  "", *header, *(row(s) for s in mirrors), ""]
    lines += ["Readers:", ""]
    lines += [f"- **{r}**: {what}" for r, what in READERS.items()]
    return "\n".join(lines) + "\n"
