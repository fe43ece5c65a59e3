"""Cobordism shard: one slice [VOCAB_START, VOCAB_END) of the vocabulary (seed sections 1, 3).

    POST /embed     envelope mode "embed", int32 tokens (T,) -> float32 (T, dim): the rows of the
                    tokens this shard owns, zeros for every other token, so the coordinator's sum
                    over disjoint shards is the full lookup
    POST /logits    envelope mode "logits", float32 (T, dim) final normed hidden -> (T, n_rows):
                    this slice of the LM head (rows of output.weight, or token_embd when tied);
                    concurrent requests are batched into one product (services/batcher.py)
    POST /sample    a sampling spec then a "logits" envelope (common/wire.py) -> three "sample"
                    envelopes: the slice's summary per row (common/shard_sampling.py): candidate ids
                    (T, t) int32, their logits (T, t) float32, stats (T, 5) float64; the coordinator
                    decides the tokens from those, not from the slice's logits
    POST /sample_many  several /sample bodies in one bundle (common/wire.py, services/bundle.py): the
                    decode steps of concurrent generations, their rows in one product
    GET  /stats

Env: KNOT_KEY, VOCAB_START, VOCAB_END, MEMORY_BUDGET_BYTES (default 128 MiB), ROW_CACHE_BYTES
(default 4 MiB, 0 = off), WARM_WARDEN (on: at boot the warden reads our slice into its RAM);
bindings KNOT_BUCKET, COBORDISM_WARDEN (DO namespace, optional: the RAM -> KV -> R2 row hierarchy
lives behind it).

Rows also stay in a small isolate-local LRU in front of the warden: a decode step embeds one
token, and without it every step paid a second hop (shard -> warden) on the critical path. Each
entry is sealed with the knot version and its crc32, checked on every hit (a bad one is a miss,
counted in `row_cache_rejects`); the warden must answer for the shard's version (X-Knot-Etag).
When it boots, the shard has its warden read the whole slice into RAM (WARM_WARDEN): a decode's new
token missed the warden's RAM and came from KV and R2, several times slower than from RAM
(cluster_profile.py --only embed). Where the head is tied to token_embd (a GGUF without output.weight), the shard already pins
its rows' bytes as its head slice, so it embeds from those (`rows_from_head`) and asks no warden.

Why the LM head is here: a 7B's output matrix is ~447 MB in Q6_K, more than any 128 MB exit
station holds; one eighth of it fits a shard.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np

from common import wire
from common.knot import KnotHeader
from common.models import Model
from common.quant import QTensor, dequantize_rows, resident_copy, row_nbytes
from common.runtime import BadRequest, Env, HttpError, NotFound, Request, Response, ServiceUnavailable
from common.sampling import SamplingParams
from common.settings import ConfigError, default, read
from common.shard_sampling import summarize
from services.batcher import Batcher
from services.boot import BootCache
from services.bundle import serve_bundle
from services.cobordism_warden.cobordism_warden_client import CobordismWardenClient
from services.embed_cache import SealedRows
from services.knot_source import KNOT_ETAG_HEADER, KnotSource, read_pin, serving_version

log = logging.getLogger(__name__)

DEFAULT_BUDGET_BYTES = default("MEMORY_BUDGET_BYTES", "shard")
# 4 MiB: ~1,100 rows of a 0.5B (3.5 KiB each), ~290 of a 7B
DEFAULT_ROW_CACHE_BYTES = default("ROW_CACHE_BYTES", "shard")


@dataclass(frozen=True)
class ShardSettings:
    knot_key: str
    vocab_start: int
    vocab_end: int
    budget_bytes: int
    row_cache_bytes: int = DEFAULT_ROW_CACHE_BYTES
    warm_warden: bool = True

    @property
    def boot_key(self) -> str:
        return f"{self.knot_key}|{self.vocab_start}-{self.vocab_end}"

    @classmethod
    def from_env(cls, env: Env) -> "ShardSettings":
        def get(name: str):
            return read(env, name, "shard")

        s = cls(get("KNOT_KEY"), get("VOCAB_START"), get("VOCAB_END"), get("MEMORY_BUDGET_BYTES"),
                get("ROW_CACHE_BYTES"), get("WARM_WARDEN") == "on")
        if not 0 <= s.vocab_start < s.vocab_end:
            raise ConfigError(f"shard vocab range [{s.vocab_start}, {s.vocab_end}) is empty or negative",
                              name="VOCAB_END")
        if not 0 <= s.row_cache_bytes <= s.budget_bytes // 2:
            raise ConfigError(f"ROW_CACHE_BYTES={s.row_cache_bytes} must lie in [0, MEMORY_BUDGET_BYTES / 2]",
                              name="ROW_CACHE_BYTES")
        return s


class Shard:
    def __init__(self, settings: ShardSettings, model: Model, header: KnotHeader, source: KnotSource,
                 warden: CobordismWardenClient | None):
        self.settings, self.model, self.header, self.source, self.warden = settings, model, header, source, warden
        self.embd_name = model.TOKEN_EMBD
        self.embd = header.entry(self.embd_name)
        self.dim = self.embd.shape[0]
        if settings.vocab_end > self.embd.n_rows:
            raise ServiceUnavailable(f"shard rows [{settings.vocab_start}, {settings.vocab_end}) exceed the "
                                     f"{self.embd.n_rows} rows of {self.embd_name}")
        self.head_name = model.head_tensor(lambda n: n in header.tensors)
        self.head: QTensor | None = None
        self.head_f32: QTensor | None = None
        self.batcher: Batcher[np.ndarray, np.ndarray] = Batcher(self._logits_batch)
        self.row_cache = SealedRows(settings.row_cache_bytes, "shard")
        self.tied = self.head_name == self.embd_name  # the head slice holds our embedding rows' bytes
        self.stats = {"embed_calls": 0, "rows_from_head": 0, "rows_from_local": 0, "rows_from_warden": 0,
                      "rows_from_r2": 0,
                      "warden_failures": 0, "warden_rows_rejected": 0, "row_cache_rejects": 0, "logits_calls": 0,
                      "sample_calls": 0}

    async def boot(self) -> None:
        """The LM-head slice: one ranged read of rows [vocab_start, vocab_end), kept resident."""
        a, b = self.settings.vocab_start, self.settings.vocab_end
        e = self.header.entry(self.head_name)
        data = await self.source.read_rows(self.head_name, a, b)  # pinned to our version, chunks checked
        self.head = QTensor(f"{self.head_name}[{a}:{b}]", e.ggml_type, (e.shape[0], b - a),
                            resident_copy(data))  # on huge pages: every token's product streams it
        if self.warden is not None and not self.tied and self.settings.warm_warden:
            await self._warm_warden()
        f32_bytes = (b - a) * e.shape[0] * 4
        if e.ggml_type not in self.model.ops.quantized_types and self.head.nbytes + f32_bytes <= self.settings.budget_bytes // 2:
            # Without a quantized kernel, dequantize once when it fits: one float32 matmul per token.
            w = self.head.dequantize()  # (n_rows, dim)
            self.head_f32 = QTensor(self.head.name, "F32", self.head.shape, w.reshape(-1).view(np.uint8))

    async def _warm_warden(self) -> None:
        """Have the warden read our slice of the embedding into its RAM (it does so in the background,
        once per version): a new token's row then costs a RAM hit, not KV and R2 (cobordism_warden.py)."""
        try:
            got = await self.warden.warm()
        except (HttpError, TimeoutError, wire.WireError, ValueError) as e:
            log.warning("cobordism warden warm-up not started (rows stay on the tiers' path): %s: %s",
                        type(e).__name__, e)
            return
        if not got.get("warming"):
            log.info("cobordism warden does not warm: %s", got.get("reason"))

    # -------------------------------------------------------- embeddings

    async def rows(self, rows: list[int]) -> dict[int, np.ndarray]:
        """row -> float32 (dim,): a tied head's pinned slice; else the local LRU, then the warden's
        hierarchy, R2 directly if the warden fails."""
        if self.tied and self.head is not None:
            return self._rows_from_head(rows)
        out: dict[int, np.ndarray] = {}
        for r in rows:
            v = self.row_cache.checked(r, self.source.etag)
            if v is not None:
                out[r] = v
        self.stats["rows_from_local"] += len(out)
        self.stats["row_cache_rejects"] = self.row_cache.rejects
        fetch = [r for r in rows if r not in out]
        if fetch and self.warden is not None:
            out.update(await self._from_warden(fetch))
        for r in [r for r in fetch if r not in out]:
            data = await self.source.read_rows(self.embd_name, r, r + 1)  # its chunk (64 KiB) read and checked
            out[r] = dequantize_rows(data, self.embd.ggml_type, self.dim, self.embd_name)[0]
            self.stats["rows_from_r2"] += 1
        for r in fetch:
            self.row_cache.keep(r, out[r], self.source.etag)  # its own (dim,) array
        return out

    def _rows_from_head(self, rows: list[int]) -> dict[int, np.ndarray]:
        """The same bytes the warden would serve (rows of token_embd at this version), already here."""
        nb = row_nbytes(self.head.ggml_type, self.dim, self.embd_name)
        idx = np.asarray(rows, np.int64) - self.settings.vocab_start  # (R,) local rows
        raw = self.head.data.reshape(-1, nb)[idx]  # (R, nb) a gathered copy
        got = dequantize_rows(raw, self.head.ggml_type, self.dim, self.embd_name)  # (R, dim)
        self.stats["rows_from_head"] += len(rows)
        return dict(zip(rows, got))

    def warden_stats(self) -> dict[str, int]:
        """What the warden client counted: replies for another version, bad entries it reported."""
        if self.warden is None:
            return {}
        return {"warden_version_mismatches": self.warden.version_mismatches,
                "warden_rejects_ram": self.warden.rejects["ram"], "warden_rejects_kv": self.warden.rejects["kv"]}

    async def _from_warden(self, rows: list[int]) -> dict[int, np.ndarray]:
        try:
            frames = await self.warden.rows(rows)
        except (HttpError, TimeoutError, wire.WireError) as e:
            self.stats["warden_failures"] += 1
            log.warning("cobordism warden failed for %d rows, reading R2: %s", len(rows), e)
            return {}
        out = {}
        for f in frames:
            if f.name != self.embd_name or f.shape[0] != self.dim or f.row_start not in rows:
                self.stats["warden_rows_rejected"] += 1
                log.warning("cobordism warden frame %s row %d %s rejected", f.name, f.row_start, f.shape)
                continue
            out[f.row_start] = dequantize_rows(f.payload, f.ggml_type, self.dim, self.embd_name)[0]
            self.stats["rows_from_warden"] += 1
        return out

    async def embed(self, tokens: np.ndarray) -> np.ndarray:
        """tokens (T,) -> (T, dim), zeros where this shard does not own the token."""
        a, b = self.settings.vocab_start, self.settings.vocab_end
        vocab_size = self.model.cfg.vocab_size
        if tokens.size and (tokens.min() < 0 or tokens.max() >= vocab_size):
            raise BadRequest(f"token ids must lie in [0, {vocab_size})")
        out = np.zeros((tokens.shape[0], self.dim), np.float32)  # (T, dim): zero = "not my token"
        owned = [int(t) for t in tokens if a <= t < b]
        if owned:
            got = await self.rows(list(dict.fromkeys(owned)))
            for i, t in enumerate(tokens):
                if a <= t < b:
                    out[i] = got[int(t)]
        self.stats["embed_calls"] += 1
        return out

    def logits(self, h: np.ndarray) -> np.ndarray:
        """h (T, dim) output-normed -> (T, n_rows) logits of this slice."""
        self.stats["logits_calls"] += 1
        return self.model.lm_head(h, self.head_f32 or self.head)

    async def _logits_batch(self, hs: list[np.ndarray]) -> list[np.ndarray]:
        """Concurrent requests' hidden states stacked: the slice's head is read once for all."""
        rows = self.logits(np.concatenate(hs) if len(hs) > 1 else hs[0])  # (sum T_i, n_rows)
        out, a = [], 0
        for h in hs:
            out.append(rows[a:a + h.shape[0]])
            a += h.shape[0]
        return out


