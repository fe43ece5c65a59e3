"""Both wardens as the real processes docker-compose.yml defines, on SeaweedFS and Redis."""
import asyncio
import json

import numpy as np

from common import wire
from common.integrity import CacheKey
from common.quant import dequantize_rows
from deploy.local.server_bindings import RedisKV
from services.embed_cache import decode_row, row_key

from .conftest import http, wait_for


def layer_headers(key, start, end):
    return {"X-Knot-Id": key, "X-Layer-Start": str(start), "X-Layer-End": str(end)}


def vocab_headers(key, start, end):
    return {"X-Knot-Id": key, "X-Vocab-Start": str(start), "X-Vocab-End": str(end)}


def stats(url, headers):
    status, _, body = http("GET", url + "/stats", headers=headers)
    assert status == 200, body
    return json.loads(body)


def embed_row(knot, row):
    e = knot.header.tensors["token_embd.weight"]
    a, b = knot.header.row_range("token_embd.weight", row, row + 1)
    return dequantize_rows(knot.data[a:b], e.ggml_type, e.shape[0])[0]


def kv_call(redis_server, fn):
    """Run fn(kv) with a fresh client on the compose binding's key prefix."""
    async def go():
        kv = RedisKV(redis_server.url, "EMBED_CACHE:", password=redis_server.password)
        try:
            return await fn(kv)
        finally:
            await kv.close()
    return asyncio.run(go())


def test_layer_warden_lru_budget_residency_and_invalidate(procs, upload, knot):
    key = upload("tests/layer-lru.knot")
    url = procs.url("layer-warden")
    budget = 4 << 20
    status, _, body = http("POST", url + "/configure", {"knot_key": key, "layer_start": 0, "layer_end": 2,
                                                         "budget_bytes": budget})
    assert status == 200, body
    h = layer_headers(key, 0, 2)
    names = [n for n in knot.header.tensors if n.startswith("blk.")]
    resident = {n for n in names if "norm" in n or knot.header.tensors[n].length < 1 << 20}
    for name in names + names[::-1]:
        status, headers, body = http("GET", f"{url}/tensor/{name}", headers=h)
        assert status == 200 and headers["Content-Type"] == wire.TENSOR_CONTENT_TYPE
        frame = wire.decode_tensor(body)
        assert frame.payload == knot.data[slice(*knot.header.tensor_range(name))]
        s = stats(url, h)
        assert s["bytes_resident"] <= budget, s
    assert s["evictions"] > 0 and resident <= set(s["cached"])
    reads = s["r2_reads"]
    status, _, body = http("POST", url + "/tensors", {"names": sorted(resident)}, headers=h)
    assert [f.name for f in wire.decode_batch(body)] == sorted(resident)
    assert stats(url, h)["r2_reads"] == reads  # the resident set was all hits

    status, _, body = http("POST", url + "/invalidate/blk.1.ffn_norm.weight", headers=h)
    assert json.loads(body) == {"name": "blk.1.ffn_norm.weight", "dropped": True}
    assert "blk.1.ffn_norm.weight" not in stats(url, h)["cached"]
    http("GET", url + "/tensor/blk.1.ffn_norm.weight", headers=h)
    assert stats(url, h)["r2_reads"] == reads + 1

    # Another identity is another DO instance: this one would have to find its own knot.
    status, _, body = http("POST", url + "/configure", {"knot_key": "tests/other.knot", "layer_start": 0,
                                                         "layer_end": 2})
    assert status == 404 and "tests/other.knot" in json.loads(body)["message"]


def test_poisoned_kv_row_is_detected_deleted_and_refetched(procs, upload, knot, redis_server, cluster_env):
    key = upload("tests/poison.knot")
    url, h = procs.url("cobordism-warden"), vocab_headers(key, 0, 100)
    etag = stats(url, h)["knot_etag"]
    kv_key = row_key(f"{key}@{etag}", 42)
    hidden = knot.header.tensors["token_embd.weight"].shape[0]
    # The seed's poisoning: a row of the wrong byte length (raw Q4_K size, 576 B) stored as if float32.
    kv_call(redis_server, lambda kv: kv.put(kv_key, b"\x07" * 576, expiration_ttl=3600))

    status, _, body = http("POST", url + "/tensors", {"rows": [42]}, headers=h)
    (frame,) = wire.decode_batch(body)
    assert (frame.ggml_type, frame.row_start) == ("Q4_K", 42)  # from R2, not the poisoned value
    s = stats(url, h)
    assert (s["kv_poisoned"], s["kv_hits"], s["misses"]) == (1, 0, 1)

    cluster_key = CacheKey(cluster_env["KNOT_INTERNAL_SECRET"])  # what the warden's KV rows are keyed with

    def rewritten():  # deleted in the background, then rewritten with the right row, version, row id, crc32 and MAC
        v = kv_call(redis_server, lambda kv: kv.get(kv_key))
        row = None if v is None else decode_row(cluster_key, kv_key, v, etag, 42, hidden)
        return None if row is None or isinstance(row, str) else [row]

    (good,) = wait_for(rewritten, 10, "the rewritten KV row")
    np.testing.assert_array_equal(good, embed_row(knot, 42))


def test_do_restart_loses_ram_and_refills_from_kv_before_r2(procs, upload, knot, redis_server):
    key = upload("tests/restart.knot")
    url, h = procs.url("cobordism-warden"), vocab_headers(key, 0, 200)
    rows = [1, 2, 3, 77, 150]
    status, _, body = http("POST", url + "/tensors", {"rows": rows}, headers=h)
    assert [f.ggml_type for f in wire.decode_batch(body)] == ["Q4_K"] * 5
    s = stats(url, h)
    assert s["r2_bytes_read"] > s["r2_header_bytes_read"] and s["kv_misses"] == 5

    procs.restart("cobordism-warden")  # SIGTERM: the KV writes drain before exit; RAM is lost
    s = stats(url, h)
    assert (s["entries"], s["hits"], s["misses"]) == (0, 0, 0)
    status, _, body = http("POST", url + "/tensors", {"rows": rows}, headers=h)
    frames = wire.decode_batch(body)
    assert [(f.row_start, f.ggml_type, f.shape) for f in frames] == [(r, "F32", (1024, 1)) for r in rows]
    for f in frames:
        np.testing.assert_array_equal(np.frombuffer(f.payload, "<f4"), embed_row(knot, f.row_start))
    s = stats(url, h)
    assert s["kv_hits"] == 5 and s["r2_bytes_read"] == s["r2_header_bytes_read"]  # no row came from R2
    http("POST", url + "/tensors", {"rows": rows}, headers=h)
    s = stats(url, h)
    assert (s["hits"], s["kv_hits"]) == (5, 5)  # DO RAM was re-warmed from KV
