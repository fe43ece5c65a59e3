"""Both wardens on embedded bindings: identity, LRU budget and residency, invalidate, the KV tier.

The same behaviours are proven against real SeaweedFS and Redis in tests/integration/.
"""
import json
import os

import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q

import services.cobordism_warden as cw
import services.layer_warden as lw
from common import wire
from common.knot import read_header_sync
from common.quant import dequantize_rows
from common.runtime import Context, Env, Request, ServiceUnavailable, call_handler
from deploy.encoder import encode
from deploy.local.durable import DurableObjectHost, LocalNamespace
from deploy.local.embedded_bindings import DirectoryBucket, MemoryKV
from deploy.local.tasks import BackgroundTasks
from services.embed_cache import decode_row, row_key
from tests.inprocess import INTERNAL_SECRET, KV_KEY
from tests.tiny_gguf import TinySpec, write_tiny_gguf

KEY = "models/tiny.knot"
# hidden 1024: attn_q/attn_output (1.06 MiB) and the ffn matrices (1.6 MiB) are above the 1 MiB
# residency threshold, so they are the evictable ones; token_embd is Q4_K to exercise a K-quant.
SPEC = TinySpec(hidden=1024, ffn=1536, n_head=8, n_kv_head=2, overrides={"token_embd.weight": Q.Q4_K})


@pytest.fixture(scope="module")
def knot(tmp_path_factory):
    d = tmp_path_factory.mktemp("knot")
    path = d / "tiny.knot"
    encode(write_tiny_gguf(d / "tiny.gguf", SPEC), path, progress=False)
    data = path.read_bytes()
    return data, read_header_sync(lambda a, b: data[a:b], len(data))


class World:
    """Bucket + KV + one DO host (a 'process'); restart() drops the host, as a DO eviction does."""

    def __init__(self, tmp_path, data, kv=None):
        self.bucket = DirectoryBucket(tmp_path / "bucket")
        (tmp_path / "bucket" / "models").mkdir(parents=True, exist_ok=True)
        (tmp_path / "bucket" / KEY).write_bytes(data)
        self.kv = kv or MemoryKV()
        self.restart()

    def restart(self):
        self.tasks = BackgroundTasks()
        self.host = host = DurableObjectHost({**lw.DURABLE_OBJECTS, **cw.DURABLE_OBJECTS}, self.tasks)
        self.env = Env({"KNOT_BUCKET": self.bucket, "EMBED_CACHE": self.kv,
                        "LAYER_WARDEN": LocalNamespace(host, "LayerWarden"),
                        "COBORDISM_WARDEN": LocalNamespace(host, "CobordismWarden")},
                       {"KNOT_INTERNAL_SECRET": INTERNAL_SECRET})
        host.env = self.env

    def warden_ram(self, name: str = f"{KEY}|0-200") -> dict:
        """The CobordismWarden's RAM entries, without touching their recency or the stats."""
        ram = self.host._instances[("CobordismWarden", name)].obj.served.caches.ram
        return {k: ram.peek(k) for k in ram.keys()}

    async def call(self, service, method, path, headers=None, body=None):
        raw = body if isinstance(body, bytes) else json.dumps(body).encode() if body is not None else b""
        return await call_handler(service.fetch, Request(method, path, headers or {}, raw), self.env,
                                  Context(self.tasks.add))


LAYER = {"X-Knot-Id": KEY, "X-Layer-Start": "0", "X-Layer-End": "1"}
VOCAB = {"X-Knot-Id": KEY, "X-Vocab-Start": "0", "X-Vocab-End": "200"}


