"""One regression test per trap of seed section 8, named after the trap.

They run the real handlers in one process (tests/inprocess.py); tests/integration repeats the
storage-facing ones against real S3 and Redis servers.
"""
from __future__ import annotations

import json

import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q

from common import knot, wire
from common.quant import UnsupportedQuantType, dequantize
from common.runtime import Request, Response
from deploy.encoder import encode
from deploy.knotfile import open_model
from services.embed_cache import decode_row, row_key
from services.shard import handler as shard_handler
from tests.inprocess import FLUID_BUDGET_BYTES, KNOT_KEY, KV_KEY, build_cluster
from tests.tiny_gguf import TinySpec, rewrite_metadata, write_tiny_gguf

PROMPT = "the def the"


def embed_frame(tokens):
    ids = np.asarray(tokens, np.int32)
    return wire.encode_envelope(wire.Envelope("t", "embed", 0, len(ids), ids))


async def embed_via_shards(c, tokens):
    total = None
    for sh in c.shards:
        r = await sh.fetch(Request("POST", "/embed", {}, embed_frame(tokens)))
        assert r.status == 200, r.body
        part = wire.decode_envelope(r.body).array
        total = part.copy() if total is None else total + part
    return total


@pytest.mark.parametrize("qtype", [Q.F32, Q.F16, Q.Q8_0, Q.Q5_0, Q.Q4_0, Q.Q4_K, Q.Q6_K])
async def test_trap_dequantize_row_f32_only_fallthrough(tmp_path, qtype):
    """Every embedding type gives its real rows, never the zero vector; an unknown type raises."""
    g = write_tiny_gguf(tmp_path / "m.gguf", TinySpec(overrides={"token_embd.weight": qtype}))
    k = tmp_path / "m.knot"
    encode(g, k, progress=False)
    c = await build_cluster(k, tmp_path, 1, 3)
    tokens = [0, 100, 200, 260, 268]
    got = await embed_via_shards(c, tokens)
    want = open_model(k).tensor("token_embd.weight").dequantize()[tokens]
    np.testing.assert_array_equal(got, want)
    assert np.abs(got).sum(axis=1).min() > 0
    with pytest.raises(UnsupportedQuantType, match="token_embd.weight.*IQ2_XXS|IQ2_XXS.*token_embd.weight"):
        dequantize(b"\x00" * 66, "IQ2_XXS", (256,), "token_embd.weight")
    await c.drain()


async def test_trap_tensor_type_vs_type_field_name(tiny_knot, tmp_path):
    """A knot whose table says tensor_type serves the same tokens as one that says type."""
    def rename(meta):
        for t in meta["tensors"].values():
            t["tensor_type"] = t.pop("type")

    alias = rewrite_metadata(tiny_knot, tmp_path / "alias.knot", rename)
    ref = await build_cluster(tiny_knot, tmp_path / "a", 2, 2)
    want = (await ref.generate(prompt=PROMPT, max_tokens=6)).json()["tokens"]
    await ref.drain()  # its release calls would boot its stations again in this process's caches
    c = await build_cluster(alias, tmp_path / "b", 2, 2)
    assert (await c.generate(prompt=PROMPT, max_tokens=6)).json()["tokens"] == want
    await c.drain()


async def test_trap_kvget_silent_cache_poisoning(tiny_knot, tmp_path):
    """A KV row of the wrong length is a miss, is deleted, and the right row is served and rewritten."""
    c = await build_cluster(tiny_knot, tmp_path, 1, 1)
    etag = (await c.bucket.head(KNOT_KEY)).etag
    key = row_key(f"{KNOT_KEY}@{etag}", 100)
    await c.kv.put(key, b"\x00" * 17)  # a Q4_K-sized row where float32 * hidden belongs
    got = await embed_via_shards(c, [100])
    want = open_model(tiny_knot).tensor("token_embd.weight").dequantize()[[100]]
    np.testing.assert_array_equal(got, want)
    await c.drain()
    fixed = await c.kv.get(key)
    np.testing.assert_array_equal(decode_row(KV_KEY, key, fixed, etag, 100, 256), want[0])
    stats = (await c.cobordism_wardens.fetch("CobordismWarden", f"{KNOT_KEY}|0-{c.shard_ranges[0][1]}",
                                             Request("GET", "/stats"))).json()
    assert stats["kv_poisoned"] == 1


