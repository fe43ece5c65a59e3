"""CobordismWarden Durable Object: a cobordism shard's embedding-row cache (seed sections 4, 7, 8).

    L1  this DO's RAM: raw quantized rows (~2 KB per Q4_K row at hidden 3584), pure LRU, 256 MiB
    L2  KV (env.EMBED_CACHE): dequantized float32 rows, 24 h TTL (services/embed_cache.py)
    L3  R2 (env.KNOT_BUCKET): ranged reads, contiguous rows coalesced into one read

Why raw quant bytes in RAM: a 256 MiB budget holds ~128k Q4_K rows but only ~18k float32 rows,
and dequantizing one row per call is cheap. A row that came back from KV (after a DO restart)
is held as the float32 it arrived as: it cannot be re-quantized exactly, and going to R2 for the
raw bytes is what the L2 tier exists to avoid. The LRU counts the bytes actually held.

Endpoints (identity "{knot_key}|{vocab_start}-{vocab_end}"):
    POST /configure        {"knot_key", "vocab_start", "vocab_end", "budget_bytes"?}
    POST /tensors          int32 row ids (application/x-knot-rows, tensor in X-Knot-Tensor; what
                           shards send) or {"rows": [int, ...], "tensor"?: "token_embd.weight"} -> batch of
                           one-row tensor frames (row_start = row id), one per distinct row in
                           first-seen order; type is the knot's (Q4_K, ...) or F32 (from KV)
    POST /invalidate/<row> drop one row of token_embd.weight from RAM
    GET  /stats
"""
from __future__ import annotations

import asyncio
from typing import Any

from common import wire
from common.knot import KnotHeader, UnknownTensor
from common.lru import ByteLRU
from common.models import Model
from common.quant import dequantize_rows, row_nbytes
from common.runtime import BadRequest, NotFound, Request, Response, int_param
from common.settings import default, read
from services.embed_cache import EmbedRowCache
from services.warden_base import Identity, IdentityFields, WardenBase, budget_from

DEFAULT_BUDGET_BYTES = default("MEMORY_BUDGET_BYTES", "cobordism_warden")  # 256 MiB
MAX_ROWS = 8192
R2_CONCURRENCY = 8

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