async def test_layer_warden_identity_and_configure(tmp_path, knot):
    w = World(tmp_path, knot[0])
    r = await w.call(lw, "POST", "/configure", body={"layer_start": 0, "layer_end": 1})
    assert r.status == 400 and "explicit knot_key" in r.json()["message"]
    r = await w.call(lw, "POST", "/configure", body={"knot_key": "nope.knot", "layer_start": 0, "layer_end": 1})
    assert r.status == 404 and "nope.knot" in r.json()["message"]
    r = await w.call(lw, "POST", "/configure", body={"knot_key": KEY, "layer_start": 0, "layer_end": 9})
    assert r.status == 400 and "exceed the knot's 2 layers" in r.json()["message"]
    r = await w.call(lw, "POST", "/configure", body={"knot_key": KEY, "layer_start": 0, "layer_end": 1})
    assert r.status == 200 and r.json()["identity"] == f"{KEY}|0-1"
    assert r.json()["budget_bytes"] == 1 << 30
    # The worker routes by identity; a DO reached under another name refuses (misrouting guard).
    ns = w.env.LAYER_WARDEN
    r = await ns.get(ns.id_from_name(f"{KEY}|0-1")).fetch(Request("GET", "/stats", {**LAYER, "X-Layer-End": "2"}))
    assert r.status == 409 and "misrouted" in r.json()["message"]
    r = await w.call(lw, "GET", "/stats")
    assert r.status == 400 and "X-Knot-Id" in r.json()["message"]


async def test_layer_warden_serves_exact_bytes_in_frames(tmp_path, knot):
    data, header = knot
    w = World(tmp_path, data)
    r = await w.call(lw, "GET", "/tensor/blk.0.attn_q.weight", LAYER)
    assert r.headers["content-type"] == wire.TENSOR_CONTENT_TYPE
    f = wire.decode_tensor(r.body)
    a, b = header.tensor_range("blk.0.attn_q.weight")
    assert (f.name, f.ggml_type, f.shape, f.payload) == ("blk.0.attn_q.weight", "Q8_0", (1024, 1024), data[a:b])
    names = ["blk.0.ffn_norm.weight", "blk.0.attn_q.bias", "blk.0.attn_norm.weight"]
    r = await w.call(lw, "POST", "/tensors", LAYER, {"names": names})
    frames = wire.decode_batch(r.body)
    assert [f.name for f in frames] == names
    assert all(f.payload == data[slice(*header.tensor_range(f.name))] for f in frames)
    r = await w.call(lw, "GET", "/tensor/blk.1.attn_q.weight", LAYER)
    assert r.status == 400 and "outside this warden's layers [0, 1)" in r.json()["message"]
    r = await w.call(lw, "POST", "/tensors", LAYER, {"names": ["blk.0.attn_q.weight", "blk.0.nope"]})
    assert r.status == 404 and "blk.0.nope" in r.json()["message"]


async def test_layer_warden_lru_budget_residency_and_invalidate(tmp_path, knot):
    data, header = knot
    w = World(tmp_path, data)
    budget = 4 << 20
    await w.call(lw, "POST", "/configure", body={"knot_key": KEY, "layer_start": 0, "layer_end": 2,
                                                 "budget_bytes": budget})
    hdrs = {**LAYER, "X-Layer-End": "2"}
    names = [n for n in header.tensors if n.startswith("blk.")]
    resident = {n for n in names if "norm" in n or header.tensors[n].length < 1 << 20}
    for _ in range(2):
        for n in names:
            assert (await w.call(lw, "GET", f"/tensor/{n}", hdrs)).status == 200
            s = (await w.call(lw, "GET", "/stats", hdrs)).json()
            assert s["bytes_resident"] <= budget
    assert resident <= set(s["cached"]) and s["evictions"] > 0
    before = s["r2_reads"]
    for n in sorted(resident):  # all hits: no R2 read
        await w.call(lw, "GET", f"/tensor/{n}", hdrs)
    assert (await w.call(lw, "GET", "/stats", hdrs)).json()["r2_reads"] == before
    r = await w.call(lw, "POST", "/invalidate/blk.0.attn_norm.weight", hdrs)
    assert r.json() == {"name": "blk.0.attn_norm.weight", "dropped": True}
    s = (await w.call(lw, "GET", "/stats", hdrs)).json()
    assert "blk.0.attn_norm.weight" not in s["cached"]
    await w.call(lw, "GET", "/tensor/blk.0.attn_norm.weight", hdrs)
    assert (await w.call(lw, "GET", "/stats", hdrs)).json()["r2_reads"] == before + 1


