"""The distributed pipeline in one process (embedded bindings, the real handlers): any split gives
the single-process engine's tokens; failures degrade or recover as issue 5 says."""
from __future__ import annotations

import asyncio
import json

import numpy as np
import pytest

from common import wire
from common.kvcache import prefill_chunks
from common.runtime import Request, Response, ServiceUnavailable
from common.sampling import SamplingParams
from deploy.engine_local import LocalEngine
from services.coordinator import cluster_engine
from services.station import handler as station_handler
from tests.inprocess import build_cluster
from tests.unit.test_openai_api import read_sse
from tests.waits import until

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


async def _kill_shard(c, engine, **vars):
    """Shard `victim` (one that owns a prompt token) is down; the coordinator reboots with `vars`."""
    from services.coordinator import handler as co

    ids = engine.tokenizer.encode(PROMPT)
    victim = next(i for i, (a, b) in enumerate(c.shard_ranges) if any(a <= t < b for t in ids))
    c.coordinator.env._items[f"SHARD_{victim}"] = Dead()
    c.coordinator.env._items.update(vars)
    co._booted.clear()
    return victim, c.shard_ranges[victim]


async def test_killed_shard_fails_the_request_naming_its_range(tiny_knot, tmp_path, engine):
    """The default policy: a shard down longer than PEER_WAIT_S is a 503 with Retry-After that names
    the vocabulary range it would have served, on every endpoint; never a 200 with wrong text."""
    c = await build_cluster(tiny_knot, tmp_path, 2, 4)
    victim, (a, b) = await _kill_shard(c, engine, PEER_WAIT_S="0.2")
    r = await c.generate(prompt=PROMPT, max_tokens=4)
    assert r.status == 503, r.body
    assert f"shard {victim} (vocabulary [{a}, {b}))" in r.json()["message"] and r.headers["Retry-After"] == "1"
    for path, body in [("/v1/completions", {"prompt": PROMPT, "max_tokens": 4}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": PROMPT}], "max_tokens": 4})]:
        r = await c.coordinator.fetch(Request("POST", path, {}, json.dumps(body).encode()))
        assert r.status == 503 and f"[{a}, {b})" in r.json()["error"]["message"], r.body
        assert r.json()["error"]["type"] == "server_error" and "Retry-After" in r.headers
    await c.drain()


async def test_killed_shard_degrades_only_its_tokens_when_asked(tiny_knot, tmp_path, engine):
    """shard_failure "degrade" (the seed's allSettled merge), per request: the dead shard's tokens are
    zero at the embedding and -inf at the head, the rest exact, and the reply says so."""
    c = await build_cluster(tiny_knot, tmp_path, 2, 4)
    victim, (a, b) = await _kill_shard(c, engine, PEER_WAIT_S="30")
    ids = engine.tokenizer.encode(PROMPT)
    r = await c.generate(prompt=PROMPT, max_tokens=4, shard_failure="degrade")
    assert r.status == 200, r.body
    body = r.json()
    stages = {d["stage"] for d in body["degraded_shards"]}
    assert {"embed", "logits"} <= stages and body["shard_failure"] == "degrade"
    assert all(d["shard"] == victim and (d["vocab_start"], d["vocab_end"]) == (a, b) for d in body["degraded_shards"])
    assert not any(a <= t < b for t in body["tokens"]), "a dead shard's slice is -inf: never sampled"
    assert r.headers["X-Knot-Shard-Failure"] == "degrade" and r.headers["X-Knot-Degraded-Shards"] == f"{victim}:{a}-{b}"
    # The merge itself: tokens outside the dead range keep their exact embeddings.
    from services.coordinator import handler as co
    from services.coordinator.pipeline import Call
    boot = await co.coordinator_for(c.coordinator.env)
    call = Call("probe", shard_failure="degrade")
    x = await boot.pipeline.embed(call, ids, 0)
    full = engine.weight("token_embd.weight").dequantize()[ids]
    for i, t in enumerate(ids):
        np.testing.assert_array_equal(x[i], 0 if a <= t < b else full[i])
    assert call.degraded and call.degraded[0].shard == victim
    co._booted.clear()
    await c.drain()


async def test_degrade_per_cluster_is_said_by_every_openai_reply(tiny_knot, tmp_path, engine):
    """SHARD_FAILURE=degrade for the cluster: /v1 replies (whole and streamed) carry the header and
    the degraded_shards field; a request may still ask for "fail"."""
    c = await build_cluster(tiny_knot, tmp_path, 2, 4)
    victim, (a, b) = await _kill_shard(c, engine, SHARD_FAILURE="degrade", PEER_WAIT_S="0.2")
    chat = {"messages": [{"role": "user", "content": PROMPT}], "max_tokens": 3}
    for path, body in [("/v1/completions", {"prompt": PROMPT, "max_tokens": 3}), ("/v1/chat/completions", chat)]:
        r = await c.coordinator.fetch(Request("POST", path, {}, json.dumps(body).encode()))
        assert r.status == 200 and r.headers["X-Knot-Shard-Failure"] == "degrade", r.body
        got = r.json()
        assert got["shard_failure"] == "degrade" and {d["shard"] for d in got["degraded_shards"]} == {victim}
        r = await c.coordinator.fetch(Request("POST", path, {}, json.dumps({**body, "stream": True}).encode()))
        assert r.headers["X-Knot-Shard-Failure"] == "degrade"
        events = [e for e in await read_sse(r) if e != "[DONE]"]
        last = [e for e in events if e["choices"] and e["choices"][0]["finish_reason"]][-1]
        assert {d["shard"] for d in last["degraded_shards"]} == {victim}, last
    r = await c.generate(prompt=PROMPT, max_tokens=3, shard_failure="fail")
    assert r.status == 503 and f"[{a}, {b})" in r.json()["message"]
    await c.drain()


class Flaky:
    """A shard (or station) that is down for its first `n` data calls, then answers: a supervised restart."""

    def __init__(self, inner, n: int):
        self.inner, self.n, self.calls = inner, n, 0

    async def fetch(self, request: Request) -> Response:
        if request.path.startswith("/release/"):
            return await self.inner.fetch(request)
        self.calls += 1
        if self.calls <= self.n:
            raise ServiceUnavailable(f"connection refused (call {self.calls}: restarting)")
        return await self.inner.fetch(request)


async def test_a_shard_that_comes_back_within_the_wait_gives_exact_tokens(tiny_knot, tmp_path, engine):
    c = await build_cluster(tiny_knot, tmp_path, 2, 2)
    from services.coordinator import handler as co
    flaky = Flaky(c.shards[1], 3)
    c.coordinator.env._items["SHARD_1"] = flaky
    co._booted.clear()
    r = await c.generate(prompt=PROMPT, max_tokens=6)
    assert r.status == 200, r.body
    assert r.json()["tokens"] == reference(engine, PROMPT, 6).token_ids and r.json()["degraded_shards"] == []
    assert flaky.calls > 3 and r.headers["X-Knot-Shard-Failure"] == "fail"
    co._booted.clear()
    await c.drain()


async def test_storage_loss_is_an_error_never_zeros(tiny_knot, tmp_path, engine):
    """The bucket (S3/R2) fails once the cluster has booted: rows no cache holds cannot be read, and
    the request fails with a 503 naming the shard, on /generate and /v1 alike; it is never a 200 with
    zero embeddings. When the bucket is back, the same request gives the fault-free tokens. (The
    wardens do not warm: a warm slice would hold every row.)"""
    c = await build_cluster(tiny_knot, tmp_path, 2, 2, shard_vars={"WARM_WARDEN": "off"})
    c.coordinator.env._items["PEER_WAIT_S"] = "0.3"
    from services.coordinator import handler as co
    co._booted.clear()
    assert (await c.generate(prompt="the", max_tokens=1)).status == 200  # booted, a few rows cached
    real_get = c.bucket.get

    async def down(key, range=None, **pinned):
        raise ServiceUnavailable("S3 endpoint unreachable (stopped by the test)")

    c.bucket.get = down
    prompt = "def return class import while"  # rows nobody has read yet
    r = await c.generate(prompt=prompt, max_tokens=4)
    assert r.status == 503 and "is down" in r.json()["message"] and "unreachable" in r.json()["message"], r.body
    r = await c.coordinator.fetch(Request("POST", "/v1/completions", {},
                                          json.dumps({"prompt": prompt, "max_tokens": 4}).encode()))
    assert r.status == 503 and r.json()["error"]["type"] == "server_error", r.body
    c.bucket.get = real_get
    r = await c.generate(prompt=prompt, max_tokens=4)
    assert r.status == 200 and r.json()["tokens"] == reference(engine, prompt, 4).token_ids, r.body
    co._booted.clear()
    await c.drain()


async def test_a_dead_station_is_a_503_and_then_known_at_once(tiny_knot, tmp_path):
    """A station that stays down: the first request retries it for PEER_WAIT_S, then gets 503 with
    Retry-After naming it; the next request tries it once and is refused at once (the coordinator
    knows it has been down that long), instead of waiting again."""
    c = await build_cluster(tiny_knot, tmp_path, 2, 2)
    from services.coordinator import handler as co
    c.coordinator.env._items["PEER_WAIT_S"] = "0.5"
    co._booted.clear()
    booted = await co.coordinator_for(c.coordinator.env)  # boots against the live stations (it asks their ranges)
    dead = Flaky(c.stations[1], 10 ** 9)
    booted.pipeline.stations[1].binding = dead  # then station 1 dies
    r = await c.generate(prompt=PROMPT, max_tokens=4)
    assert r.status == 503 and "station 1 is down" in r.json()["message"] and r.headers["Retry-After"] == "1", r.body
    assert dead.calls > 2, "it waited for a restart"
    before = dead.calls
    r = await c.generate(prompt=PROMPT, max_tokens=4)
    assert r.status == 503 and "station 1 is down" in r.json()["message"]
    assert dead.calls == before + 1, "known down: one attempt, no wait"
    dead.n = 0  # back: the next request goes through
    r = await c.generate(prompt=PROMPT, max_tokens=4)
    assert r.status == 200 and booted.pipeline.station_state[1].down_since is None, r.body
    co._booted.clear()
    await c.drain()


class Tampering:
    """A peer binding whose replies to `path` are changed by `tamper`, each envelope (Envelope -> Envelope)."""

    def __init__(self, inner, tamper, path: str = "/forward"):
        self.inner, self.tamper, self.path = inner, tamper, path

    async def fetch(self, request):
        resp = await self.inner.fetch(request)
        if not request.path.endswith(self.path) or not resp.ok:
            return resp
        envs = [self.tamper(e) for e in wire.decode_envelopes(resp.body)]
        return Response(200, dict(resp.headers), wire.encode_envelopes(envs))


@pytest.mark.parametrize("station", [0, 1])
@pytest.mark.parametrize("tamper, needle", [
    (lambda e: wire.Envelope("another-request", e.mode, e.position, e.seq_len, e.array), "another-request"),
    (lambda e: wire.Envelope(e.request_id, e.mode, e.position + 1, e.seq_len + 1, e.array), "positions"),
    (lambda e: wire.Envelope(e.request_id, e.mode, e.position, e.seq_len, e.array[:, :-1]), "shape"),
    (lambda e: wire.Envelope(e.request_id, e.mode, e.position, e.seq_len, np.concatenate([e.array, e.array])),
     "shape"),
    (lambda e: wire.Envelope(e.request_id, e.mode, e.position, e.seq_len, e.array.astype(np.float64)), "float64"),
], ids=["request id", "positions", "width", "rows", "dtype"])
async def test_a_station_reply_for_other_rows_is_a_502_never_tokens(tiny_knot, tmp_path, station, tamper, needle):
    """Why: a station batches the decode frames of several requests and splits the rows back; a reply
    that is not the rows asked for (another request's, other positions, another shape) would be
    computed on as if it were, and give other tokens with a 200. The coordinator checks each reply
    against its frame, and such a reply fails the request, naming the station."""
    c = await build_cluster(tiny_knot, tmp_path, 2, 2)
    from services.coordinator import handler as co
    co._booted.clear()
    booted = await co.coordinator_for(c.coordinator.env)
    st = booted.pipeline.stations[station]
    st.binding = Tampering(st.binding, tamper)
    r = await c.generate(prompt=PROMPT, max_tokens=4)
    assert r.status == 502, r.body
    msg = r.json()["message"]
    assert f"station {station}" in msg and needle in msg, msg
    co._booted.clear()
    await c.drain()


@pytest.mark.parametrize("path, tamper, needle", [
    ("/embed", lambda e: wire.Envelope("another-request", e.mode, e.position, e.seq_len, e.array), "another-request"),
    ("/embed", lambda e: wire.Envelope(e.request_id, e.mode, e.position, e.seq_len, e.array.astype(np.float64)),
     "float64"),
    ("/sample", lambda e: wire.Envelope(e.request_id, e.mode, e.position + 1, e.seq_len + 1, e.array), "positions"),
    ("/sample", lambda e: wire.Envelope("another-request", e.mode, e.position, e.seq_len, e.array), "another-request"),
    ("/logits", lambda e: wire.Envelope("another-request", e.mode, e.position, e.seq_len, e.array), "another-request"),
    ("/logits", lambda e: wire.Envelope(e.request_id, e.mode, e.position, e.seq_len, e.array * np.nan),
     "non-finite logits"),
], ids=["embed request id", "embed dtype", "sample positions", "sample request id", "logits request id",
        "logits NaN"])
async def test_a_shard_reply_for_other_rows_is_a_502_never_tokens(tiny_knot, tmp_path, path, tamper, needle):
    """Shards stack the LM-head calls of several requests as stations stack frames: a reply for
    another request or other positions, or full logits that are not finite, fails the request and
    names the shard (SHARD_SAMPLE_TOP=0 makes the shards send full slices, the /logits path)."""
    c = await build_cluster(tiny_knot, tmp_path, 2, 2, coordinator_vars={"SHARD_SAMPLE_TOP": "0"} if
                            path == "/logits" else None)
    from services.coordinator import handler as co
    co._booted.clear()
    booted = await co.coordinator_for(c.coordinator.env)
    spec, client = booted.pipeline.shards[0]
    client.binding = Tampering(client.binding, tamper, path)
    r = await c.generate(prompt=PROMPT, max_tokens=4, speculation="off")
    assert r.status == 502, r.body
    msg = r.json()["message"]
    assert f"shard {spec.index}" in msg and needle in msg, msg
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


async def test_a_replay_reruns_the_original_frames_exactly(tiny_knot, tmp_path, engine, monkeypatch):
    """Exact replay (issue 13 item 3b): after a station lost the session, the frames it receives
    from position 0 are the fault-free run's, boundary for boundary (the prompt's prefill chunks,
    then one frame per decode step), so its KV cache and the tokens are the fault-free ones.
    Replaying prompt + generated text as one new prefill (the old way) computed with another
    chunking, and diverged at near-ties on the real model."""
    prompt = "the def the class the def return the"
    # PREFILL_CHUNK_TOKENS (256) would take this 22-token prompt in one chunk: 8-token chunks give
    # the prompt several prefill frames, whose boundaries the replay must keep.
    monkeypatch.setattr(cluster_engine, "prefill_chunks", lambda n: prefill_chunks(n, 8))

    async def frames_seen(restart_at: int | None) -> tuple[list, dict]:
        c = await build_cluster(tiny_knot, tmp_path / f"r{restart_at}", 2, 2)
        real, seen = c.stations[1].handler, []

        async def recording(request, env, ctx):
            if request.path == "/forward":
                f = wire.decode_envelope(request.body)
                seen.append((f.mode, f.position, f.seq_len))
                if len(seen) == restart_at:  # the isolate dies before this frame: its RAM is gone
                    station_handler._booted.clear()
            return await real(request, env, ctx)

        c.stations[1].handler = recording
        body = (await c.generate(prompt=prompt, max_tokens=8)).json()
        await c.drain()
        return seen, body

    clean, want = await frames_seen(None)
    n_prefill = sum(1 for mode, _, _ in clean if mode == "prefill")
    assert n_prefill >= 2, f"the prompt is prefilled in chunks: {clean}"
    k = n_prefill + 2  # the third decode frame is the first the restarted station sees
    faulty, body = await frames_seen(k + 1)
    assert faulty == clean[:k + 1] + clean, faulty  # refused at k, then everything again from 0, then on
    assert body["replays"] == 1 and body["tokens"] == want["tokens"] == reference(engine, prompt, 8).token_ids


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


async def test_a_bundles_parts_answer_as_their_single_calls_would(tiny_knot, tmp_path):
    """POST /forward_many and /sample_many: each part gets its single call's answer, an error as its
    own status beside the others' 200s; a bundle that does not decode is a 400; the services survive."""
    c = await build_cluster(tiny_knot, tmp_path, 2, 2)

    def env(rid, mode, pos, t=1, width=256):
        return wire.Envelope(rid, mode, pos, pos + t, np.zeros((t, width), np.float32))

    prefill = wire.encode_envelope(env("a", "prefill", 0, 3))
    r = await c.stations[0].fetch(Request("POST", "/forward", {}, prefill))
    assert r.status == 200, r.body
    parts = [wire.encode_envelope(env("a", "decode", 3)), wire.encode_envelope(env("nobody", "decode", 5)),
             prefill, wire.encode_envelope(env("b", "decode", 0, width=7)), b"garbage-garbage-garbage"]
    r = await c.stations[0].fetch(Request("POST", "/forward_many", {}, wire.encode_bundle((0, p) for p in parts)))
    assert r.status == 200, r.body
    got = wire.decode_bundle(r.body)
    assert [status for status, _ in got] == [200, 409, 400, 400, 400]
    assert wire.decode_envelope(got[0][1]).array.shape == (1, 256)
    assert json.loads(bytes(got[1][1]))["error"] == "UnknownSession"
    assert "decode frames" in json.loads(bytes(got[2][1]))["message"]
    assert "(T>0, 256)" in json.loads(bytes(got[3][1]))["message"]
    assert "malformed envelope" in json.loads(bytes(got[4][1]))["message"]
    for bad, needle in [(b"garbage", "malformed bundle"), (wire.encode_bundle([(200, prefill)]), "status must be 0")]:
        r = await c.stations[0].fetch(Request("POST", "/forward_many", {}, bad))
        assert r.status == 400 and needle in r.json()["message"], r.body
    spec = wire.SampleSpec(top=1, temperature=0.0, key=1, lse=False)
    nan = wire.Envelope("n", "logits", 0, 1, np.full((1, 256), np.nan, np.float32))
    body = wire.encode_bundle([(0, wire.encode_sample_request(spec, env("s", "logits", 0))),
                               (0, wire.encode_sample_request(spec, nan))])
    got = wire.decode_bundle((await c.shards[0].fetch(Request("POST", "/sample_many", {}, body))).body)
    assert [status for status, _ in got] == [200, 400] and len(wire.decode_envelopes(got[0][1])) == 3
    assert "NaN" in json.loads(bytes(got[1][1]))["message"]
    assert (await c.generate(prompt=PROMPT, max_tokens=2)).status == 200  # the services survive all that
    await c.drain()


async def test_generate_validation(tiny_knot, tmp_path):
    c = await build_cluster(tiny_knot, tmp_path, 1, 1)
    cases = [({"prompt": 5}, "prompt must be a string"), ({}, "exactly one of"),
             ({"prompt": "x", "max_tokens": 0}, "max_tokens must be >= 1"),
             ({"prompt": "x", "temperature": -1}, "temperature must be >= 0"),
             ({"prompt": "x", "max_tokens": 10**6}, "exceeds the context length"),
             ({"prompt": "x", "stop": [1]}, "stop must be"),
             ({"prompt": "x", "stop": ["\n"] * 17}, "stop takes at most 16 strings")]
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
    # tile 512 KiB, attention's float64 copies of a slice of keys, a KV block, a chunk's frames,
    # the ~0.6 MiB of matrices: all kept while decoding (2.75 MiB is the least that serves the prompt)
    budget = 3 << 20
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
    c = await build_cluster(tiny_knot, tmp_path, 1, 1, station_budget_bytes=1536 << 10)
    st = c.stations[0]
    await c.generate(prompt="the", max_tokens=3)
    s0 = (await st.fetch(Request("GET", "/stats"))).json()
    await c.generate(prompt="the", max_tokens=3)
    s1 = (await st.fetch(Request("GET", "/stats"))).json()
    await c.generate(prompt="the", max_tokens=7)
    s2 = (await st.fetch(Request("GET", "/stats"))).json()
    # the decode forwards alone: the longer generation's bytes less the shorter one's, whose prompt
    # forward (which reserves more for its rows' attention, so may stream more) is the same
    forwards = (s2["forwards"] - s1["forwards"]) - (s1["forwards"] - s0["forwards"])
    per_forward = ((s2["warden_bytes"] - s1["warden_bytes"]) - (s1["warden_bytes"] - s0["warden_bytes"])) / forwards
    s1 = s2
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


async def test_tied_head_shard_embeds_from_its_pinned_slice_with_the_gguf_rows(tmp_path):
    """A head tied to token_embd: the shard's pinned slice holds its rows' bytes, so an embedding
    comes from there, with no call to its warden, bit for bit gguf's rows, and the tokens stay the
    single process's."""
    import gguf

    from deploy.encoder import encode
    from tests.tiny_gguf import TinySpec, write_tiny_gguf

    path = write_tiny_gguf(tmp_path / "tied.gguf", TinySpec(tied=True))
    encode(path, tmp_path / "tied.knot", progress=False)
    t = next(t for t in gguf.GGUFReader(path).tensors if t.name == "token_embd.weight")
    want = gguf.quants.dequantize(t.data, t.tensor_type)  # (vocab, dim)
    c = await build_cluster(tmp_path / "tied.knot", tmp_path, 2, 3, coordinator_vars={"EMBED_ROW_CACHE_BYTES": "0"})
    ids = [c.shard_ranges[1][0], c.shard_ranges[1][0] + 3, c.shard_ranges[1][1] - 1, 5]
    frame = Request("POST", "https://shard/embed", {}, wire.encode_envelope(
        wire.Envelope("r", "embed", 0, len(ids), np.asarray(ids, np.int32))))
    got = wire.decode_envelope((await c.shards[1].fetch(frame)).body).array  # (4, dim)
    np.testing.assert_array_equal(got[:3], want[ids[:3]])
    assert not got[3].any(), "a token of another shard's slice is zeros"
    r = await c.generate(prompt=PROMPT, max_tokens=6)
    assert r.status == 200, r.body
    engine = LocalEngine.open(tmp_path / "tied.knot")
    assert r.json()["tokens"] == reference(engine, PROMPT, 6).token_ids
    stats = [(await sh.fetch(Request("GET", "/stats"))).json() for sh in c.shards]
    assert sum(s["rows_from_head"] for s in stats) >= 3 + len(engine.tokenizer.encode(PROMPT))
    assert all(s["rows_from_warden"] == s["rows_from_local"] == s["rows_from_r2"] == 0 for s in stats)
    await c.drain()


@pytest.mark.parametrize("warm", ["on", "off"])
async def test_shards_have_their_wardens_warm_their_slices_at_boot(tiny_knot, tmp_path, engine, warm):
    """WARM_WARDEN=on (the default): once a shard boots, its warden holds the whole slice, so a decode's
    new tokens are RAM hits, and a warden that restarts warms again; off: only the rows asked for.
    The tokens are the same either way."""
    from tests.inprocess import KNOT_KEY

    c = await build_cluster(tiny_knot, tmp_path, 1, 2, shard_vars={"WARM_WARDEN": warm},
                            coordinator_vars={"EMBED_ROW_CACHE_BYTES": "0"})

    async def stats():
        return [(await c.cobordism_wardens.fetch("CobordismWarden", f"{KNOT_KEY}|{a}-{b}",
                                                 Request("GET", "/stats"))).json() for a, b in c.shard_ranges]

    r = await c.generate(prompt=PROMPT, max_tokens=4)
    assert r.status == 200 and r.json()["tokens"] == reference(engine, PROMPT, 4).token_ids, r.body
    await c.tasks.drain(5)
    first = await stats()
    prompt = "while import return class"  # tokens the first request did not embed
    r = await c.generate(prompt=prompt, max_tokens=4)
    assert r.status == 200 and r.json()["tokens"] == reference(engine, prompt, 4).token_ids, r.body
    then = await stats()
    for (a, b), s0, s in zip(c.shard_ranges, first, then):
        if warm == "on":  # the whole slice came in; the second request's new rows were all RAM hits
            assert s["warm_rows"] == b - a and s["misses"] == s0["misses"], s
        else:
            assert s["warm_rows"] == 0 and s["entries"] == s["misses"] < b - a, s
    grew = "hits" if warm == "on" else "misses"  # the second request's new rows: RAM hits, or misses
    assert sum(s[grew] - s0[grew] for s0, s in zip(first, then)) > 0
    # the wardens restart (their RAM is gone) while the shards live on: the shards' next /tensors
    # (X-Knot-Warm) has them warm again
    c.cobordism_wardens._instances.clear()
    r = await c.generate(prompt="the class while", max_tokens=4)
    assert r.status == 200 and r.json()["tokens"] == reference(engine, "the class while", 4).token_ids, r.body
    await c.tasks.drain(5)
    for (a, b), s in zip(c.shard_ranges, await stats()):
        assert s["warm_rows"] == ((b - a) if warm == "on" else 0), s
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


class BundleTampering:
    """A peer binding whose bundle replies to `path` (/forward_many, /sample_many) have each part's
    envelopes changed by `tamper`."""

    def __init__(self, inner, tamper, path: str):
        self.inner, self.tamper, self.path = inner, tamper, path

    async def fetch(self, request):
        resp = await self.inner.fetch(request)
        if not request.path.endswith(self.path) or not resp.ok:
            return resp
        parts = [(status, wire.encode_envelopes([self.tamper(e) for e in wire.decode_envelopes(body)])
                  if status == 200 else bytes(body)) for status, body in wire.decode_bundle(resp.body)]
        return Response(200, dict(resp.headers), wire.encode_bundle(parts))


CONCURRENT = ["the", "def the", "the def the def", "def", "class the"]


async def _concurrent(c, n: int = 8) -> list[dict]:
    rs = await asyncio.gather(*(c.generate(prompt=p, max_tokens=n, speculation="off") for p in CONCURRENT))
    assert all(r.status == 200 for r in rs), [r.body for r in rs if r.status != 200]
    return [r.json() for r in rs]


@pytest.mark.parametrize("step_batch", ["16", "0"])
async def test_concurrent_decode_steps_cross_each_hop_as_one_call(tiny_knot, tmp_path, engine, step_batch):
    """Continuous batching (STEP_BATCH): the generations' decode steps go together, one bundle per
    station and per shard, and each generation gets exactly its single-process tokens; with
    STEP_BATCH=0 each makes its own calls, with the same tokens."""
    c = await build_cluster(tiny_knot, tmp_path, 2, 3, coordinator_vars={"STEP_BATCH": step_batch})
    from services.coordinator import handler as co
    co._booted.clear()
    booted = await co.coordinator_for(c.coordinator.env)
    for p, body in zip(CONCURRENT, await _concurrent(c)):
        assert body["tokens"] == reference(engine, p, 8).token_ids, p
    s = booted.pipeline.step_stats()
    if step_batch == "0":
        assert s is None
    else:
        assert s["steps"]["largest_batch"] > 1 and s["steps"]["batches"] < s["steps"]["batched_items"], s
        assert s["bundles"]["station"] > 0 and s["bundles"]["shard"] > 0 and s["made_alone"] == 0, s
    co._booted.clear()
    await c.drain()


async def test_a_steps_new_tokens_are_embedded_in_one_call_for_all(tiny_knot, tmp_path, engine):
    """The rows a step's generations lack are fetched in one fan-out for all of them (_keep_rows):
    a shard answers at most one embed call per prompt and one per step, not one per generation."""
    c = await build_cluster(tiny_knot, tmp_path, 2, 2)
    from services.coordinator import handler as co
    co._booted.clear()
    booted = await co.coordinator_for(c.coordinator.env)
    for p, body in zip(CONCURRENT, await _concurrent(c)):
        assert body["tokens"] == reference(engine, p, 8).token_ids, p
    steps = booted.pipeline.step_stats()["steps"]
    assert steps["batches"] < steps["batched_items"], steps
    for sh in c.shards:
        s = (await sh.fetch(Request("GET", "/stats"))).json()
        assert s["embed_calls"] <= len(CONCURRENT) + steps["batches"], (s["embed_calls"], steps)
    co._booted.clear()
    await c.drain()


@pytest.mark.parametrize("target, path", [("station 0", "/forward_many"), ("station 1", "/forward_many"),
                                          ("shard", "/sample_many")])
@pytest.mark.parametrize("tamper", [
    lambda e: wire.Envelope("another-request", e.mode, e.position, e.seq_len, e.array),
    lambda e: wire.Envelope(e.request_id, e.mode, e.position + 1, e.seq_len + 1, e.array),
], ids=["request id", "positions"])
async def test_a_bundle_part_for_other_rows_is_never_computed_on(tiny_knot, tmp_path, engine, target, path, tamper):
    """Why: a bundle carries several generations' rows; a part that is not its frame's (another
    request's, other positions) would give other tokens with a 200. The coordinator checks each
    part against its frame and makes that generation's call alone, where a wrong reply is a 502
    (the tests above): here the single calls are sound, so every generation gets its own tokens."""
    c = await build_cluster(tiny_knot, tmp_path, 2, 2)
    from services.coordinator import handler as co
    co._booted.clear()
    booted = await co.coordinator_for(c.coordinator.env)
    client = booted.pipeline.stations[int(target[-1])] if target.startswith("station") else \
        booted.pipeline.shards[0][1]
    client.binding = BundleTampering(client.binding, tamper, path)
    for p, body in zip(CONCURRENT, await _concurrent(c, 6)):
        assert body["tokens"] == reference(engine, p, 6).token_ids, p
    s = booted.pipeline.step_stats()
    assert s["bundles"]["station" if target.startswith("station") else "shard"] > 0 and s["made_alone"] > 0, s
    co._booted.clear()
    await c.drain()


async def test_a_failed_bundle_leaves_each_generation_to_its_own_calls(tiny_knot, tmp_path, engine):
    """A bundle call that fails as a whole (here: the station answers 500 to every /forward_many)
    costs its generations a call each, never their tokens."""
    c = await build_cluster(tiny_knot, tmp_path, 2, 2)
    from services.coordinator import handler as co
    co._booted.clear()
    booted = await co.coordinator_for(c.coordinator.env)
    st = booted.pipeline.stations[1]
    inner = st.binding

    class Refusing:
        async def fetch(self, request):
            if request.path.endswith("/forward_many"):
                return Response.from_json({"error": "InternalError", "message": "boom"}, 500)
            return await inner.fetch(request)

    st.binding = Refusing()
    for p, body in zip(CONCURRENT, await _concurrent(c, 6)):
        assert body["tokens"] == reference(engine, p, 6).token_ids, p
    assert booted.pipeline.step_stats()["bundles"]["station"] > 0
    co._booted.clear()
    await c.drain()


class Slow:
    """A station that takes delay_s per /forward and counts them."""

    def __init__(self, inner, delay_s: float):
        self.inner, self.delay_s, self.forwards = inner, delay_s, 0

    async def fetch(self, request: Request) -> Response:
        if request.path == "/forward":
            self.forwards += 1
            await asyncio.sleep(self.delay_s)
        return await self.inner.fetch(request)


@pytest.mark.parametrize("path", ["/generate", "/v1/completions"])
async def test_a_whole_reply_whose_client_hangs_up_is_cancelled(tiny_knot, tmp_path, path):
    """Served by the host as the coordinator is (a public service): the client of a non-streaming
    request disconnects; the generation stops, its slot is free and the stations hold no session."""
    import aiohttp
    from aiohttp import web

    from deploy.local.host import ServiceRuntime, app_runner, build_app
    from deploy.local.tasks import BackgroundTasks
    from services.coordinator import PUBLIC, handler as co

    c = await build_cluster(tiny_knot, tmp_path, 2, 2)
    slow = Slow(c.stations[1], 0.05)
    c.coordinator.env._items["STATION_1"] = slow
    co._booted.clear()
    booted = await co.coordinator_for(c.coordinator.env)
    rt = ServiceRuntime("coordinator", co.fetch, c.coordinator.env, BackgroundTasks("test"), public=PUBLIC)
    runner = app_runner(build_app(rt))
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    url = f"http://127.0.0.1:{runner.addresses[0][1]}{path}"
    try:
        async with aiohttp.ClientSession() as s:
            req = asyncio.create_task(s.post(url, json={"prompt": PROMPT, "max_tokens": 200}))
            await until(lambda: slow.forwards > 3, timeout_s=30, what="generating")
            assert booted.admission.active == 1
            req.cancel()  # the client goes away
            await asyncio.gather(req, return_exceptions=True)
        await until(lambda: booted.admission.active == 0, timeout_s=10, what="the slot given back")
        n = slow.forwards
        await asyncio.sleep(0.5)  # a window, not an order: a generation still running forwards ~10 times in it
        assert slow.forwards <= n + 1 and n < 100, f"generation stopped ({n} forwards, then {slow.forwards})"
        await rt.tasks.drain()
        await c.drain()
        for env in c.station_envs:
            st = await station_handler.station_for(env, None)
            assert not st.sessions, "the KV sessions are released"
    finally:
        await runner.cleanup()
        co._booted.clear()
