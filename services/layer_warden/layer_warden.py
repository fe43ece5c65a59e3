"""LayerWarden Durable Object: a layer station's tensor cache (seed sections 4, 7, 8).

    L1  this DO's RAM: a byte budget (default 1 GiB) and the residency rule below, evicting the most
        recently used first (a station's cyclic scan; common/lru.py); entries are kept as encoded
        tensor frames, so a hit costs no crc32 and one copy (none, where the host offers the binding
        SHARED_BLOCKS: local processes keep large frames in sealed shared memory, which replies name)
    L3  R2 (env.KNOT_BUCKET) ranged reads          (L2, KV, is not used for layer tensors)

Integrity: R2 reads are pinned to the served knot version and checked against the knot's crc32.
Each entry is sealed with that version and the payload's crc32, which the frame's own crc32 is
built from, and an HMAC-SHA256 of (tag, version, name, length, crc32) under this warden's own key
(common/integrity.py CacheKey: a seal MAC, not a content MAC, because the content is tens of MB a
token for a fluid station: docs/reliability.md, "Keyed caches"). A hit whose seal names another
version, or whose MAC fails, is a miss. Its bytes are checked where they
are used: the station compares each frame's payload crc32 (computed while decoding) with the
knot header's, and invalidates an entry that disagrees (counted here in `rejects.reader`). For a
knot without checksums the station has nothing to compare with, so the warden re-checks the
frame's crc32 on every hit instead (a pass over the bytes; re-encode the knot to skip it).

Endpoints (identity "{knot_key}|{layer_start}-{layer_end}"):
    POST /configure         {"knot_key", "layer_start", "layer_end", "budget_bytes"?}
    GET  /tensor/<name>     one tensor, as a tensor frame (common.wire)
    POST /tensors           names, one per line (text/plain; what stations send) or {"names": [...]}
                            -> a batch of tensor frames, in request order
    POST /invalidate/<name> drop one entry (a station that rejected a frame asks for this)
    GET  /stats             hits, misses, bytes_resident, r2_bytes_read, rejects by tier, knot_etag, ...
"""
from __future__ import annotations

import asyncio
import logging
import re
from collections import Counter
from typing import Any, Callable

from common import wire
from common.integrity import Seal, crc32
from common.knot import KnotHeader, UnknownTensor
from common.lru import ByteLRU
from common.models import Model
from common.runtime import BadRequest, DurableObjectState, Env, NotFound, Request, Response
from common.settings import default, read
from services.embed_cache import process_key
from services.knot_source import KnotSource
from services.warden_base import Identity, IdentityFields, Served, WardenBase, budget_from

log = logging.getLogger(__name__)

DEFAULT_BUDGET_BYTES = default("MEMORY_BUDGET_BYTES", "layer_warden")  # 1 GiB
RESIDENT_BELOW_BYTES = 1 << 20
MAX_BATCH = 256
_BLOCK = re.compile(r"^blk\.(\d+)\.")
FRAME_TAG = b"warden-frame"  # the domain of a RAM entry's seal MAC (named by its tensor)

FIELDS = IdentityFields("layer_start", "layer_end", "X-Layer-Start", "X-Layer-End")


def resident_rule(model: Model) -> Callable[[str, int], bool]:
    """Seed section 4 (loader.rs pick_resident_names): never evicted once cached. The model's
    resident tensors (norms, biases), the tensors outside the layers, and anything under 1 MiB."""
    outside = frozenset({model.TOKEN_EMBD, model.OUTPUT_NORM, model.OUTPUT})
    return lambda name, nbytes: model.is_resident(name) or name in outside or nbytes < RESIDENT_BELOW_BYTES