_booted: BootCache[Shard] = BootCache()


async def shard_for(env: Env, knot_etag: str | None = None) -> Shard:
    """The shard serving knot version knot_etag (a request's X-Knot-Etag; None: the loaded one)."""
    settings = ShardSettings.from_env(env)

    async def boot(pin: str) -> Shard:
        source = KnotSource(env.KNOT_BUCKET, settings.knot_key, pin)
        header, model = await source.header(), await source.model()
        ns = read(env, "COBORDISM_WARDEN", "shard")
        warden = (None if ns is None else  # it must answer for our version
                  CobordismWardenClient(ns, settings.knot_key, settings.vocab_start, settings.vocab_end, source.etag))
        sh = Shard(settings, model, header, source, warden)
        await sh.boot()
        log.info("shard booted: %s, head %s (%d bytes%s)", settings.boot_key, sh.head_name, sh.head.nbytes,
                 ", float32 cached" if sh.head_f32 else "")
        return sh

    return await serving_version(_booted, settings.boot_key, boot, lambda sh: sh.source, knot_etag,
                                 pin=read_pin(env, "shard"))


async def ready(env: Env) -> None:
    ShardSettings.from_env(env)
    read_pin(env, "shard")


def _frame(request: Request, mode: str) -> wire.Envelope:
    try:
        env = wire.decode_envelope(request.body)
    except wire.WireError as e:
        raise BadRequest(f"malformed envelope: {e}") from None
    return _mode(env, mode)