async def test_trap_missing_ctx_waituntil_on_kv_writes(tiny_knot, tmp_path):
    """KV writes go through wait_until: they complete after the response, and none is dropped."""
    c = await build_cluster(tiny_knot, tmp_path, 1, 1)
    before = c.tasks.started
    await embed_via_shards(c, [5, 6, 7])
    assert c.tasks.started >= before + 3, "each row write is registered with wait_until"
    await c.drain()
    assert c.tasks.failed == 0 and len(c.tasks) == 0
    etag = (await c.bucket.head(KNOT_KEY)).etag
    want = open_model(tiny_knot).tensor("token_embd.weight").dequantize()
    for row in (5, 6, 7):
        key = row_key(f"{KNOT_KEY}@{etag}", row)
        np.testing.assert_array_equal(decode_row(KV_KEY, key, await c.kv.get(key), etag, row, 256), want[row])


class Dead:
    async def fetch(self, request: Request) -> Response:
        raise TimeoutError("shard timed out (killed by the test)")


async def test_trap_promise_all_on_cobordism_merge(tiny_knot, tmp_path):
    """allSettled: a failed shard zeroes its own tokens only, and the request still completes. Since
    issue 13 that merge is an opt-in (shard_failure=degrade; the default fails naming the range,
    tests/unit/test_pipeline.py), and the reply says it ran under it."""
    c = await build_cluster(tiny_knot, tmp_path, 2, 3)
    c.coordinator.env._items["SHARD_2"] = Dead()
    r = await c.generate(prompt=PROMPT, max_tokens=3, shard_failure="degrade")
    assert r.status == 200, r.body
    body = r.json()
    assert body["shard_failure"] == "degrade" and r.headers["X-Knot-Shard-Failure"] == "degrade"
    assert {d["shard"] for d in body["degraded_shards"]} == {2}
    assert "TimeoutError" in body["degraded_shards"][0]["error"]
    await c.drain()


async def test_trap_encoder_reader_payload_offset_off_by_one(tiny_knot, tmp_path):
    """A pre-fix knot in the bucket is refused at boot with the stale-knot error, never served."""
    buf = tiny_knot.read_bytes()
    h = knot.parse_header(buf)
    js = json.dumps(h.metadata, separators=(",", ":")).encode()
    while (10 + len(js)) % 4 != 3:
        js += b" "
    stale = tmp_path / "stale.knot"
    stale.write_bytes(knot.PREAMBLE.pack(knot.MAGIC, knot.VERSION, len(js)) + js + bytes([knot.MARKER]) + buf[h.payload_offset:])
    with pytest.raises(knot.StaleKnotError):
        await build_cluster(stale, tmp_path, 1, 1)  # open_model in the builder refuses it too
    c = await build_cluster(tiny_knot, tmp_path, 1, 1)
    await c.bucket.put(KNOT_KEY, stale.read_bytes())
    r = await c.stations[0].fetch(Request("GET", "/stats"))
    assert r.status >= 500 and "stale" in r.json()["message"] and "re-encode" in r.json()["message"]
    r = await c.shards[0].fetch(Request("POST", "/embed", {}, embed_frame([1])))
    assert r.status >= 500 and "stale" in r.json()["message"]


async def test_trap_loadlayerphase_silent_skip_on_missing_tensor(tiny_knot, tmp_path):
    """A missing phase tensor fails loudly, naming the phase, the layer and the tensor."""
    def drop(meta):
        # Remove blk.1.ffn_up.weight and close the gap so the table stays contiguous.
        t = meta["tensors"].pop("blk.1.ffn_up.weight")
        for e in meta["tensors"].values():
            if e["offset"] > t["offset"]:
                e["offset"] -= t["length"]
        for b in meta["blobs"].values():
            b["offset"] -= t["length"]

    src = tiny_knot.read_bytes()
    h = knot.parse_header(src)
    a, b = h.tensor_range("blk.1.ffn_up.weight")
    cut = tmp_path / "src.knot"
    cut.write_bytes(src[:a] + src[b:])
    missing = rewrite_metadata(cut, tmp_path / "missing.knot", drop)
    c = await build_cluster(missing, tmp_path, 2, 2)
    r = await c.generate(prompt=PROMPT, max_tokens=2)
    assert r.status >= 500
    assert "phase ffn_up of layer 1: missing tensor blk.1.ffn_up.weight" in r.json()["message"]