async def test_layer_warden_keeps_large_frames_in_shared_blocks(tmp_path, knot):
    """With the host's SHARED_BLOCKS binding (local processes), the LayerWarden caches frames of 1 MiB
    or more in shared blocks: its replies carry the blocks themselves (a host names them, copying
    nothing), their bytes are the frames it sent before, and an evicted entry's block goes."""
    import gc

    from deploy.local.shm import SharedBlocks

    data, header = knot
    w = World(tmp_path, data)
    blocks = SharedBlocks()
    w.env.update({"SHARED_BLOCKS": blocks})
    budget = 4 << 20
    hdrs = {**LAYER, "X-Layer-End": "2"}
    await w.call(lw, "POST", "/configure", body={"knot_key": KEY, "layer_start": 0, "layer_end": 2,
                                                 "budget_bytes": budget})
    names = ["blk.0.attn_norm.weight", "blk.0.attn_q.weight", "blk.0.ffn_up.weight"]
    for _ in range(2):  # a miss, then hits
        r = await w.call(lw, "POST", "/tensors", hdrs, {"names": names})
        assert [blocks.region(p) is not None for p in r.parts] == [False, False, True, True], "the header, a norm, two blocks"
        frames = wire.decode_batch(r.body)  # (r.body joins the parts)
        assert [f.payload for f in frames] == [data[slice(*header.tensor_range(n))] for n in names]
    del r
    big = [n for n in header.tensors if n.startswith("blk.") and header.tensors[n].length >= 1 << 20]
    for n in big:  # past the budget: evictions
        assert (await w.call(lw, "GET", f"/tensor/{n}", hdrs)).status == 200
    s = (await w.call(lw, "GET", "/stats", hdrs)).json()
    gc.collect()
    cached_big = [n for n in s["cached"] if n in big]
    assert s["evictions"] > 0 and blocks.stats()["blocks"] == len(cached_big)
    payloads = sum(header.tensors[n].length for n in cached_big)
    assert payloads < blocks.stats()["block_bytes"] < payloads + 1024 * len(cached_big), "each a frame: a header, a crc32"


def embed_rows(data, header, rows):
    e = header.tensors["token_embd.weight"]
    a, b = header.row_range("token_embd.weight", rows[0], rows[-1] + 1)
    return dequantize_rows(data[a:b], e.ggml_type, e.shape[0])


async def test_cobordism_warden_rows_kv_tier_and_restart(tmp_path, knot):
    data, header = knot
    w = World(tmp_path, data)
    rows = [7, 3, 4, 7, 150]
    r = await w.call(cw, "POST", "/tensors", VOCAB, {"rows": rows})
    frames = wire.decode_batch(r.body)
    assert [f.row_start for f in frames] == [7, 3, 4, 150]
    for f in frames:
        assert (f.ggml_type, f.shape) == ("Q4_K", (1024, 1))
        assert f.payload == data[slice(*header.row_range("token_embd.weight", f.row_start, f.row_start + 1))]
    s = (await w.call(cw, "GET", "/stats", VOCAB)).json()
    assert (s["misses"], s["kv_misses"], s["r2_reads"] - 1) == (4, 4, 3)  # 3, 4 coalesce into one read
    await w.tasks.drain(5)  # the KV writes went through wait_until
    etag = s["knot_etag"]
    for row in (3, 4, 7, 150):
        key = row_key(f"{KEY}@{etag}", row)
        np.testing.assert_array_equal(decode_row(KV_KEY, key, await w.kv.get(key), etag, row, 1024),
                                      embed_rows(data, header, [row])[0])

    w.restart()  # RAM is gone; KV is not
    r = await w.call(cw, "POST", "/tensors", VOCAB, {"rows": [3, 150]})
    frames = wire.decode_batch(r.body)
    assert [(f.row_start, f.ggml_type) for f in frames] == [(3, "F32"), (150, "F32")]
    np.testing.assert_array_equal(np.frombuffer(frames[0].payload, "<f4"), embed_rows(data, header, [3])[0])
    s = (await w.call(cw, "GET", "/stats", VOCAB)).json()
    assert s["kv_hits"] == 2 and s["r2_bytes_read"] == s["r2_header_bytes_read"]
    await w.call(cw, "POST", "/tensors", VOCAB, {"rows": [3, 150]})
    s = (await w.call(cw, "GET", "/stats", VOCAB)).json()
    assert (s["hits"], s["kv_hits"]) == (2, 2)  # re-warmed RAM

    r = await w.call(cw, "POST", "/tensors", VOCAB, {"rows": [199, 200]})
    assert r.status == 400 and "[0, 200)" in r.json()["message"]


