"""The distributed pipeline in one process (embedded bindings, the real handlers): any split gives
the single-process engine's tokens; failures degrade or recover as issue 5 says."""
from __future__ import annotations

import numpy as np
import pytest

from common import wire
from common.runtime import Request, Response, ServiceUnavailable
from common.sampling import SamplingParams
from deploy.engine_local import LocalEngine
from services.station import handler as station_handler
from tests.inprocess import build_cluster

PROMPT = "the def the"


@pytest.fixture(scope="module")
def engine(tiny_knot):
    return LocalEngine.open(tiny_knot)


def reference(engine, prompt, max_tokens, **sampling):
    ids = engine.tokenizer.encode(prompt)
    return engine.generate(ids, SamplingParams(**sampling), max_tokens=max_tokens)


@pytest.mark.parametrize("n_stations,n_shards", [(1, 1), (2, 8), (2, 3)])
async def test_cluster_tokens_equal_single_process(tiny_knot, tmp_path, engine, n_stations, n_shards):
    c = await build_cluster(tiny_knot, tmp_path, n_stations, n_shards)
    r = await c.generate(prompt=PROMPT, max_tokens=10)
    assert r.status == 200, r.body
    body = r.json()
    want = reference(engine, PROMPT, 10)
    assert body["prompt_tokens"] == engine.tokenizer.encode(PROMPT)
    assert body["tokens"] == want.token_ids
    assert body["text"] == want.text
    assert body["degraded_shards"] == [] and body["replays"] == 0
    assert set(body["timings"]["hops"]) == {"embed", "logits", *(f"station_{i}" for i in range(n_stations))}
    await c.drain()


async def test_seeded_sampling_equals_single_process(tiny_knot, tmp_path, engine):
    c = await build_cluster(tiny_knot, tmp_path, 2, 4)
    params = dict(temperature=0.9, top_k=40, top_p=0.95, seed=1234)
    r1 = (await c.generate(prompt=PROMPT, max_tokens=12, **params)).json()
    r2 = (await c.generate(prompt=PROMPT, max_tokens=12, **params)).json()
    want = reference(engine, PROMPT, 12, **params)
    assert r1["tokens"] == r2["tokens"] == want.token_ids
    await c.drain()


async def test_three_stations_fluid_budget(tiny_knot, tmp_path, engine):
    """A tiny budget (matmul's 512 KiB tile, a KV block, a chunk's frames, one phase's tensors and
    the activations): a station cannot keep all its matrices and streams the rest, tokens unchanged."""
    budget = 1536 << 10
    c = await build_cluster(tiny_knot, tmp_path, 2, 2, station_budget_bytes=budget)
    body = (await c.generate(prompt=PROMPT, max_tokens=6)).json()
    assert body["tokens"] == reference(engine, PROMPT, 6).token_ids
    stats = (await c.stations[0].fetch(Request("GET", "/stats"))).json()
    header = (await station_handler.station_for(c.station_envs[0], None)).header
    matrices = sum(e.length for n, e in header.tensors.items() if n.startswith("blk.0.") and len(e.shape) == 2)
    assert stats["kept_bytes"] < matrices < stats["warden_bytes"] and stats["budget_bytes"] == budget
    assert stats["peak_accounted_bytes"] <= budget
    await c.drain()


class Dead:
    """A shard that is down."""

    async def fetch(self, request: Request) -> Response:
        raise ServiceUnavailable("connection refused (shard killed by the test)")


async def test_killed_shard_degrades_only_its_tokens(tiny_knot, tmp_path, engine):
    c = await build_cluster(tiny_knot, tmp_path, 2, 4)
    ids = engine.tokenizer.encode(PROMPT)
    victim = next(i for i, (a, b) in enumerate(c.shard_ranges) if any(a <= t < b for t in ids))
    a, b = c.shard_ranges[victim]
    c.coordinator.env._items[f"SHARD_{victim}"] = Dead()
    from services.coordinator import handler as co
    co._booted.clear()
    body = (await c.generate(prompt=PROMPT, max_tokens=4)).json()
    stages = {d["stage"] for d in body["degraded_shards"]}
    assert {"embed", "logits"} <= stages
    assert all(d["shard"] == victim and (d["vocab_start"], d["vocab_end"]) == (a, b) for d in body["degraded_shards"])
    assert not any(a <= t < b for t in body["tokens"]), "a dead shard's slice is -inf: never sampled"
    # The merge itself: tokens outside the dead range keep their exact embeddings.
    from services.coordinator.pipeline import Hops
    boot = await co.coordinator_for(c.coordinator.env)
    degraded = []
    x = await boot.pipeline.embed("probe", ids, 0, Hops(), degraded)
    full = engine.weight("token_embd.weight").dequantize()[ids]
    for i, t in enumerate(ids):
        np.testing.assert_array_equal(x[i], 0 if a <= t < b else full[i])
    co._booted.clear()
    await c.drain()


