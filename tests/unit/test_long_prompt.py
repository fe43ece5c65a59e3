"""Long prompts inside the stations' memory budget (issue 12): a 30,000-token prompt through the
in-process cluster on a small synthetic model, every station's accounted peak within its budget;
frames that do not fit run in passes; sequences the budget cannot hold are refused with the bytes."""
from __future__ import annotations

import numpy as np
import pytest

from common import wire
from common.runtime import Request
from common.sampling import SamplingParams
from deploy.engine_local import LocalEngine
from tests.inprocess import build_cluster
from tests.tiny_gguf import TinySpec, tiny_knot

# Small dims keep 30k tokens fast; one layer per station, a context past 30k.
SPEC = TinySpec(n_layers=2, hidden=32, ffn=64, n_head=2, n_kv_head=1, context=32768, seed=3)
BUDGET = 16 << 20  # a 30k-token KV cache of one layer (~8.7 MB at most) and a 256-row chunk's activations


@pytest.fixture(scope="module")
def long_knot(tmp_path_factory):
    return tiny_knot(tmp_path_factory.mktemp("longctx"), SPEC, "long")


@pytest.fixture(scope="module")
def long_engine(long_knot):
    return LocalEngine.open(long_knot)


def digits(n: int) -> str:
    """n tokens: the pre-tokenizer makes every digit a token of its own."""
    return ("0123456789" * (n // 10 + 1))[:n]


async def station_stats(c) -> list[dict]:
    return [(await st.fetch(Request("GET", "/stats"))).json() for st in c.stations]


@pytest.mark.parametrize("n_tokens", [3_000, 30_000])
async def test_long_prompt_runs_within_every_station_budget(long_knot, long_engine, tmp_path, n_tokens):
    """Before issue 12 the first chunk was half the prompt and attention held (n_head, T, S)
    scores: 3,000 tokens already accounted ~38 MB against this 16 MiB budget, and 30,000 tokens
    ~3.6 GB. Now chunks of 256 rows and tiled attention keep each station within its budget, and
    the cluster's tokens equal the single process's."""
    prompt = digits(n_tokens)
    c = await build_cluster(long_knot, tmp_path, 2, 2, station_budget_bytes=BUDGET)
    r = await c.generate(prompt=prompt, max_tokens=3)
    assert r.status == 200, r.body
    body = r.json()
    assert len(body["prompt_tokens"]) == n_tokens
    for s in await station_stats(c):
        assert 0 < s["peak_accounted_bytes"] <= BUDGET, s
        assert s["split_frames"] == 0 and s["max_session_tokens"] >= n_tokens + 3, s
    want = long_engine.generate(body["prompt_tokens"], SamplingParams(), max_tokens=3)
    assert body["tokens"] == want.token_ids
    await c.drain()


async def test_a_frame_too_big_for_the_budget_runs_in_passes_with_the_same_tokens(long_knot, long_engine, tmp_path):
    """A budget that holds a prefill chunk's KV but not its 256 rows' activations at once: the
    station runs the frame in passes of as many rows as fit, within its budget."""
    budget = 1 << 20
    c = await build_cluster(long_knot, tmp_path, 2, 2, station_budget_bytes=budget)
    r = await c.generate(prompt=digits(600), max_tokens=4)
    assert r.status == 200, r.body
    for s in await station_stats(c):
        assert s["split_frames"] > 0 and s["peak_accounted_bytes"] <= budget, s
    want = long_engine.generate(r.json()["prompt_tokens"], SamplingParams(), max_tokens=4)
    assert r.json()["tokens"] == want.token_ids
    await c.drain()


async def test_a_sequence_the_budget_cannot_hold_is_refused_naming_the_bytes(long_knot, tmp_path):
    """The coordinator refuses a prompt beyond what the stations' KV budgets hold (400, before any
    work); a station refuses a frame it cannot run even one row at a time (413), never running
    over its budget."""
    budget = 4 << 20
    c = await build_cluster(long_knot, tmp_path, 2, 2, station_budget_bytes=budget)
    cap = min(s["max_session_tokens"] for s in await station_stats(c))
    assert 1000 < cap < 20_000
    r = await c.generate(prompt=digits(cap + 10), max_tokens=1)
    assert r.status == 400, r.body
    msg = r.json()["message"]
    assert f"MEMORY_BUDGET_BYTES={budget}" in msg and f"at most the {cap} tokens" in msg, msg
    r = await c.generate(prompt=digits(cap - 10), max_tokens=5)
    assert r.status == 200, r.body
    # Straight to a station: a frame whose KV alone exceeds the budget.
    dim = SPEC.hidden
    frame = wire.Envelope("big", "prefill", 0, 40_000, np.zeros((40_000, dim), np.float32))
    resp = await c.stations[0].fetch(Request("POST", "https://station/forward",
                                             {"Content-Type": wire.ENVELOPE_CONTENT_TYPE}, wire.encode_envelope(frame)))
    assert resp.status == 413 and resp.json()["error"] == "StationMemoryFull", resp.body
    assert f"MEMORY_BUDGET_BYTES={budget}" in resp.json()["message"] and "bytes" in resp.json()["message"]
    s = (await station_stats(c))[0]
    assert s["refused_frames"] == 1 and s["peak_accounted_bytes"] <= budget, s
    await c.drain()