class CorruptingNamespace:
    """Flips one byte of every LayerWarden batch reply once `armed`: an undecodable frame."""

    def __init__(self, inner):
        self.inner, self.armed, self.corrupted = inner, 0, 0

    def id_from_name(self, name):
        return self.inner.id_from_name(name)

    def get(self, id):
        outer, stub = self, self.inner.get(id)

        class Stub:
            async def fetch(self, request):
                resp = await stub.fetch(request)
                if outer.armed and request.path == "/tensors" and resp.ok:
                    outer.armed -= 1
                    outer.corrupted += 1
                    body = bytearray(resp.body)
                    body[len(body) // 2] ^= 0xFF
                    return Response(resp.status, resp.headers, bytes(body))
                return resp

        return Stub()


async def test_trap_layer_warden_no_invalidate_poisoning(tiny_knot, tmp_path):
    """A rejected warden frame is invalidated and read from R2; the next request gets a clean entry."""
    c = await build_cluster(tiny_knot, tmp_path, 1, 2, station_budget_bytes=FLUID_BUDGET_BYTES)  # fluid
    want = (await c.generate(prompt=PROMPT, max_tokens=4)).json()["tokens"]
    env = c.station_envs[0]
    ns = CorruptingNamespace(env.LAYER_WARDEN)
    env._items["LAYER_WARDEN"] = ns
    from services.station import handler as st
    st._booted.clear()
    # 1. corrupted on the wire: undecodable batches
    ns.armed = 3
    assert (await c.generate(prompt=PROMPT, max_tokens=4)).json()["tokens"] == want
    stats = (await c.stations[0].fetch(Request("GET", "/stats"))).json()
    assert ns.corrupted == 3 and stats["invalidations"] >= 3 and stats["r2_tensors"] > 0
    await c.drain()
    # 2. poisoned in the warden's RAM: a wrong-length entry is rejected, invalidated, then refetched
    name = "blk.0.ffn_up.weight"
    warden = c.layer_wardens._instances[("LayerWarden", f"{KNOT_KEY}|0-2")].obj
    cache = warden.served.caches
    seal, encoded = cache.peek(name)
    frame = wire.decode_tensor(encoded)
    short = wire.TensorFrame(name, frame.ggml_type, frame.shape, frame.payload[:-8])  # a valid frame, wrong length
    cache.put(name, (seal, wire.encode_tensor(short)), len(frame.payload))
    before = stats["invalidations"]
    assert (await c.generate(prompt=PROMPT, max_tokens=4)).json()["tokens"] == want
    await c.drain()
    after = (await c.stations[0].fetch(Request("GET", "/stats"))).json()["invalidations"]
    assert after == before + 1, "the poisoned entry was rejected once, then served clean"
    assert len(wire.decode_tensor(cache.peek(name)[1]).payload) == len(frame.payload)


async def test_trap_layer_warden_bucket_binding_mismatch(tiny_knot, tmp_path):
    """knot_key is explicit: configure without it is refused, and a warden never serves another knot."""
    c = await build_cluster(tiny_knot, tmp_path, 1, 1)
    host = c.layer_wardens
    r = await host.fetch("LayerWarden", "x", Request("POST", "/configure", {}, b'{"layer_start": 0, "layer_end": 2}'))
    assert r.status == 400 and "explicit knot_key" in r.json()["message"]
    await c.generate(prompt=PROMPT, max_tokens=1)  # configures the station's warden by headers
    r = await host.fetch("LayerWarden", f"{KNOT_KEY}|0-2", Request(
        "POST", "/tensors", {"X-Knot-Id": "tinyllama-1.1b-q4k.knot", "X-Layer-Start": "0", "X-Layer-End": "2"},
        b'{"names": ["blk.0.attn_norm.weight"]}'))
    assert r.status == 409 and "tinyllama" in r.json()["message"]
    await c.drain()


async def test_trap_do_scaffolding_vs_hot_path(tiny_knot, tmp_path):
    """The shards' rows and the stations' tensors really flow through the wardens (the coordinator
    keeps no rows here, so every embedding is asked of a shard)."""
    c = await build_cluster(tiny_knot, tmp_path, 2, 2, station_budget_bytes=FLUID_BUDGET_BYTES,
                            coordinator_vars={"EMBED_ROW_CACHE_BYTES": "0"})
    await c.generate(prompt=PROMPT, max_tokens=4)
    await c.generate(prompt=PROMPT, max_tokens=4)
    first = [(await sh.fetch(Request("GET", "/stats"))).json() for sh in c.shards]
    assert sum(s["rows_from_warden"] for s in first) > 0 and sum(s["rows_from_r2"] for s in first) == 0
    assert sum(s["rows_from_local"] for s in first) > 0, "a repeated token comes from the shard's own LRU"
    shard_handler._booted.clear()  # new shard isolates: empty local LRUs, the wardens stay warm
    await c.generate(prompt=PROMPT, max_tokens=4)
    warm = [(await c.cobordism_wardens.fetch("CobordismWarden", f"{KNOT_KEY}|{a}-{b}", Request("GET", "/stats"))).json()
            for a, b in c.shard_ranges]
    assert sum(w.get("hits", 0) for w in warm) > 0, "a warm prompt hits the CobordismWarden's RAM"
    st = (await c.stations[0].fetch(Request("GET", "/stats"))).json()
    assert st["warden_tensors"] > 0 and st["r2_tensors"] == 0
    await c.drain()

