"""Typed calls to a shard's CobordismWarden (services/cobordism_warden/cobordism_warden.py)."""
from __future__ import annotations

from common import wire
from services.cobordism_warden.cobordism_warden import FIELDS, WARM_HEADER
from services.warden_base import WardenClient


class CobordismWardenClient(WardenClient):
    """CobordismWardenClient(namespace, knot_key, vocab_start, vocab_end, knot_etag); warm() starts the
    warden's warm-up, and after it every rows() call asks a warden that lost its RAM to warm again."""

    FIELDS = FIELDS
    URL = "https://cobordism-warden"

    async def rows(self, rows: list[int]) -> list[wire.TensorFrame]:
        """One-row frames of the embedding (row_start = the row id), one per distinct row. Raises HttpError
        or TimeoutError when the warden fails or answers non-2xx, wire.WireError when its batch does not decode."""
        resp = await self._post("/tensors", wire.ROWS_CONTENT_TYPE, wire.encode_rows(rows))
        return wire.decode_batch(resp.body)

    async def warm(self) -> dict:
        """Ask the warden to read this slice into its RAM in the background (once per version) -> its answer."""
        self.headers = self.headers | {WARM_HEADER: "1"}
        return (await self._post("/warm")).json()