def _mode(env: wire.Envelope, mode: str) -> wire.Envelope:
    if env.mode != mode:
        raise BadRequest(f"envelope mode {env.mode!r}, expected {mode!r}")
    return env


def _hidden(sh: Shard, f: wire.Envelope) -> np.ndarray:
    """The final normed hidden (T, dim) of a logits envelope, checked."""
    h = f.array
    if h.dtype != np.float32 or h.ndim != 2 or h.shape[1] != sh.dim:
        raise BadRequest(f"logits envelope holds {h.dtype} {h.shape}, expected float32 (T, {sh.dim})")
    if not np.isfinite(h).all():
        # NaN in, NaN logits out: no token is the argmax of those, so refuse rather than sample one
        raise BadRequest(f"logits envelope for {f.request_id}: the hidden state holds NaN or inf")
    return h


async def _sample(sh: Shard, body: bytes | memoryview) -> bytes:
    """A POST /sample body -> its reply body."""
    try:
        spec, f = wire.decode_sample_request(body)
    except wire.WireError as e:
        raise BadRequest(f"malformed sample request: {e}") from None
    h = _hidden(sh, _mode(f, "logits"))
    vocab = sh.model.cfg.vocab_size
    if any(not 0 <= t < vocab for t in spec.history):
        raise BadRequest(f"sample request: history token ids must lie in [0, {vocab})")
    params = SamplingParams(temperature=spec.temperature, repetition_penalty=spec.repetition,
                            frequency_penalty=spec.frequency, presence_penalty=spec.presence,
                            penalty_last_n=spec.penalty_last_n)
    x = await sh.batcher.submit(h)  # (T, n_rows) logits of the slice
    ids, vals, stats = summarize(x, sh.settings.vocab_start, spec.top, params, spec.key, spec.history,
                                 f.position, spec.draw, spec.lse)
    sh.stats["sample_calls"] += 1
    return wire.encode_envelopes(wire.Envelope(f.request_id, "sample", f.position, f.seq_len, a)
                                 for a in (ids, vals, stats))


