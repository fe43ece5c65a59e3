"""Typed calls to a cobordism shard (services/shard/handler.py): what the coordinator sends it."""
from __future__ import annotations

from typing import Any

from common import wire
from common.runtime import BadGateway
from services.peer import get_json, post_envelope, post_pinned


class ShardClient:
    def __init__(self, binding: Any, timeout_s: float, knot_etag: str | None = None):
        self.binding, self.timeout_s = binding, timeout_s
        self.knot_etag = knot_etag  # every hop works on this knot version (None: not checked)

    async def embed(self, frame: wire.Envelope, timeout_s: float | None = None) -> wire.Envelope:
        """int32 tokens (T,) -> float32 (T, dim): the shard's rows, zeros for the tokens it does not own.
        timeout_s: this call's (default: the client's), as for logits."""
        return await post_envelope(self.binding, "/embed", frame, timeout_s or self.timeout_s, self.knot_etag)

    async def logits(self, frame: wire.Envelope, timeout_s: float | None = None) -> wire.Envelope:
        """float32 (T, dim) final normed hidden -> (T, n_rows) logits of the shard's slice."""
        return await post_envelope(self.binding, "/logits", frame, timeout_s or self.timeout_s, self.knot_etag)

    async def sample(self, spec: wire.SampleSpec, frame: wire.Envelope,
                     timeout_s: float | None = None) -> list[wire.Envelope]:
        """float32 (T, dim) final normed hidden -> the slice's summary: ids (T, t), logits (T, t), stats (T, 5)."""
        resp = await post_pinned(self.binding, "/sample", wire.encode_sample_request(spec, frame),
                                 wire.SAMPLE_CONTENT_TYPE, timeout_s or self.timeout_s, self.knot_etag)
        try:
            envs = wire.decode_envelopes(resp.body)
        except wire.WireError as e:
            raise BadGateway(f"/sample: malformed reply: {e}") from None
        want = [("sample", "<i4"), ("sample", "<f4"), ("sample", "<f8")]
        if [(e.mode, e.array.dtype.str) for e in envs] != want:
            raise BadGateway(f"/sample: reply of {[(e.mode, e.array.dtype.str) for e in envs]}, expected {want}")
        return envs

    async def stats(self, timeout_s: float | None = None) -> dict:
        return await get_json(self.binding, "/stats", self.timeout_s if timeout_s is None else timeout_s)