async def test_station_restart_mid_generation_replays(tiny_knot, tmp_path, engine):
    c = await build_cluster(tiny_knot, tmp_path, 2, 2)
    exit_station = c.stations[1]
    calls = {"n": 0}
    real = exit_station.handler

    async def restarting(request, env, ctx):
        calls["n"] += 1
        if calls["n"] == 5:  # the isolate dies between two decode steps: its RAM is gone
            station_handler._booted.clear()
        return await real(request, env, ctx)

    exit_station.handler = restarting
    body = (await c.generate(prompt=PROMPT, max_tokens=10)).json()
    assert body["replays"] == 1
    assert body["tokens"] == reference(engine, PROMPT, 10).token_ids
    await c.drain()


async def test_configuration_change_reboots_the_station(tiny_knot, tmp_path):
    c = await build_cluster(tiny_knot, tmp_path, 2, 2)
    st = c.stations[0]
    s1 = (await st.fetch(Request("GET", "/stats"))).json()
    again = (await st.fetch(Request("GET", "/stats"))).json()
    assert again["boots"] == s1["boots"], "same configuration: no reboot"
    st.env._items["SPECIALIZATION_END_LAYER"] = "2"
    st.env._items["SPECIALIZATION_ROLE"] = "solo"
    s2 = (await st.fetch(Request("GET", "/stats"))).json()
    assert s2["boots"] == s1["boots"] + 1
    assert s1["boot_key"].endswith("|entry|0-1") and s2["boot_key"].endswith("|solo|0-2")
    await c.drain()


async def test_malformed_frames_get_400(tiny_knot, tmp_path):
    c = await build_cluster(tiny_knot, tmp_path, 2, 2)
    good = wire.encode_envelope(wire.Envelope("r", "prefill", 0, 1, np.zeros((1, 256), np.float32)))
    for body, needle in [(b"garbage-garbage-garbage-garbage", "magic"), (good[:-3], "needs"), (good[:-1] + b"\x00", "crc32")]:
        r = await c.stations[0].fetch(Request("POST", "/forward", {}, body))
        assert r.status == 400 and needle in r.json()["message"], r.body
    wrong = wire.encode_envelope(wire.Envelope("r", "prefill", 0, 1, np.zeros((1, 7), np.float32)))
    r = await c.stations[0].fetch(Request("POST", "/forward", {}, wrong))
    assert r.status == 400 and "(T>0, 256)" in r.json()["message"]
    decode_unknown = wire.encode_envelope(wire.Envelope("nobody", "decode", 5, 6, np.zeros((1, 256), np.float32)))
    r = await c.stations[0].fetch(Request("POST", "/forward", {}, decode_unknown))
    assert r.status == 409 and r.json()["error"] == "UnknownSession"
    r = await c.shards[0].fetch(Request("POST", "/embed", {}, good))
    assert r.status == 400 and "expected 'embed'" in r.json()["message"]
    # the services survive all that
    assert (await c.generate(prompt=PROMPT, max_tokens=2)).status == 200
    await c.drain()


async def test_generate_validation(tiny_knot, tmp_path):
    c = await build_cluster(tiny_knot, tmp_path, 1, 1)
    cases = [({"prompt": 5}, "prompt must be a string"), ({}, "exactly one of"),
             ({"prompt": "x", "max_tokens": 0}, "max_tokens must be >= 1"),
             ({"prompt": "x", "temperature": -1}, "temperature must be >= 0"),
             ({"prompt": "x", "max_tokens": 10**6}, "exceeds the context length"),
             ({"prompt": "x", "stop": [1]}, "stop must be")]
    for body, needle in cases:
        r = await c.generate(**body)
        assert r.status == 400 and needle in r.json()["message"], (body, r.body)
    r = await c.coordinator.fetch(Request("POST", "/generate", {}, b"{not json"))
    assert r.status == 400 and "not JSON" in r.json()["message"]
    await c.drain()


async def test_bad_shard_tiling_is_refused(tiny_knot, tmp_path):
    c = await build_cluster(tiny_knot, tmp_path, 2, 2)
    from services.coordinator import handler as co
    c.coordinator.env._items["SHARDS"] = "SHARD_0:0-100,SHARD_1:120-270"
    r = await c.generate(prompt=PROMPT, max_tokens=1)
    assert r.status == 503
    assert "vocabulary gap: tokens [100, 120)" in r.json()["message"]
    with pytest.raises(Exception, match="vocabulary gap"):
        await co.ready(c.coordinator.env)
    await c.drain()


async def test_stop_strings_and_chat(tiny_knot, tmp_path, engine):
    c = await build_cluster(tiny_knot, tmp_path, 2, 2)
    full = reference(engine, PROMPT, 10)
    if len(full.text) > 3:
        stop = full.text[2:4]
        body = (await c.generate(prompt=PROMPT, max_tokens=10, stop=stop)).json()
        assert body["finish_reason"] == "stop" and stop not in body["text"]
        assert full.text.startswith(body["text"])
    body = (await c.generate(messages=[{"role": "user", "content": "hi"}], max_tokens=3)).json()
    want = engine.tokenizer.encode(engine.tokenizer.render_chat([{"role": "user", "content": "hi"}]))
    assert body["prompt_tokens"] == want
    await c.drain()


