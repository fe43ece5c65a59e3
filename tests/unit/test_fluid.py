"""Issue 15, the fluid path: a station that streams its phases from the LayerWarden prefetches the
next phase while one computes (off the event loop), within its budget, and gives the same tokens."""
from __future__ import annotations

import threading

from common.models.qwen2 import Qwen2
from common.runtime import Request
from tests.inprocess import build_cluster

# One station of both tiny layers: ~1.25 MB of layer tensors beside ~0.81 MB fixed, so at this
# budget it streams most phases each step and has room for two at once (prefetch_fits) in decode.
PREFETCH_BUDGET_BYTES = 1_800_000


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
        r = await c.generate(prompt=prompt, max_tokens=8, ignore_eos=True)
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