async def test_cobordism_warden_warm_reads_the_slice_into_ram_once(tmp_path, knot):
    """POST /warm: the slice's rows come into RAM in the background (ranged reads, no KV writes), then
    every row is a RAM hit with the knot's bytes and no further read; a second /warm reads nothing; a
    slice above half the RAM budget is not warmed, and says why."""
    data, header = knot
    w = World(tmp_path, data)
    await w.call(cw, "POST", "/tensors", VOCAB, {"rows": [9]})  # its own entry stays, and is looked up first
    r = await w.call(cw, "POST", "/warm", VOCAB)
    nb = header.row_range("token_embd.weight", 1, 2)[0] - header.row_range("token_embd.weight", 0, 1)[0]
    assert r.status == 200 and r.json() == {"rows": 200, "bytes": 200 * nb, "warming": True, "already": False}
    await w.tasks.drain(5)
    s = (await w.call(cw, "GET", "/stats", VOCAB)).json()
    assert (s["entries"], s["warm_rows"]) == (2, 200)  # row 9's own entry, and one slab of all 200
    assert s["warm_seconds"] is not None and (s["kv_misses"], s["kv_writes"]) == (1, 1)  # only row 9's
    reads = s["r2_reads"]
    rows = [0, 57, 9, 199]
    frames = wire.decode_batch((await w.call(cw, "POST", "/tensors", VOCAB, {"rows": rows})).body)
    for f in frames:
        assert f.payload == data[slice(*header.row_range("token_embd.weight", f.row_start, f.row_start + 1))]
    s = (await w.call(cw, "GET", "/stats", VOCAB)).json()
    assert (s["hits"], s["misses"], s["r2_reads"]) == (4, 1, reads)
    assert (await w.call(cw, "POST", "/warm", VOCAB)).json()["already"] is True
    await w.tasks.drain(5)
    assert (await w.call(cw, "GET", "/stats", VOCAB)).json()["r2_reads"] == reads
    assert (await w.call(cw, "GET", "/stats", VOCAB)).json()["kv_writes"] == 1  # the warm-up wrote none
    # a slab's row is checked on every hit as a row's entry is: a flipped byte is rejected, the slab
    # dropped, and the row read again
    slab = next(v for k, v in w.warden_ram().items() if k[1] == "slab")
    bad = bytearray(slab.data)
    bad[57 * nb + 3] ^= 0xFF
    object.__setattr__(slab, "data", bytes(bad))
    r = await w.call(cw, "POST", "/tensors", VOCAB, {"rows": [57]})
    assert r.headers["X-Knot-Cache-Rejects"] == "ram=1"
    (f,) = wire.decode_batch(r.body)
    assert f.payload == data[slice(*header.row_range("token_embd.weight", 57, 58))]
    assert all(k[1] != "slab" for k in w.warden_ram())
    # /invalidate/<row> drops the slab that holds the row: the row is read again
    w2 = World(tmp_path / "w2", data)
    await w2.call(cw, "POST", "/warm", VOCAB)
    await w2.tasks.drain(5)
    reads = (await w2.call(cw, "GET", "/stats", VOCAB)).json()["r2_reads"]
    assert (await w2.call(cw, "POST", "/invalidate/100", VOCAB)).json() == {"row": 100, "dropped": True}
    (f,) = wire.decode_batch((await w2.call(cw, "POST", "/tensors", VOCAB, {"rows": [100]})).body)
    assert f.payload == data[slice(*header.row_range("token_embd.weight", 100, 101))]
    assert (await w2.call(cw, "GET", "/stats", VOCAB)).json()["r2_reads"] == reads + 1

    small = World(tmp_path / "small", data)
    r = await small.call(cw, "POST", "/configure", body={"knot_key": KEY, "vocab_start": 0, "vocab_end": 200,
                                                         "budget_bytes": 200 * nb})
    assert r.status == 200
    r = await small.call(cw, "POST", "/warm", VOCAB)
    assert r.json()["warming"] is False and "half the RAM budget" in r.json()["reason"]
    await small.tasks.drain(5)
    assert (await small.call(cw, "GET", "/stats", VOCAB)).json()["entries"] == 0