class LayerWarden(WardenBase):
    FIELDS = FIELDS
    READER = "layer_warden"
    ROUTES = {
        ("POST", "/configure"): "configure",
        ("GET", "/tensor/"): "tensor",
        ("POST", "/tensors"): "tensors",
        ("POST", "/invalidate/"): "invalidate",
        ("GET", "/stats"): "stats",
    }

    def __init__(self, state: DurableObjectState, env: Env):
        super().__init__(state, env)
        # This DO's memory: a key only it holds (whoever can write here can read any key, the
        # cluster's secret included); shared blocks are sealed by the kernel besides.
        self.key = process_key()

    def _validate(self, identity: Identity, header: KnotHeader, model: Model) -> None:
        n_layers = model.cfg.n_layer
        if identity.end > n_layers:
            raise BadRequest(f"layers [{identity.start}, {identity.end}) exceed the knot's {n_layers} layers")

    def _caches(self, header: KnotHeader, model: Model, source: KnotSource,
                body: dict) -> ByteLRU[str, tuple[Seal, bytes]]:
        """name -> (seal, encoded frame)."""
        # its station reads the layers in the same order every forward: most recently used goes first
        return ByteLRU(budget_from(body, self.env, "layer_warden"), resident_rule(model), evict_newest=True)

    # -------------------------------------------------------- tensors

    async def _frame(self, v: Served, name: str, rejects: Counter) -> bytes:
        """The tensor's encoded frame (common.wire.encode_tensor), from RAM or read from R2."""
        assert self.identity is not None
        m = _BLOCK.match(name)
        if m and not self.identity.start <= int(m.group(1)) < self.identity.end:
            raise BadRequest(f"tensor {name} is outside this warden's layers "
                             f"[{self.identity.start}, {self.identity.end})")
        try:
            entry = v.header.entry(name)
        except UnknownTensor as e:
            raise NotFound(str(e)) from None
        hit = v.caches.get(name)
        if hit is not None:
            problem = self._problem(v, name, entry.crc32, *hit)
            if problem is None:
                return hit[1]
            rejects["ram"] += 1
            log.warning("LayerWarden entry %s rejected (%s): refetching from R2", name, problem)
            v.caches.pop(name)
        data = await v.source.read_tensor(name)  # pinned, and checked against the knot's crc32
        crc = crc32(data) if entry.crc32 is None else entry.crc32
        frame = wire.encode_tensor(wire.TensorFrame(name, entry.ggml_type, entry.shape, data, payload_crc32=crc))
        frame = self._shared(frame)
        s = self.key.seal(FRAME_TAG, name, v.source.etag, data, crc, content=False)
        v.caches.put(name, (s, frame), len(data))  # budget: tensor bytes (+ ~100 B)
        return frame

    def _shared(self, frame: bytes) -> bytes | memoryview:
        """The frame as the cache keeps it: in a shared block where the host offers SHARED_BLOCKS (local
        processes: a reply then names the block, and the host copies nothing, deploy/local/shm.py),
        else the bytes themselves. A block is a read-only copy: nothing here writes it again."""
        blocks = read(self.env, "SHARED_BLOCKS", "layer_warden")
        kept = blocks.keep(frame) if blocks is not None else None
        return frame if kept is None else kept

    def _problem(self, v: Served, name: str, knot_crc: int | None, seal: Seal, frame: bytes) -> str | None:
        problem = self.key.seal_problem(seal, FRAME_TAG, name, v.source.etag)
        if problem is not None:
            return problem
        if knot_crc is None:  # nobody downstream can check it against the knot: check the frame here
            try:
                got = wire.decode_tensor(frame).payload_crc32
            except wire.WireError as e:
                return str(e)
            if got != seal.crc32:
                return f"payload crc32 0x{got:08x}, sealed with 0x{seal.crc32:08x}"
        return None

    async def tensor(self, request: Request, name: str) -> Response:
        v = await self._identified(request)
        if not name:
            raise BadRequest("GET /tensor/<name>: the name is missing")
        rejects: Counter = Counter()
        frame = await self._frame(v, name, rejects)
        return self._reply(v, Response.from_bytes(frame, wire.TENSOR_CONTENT_TYPE), rejects)

    async def tensors(self, request: Request, _rest: str) -> Response:
        v = await self._identified(request)
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
        rejects: Counter = Counter()
        got = dict(zip(unique, await asyncio.gather(*(self._frame(v, n, rejects) for n in unique))))
        # The frames as the cache holds them, not joined: the host writes them one by one (a 7B's
        # phase is ~56 MB, and the join was a copy of every byte a fluid station streams).
        return self._reply(v, Response.from_parts(wire.batch_parts([got[n] for n in names]), wire.BATCH_CONTENT_TYPE),
                           rejects)

    async def invalidate(self, request: Request, name: str) -> Response:
        """A reader rejected this entry (it disagrees with the knot): drop it, and count it."""
        v = await self._identified(request)
        dropped = v.caches.pop(name) is not None
        rejects = Counter(reader=int(dropped))
        return self._reply(v, Response.from_json({"name": name, "dropped": dropped}), rejects)

    def _stats(self, v: Served) -> dict[str, Any]:
        c = v.caches
        return {"layer_start": self.identity.start, "layer_end": self.identity.end,
                "hits": c.stats.hits, "misses": c.stats.misses, "evictions": c.stats.evictions,
                "refused": c.stats.refused, "entries": len(c), "bytes_resident": c.bytes_used,
                "pinned_bytes": c.resident_bytes, "budget_bytes": c.budget_bytes,
                "cached": list(c.keys())}
