"""Typed calls to a cobordism shard (services/shard/handler.py): what the coordinator sends it."""
from __future__ import annotations

from typing import Any

from common import wire
from common.runtime import BadGateway
from services.bundle import post_bundle
from services.peer import get_json, post_envelope, post_pinned

# a /sample reply: candidate ids, their logits, the rows' stats
SAMPLE_REPLY = [("sample", "<i4"), ("sample", "<f4"), ("sample", "<f8")]


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
        if [(e.mode, e.array.dtype.str) for e in envs] != SAMPLE_REPLY:
            raise BadGateway(f"/sample: reply of {[(e.mode, e.array.dtype.str) for e in envs]}, "
                             f"expected {SAMPLE_REPLY}")
        return envs

    async def sample_many(self, bodies: list[bytes], timeout_s: float) -> list[list[wire.Envelope] | None]:
        """Several generations' sample calls in one (POST /sample_many), each body a /sample body
        (wire.encode_sample_request: every shard gets the same) -> per call the slice's summary, or
        None where its part failed or is malformed (the caller makes that call alone)."""
        parts = await post_bundle(self.binding, "/sample_many", bodies, timeout_s, self.knot_etag)
        out: list[list[wire.Envelope] | None] = []
        for status, body in parts:
            try:
                envs = wire.decode_envelopes(body) if status == 200 else None
            except wire.WireError:
                envs = None
            out.append(envs if envs is not None and
                       [(e.mode, e.array.dtype.str) for e in envs] == SAMPLE_REPLY else None)
        return out

    async def stats(self, timeout_s: float | None = None) -> dict:
        return await get_json(self.binding, "/stats", self.timeout_s if timeout_s is None else timeout_s)