class CobordismWarden(WardenBase):
    FIELDS = FIELDS
    ROUTES = {
        ("POST", "/configure"): "configure",
        ("POST", "/tensors"): "tensors",
        ("POST", "/invalidate/"): "invalidate",
        ("GET", "/stats"): "stats",
    }

    def __init__(self, state, env):
        super().__init__(state, env)
        self.header: KnotHeader | None = None
        self.embd = ""  # the embedding's tensor name, from the model at configure
        self.row_tensors: frozenset[str] = frozenset()  # the embedding and the LM head (the shard's slice)
        self.cache: ByteLRU[tuple[str, int], wire.TensorFrame] = ByteLRU(DEFAULT_BUDGET_BYTES)
        self.rows_cache: EmbedRowCache | None = None

    def _validate(self, identity: Identity, header: KnotHeader, model: Model) -> None:
        try:
            n_rows = header.entry(model.TOKEN_EMBD).n_rows
        except UnknownTensor as e:
            raise NotFound(str(e)) from None
        if identity.end > n_rows:
            raise BadRequest(f"vocab rows [{identity.start}, {identity.end}) exceed the {n_rows} rows "
                             f"of {model.TOKEN_EMBD}")

    async def _on_configure(self, header: KnotHeader, model: Model, body: dict) -> None:
        self.header = header
        self.embd, self.row_tensors = model.TOKEN_EMBD, frozenset({model.TOKEN_EMBD, model.OUTPUT})
        self.cache = ByteLRU(budget_from(body, self.env, "cobordism_warden"))
        kv = read(self.env, "EMBED_CACHE", "cobordism_warden")
        if kv is not None:
            assert self.source is not None
            hidden = header.entry(self.embd).shape[0]
            self.rows_cache = EmbedRowCache(kv, f"{self.source.knot_key}@{self.source.etag}", hidden,
                                            self.state.wait_until)

    # -------------------------------------------------------- rows

    def _parse(self, request: Request) -> tuple[str, list[int]]:
        if request.headers.get("Content-Type", "") == wire.ROWS_CONTENT_TYPE:  # the shards' form
            try:
                body: Any = {"rows": wire.decode_rows(request.body),
                             "tensor": request.headers.get("X-Knot-Tensor") or self.embd}
            except wire.WireError as e:
                raise BadRequest(f"POST /tensors: {e}") from None
        else:
            body = request.json()
        if not isinstance(body, dict):
            raise BadRequest('POST /tensors body must be {"rows": [int, ...]}, or int32 row ids as '
                             f'{wire.ROWS_CONTENT_TYPE}')
        tensor = body.get("tensor", self.embd)
        if tensor not in self.row_tensors:
            raise BadRequest(f"tensor {tensor!r}: this warden serves rows of {sorted(self.row_tensors)}")
        if tensor not in self.header.tensors:
            raise NotFound(f"the knot has no {tensor} (tied embeddings: use {self.embd})")
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

    async def _from_r2(self, tensor: str, run: tuple[int, int], sem: asyncio.Semaphore,
                       out: dict[int, wire.TensorFrame]) -> None:
        entry = self.header.entry(tensor)
        ne0 = entry.shape[0]
        async with sem:
            data = await self.source.read(*self.header.row_range(tensor, *run))
        nb = row_nbytes(entry.ggml_type, ne0, tensor)
        for i, row in enumerate(range(*run)):
            frame = wire.TensorFrame(tensor, entry.ggml_type, (ne0, 1), data[i * nb:(i + 1) * nb], row)
            self.cache.put((tensor, row), frame, nb)
            out[row] = frame
        if tensor == self.embd and self.rows_cache is not None:
            self.rows_cache.put_rows(run[0], dequantize_rows(data, entry.ggml_type, ne0, tensor))

    async def tensors(self, request: Request, _rest: str) -> Response:
        await self._identified(request)
        tensor, rows = self._parse(request)
        out: dict[int, wire.TensorFrame] = {}
        missing = []
        for row in rows:  # L1
            frame = self.cache.get((tensor, row))
            if frame is None:
                missing.append(row)
            else:
                out[row] = frame
        if missing and tensor == self.embd and self.rows_cache is not None:  # L2
            hidden = self.rows_cache.hidden
            for row, vec in (await self.rows_cache.get_rows(missing)).items():
                frame = wire.TensorFrame(tensor, "F32", (hidden, 1), vec.tobytes(), row)
                self.cache.put((tensor, row), frame, len(frame.payload))
                out[row] = frame
            missing = [r for r in missing if r not in out]
        if missing:  # L3
            sem = asyncio.Semaphore(R2_CONCURRENCY)
            await asyncio.gather(*(self._from_r2(tensor, run, sem, out) for run in contiguous_runs(sorted(missing))))
        return Response.from_bytes(wire.encode_batch(out[r] for r in rows), wire.BATCH_CONTENT_TYPE)

    async def invalidate(self, request: Request, rest: str) -> Response:
        await self._identified(request)
        row = int_param(rest, "row")
        dropped = self.cache.pop((self.embd, row)) is not None
        return Response.from_json({"row": row, "dropped": dropped})

    def _stats(self) -> dict[str, Any]:
        c = self.cache
        kv = self.rows_cache.stats() if self.rows_cache else {}
        return {"vocab_start": self.identity.start, "vocab_end": self.identity.end,
                "hits": c.stats.hits, "misses": c.stats.misses, "evictions": c.stats.evictions,
                "entries": len(c), "bytes_resident": c.bytes_used, "budget_bytes": c.budget_bytes,
                "kv_enabled": self.rows_cache is not None, **kv}