async def test_cobordism_warden_poisoned_kv_row_is_deleted_and_refetched(tmp_path, knot):
    data, header = knot
    w = World(tmp_path, data)
    etag = (await w.call(cw, "GET", "/stats", VOCAB)).json()["knot_etag"]
    key = row_key(f"{KEY}@{etag}", 5)
    w.restart()
    await w.kv.put(key, b"\x00" * 1024)  # a Q4_K-sized row written as if it were float32
    r = await w.call(cw, "POST", "/tensors", VOCAB, {"rows": [5]})
    (f,) = wire.decode_batch(r.body)
    assert f.ggml_type == "Q4_K"  # refetched from R2, not the poisoned bytes
    s = (await w.call(cw, "GET", "/stats", VOCAB)).json()
    assert (s["kv_poisoned"], s["kv_hits"]) == (1, 0)
    await w.tasks.drain(5)
    np.testing.assert_array_equal(decode_row(KV_KEY, key, await w.kv.get(key), etag, 5, 1024),
                                  embed_rows(data, header, [5])[0])


class DownKV(MemoryKV):
    async def get(self, key):
        raise ServiceUnavailable("KV get: cannot reach Redis")


async def test_cobordism_warden_survives_an_unreachable_kv(tmp_path, knot):
    data, header = knot
    w = World(tmp_path, data, kv=DownKV())
    r = await w.call(cw, "POST", "/tensors", VOCAB, {"rows": [1]})
    assert r.status == 200 and wire.decode_batch(r.body)[0].ggml_type == "Q4_K"
    assert (await w.call(cw, "GET", "/stats", VOCAB)).json()["kv_errors"] == 1


async def test_binary_request_bodies_equal_the_json_ones_and_bad_ones_are_named(tmp_path, knot):
    """What stations and shards send on the hot path: names one per line, rows as int32; no JSON."""
    data, _ = knot
    w = World(tmp_path, data)
    names = ["blk.0.ffn_norm.weight", "blk.0.attn_q.weight", "blk.0.ffn_norm.weight"]
    as_json = await w.call(lw, "POST", "/tensors", LAYER, {"names": names})
    as_text = await w.call(lw, "POST", "/tensors", {**LAYER, "Content-Type": wire.NAMES_CONTENT_TYPE},
                           wire.encode_names(names))
    assert as_text.status == 200 and as_text.body == as_json.body
    r = await w.call(lw, "POST", "/tensors", {**LAYER, "Content-Type": wire.NAMES_CONTENT_TYPE}, b"a\n\nb")
    assert r.status == 400 and "one non-empty name per line" in r.json()["message"]
    r = await w.call(lw, "POST", "/tensors", {**LAYER, "Content-Type": wire.NAMES_CONTENT_TYPE}, b"\xff")
    assert r.status == 400 and "not UTF-8" in r.json()["message"]

    rows = [7, 3, 7, 150]
    as_json = await w.call(cw, "POST", "/tensors", VOCAB, {"rows": rows})
    binary = {**VOCAB, "Content-Type": wire.ROWS_CONTENT_TYPE}
    as_rows = await w.call(cw, "POST", "/tensors", binary, wire.encode_rows(rows))
    assert as_rows.status == 200 and as_rows.body == as_json.body
    r = await w.call(cw, "POST", "/tensors", binary, b"\x01\x02\x03")
    assert r.status == 400 and "multiple of 4" in r.json()["message"]
    r = await w.call(cw, "POST", "/tensors", binary, wire.encode_rows([-1]))
    assert r.status == 400 and "outside this warden's vocab slice" in r.json()["message"]
