"""Typed calls to a layer station (services/station/handler.py): what the coordinator sends it."""
from __future__ import annotations

from typing import Any

from common import wire
from common.runtime import BadGateway, PayloadTooLarge, Request
from services.bundle import post_bundle
from services.peer import PEER_URL, PeerError, call, get_json, post_envelope, post_pinned


class SessionLost(Exception):
    """A station no longer holds the request's KV cache: replay from position 0."""


class StationClient:
    def __init__(self, binding: Any, timeout_s: float, knot_etag: str | None = None):
        self.binding, self.timeout_s = binding, timeout_s
        self.knot_etag = knot_etag  # every hop works on this knot version (None: not checked)

    async def forward(self, frame: wire.Envelope, timeout_s: float | None = None) -> wire.Envelope:
        """A prefill or decode frame through the station's layers; SessionLost when it answers
        UnknownSession, PayloadTooLarge when its memory budget cannot hold the sequence.
        timeout_s: this call's (default: the client's)."""
        try:
            return await post_envelope(self.binding, "/forward", frame, timeout_s or self.timeout_s, self.knot_etag)
        except PeerError as e:
            if e.peer_status == 409 and e.peer_error == "UnknownSession":
                raise SessionLost(e.peer_message or "unknown session") from None
            if e.peer_status == PayloadTooLarge.status:  # StationMemoryFull: the client's sequence is too long here
                raise PayloadTooLarge(f"station: {e.peer_message}") from None
            raise

    async def forward_many(self, frames: list[wire.Envelope], timeout_s: float) -> list[wire.Envelope | None]:
        """Decode frames of several generations in one call (POST /forward_many) -> per frame its
        reply, or None where its part failed (the caller makes that frame's single call, which
        raises what the failure means: SessionLost, ...)."""
        parts = await post_bundle(self.binding, "/forward_many", [wire.encode_envelope(f) for f in frames], timeout_s,
                                  self.knot_etag)
        return [_envelope(status, body) for status, body in parts]

    async def prefix(self, keys: list[bytes], timeout_s: float | None = None) -> int:
        """How many leading blocks of a prompt (its block keys, common.prefix.block_keys) the station's
        prompt cache holds."""
        resp = await post_pinned(self.binding, "/prefix", b"".join(keys), "application/octet-stream",
                                 timeout_s or self.timeout_s, self.knot_etag)
        blocks = resp.json().get("blocks")
        if not isinstance(blocks, int) or isinstance(blocks, bool) or not 0 <= blocks < len(keys):
            raise BadGateway(f"station /prefix: {blocks!r} blocks for {len(keys)} keys")
        return blocks

    async def release(self, request_id: str) -> bool:
        """Drop the request's KV cache; whether the station held one."""
        resp = await call(self.binding, Request("POST", f"{PEER_URL}/release/{request_id}"), self.timeout_s)
        return bool(resp.json().get("released"))

    async def stats(self, timeout_s: float | None = None) -> dict:
        return await get_json(self.binding, "/stats", self.timeout_s if timeout_s is None else timeout_s)


def _envelope(status: int, body: memoryview) -> wire.Envelope | None:
    """A bundle part's envelope; None when the part failed or does not decode."""
    if status != 200:
        return None
    try:
        return wire.decode_envelope(body)
    except wire.WireError:
        return None
