"""Typed calls to a station's LayerWarden (services/layer_warden/layer_warden.py)."""
from __future__ import annotations

from common import wire
from services.layer_warden.layer_warden import FIELDS
from services.warden_base import WardenClient


class LayerWardenClient(WardenClient):
    """LayerWardenClient(namespace, knot_key, layer_start, layer_end)."""

    FIELDS = FIELDS
    URL = "https://layer-warden"

    async def tensors(self, names: list[str]) -> list[wire.TensorFrame]:
        """Tensor frames in request order. Raises HttpError or TimeoutError when the warden fails or
        answers non-2xx, wire.WireError when its batch does not decode."""
        resp = await self._post("/tensors", wire.NAMES_CONTENT_TYPE, wire.encode_names(names))
        return wire.decode_batch(resp.parts, resp.body_crc32s)  # blocks as they are mapped, not joined

    async def invalidate(self, name: str) -> bool:
        """Drop one cached tensor (a frame the caller rejected); whether the warden held it."""
        return bool((await self._post(f"/invalidate/{name}")).json().get("dropped"))