async def fetch(request: Request, env: Env, ctx) -> Response:
    sh = await shard_for(env, request.headers.get(KNOT_ETAG_HEADER))
    resp = await _route(request, sh)
    resp.headers[KNOT_ETAG_HEADER] = sh.source.etag  # the version this reply was computed from
    return resp


async def _route(request: Request, sh: Shard) -> Response:
    path = request.path
    if path == "/embed" and request.method == "POST":
        f = _frame(request, "embed")
        if f.array.dtype != np.int32 or f.array.ndim != 1:
            raise BadRequest(f"embed envelope holds {f.array.dtype} {f.array.shape}, expected int32 (T,)")
        out = await sh.embed(f.array)
        return Response.from_bytes(wire.encode_envelope(wire.Envelope(f.request_id, "embed", f.position,
                                                                      f.seq_len, out)), wire.ENVELOPE_CONTENT_TYPE)
    if path == "/logits" and request.method == "POST":
        f = _frame(request, "logits")
        out = await sh.batcher.submit(_hidden(sh, f))
        return Response.from_bytes(wire.encode_envelope(wire.Envelope(f.request_id, "logits", f.position,
                                                                      f.seq_len, out)), wire.ENVELOPE_CONTENT_TYPE)
    if path == "/sample" and request.method == "POST":
        return Response.from_bytes(await _sample(sh, request.body), wire.ENVELOPE_CONTENT_TYPE)
    if path == "/sample_many" and request.method == "POST":  # concurrent generations' rows: one head pass
        return await serve_bundle(request.body, lambda body: _sample(sh, body))
    if path == "/stats" and request.method == "GET":
        s = sh.settings
        return Response.from_json({"boot_key": s.boot_key, "vocab_start": s.vocab_start, "vocab_end": s.vocab_end,
                                   "head": sh.head_name, "head_bytes": sh.head.nbytes,
                                   "head_f32_cached": sh.head_f32 is not None, **sh.stats, **sh.batcher.stats(),
                                   **sh.warden_stats(), **sh.source.stats(), "knot_reloads": _booted.reloads,
                                   "instance": _booted.instance})
    raise NotFound(f"{request.method} {path}: the shard serves POST /embed, POST /logits, POST /sample, "
                   f"POST /sample_many, GET /stats")
