"""The coordinator's pipelined prefill (the seed's Wallington Rotation), against fakes of our own
station and shard interfaces: chunks overlap across stations, each station sees its chunks in order."""
from __future__ import annotations

import asyncio

import numpy as np
import pytest

from common import wire
from common.runtime import Conflict, Request, Response
from common.topology import ShardSpec
from services.coordinator.pipeline import Call, Pipeline

DIM = 4


class FakeStation:
    """exit: the last station, which sends a prefill's last row only (as services/station does)."""

    def __init__(self, i: int, log: list, delay_s: float = 0.02, fail_at: int | None = None, exit: bool = False):
        self.i, self.log, self.delay_s, self.fail_at, self.exit = i, log, delay_s, fail_at, exit

    async def fetch(self, request: Request) -> Response:
        env = wire.decode_envelope(request.body)
        if env.position == self.fail_at:
            self.log.append(("fail", self.i, env.position))
            raise Conflict("station failed on this chunk")
        self.log.append(("start", self.i, env.position))
        await asyncio.sleep(self.delay_s)
        self.log.append(("end", self.i, env.position))
        rows = env.array[-1:] if self.exit and env.mode == "prefill" else env.array
        out = wire.Envelope(env.request_id, env.mode, env.position, env.seq_len, rows + 1)
        return Response.from_bytes(wire.encode_envelope(out), wire.ENVELOPE_CONTENT_TYPE)


class FakeShard:
    async def fetch(self, request: Request) -> Response:
        env = wire.decode_envelope(request.body)
        x = np.repeat(env.array.astype(np.float32)[:, None], DIM, axis=1)  # row t = token id
        return Response.from_bytes(wire.encode_envelope(wire.Envelope(env.request_id, "embed", env.position,
                                                                      env.seq_len, x)), wire.ENVELOPE_CONTENT_TYPE)


def pipeline(stations) -> Pipeline:
    return Pipeline(stations, [(ShardSpec(0, 0, 1000), FakeShard())], DIM, 1000, 5.0, 5.0, 0.0)


async def test_chunks_overlap_across_stations_and_stay_in_order_per_station():
    log: list = []
    p = pipeline([FakeStation(0, log), FakeStation(1, log, exit=True)])
    ids = list(range(12))
    chunks = [(0, 4), (4, 8), (8, 12)]
    h = await p.prefill(Call("r"), ids, chunks)
    np.testing.assert_array_equal(h, np.full((1, DIM), 11 + 2, np.float32))  # the last chunk's last row
    for i in (0, 1):
        assert [pos for ev, st, pos in log if st == i and ev == "start"] == [0, 4, 8], "in order per station"
    # the rotation: station 0 starts chunk k+1 before station 1 has finished chunk k
    assert log.index(("start", 0, 4)) < log.index(("end", 1, 0))
    assert log.index(("start", 0, 8)) < log.index(("end", 1, 4))
    # and never runs two chunks at once on one station
    for i in (0, 1):
        evs = [ev for ev, st, _ in log if st == i]
        assert evs == ["start", "end"] * 3


async def test_a_failed_chunk_cancels_the_rest_instead_of_hanging():
    log: list = []
    p = pipeline([FakeStation(0, log), FakeStation(1, log, fail_at=4, exit=True)])
    before = asyncio.all_tasks()
    with pytest.raises(Conflict, match="station failed on this chunk"):
        await asyncio.wait_for(p.prefill(Call("r"), list(range(12)), [(0, 4), (4, 8), (8, 12)]), 2.0)
    # The chunk after the failed one waits for an event the failed chunk never sets: unless prefill
    # cancels it (and awaits the cancellation) it stays pending forever, holding its activations.
    left = asyncio.all_tasks() - before  # all_tasks() holds the tasks not yet finished
    assert not left, f"chunk tasks still pending after the failure: {left}"
    assert ("start", 1, 8) not in log, "no chunk after the failed one reached station 1"
