"""Fair scheduling at a station (issue 52): a short frame that arrives while a long prefill chunk
runs goes between two of its phases (INTERLEAVE_ROWS), and every frame's rows are the bits they
are alone. On the real handler of an in-process cluster, a small synthetic model."""
from __future__ import annotations

import asyncio

import numpy as np
import pytest

from common import wire
from common.runtime import Request
from common.sampling import SamplingParams
from deploy.encoder import encode
from deploy.engine_local import LocalEngine
from services.station.station_client import StationClient
from tests.inprocess import build_cluster
from tests.tiny_gguf import TinySpec, write_tiny_gguf

# six layers on one station, four phases each: points between phases where a short frame may go
SPEC = TinySpec(n_layers=6, hidden=64, ffn=128, n_head=4, n_kv_head=2, context=2048, seed=5)
LONG_ROWS = 200  # a prefill chunk longer than INTERLEAVE_ROWS


@pytest.fixture(scope="module")
def knot(tmp_path_factory):
    d = tmp_path_factory.mktemp("fair")
    encode(write_tiny_gguf(d / "fair.gguf", SPEC), d / "fair.knot", progress=False)
    return d / "fair.knot"


def rows(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((n, SPEC.hidden)).astype(np.float32)  # (n, dim)


def frame(rid: str, mode: str, position: int, x: np.ndarray) -> wire.Envelope:
    return wire.Envelope(rid, mode, position, position + x.shape[0], x)


async def stats(station) -> dict:
    return (await station.fetch(Request("GET", "https://station/stats"))).json()


async def in_order(*calls) -> tuple[list[int], list[wire.Envelope]]:
    """Start the calls in this order (each submitted before the station takes any) -> the order in
    which they finished, and their replies."""
    finished: list[int] = []

    async def one(i, c):
        out = await c
        finished.append(i)
        return out

    return finished, await asyncio.gather(*(one(i, c) for i, c in enumerate(calls)))


@pytest.mark.parametrize("interleave_rows, short_first", [("64", True), ("0", False)])
async def test_a_decode_step_runs_between_the_phases_of_a_long_prefill(knot, tmp_path, interleave_rows, short_first):
    """A decode step submitted with a 200-row prefill chunk finishes first: it runs after the
    chunk's first phase. With INTERLEAVE_ROWS=0 it waits for the whole chunk, as before. Either
    way both replies are the bits each frame gives alone."""
    c = await build_cluster(knot, tmp_path, 1, 1, station_vars={"INTERLEAVE_ROWS": interleave_rows})
    st = StationClient(c.stations[0], 30.0)
    long_x, short_x, step_x = rows(LONG_ROWS, 1), rows(5, 2), rows(1, 3)
    await st.forward(frame("b", "prefill", 0, short_x))
    finished, (long_out, step_out) = await in_order(st.forward(frame("a", "prefill", 0, long_x)),
                                                    st.forward(frame("b", "decode", 5, step_x)))
    assert finished == ([1, 0] if short_first else [0, 1])
    assert (await stats(c.stations[0]))["interjected_items"] == (1 if short_first else 0)
    # alone, one after the other, under other session names: the same bits
    alone_long = await st.forward(frame("a2", "prefill", 0, long_x))
    await st.forward(frame("b2", "prefill", 0, short_x))
    alone_step = await st.forward(frame("b2", "decode", 5, step_x))
    np.testing.assert_array_equal(long_out.array, alone_long.array)
    np.testing.assert_array_equal(step_out.array, alone_step.array)
    await c.drain()


async def test_short_prompts_interject_and_longer_frames_wait(knot, tmp_path):
    """A prefill of at most INTERLEAVE_ROWS rows (a short prompt) goes between the phases too; one
    of more rows waits for the running chunk, and a frame of the paused session is refused (409)."""
    c = await build_cluster(knot, tmp_path, 1, 1, station_vars={"INTERLEAVE_ROWS": "64"})
    st = StationClient(c.stations[0], 30.0)
    finished, outs = await in_order(st.forward(frame("a", "prefill", 0, rows(LONG_ROWS, 1))),
                                    st.forward(frame("p", "prefill", 0, rows(64, 4))),
                                    st.forward(frame("q", "prefill", 0, rows(65, 5))))
    assert finished == [1, 0, 2]
    s = await stats(c.stations[0])
    assert s["interjected_items"] == 1 and s["sessions"] == 3
    assert outs[1].array.shape == (1, SPEC.hidden)  # solo: a prefill's last row, normed
    await c.drain()


async def test_tokens_equal_the_single_process_with_a_short_request_during_a_long_prompt(knot, tmp_path):
    """Generations through the in-process cluster, a short sampled request sent with a 2,000-token
    prompt (eight chunks): both have the single process's tokens. (Which finishes first is a matter
    of one event loop here; tests/integration/test_fair_scheduling_cluster.py orders real processes.)"""
    engine = LocalEngine.open(knot)
    c = await build_cluster(knot, tmp_path, 2, 2)
    long_prompt, short_prompt = ("0123456789" * 200), "12 34"
    sampled = dict(temperature=0.9, top_p=0.95, seed=11)
    _, (long_r, short_r) = await in_order(c.generate(prompt=long_prompt, max_tokens=3),
                                          c.generate(prompt=short_prompt, max_tokens=8, **sampled))
    assert long_r.status == 200 and short_r.status == 200, (long_r.body, short_r.body)
    for r, params, n in ((long_r, {}, 3), (short_r, sampled, 8)):
        body = r.json()
        want = engine.generate(body["prompt_tokens"], SamplingParams(**params), max_tokens=n)
        assert body["tokens"] == want.token_ids
    await c.drain()


async def test_a_frame_that_does_not_fit_beside_the_paused_chunk_waits_for_it(knot, tmp_path):
    """A budget that holds the 200-row chunk, and a 64-row prompt after it, but not that prompt
    beside the paused chunk (as the station accounts them): the prompt waits for the chunk to end
    (LATER), with no 413 and nothing evicted, and the budget holds throughout."""
    from services.station import handler as station
    from tests.inprocess import KNOT_KEY

    c = await build_cluster(knot, tmp_path / "probe", 1, 1)
    await StationClient(c.stations[0], 30.0).forward(frame("w", "prefill", 0, rows(1, 9)))  # boots it
    st = station._booted.peek(f"{KNOT_KEY}|solo|0-{SPEC.n_layers}")
    act, kv = st.memory.activation_bytes, st.model.new_kv()
    chunk = (st.memory.resident_bytes + kv.nbytes_after(st.layers, LONG_ROWS) + st.frame_bytes(LONG_ROWS) +
             act(LONG_ROWS, LONG_ROWS) + st.memory.tile_bytes + st.phase_bytes)  # the chunk alone, one pass
    beside = kv.nbytes_after(st.layers, 64) + st.frame_bytes(64) + act(64, 64)  # what the prompt adds to it
    budget = chunk + beside // 2
    await c.drain()

    c = await build_cluster(knot, tmp_path / "tight", 1, 1, station_budget_bytes=budget,
                            station_vars={"INTERLEAVE_ROWS": "64"})
    cl = StationClient(c.stations[0], 30.0)
    finished, (long_out, short_out) = await in_order(cl.forward(frame("a", "prefill", 0, rows(LONG_ROWS, 1))),
                                                     cl.forward(frame("p", "prefill", 0, rows(64, 4))))
    assert finished == [0, 1]
    s = await stats(c.stations[0])
    assert s["interjected_items"] == 0 and s["split_frames"] == 0 and s["refused_frames"] == 0, s
    assert s["sessions"] == 2 and s["sessions_evicted"] == 0 and s["peak_accounted_bytes"] <= budget, s
    assert short_out.array.shape == (1, SPEC.hidden)
    await c.drain()