async def test_station_budget_holds_when_a_long_prefill_follows_decode(tiny_knot, tmp_path):
    """Decode steps keep tensors (little activation memory); a long prefill after them must evict
    kept tensors to make room for its activations instead of overshooting the budget."""
    budget = 2560 << 10  # tile 512 KiB, a KV block, a chunk's frames, the ~0.6 MiB of matrices: all kept while decoding
    c = await build_cluster(tiny_knot, tmp_path, 2, 2, station_budget_bytes=budget)
    await c.generate(prompt="the", max_tokens=8)
    kept = (await c.stations[0].fetch(Request("GET", "/stats"))).json()["kept_tensors"]
    assert kept > 0, "decode keeps tensors when they fit"
    long_prompt = " ".join(["the def"] * 60)
    r = await c.generate(prompt=long_prompt, max_tokens=2)
    assert r.status == 200, r.body
    for st in c.stations:
        s = (await st.fetch(Request("GET", "/stats"))).json()
        assert s["peak_accounted_bytes"] <= budget, s
    await c.drain()


async def test_fluid_station_streams_only_what_it_cannot_keep(tiny_knot, tmp_path):
    """A budget that holds about half a station's matrices. Layers are read in the same cyclic
    order every forward; evicting least recently used there would evict exactly the tensor needed
    next and hit nothing. The station keeps a stable set instead: each decode forward moves from
    the warden only the bytes it does not keep."""
    c = await build_cluster(tiny_knot, tmp_path, 1, 1, station_budget_bytes=1792 << 10)
    st = c.stations[0]
    await c.generate(prompt="the", max_tokens=3)
    s0 = (await st.fetch(Request("GET", "/stats"))).json()
    await c.generate(prompt="the", max_tokens=7)
    s1 = (await st.fetch(Request("GET", "/stats"))).json()
    forwards = s1["forwards"] - s0["forwards"]
    per_forward = (s1["warden_bytes"] - s0["warden_bytes"]) / forwards
    header = (await station_handler.station_for(c.station_envs[0], None)).header
    sizes = [e.length for n, e in header.tensors.items()
             if n.startswith("blk.") and n.endswith(".weight") and "norm" not in n]
    matrices = sum(sizes)
    assert 0 < s1["kept_bytes"] < matrices, s1
    assert per_forward > 0, "the budget is too small to keep everything: this station is fluid"
    # Every kept byte is a hit, except the streamed tail's last tensor, which the next miss evicts.
    assert per_forward <= matrices - s1["kept_bytes"] + max(sizes), (per_forward, matrices, s1["kept_bytes"])
    await c.drain()


async def test_shard_row_cache_serves_repeats_within_its_bytes(tiny_knot, tmp_path):
    from common.runtime import Env
    from services.shard.handler import ShardSettings

    c = await build_cluster(tiny_knot, tmp_path, 1, 1)
    sh = c.shards[0]
    frame = lambda ids: Request("POST", "https://shard/embed", {}, wire.encode_envelope(
        wire.Envelope("r", "embed", 0, len(ids), np.asarray(ids, np.int32))))
    a = wire.decode_envelope((await sh.fetch(frame([5, 7, 5]))).body).array
    b = wire.decode_envelope((await sh.fetch(frame([7, 5]))).body).array
    np.testing.assert_array_equal(b, a[[1, 0]])  # the local copy is the warden's row, bit for bit
    s = (await sh.fetch(Request("GET", "/stats"))).json()
    assert s["rows_from_warden"] == 2 and s["rows_from_local"] == 2
    with pytest.raises(ServiceUnavailable, match="ROW_CACHE_BYTES"):
        ShardSettings.from_env(Env({"KNOT_KEY": "k", "VOCAB_START": "0", "VOCAB_END": "9",
                                    "MEMORY_BUDGET_BYTES": "1000", "ROW_CACHE_BYTES": "600"}))
    await c.drain()


async def test_concurrent_decodes_are_batched_and_each_equals_the_single_process(tiny_knot, tmp_path, engine):
    """Batched decode: generations in flight together share station forwards (each weight read
    once per step for all of them); every one still gets exactly its single-process tokens."""
    import asyncio

    c = await build_cluster(tiny_knot, tmp_path, 2, 3)
    prompts = ["the", "def the", "the def the def", "def"]
    bodies = [r.json() for r in await asyncio.gather(*(c.generate(prompt=p, max_tokens=8) for p in prompts))]
    for p, body in zip(prompts, bodies):
        assert body["tokens"] == reference(engine, p, 8).token_ids, p
        assert body["replays"] == 0
    await c.drain()  # the releases run after the responses (wait_until)
    for st in c.stations:
        s = (await st.fetch(Request("GET", "/stats"))).json()
        assert s["largest_batch"] > 1, s
        assert s["batches"] < s["batched_items"], "some forwards carried more than one request"
        assert s["sessions"] == 0, "every session released"
    await c.drain()
