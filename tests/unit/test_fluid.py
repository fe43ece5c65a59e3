"""Issue 15, the fluid path: a station that streams its phases from the LayerWarden prefetches the
next phase while one computes (off the event loop), within its budget, and gives the same tokens;
concurrent sessions' decodes share one streamed copy of each phase."""
from __future__ import annotations

import asyncio
import threading

import numpy as np

from common import wire
from common.models import model_for
from common.models.qwen2 import Qwen2
from common.runtime import Request
from deploy.knotfile import open_model
from tests.inprocess import build_cluster

# One station of both tiny layers: ~1.25 MB of layer tensors beside ~0.81 MB fixed, so at this
# budget it streams most phases each step and has room for two at once (prefetch_fits) in decode.
PREFETCH_BUDGET_BYTES = 1_800_000
BATCH_BUDGET_BYTES = 2_400_000


async def _run(tiny_knot, tmp_path, prefetch: str, monkeypatch):
    in_thread: list[bool] = []
    real = Qwen2.run_phase

    def spy(self, layer, phase, state, w, seqs):
        in_thread.append(threading.current_thread() is not threading.main_thread())
        return real(self, layer, phase, state, w, seqs)

    monkeypatch.setattr(Qwen2, "run_phase", spy)
    c = await build_cluster(tiny_knot, tmp_path / prefetch, n_stations=1, n_shards=2,
                            station_budget_bytes=PREFETCH_BUDGET_BYTES, station_vars={"PREFETCH": prefetch})
    tokens = []
    for prompt in ("the def", "def the quick"):
        r = await c.generate(prompt=prompt, max_tokens=8)
        assert r.status == 200, r.body
        tokens.append(r.json()["tokens"])
    stats = (await c.stations[0].fetch(Request("GET", "https://station/stats"))).json()
    await c.drain()
    return tokens, stats, in_thread


async def test_prefetch_gives_the_same_tokens_within_the_budget_and_computes_off_the_loop(
        tiny_knot, tmp_path, monkeypatch):
    on, on_stats, on_threads = await _run(tiny_knot, tmp_path, "on", monkeypatch)
    off, off_stats, off_threads = await _run(tiny_knot, tmp_path, "off", monkeypatch)
    assert on == off and all(len(t) == 8 for t in on)

    assert on_stats["memory"]["prefetch"] and not on_stats["memory"]["fits"]
    assert on_stats["prefetched_phases"] > 0, on_stats
    assert on_stats["peak_accounted_bytes"] <= on_stats["budget_bytes"] == PREFETCH_BUDGET_BYTES
    assert any(on_threads), "phases computed in a worker thread while the next one loaded"
    assert on_stats["warden_tensors"] > 0, "the phases came from the LayerWarden"

    assert not off_stats["memory"]["prefetch"] and off_stats["prefetched_phases"] == 0
    assert off_stats["peak_accounted_bytes"] <= off_stats["budget_bytes"]
    assert not any(off_threads), "without a load in flight every phase computes in place"


async def test_concurrent_decodes_at_a_fluid_station_share_one_load_of_each_phase(tiny_knot, tmp_path):
    """Three sessions' decode frames arrive together: they run as one forward (services/batcher.py),
    which loads each streamed tensor from the warden once for all of them, not once per session."""
    # room for three sessions' KV blocks (~0.5 MB each), which leaves too little to keep the layers
    c = await build_cluster(tiny_knot, tmp_path, n_stations=1, n_shards=2, station_budget_bytes=BATCH_BUDGET_BYTES)
    st = c.stations[0]
    dim = model_for(open_model(tiny_knot).header).cfg.dim
    rng = np.random.default_rng(0)

    async def forward(rid: str, mode: str, pos: int, x: np.ndarray) -> np.ndarray:
        body = wire.encode_envelope(wire.Envelope(rid, mode, pos, pos + len(x), x))
        r = await st.fetch(Request("POST", "https://station/forward", {}, body))
        assert r.status == 200, r.body
        return wire.decode_envelope(r.body).array

    async def stats() -> dict:
        return (await st.fetch(Request("GET", "https://station/stats"))).json()

    rids = ["a", "b", "c"]
    xs = {rid: (rng.standard_normal((4, dim)) * 0.1).astype(np.float32) for rid in rids}
    for rid in rids:  # prefills, one after another
        await forward(rid, "prefill", 0, xs[rid][:3])
    s0 = await stats()
    alone = await forward("a", "decode", 3, xs["a"][3:])  # one decode alone: what a forward streams
    s1 = await stats()
    one_forward = s1["warden_tensors"] - s0["warden_tensors"]
    assert s1["forwards"] - s0["forwards"] == 1 and one_forward > 0, "fluid: a decode streams phases"

    outs = await asyncio.gather(*(forward(rid, "decode", 3 + (rid == "a"), xs[rid][3:]) for rid in rids))
    s2 = await stats()
    assert s2["forwards"] - s1["forwards"] == 1 and s2["largest_batch"] == 3, s2
    streamed = [n for n in header_tensors(tiny_knot) if "norm" not in n and not n.endswith(".bias")]  # the matrices
    loads = s2["warden_tensors"] - s1["warden_tensors"]
    assert 0 < loads <= len(streamed), f"{loads} tensor loads for 3 decodes: at most one per streamed tensor"
    assert s2["peak_accounted_bytes"] <= s2["budget_bytes"]
    assert outs[0].shape == alone.shape == (1, dim) and not np.array_equal(outs[0], alone)  # a's next position
    await c.drain()


def header_tensors(knot_path) -> list[str]:
    return [n for n in open_model(knot_path).header.tensors if n.startswith("blk.")]


async def test_prefetch_where_threads_cannot_start_computes_inline_with_the_same_tokens(tiny_knot, tmp_path,
                                                                                       monkeypatch):
    """Pyodide has no threads (services/offload.py runs inline): prefetch still gives the same
    tokens, and its loads are still issued ahead, within the budget."""
    from services import offload

    off, _, _ = await _run(tiny_knot, tmp_path / "threads", "off", monkeypatch)
    monkeypatch.setattr(offload, "_threads", False)
    inline, stats, in_thread = await _run(tiny_knot, tmp_path / "inline", "on", monkeypatch)
    assert inline == off and not any(in_thread)
    assert stats["prefetched_phases"] > 0 and stats["peak_accounted_bytes"] <= stats["budget_bytes"]


async def test_a_plan_that_says_prefetch_is_one_a_decode_with_a_session_can_keep(tiny_knot, tmp_path):
    """memory.prefetch is a promise: at every budget where the plan says the station prefetches,
    a generation's decode steps (a session's KV cache beside the two phases) do prefetch. The plan
    counts one KV block for that; without it the low end of this sweep promised what no forward
    had room for."""
    promised = 0
    for budget in range(1_300_000, 3_300_000, 50_000):
        c = await build_cluster(tiny_knot, tmp_path / str(budget), n_stations=1, n_shards=2,
                                station_budget_bytes=budget)
        r = await c.generate(prompt="the def", max_tokens=6)
        if r.status == 400 and (b"no room for a completion" in r.body or b"whose KV cache" in r.body):
            await c.drain()
            continue  # below the least budget that holds this generation's session
        assert r.status == 200, (budget, r.body)
        stats = (await c.stations[0].fetch(Request("GET", "https://station/stats"))).json()
        await c.drain()
        if stats["memory"]["prefetch"] and not stats["memory"]["fits"]:
            promised += 1
            assert stats["prefetched_phases"] > 0, (budget, stats["memory"], stats["prefetched_phases"])
    assert promised >= 3, "the sweep must cross budgets where the plan prefetches"
