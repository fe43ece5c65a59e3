"""CobordismWarden Durable Object: a cobordism shard's embedding-row cache (seed sections 4, 7, 8).

    L1  this DO's RAM: raw quantized rows (~2 KB per Q4_K row at hidden 3584), pure LRU, 256 MiB
    L2  KV (env.EMBED_CACHE): dequantized float32 rows, 24 h TTL (services/embed_cache.py)
    L3  R2 (env.KNOT_BUCKET): ranged reads, contiguous rows coalesced into one read

Why raw quant bytes in RAM: a 256 MiB budget holds ~128k Q4_K rows but only ~18k float32 rows,
and dequantizing one row per call is cheap. A row that came back from KV (after a DO restart)
is held as the float32 it arrived as: it cannot be re-quantized exactly, and going to R2 for the
raw bytes is what the L2 tier exists to avoid. The LRU counts the bytes actually held.

Integrity: R2 reads are pinned to the served knot version; every RAM entry is sealed with that
version and an HMAC-SHA256 of its name and content (common/integrity.py CacheKey, under a key of
this warden's own: its memory is its own), checked on each hit (a row is ~0.5-4 KB); KV values
carry the knot version and a MAC under the cluster's secret (KNOT_INTERNAL_SECRET), checked by
embed_cache, so a process that can write Redis but does not hold the secret cannot make a row this
warden serves. Without the secret the warden does not use KV (a warning). A bad entry is a miss,
counted in `rejects` ("ram", "kv"), and refetched; the reply's X-Knot-Cache-Rejects tells the
shard, whose /stats the coordinator's /metrics gathers.

Endpoints (identity "{knot_key}|{vocab_start}-{vocab_end}"):
    POST /configure        {"knot_key", "vocab_start", "vocab_end", "budget_bytes"?}
    POST /tensors          int32 row ids (application/x-knot-rows, tensor in X-Knot-Tensor; what
                           shards send) or {"rows": [int, ...], "tensor"?: "token_embd.weight"} -> batch of
                           one-row tensor frames (row_start = row id), one per distinct row in
                           first-seen order; type is the knot's (Q4_K, ...) or F32 (from KV)
    POST /warm             read this version's slice of token_embd.weight into RAM in the background,
                           once per version, where it fits half the RAM budget -> {"warming", ...};
                           what a shard calls when it boots (and X-Knot-Warm: 1 on its /tensors
                           does the same, for a warden that restarted since)
    POST /invalidate/<row> drop one row of token_embd.weight from RAM
    GET  /stats

Why warm: a new token's row missing from RAM went to KV, then to R2, several times slower than from
RAM and on the critical path (the next token's embedding; cluster_profile.py --only embed). A decode's new
tokens fall anywhere in the slice, so a miss's neighbours do not help; the whole slice does (a 0.5B's
is 11.7 MB, a 7B's ~38 MB, both well inside 256 MiB), read in ranged reads of WARM_CHUNK_BYTES, each
kept as one slab (Slab: its rows' bytes and crc32s; a row fetched alone is looked up first). The
warm-up writes RAM only: a KV write per row (~19k) would cost more than the one ranged R2 read a
restarted warden needs to warm again.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from common import wire
from common.integrity import CacheKey, Seal, crc32
from common.knot import KnotHeader, UnknownTensor
from common.lru import ByteLRU
from common.models import Model
from common.quant import dequantize_rows, row_nbytes
from common.runtime import BadRequest, NotFound, Request, Response, int_param
from common.settings import default, read
from services.embed_cache import EmbedRowCache, cluster_key, process_key
from services.knot_source import KnotSource
from services.warden_base import Identity, IdentityFields, Served, WardenBase, budget_from

log = logging.getLogger(__name__)

DEFAULT_BUDGET_BYTES = default("MEMORY_BUDGET_BYTES", "cobordism_warden")  # 256 MiB
MAX_ROWS = 8192
R2_CONCURRENCY = 8
WARM_CHUNK_BYTES = 4 << 20  # one ranged read of the warm-up, kept as one slab
# On a shard's /tensors: "1" starts the warm-up if this version has none (a warden restarted while
# the shard lived on has lost its RAM, and no shard boots to call /warm).
WARM_HEADER = "X-Knot-Warm"
ROW_TAG = b"warden-row"  # the domain of a RAM row's MAC (named "{tensor}:{row}")
SLAB_TAG = b"warden-slab"  # of a slab's MAC (named "{tensor}:slab:{start}"), over its rows' crc32s


def row_name(tensor: str, row: int) -> str:
    return f"{tensor}:{row}"


def slab_name(tensor: str, start: int) -> str:
    return f"{tensor}:slab:{start}"


@dataclass(frozen=True)
class Slab:
    """Rows [start, start + len(crcs)) of the embedding as one RAM entry (the warm-up's): their raw
    bytes as read at version `etag`, each row's crc32 then, and a MAC of those crc32s (the slab's
    seal). A hit checks the seal once per request (check_seal) and the row's bytes against its crc32.
    One entry, not ~6,800 rows of objects: the warm-up of a 0.5B's eight slices cost ~1.7 s of CPU
    with an entry per row, competing with the first requests' decode; a MAC per row would add
    ~5-10 us a row of Python to it (~1 s for a 0.5B's 152k rows), one per slab ~20 us."""

    etag: str
    ggml_type: str
    ne0: int
    start: int
    data: bytes
    crcs: np.ndarray  # uint32 (rows,)
    mac: bytes  # CacheKey.content_mac(SLAB_TAG, etag, slab_name(tensor, start), crcs' bytes)

    @property
    def nbytes(self) -> int:
        return len(self.data) + self.crcs.nbytes + len(self.mac)

    def check_seal(self, tensor: str, served_etag: str, key: CacheKey) -> str | None:
        """None when the crc32s are the ones sealed at the served version; else what is wrong."""
        return key.problem(Seal(self.etag, 0, self.crcs.nbytes, self.mac), SLAB_TAG, slab_name(tensor, self.start),
                           served_etag, self.crcs)

    def frame(self, tensor: str, row: int) -> tuple[wire.TensorFrame, str | None]:
        """The row's frame, and what is wrong with its bytes (None: they have the sealed crc32)."""
        i, nb = row - self.start, len(self.data) // len(self.crcs)
        payload = memoryview(self.data)[i * nb:(i + 1) * nb]
        want, got = int(self.crcs[i]), crc32(payload)
        problem = None if got == want else f"row {row}: crc32 0x{got:08x}, sealed with 0x{want:08x}"
        return wire.TensorFrame(tensor, self.ggml_type, (self.ne0, 1), payload, row, want), problem

FIELDS = IdentityFields("vocab_start", "vocab_end", "X-Vocab-Start", "X-Vocab-End")


def contiguous_runs(rows: list[int]) -> list[tuple[int, int]]:
    """Sorted distinct rows -> [start, end) runs: [3, 4, 5, 9] -> [(3, 6), (9, 10)]."""
    runs: list[tuple[int, int]] = []
    for r in rows:
        if runs and runs[-1][1] == r:
            runs[-1] = (runs[-1][0], r + 1)
        else:
            runs.append((r, r + 1))
    return runs


@dataclass
class RowCaches:
    """One knot version's row tiers: RAM (tensor, row) -> (seal, frame) and the warm-up's
    (tensor, "slab", start) -> Slab, and KV (None: not bound);
    and the model's row tensors: the embedding, and the LM head (the shards' slices)."""

    ram: ByteLRU[tuple, Any]  # (tensor, row) -> (Seal, TensorFrame); (tensor, "slab", start) -> Slab
    key: CacheKey  # RAM entries' MACs
    kv: EmbedRowCache | None
    embd: str
    row_tensors: frozenset[str]
    warm: dict[str, Any] = field(default_factory=dict)  # the warm-up's: step (rows a slab), rows, seconds


class CobordismWarden(WardenBase):
    FIELDS = FIELDS
    READER = "cobordism_warden"
    ROUTES = {
        ("POST", "/configure"): "configure",
        ("POST", "/tensors"): "tensors",
        ("POST", "/warm"): "warm",
        ("POST", "/invalidate/"): "invalidate",
        ("GET", "/stats"): "stats",
    }

    def _validate(self, identity: Identity, header: KnotHeader, model: Model) -> None:
        try:
            n_rows = header.entry(model.TOKEN_EMBD).n_rows
        except UnknownTensor as e:
            raise NotFound(str(e)) from None
        if identity.end > n_rows:
            raise BadRequest(f"vocab rows [{identity.start}, {identity.end}) exceed the {n_rows} rows "
                             f"of {model.TOKEN_EMBD}")

    def _caches(self, header: KnotHeader, model: Model, source: KnotSource, body: dict) -> RowCaches:
        kv = read(self.env, "EMBED_CACHE", "cobordism_warden")
        kv_key = cluster_key(read(self.env, "KNOT_INTERNAL_SECRET", "cobordism_warden"))
        if kv is not None and kv_key is None:
            log.warning("CobordismWarden: KNOT_INTERNAL_SECRET is unset: KV rows could not be told from forged "
                        "ones, so this warden does not use EMBED_CACHE (rows come from RAM and R2)")
            kv = None
        hidden = header.entry(model.TOKEN_EMBD).shape[0]
        return RowCaches(ByteLRU(budget_from(body, self.env, "cobordism_warden")), process_key(),
                         None if kv is None else EmbedRowCache(kv, kv_key, source.knot_key, source.etag, hidden,
                                                               self.state.wait_until),
                         model.TOKEN_EMBD, frozenset({model.TOKEN_EMBD, model.OUTPUT}))

    # -------------------------------------------------------- rows

    def _parse(self, request: Request, v: Served) -> tuple[str, list[int]]:
        embd, row_tensors = v.caches.embd, v.caches.row_tensors
        if request.headers.get("Content-Type", "") == wire.ROWS_CONTENT_TYPE:  # the shards' form
            try:
                body: Any = {"rows": wire.decode_rows(request.body),
                             "tensor": request.headers.get("X-Knot-Tensor") or embd}
            except wire.WireError as e:
                raise BadRequest(f"POST /tensors: {e}") from None
        else:
            body = request.json()
        if not isinstance(body, dict):
            raise BadRequest('POST /tensors body must be {"rows": [int, ...]}, or int32 row ids as '
                             f'{wire.ROWS_CONTENT_TYPE}')
        tensor = body.get("tensor", embd)
        if tensor not in row_tensors:
            raise BadRequest(f"tensor {tensor!r}: this warden serves rows of {sorted(row_tensors)}")
        if tensor not in v.header.tensors:
            raise NotFound(f"the knot has no {tensor} (tied embeddings: use {embd})")
        rows = body.get("rows")
        if not isinstance(rows, list) or not all(isinstance(r, int) and not isinstance(r, bool) for r in rows):
            raise BadRequest('POST /tensors body must be {"rows": [int, ...]}')
        if len(rows) > MAX_ROWS:
            raise BadRequest(f"batch of {len(rows)} rows exceeds {MAX_ROWS}")
        a, b = self.identity.start, self.identity.end
        bad = [r for r in rows if not a <= r < b]
        if bad:
            raise BadRequest(f"rows {bad[:5]} are outside this warden's vocab slice [{a}, {b}); "
                             f"a shard zero-fills rows it does not own")
        return tensor, list(dict.fromkeys(rows))

    @staticmethod
    def _keep(v: Served, frame: wire.TensorFrame) -> wire.TensorFrame:
        """Put a row frame in RAM, sealed with the version, its crc32 (which its encoding reuses) and its MAC."""
        s = v.caches.key.seal(ROW_TAG, row_name(frame.name, frame.row_start), v.source.etag, frame.payload)
        frame = wire.TensorFrame(frame.name, frame.ggml_type, frame.shape, frame.payload, frame.row_start, s.crc32)
        v.caches.ram.put((frame.name, frame.row_start), (s, frame), s.nbytes)
        return frame

    async def _from_r2(self, v: Served, tensor: str, run: tuple[int, int], sem: asyncio.Semaphore,
                       out: dict[int, wire.TensorFrame]) -> None:
        entry = v.header.entry(tensor)
        ne0 = entry.shape[0]
        async with sem:
            data = await v.source.read_rows(tensor, *run)  # pinned to the served version, chunks checked
        nb = row_nbytes(entry.ggml_type, ne0, tensor)
        for i, row in enumerate(range(*run)):
            payload = data[i * nb:(i + 1) * nb]
            out[row] = self._keep(v, wire.TensorFrame(tensor, entry.ggml_type, (ne0, 1), payload, row))
        if tensor == v.caches.embd and v.caches.kv is not None:
            v.caches.kv.put_rows(run[0], dequantize_rows(data, entry.ggml_type, ne0, tensor))

    def _from_ram(self, v: Served, tensor: str, row: int, rejects: Counter,
                  sealed: dict[int, Slab]) -> wire.TensorFrame | None:
        if (tensor, row) not in v.caches.ram and tensor == v.caches.embd and "step" in v.caches.warm:
            return self._from_slab(v, row, rejects, sealed)
        hit = v.caches.ram.get((tensor, row))
        if hit is None:
            return None
        s, frame = hit
        problem = v.caches.key.problem(s, ROW_TAG, row_name(tensor, row), v.source.etag, frame.payload)
        if problem is None:
            return frame
        rejects["ram"] += 1
        log.warning("CobordismWarden entry %s row %d rejected (%s): refetching", tensor, row, problem)
        v.caches.ram.pop((tensor, row))
        return None

    def _slab_key(self, v: Served, row: int) -> tuple[str, str, int]:
        a, step = self.identity.start, v.caches.warm["step"]
        return v.caches.embd, "slab", a + (row - a) // step * step

    def _from_slab(self, v: Served, row: int, rejects: Counter, sealed: dict[int, Slab]) -> wire.TensorFrame | None:
        """sealed: id -> slab, of the slabs whose seal this request checked already."""
        key = self._slab_key(v, row)
        slab = v.caches.ram.get(key)  # absent: a miss, as the row's would be
        if slab is None:
            return None
        problem = None if sealed.get(id(slab)) is slab else slab.check_seal(v.caches.embd, v.source.etag, v.caches.key)
        if problem is None:
            sealed[id(slab)] = slab
            frame, problem = slab.frame(v.caches.embd, row)
        if problem is None:
            return frame
        rejects["ram"] += 1
        log.warning("CobordismWarden slab %s rows from %d: row %d rejected (%s): dropping the slab", key[0],
                    slab.start, row, problem)
        v.caches.ram.pop(key)
        return None

    async def tensors(self, request: Request, _rest: str) -> Response:
        v = await self._identified(request)
        tensor, rows = self._parse(request, v)
        if request.headers.get(WARM_HEADER) == "1" and not v.caches.warm:  # a restarted warden, asked to warm
            self._start_warm(v)
        rejects: Counter = Counter()
        out: dict[int, wire.TensorFrame] = {}
        missing = []
        sealed: dict[int, Slab] = {}
        for row in rows:  # L1
            frame = self._from_ram(v, tensor, row, rejects, sealed)
            if frame is None:
                missing.append(row)
            else:
                out[row] = frame
        kv = v.caches.kv
        if missing and tensor == v.caches.embd and kv is not None:  # L2
            poisoned = kv.poisoned
            for row, vec in (await kv.get_rows(missing)).items():
                out[row] = self._keep(v, wire.TensorFrame(tensor, "F32", (kv.hidden, 1), vec.tobytes(), row))
            rejects["kv"] += kv.poisoned - poisoned
            missing = [r for r in missing if r not in out]
        if missing:  # L3
            sem = asyncio.Semaphore(R2_CONCURRENCY)
            await asyncio.gather(*(self._from_r2(v, tensor, run, sem, out) for run in contiguous_runs(sorted(missing))))
        return self._reply(v, Response.from_bytes(wire.encode_batch(out[r] for r in rows), wire.BATCH_CONTENT_TYPE),
                           rejects)

    async def warm(self, request: Request, _rest: str) -> Response:
        """Start reading the served version's slice into RAM (once); reply at once with what it does."""
        v = await self._identified(request)
        return self._reply(v, Response.from_json(self._start_warm(v)))

    def _start_warm(self, v: Served) -> dict[str, Any]:
        """The warm-up of v's slice, started unless it was (or cannot be): what /warm answers."""
        c, a, b = v.caches, self.identity.start, self.identity.end
        entry = v.header.entry(c.embd)
        nb = row_nbytes(entry.ggml_type, entry.shape[0], c.embd)
        nbytes = (b - a) * nb
        out: dict[str, Any] = {"rows": b - a, "bytes": nbytes}
        if nbytes > c.ram.budget_bytes // 2:  # it would evict what the requests keep
            c.warm["refused"] = True  # so a shard's X-Knot-Warm does not ask again on every call
            out.update(warming=False, reason=f"the slice's {nbytes} bytes exceed half the RAM budget "
                                             f"({c.ram.budget_bytes} bytes)")
        else:
            out.update(warming=True, already="step" in c.warm)
            if "step" not in c.warm:
                c.warm.update(step=max(1, WARM_CHUNK_BYTES // nb), rows=0, seconds=None)
                self.state.wait_until(self._warm(v, entry.ggml_type, entry.shape[0], nb))
        return out

    async def _warm(self, v: Served, ggml_type: str, ne0: int, nb: int) -> None:
        """The slice in ranged reads of ~WARM_CHUNK_BYTES (rows of nb bytes), each kept as one slab."""
        c, a, b, step = v.caches, self.identity.start, self.identity.end, v.caches.warm["step"]
        t0 = time.perf_counter()
        try:
            for start in range(a, b, step):
                if self.served is not v:  # another version is served now: its caches start empty
                    return
                end = min(b, start + step)
                data = bytes(await v.source.read_rows(c.embd, start, end))  # pinned to v, chunks checked
                view = memoryview(data)
                crcs = np.array([crc32(view[i:i + nb]) for i in range(0, len(data), nb)], np.uint32)
                slab = Slab(v.source.etag, ggml_type, ne0, start, data, crcs,
                            c.key.content_mac(SLAB_TAG, v.source.etag, slab_name(c.embd, start), crcs))
                c.ram.put((c.embd, "slab", start), slab, slab.nbytes)
                c.warm["rows"] += end - start
                await asyncio.sleep(0)  # requests go between reads
        except Exception as e:  # noqa: BLE001 - a warm-up is an optimization: the tiers still serve every row
            log.warning("CobordismWarden %s: warm-up stopped after %d rows: %s: %s", self.identity.name,
                        c.warm["rows"], type(e).__name__, e)
            return
        c.warm["seconds"] = round(time.perf_counter() - t0, 3)
        log.info("CobordismWarden %s: warmed %d rows of %s in %.2f s", self.identity.name, c.warm["rows"],
                 c.embd, c.warm["seconds"])

    async def invalidate(self, request: Request, rest: str) -> Response:
        v = await self._identified(request)
        row = int_param(rest, "row")
        dropped = v.caches.ram.pop((v.caches.embd, row)) is not None
        if "step" in v.caches.warm:  # the warm-up's slab holds the row too
            dropped = v.caches.ram.pop(self._slab_key(v, row)) is not None or dropped
        return self._reply(v, Response.from_json({"row": row, "dropped": dropped}))

    def _stats(self, v: Served) -> dict[str, Any]:
        c = v.caches.ram
        kv = v.caches.kv.stats() if v.caches.kv else {}
        return {"vocab_start": self.identity.start, "vocab_end": self.identity.end,
                "hits": c.stats.hits, "misses": c.stats.misses, "evictions": c.stats.evictions,
                "entries": len(c), "bytes_resident": c.bytes_used, "budget_bytes": c.budget_bytes,
                "kv_enabled": v.caches.kv is not None, "warm_rows": v.caches.warm.get("rows", 0),
                "warm_seconds": v.caches.warm.get("seconds"), **kv}
