"""LayerWarden Durable Object: a layer station's tensor cache (seed sections 4, 7, 8).

    L1  this DO's RAM: LRU with a byte budget (default 1 GiB) and the residency rule below;
        entries are kept as encoded tensor frames, so a hit costs no crc32 and one copy
    L3  R2 (env.KNOT_BUCKET) ranged reads          (L2, KV, is not used for layer tensors)

Endpoints (identity "{knot_key}|{layer_start}-{layer_end}"):
    POST /configure         {"knot_key", "layer_start", "layer_end", "budget_bytes"?}
    GET  /tensor/<name>     one tensor, as a tensor frame (common.wire)
    POST /tensors           names, one per line (text/plain; what stations send) or {"names": [...]}
                            -> a batch of tensor frames, in request order
    POST /invalidate/<name> drop one entry (a station that rejected a frame asks for this)
    GET  /stats             hits, misses, bytes_resident, r2_bytes_read, ...
"""
from __future__ import annotations

import asyncio
import re
from typing import Any, Callable

from common import wire
from common.knot import KnotHeader, UnknownTensor
from common.lru import ByteLRU
from common.models import Model
from common.runtime import BadRequest, NotFound, Request, Response
from common.settings import default
from services.warden_base import Identity, IdentityFields, WardenBase, budget_from

DEFAULT_BUDGET_BYTES = default("MEMORY_BUDGET_BYTES", "layer_warden")  # 1 GiB
RESIDENT_BELOW_BYTES = 1 << 20
MAX_BATCH = 256
_BLOCK = re.compile(r"^blk\.(\d+)\.")

FIELDS = IdentityFields("layer_start", "layer_end", "X-Layer-Start", "X-Layer-End")


def resident_rule(model: Model) -> Callable[[str, int], bool]:
    """Seed section 4 (loader.rs pick_resident_names): never evicted once cached. The model's
    resident tensors (norms, biases), the tensors outside the layers, and anything under 1 MiB."""
    outside = frozenset({model.TOKEN_EMBD, model.OUTPUT_NORM, model.OUTPUT})
    return lambda name, nbytes: model.is_resident(name) or name in outside or nbytes < RESIDENT_BELOW_BYTES


class LayerWarden(WardenBase):
    FIELDS = FIELDS
    ROUTES = {
        ("POST", "/configure"): "configure",
        ("GET", "/tensor/"): "tensor",
        ("POST", "/tensors"): "tensors",
        ("POST", "/invalidate/"): "invalidate",
        ("GET", "/stats"): "stats",
    }

    def __init__(self, state, env):
        super().__init__(state, env)
        self.header: KnotHeader | None = None
        self.cache: ByteLRU[str, bytes] = ByteLRU(DEFAULT_BUDGET_BYTES)  # name -> encoded frame; set at configure

    def _validate(self, identity: Identity, header: KnotHeader, model: Model) -> None:
        n_layers = model.cfg.n_layer
        if identity.end > n_layers:
            raise BadRequest(f"layers [{identity.start}, {identity.end}) exceed the knot's {n_layers} layers")

    async def _on_configure(self, header: KnotHeader, model: Model, body: dict) -> None:
        self.header = header
        self.cache = ByteLRU(budget_from(body, self.env, "layer_warden"), resident_rule(model))

    # -------------------------------------------------------- tensors

    async def _frame(self, name: str) -> bytes:
        """The tensor's encoded frame (common.wire.encode_tensor), from RAM or read from R2."""
        assert self.identity is not None and self.header is not None and self.source is not None
        m = _BLOCK.match(name)
        if m and not self.identity.start <= int(m.group(1)) < self.identity.end:
            raise BadRequest(f"tensor {name} is outside this warden's layers "
                             f"[{self.identity.start}, {self.identity.end})")
        try:
            entry = self.header.entry(name)
        except UnknownTensor as e:
            raise NotFound(str(e)) from None
        frame = self.cache.get(name)
        if frame is None:
            start, end = self.header.tensor_range(name)
            data = await self.source.read(start, end)
            frame = wire.encode_tensor(wire.TensorFrame(name, entry.ggml_type, entry.shape, data))
            self.cache.put(name, frame, len(data))  # the budget counts tensor bytes (+ ~60 B of frame)
        return frame

    async def tensor(self, request: Request, name: str) -> Response:
        await self._identified(request)
        if not name:
            raise BadRequest("GET /tensor/<name>: the name is missing")
        return Response.from_bytes(await self._frame(name), wire.TENSOR_CONTENT_TYPE)

    async def tensors(self, request: Request, _rest: str) -> Response:
        await self._identified(request)
        if request.headers.get("Content-Type", "").startswith("text/plain"):  # the stations' form
            try:
                names = wire.decode_names(request.body)
            except wire.WireError as e:
                raise BadRequest(f"POST /tensors: {e}") from None
        else:
            body = request.json()
            names = body.get("names") if isinstance(body, dict) else None
            if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
                raise BadRequest('POST /tensors body must be {"names": [str, ...]}, or names one per line '
                                 f'as {wire.NAMES_CONTENT_TYPE}')
        if len(names) > MAX_BATCH:
            raise BadRequest(f"batch of {len(names)} tensors exceeds {MAX_BATCH}")
        # One missing tensor fails the whole batch (seed section 8: no silent partial loads).
        unique = list(dict.fromkeys(names))
        got = dict(zip(unique, await asyncio.gather(*(self._frame(n) for n in unique))))
        return Response.from_bytes(wire.join_batch([got[n] for n in names]), wire.BATCH_CONTENT_TYPE)

    async def invalidate(self, request: Request, name: str) -> Response:
        await self._identified(request)
        dropped = self.cache.pop(name) is not None
        return Response.from_json({"name": name, "dropped": dropped})

    def _stats(self) -> dict[str, Any]:
        c = self.cache
        return {"layer_start": self.identity.start, "layer_end": self.identity.end,
                "hits": c.stats.hits, "misses": c.stats.misses, "evictions": c.stats.evictions,
                "refused": c.stats.refused, "entries": len(c), "bytes_resident": c.bytes_used,
                "pinned_bytes": c.resident_bytes, "budget_bytes": c.budget_bytes,
                "cached": list(c.keys())}
