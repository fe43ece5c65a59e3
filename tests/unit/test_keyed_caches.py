"""Issue 52 item 3, keyed caches, on the real handlers in one process (tests/inprocess.py): an entry
of the right layout and the right crc32 over other bytes, with no MAC or a MAC under another key,
is rejected, counted and refetched in every store, and the tokens stay the baseline's.
tests/integration/test_integrity.py forges a row in a real Valkey with the Redis password."""
from __future__ import annotations

import contextlib
import os
import re

import numpy as np
import pytest

from common import wire
from common.integrity import CacheKey, Seal, crc32
from common.runtime import Request
from common.settings import ConfigError
from deploy.engine_local import LocalEngine
from deploy.local.host import open_runtime
from deploy.local.host_settings import HostSettings
from deploy.local.shm import ShmError, check_private
from services.cobordism_warden.cobordism_warden import ROW_TAG, Slab, row_name
from services.coordinator import handler as coordinator_handler
from services.embed_cache import decode_row, encode_row, process_key, row_key
from services.shard import handler as shard_handler
from tests.inprocess import FLUID_BUDGET_BYTES, KNOT_KEY, KV_KEY, build_cluster

PROMPT = "the def the"
N = 8
NO_ROW_CACHE = {"EMBED_ROW_CACHE_BYTES": "0"}  # the coordinator keeps no rows: every embed reaches the shards
ANOTHER_KEY = CacheKey("another-clusters-internal-secret-of-43-chars")


@pytest.fixture(scope="module")
def engine(tiny_knot):
    return LocalEngine.open(tiny_knot)


async def tokens(c) -> list[int]:
    r = await c.generate(prompt=PROMPT, max_tokens=N)
    assert r.status == 200, r.body
    return r.json()["tokens"]


async def counter(c, name: str, **labels) -> float:
    text = (await c.coordinator.fetch(Request("GET", "/metrics"))).text()
    sel = ",".join(f'{k}="{v}"' for k, v in labels.items())
    m = re.search(rf"^{name}{re.escape('{' + sel + '}')} (\S+)$", text, re.M)
    return float(m.group(1)) if m else 0.0


def warden(host, cls: str, name: str):
    return host._instances[(cls, name)].obj


def owner(c, token: int) -> int:
    return next(i for i, (a, b) in enumerate(c.shard_ranges) if a <= token < b)


def fresh_isolates(c) -> None:
    """New shard and coordinator isolates and evicted warden DOs: only KV still holds rows."""
    shard_handler._booted.clear()
    coordinator_handler._booted.clear()
    c.cobordism_wardens._instances.clear()


# ------------------------------------------------------------ KV (Redis; Workers KV)


def test_a_kv_row_needs_the_clusters_key_and_its_own_key_name():
    """The forger of issue 52: the right layout, version, row and crc32 over other floats, with no
    MAC, with a MAC under another secret, or a genuine value copied under another key."""
    vec = np.linspace(-1, 1, 16, dtype=np.float32)
    other = vec[::-1].copy()
    forged = bytearray(encode_row(KV_KEY, "k7", "etag-a", 7, other))
    mac_at = 16  # magic 4 | version 1 | etag_len 1 | reserved 2 | row 4 | crc32 4
    forged[mac_at:mac_at + 32] = bytes(32)
    assert "MAC" in decode_row(KV_KEY, "k7", bytes(forged), "etag-a", 7, 16)
    by_another = encode_row(CacheKey("another-clusters-secret-of-32-characters"), "k7", "etag-a", 7, other)
    assert "MAC" in decode_row(KV_KEY, "k7", by_another, "etag-a", 7, 16)
    assert "MAC" in decode_row(KV_KEY, "k8", encode_row(KV_KEY, "k7", "etag-a", 7, vec), "etag-a", 7, 16)
    v1 = bytearray(encode_row(KV_KEY, "k7", "etag-a", 7, other))
    v1[4] = 1  # the version-1 layout had no MAC at all
    assert "version 1" in decode_row(KV_KEY, "k7", bytes(v1), "etag-a", 7, 16)


def test_a_keyed_seal_covers_tag_version_name_length_and_content():
    data = bytes(range(200))
    s = KV_KEY.seal(b"t", "row:3", "e1", data)
    assert KV_KEY.problem(s, b"t", "row:3", "e1", data) is None
    assert "MAC" in KV_KEY.problem(s, b"t", "row:3", "e1", data[:-1] + b"\x00")
    assert "MAC" in KV_KEY.problem(s, b"u", "row:3", "e1", data)
    assert "MAC" in KV_KEY.problem(s, b"t", "row:4", "e1", data)
    assert "version" in KV_KEY.problem(s, b"t", "row:3", "e2", data)
    assert "no MAC" in KV_KEY.problem(Seal(s.etag, s.crc32, s.nbytes), b"t", "row:3", "e1", data)
    assert "MAC" in process_key().problem(s, b"t", "row:3", "e1", data)  # another process's key
    sm = KV_KEY.seal(b"t", "w", "e1", data, content=False)
    assert KV_KEY.seal_problem(sm, b"t", "w", "e1") is None
    assert sm.mac != s.mac and KV_KEY.seal(b"t", "w", "e1", data).mac != sm.mac  # content and seal MACs differ
    assert "MAC" in KV_KEY.seal_problem(Seal("e1", sm.crc32 ^ 1, sm.nbytes, sm.mac), b"t", "w", "e1")
    assert "MAC" in KV_KEY.seal_problem(Seal("e1", sm.crc32, sm.nbytes + 1, sm.mac), b"t", "w", "e1")


@pytest.mark.parametrize("mac", ["none", "another-key"])
async def test_a_forged_kv_row_is_rejected_counted_and_refetched(tiny_knot, tmp_path, engine, mac):
    c = await build_cluster(tiny_knot, tmp_path, 2, 2)
    baseline = await tokens(c)
    await c.drain()  # the KV writes
    etag = (await c.bucket.head(KNOT_KEY)).etag
    ids = sorted(set(engine.tokenizer.encode(PROMPT)))
    want = engine.weight("token_embd.weight").dequantize()
    for t in ids:
        key = row_key(f"{KNOT_KEY}@{etag}", t)
        assert not isinstance(decode_row(KV_KEY, key, await c.kv.get(key), etag, t, 256), str)
        forged_vec = -8 * want[t]  # far off, the same length
        if mac == "none":  # the right layout, version, row and crc32, and no MAC (zeros)
            value = bytearray(encode_row(KV_KEY, key, etag, t, forged_vec))
            value[16:48] = bytes(32)
        else:  # a MAC, computed by whoever wrote it, without this cluster's secret
            value = encode_row(ANOTHER_KEY, key, etag, t, forged_vec)
        assert "MAC" in decode_row(KV_KEY, key, bytes(value), etag, t, 256)
        await c.kv.put(key, bytes(value))
    fresh_isolates(c)
    assert await tokens(c) == baseline
    for i, (a, b) in enumerate(c.shard_ranges):
        mine = len([t for t in ids if a <= t < b])
        w = warden(c.cobordism_wardens, "CobordismWarden", f"{KNOT_KEY}|{a}-{b}")
        s = await w.stats_dict()
        assert s["rejects"].get("kv", 0) == mine and s["kv_poisoned"] == mine
        assert await counter(c, "knot_cache_rejects_total", service=f"shard_{i}", tier="kv") == mine
    await c.drain()  # deleted, then rewritten from R2 with the cluster's key
    for t in ids:
        key = row_key(f"{KNOT_KEY}@{etag}", t)
        np.testing.assert_array_equal(decode_row(KV_KEY, key, await c.kv.get(key), etag, t, 256), want[t])


async def test_without_the_secret_the_warden_uses_no_kv(tiny_knot, tmp_path):
    c = await build_cluster(tiny_knot, tmp_path, 1, 1)
    c.cobordism_wardens.env = type(c.cobordism_wardens.env)({"KNOT_BUCKET": c.bucket, "EMBED_CACHE": c.kv})
    fresh_isolates(c)
    await tokens(c)
    await c.drain()
    w = warden(c.cobordism_wardens, "CobordismWarden", f"{KNOT_KEY}|0-{c.shard_ranges[0][1]}")
    assert (await w.stats_dict())["kv_enabled"] is False
    assert not c.kv._data, "nothing written to KV without the cluster's key"


# ------------------------------------------------------------ warden memory


async def test_a_forged_cobordism_warden_row_is_rejected_counted_and_refetched(tiny_knot, tmp_path, engine):
    c = await build_cluster(tiny_knot, tmp_path, 2, 2, coordinator_vars=NO_ROW_CACHE)
    baseline = await tokens(c)
    t = engine.tokenizer.encode(PROMPT)[0]
    i = owner(c, t)
    a, b = c.shard_ranges[i]
    w = warden(c.cobordism_wardens, "CobordismWarden", f"{KNOT_KEY}|{a}-{b}")
    ram, etag = w.served.caches.ram, w.served.source.etag
    seal, frame = ram.peek(("token_embd.weight", t))
    assert w.served.caches.key.problem(seal, ROW_TAG, row_name(frame.name, t), etag, frame.payload) is None
    bad = bytearray(frame.payload)
    bad[5] ^= 0x10
    forged = Seal(etag, crc32(bytes(bad)), len(bad))  # the right crc32 of the new bytes, no MAC
    ram.put(("token_embd.weight", t), (forged, wire.TensorFrame(frame.name, frame.ggml_type, frame.shape,
                                                                 bytes(bad), t)), forged.nbytes)
    shard_handler._booted.clear()  # the shards' own row caches are empty: the rows come from the warden
    assert await tokens(c) == baseline
    assert (await w.stats_dict())["rejects"] == {"ram": 1}
    assert await counter(c, "knot_cache_rejects_total", service=f"shard_{i}", tier="cobordism_warden_ram") == 1
    s2, f2 = ram.peek(("token_embd.weight", t))  # refetched (from KV, as float32, or R2), and sealed again
    assert w.served.caches.key.problem(s2, ROW_TAG, row_name(f2.name, t), etag, f2.payload) is None
    assert bytes(f2.payload) in (bytes(frame.payload), engine.weight("token_embd.weight").dequantize()[t].tobytes())
    await c.drain()


async def test_a_forged_row_of_a_warm_slab_is_rejected_and_the_slab_dropped(tiny_knot, tmp_path, engine):
    c = await build_cluster(tiny_knot, tmp_path, 1, 1, coordinator_vars=NO_ROW_CACHE, shard_vars={"WARM_WARDEN": "on"})
    baseline = await tokens(c)
    await c.drain()  # the warm-up
    w = warden(c.cobordism_wardens, "CobordismWarden", f"{KNOT_KEY}|0-{c.shard_ranges[0][1]}")
    ram = w.served.caches.ram
    (key, slab), = [(k, ram.peek(k)) for k in ram.keys() if k[1:2] == ("slab",)]
    t = engine.tokenizer.encode(PROMPT)[0]
    nb = len(slab.data) // len(slab.crcs)
    data = bytearray(slab.data)
    i = t - slab.start
    data[i * nb + 3] ^= 0x20
    crcs = np.array([crc32(data[j:j + nb]) for j in range(0, len(data), nb)], np.uint32)  # right for the new bytes
    assert crcs[i] != slab.crcs[i]
    ram.put(key, Slab(slab.etag, slab.ggml_type, slab.ne0, slab.start, bytes(data), crcs, slab.mac), slab.nbytes)
    for row in engine.tokenizer.encode(PROMPT) + baseline:  # rows kept alone are looked up before the slab
        ram.pop(("token_embd.weight", row))
    shard_handler._booted.clear()
    assert await tokens(c) == baseline
    assert (await w.stats_dict())["rejects"] == {"ram": 1}
    assert key not in ram
    await c.drain()


async def test_a_forged_layer_warden_entry_is_rejected_by_the_warden(tiny_knot, tmp_path):
    """The frame's bytes changed, its seal's crc32 made right for them, no MAC: the warden refuses its
    own entry before any station sees it, and reads R2 again."""
    c = await build_cluster(tiny_knot, tmp_path, 1, 2, station_budget_bytes=FLUID_BUDGET_BYTES)
    baseline = await tokens(c)
    w = warden(c.layer_wardens, "LayerWarden", f"{KNOT_KEY}|0-2")
    name = "blk.0.ffn_up.weight"
    seal, encoded = w.served.caches.peek(name)
    assert seal.mac and w.key.seal_problem(seal, b"warden-frame", name, w.served.source.etag) is None
    frame = wire.decode_tensor(encoded)
    bad = bytearray(frame.payload)
    bad[100] ^= 0x01
    for forged in (Seal(seal.etag, crc32(bytes(bad)), seal.nbytes),  # no MAC
                   ANOTHER_KEY.seal(b"warden-frame", name, seal.etag, bytes(bad), content=False)):  # another key's
        w.served.caches.put(name, (forged, wire.encode_tensor(wire.TensorFrame(name, frame.ggml_type, frame.shape,
                                                                                bytes(bad)))), seal.nbytes)
        before = (await c.stations[0].fetch(Request("GET", "/stats"))).json()
        rejects = (await w.stats_dict())["rejects"].get("ram", 0)
        assert await tokens(c) == baseline
        await c.drain()
        after = (await c.stations[0].fetch(Request("GET", "/stats"))).json()
        assert (await w.stats_dict())["rejects"].get("ram", 0) == rejects + 1
        assert after["invalidations"] == before["invalidations"], "the warden caught it, not the station"
        assert wire.decode_tensor(w.served.caches.peek(name)[1]).payload == frame.payload  # clean again
    assert await counter(c, "knot_cache_rejects_total", service="station_0", tier="layer_warden_ram") == 2
    await c.drain()


# ------------------------------------------------------------ rows kept by shards and the coordinator


async def test_a_forged_shard_row_cache_entry_is_rejected_counted_and_refetched(tiny_knot, tmp_path, engine):
    c = await build_cluster(tiny_knot, tmp_path, 2, 2, coordinator_vars=NO_ROW_CACHE)
    baseline = await tokens(c)
    t = engine.tokenizer.encode(PROMPT)[0]
    i = owner(c, t)
    sh = await shard_handler.shard_for(c.shards[i].env)
    seal, vec = sh.row_cache.peek(t)
    bad = vec + 1
    sh.row_cache.put(t, (Seal(seal.etag, crc32(bad), bad.nbytes), bad), bad.nbytes)  # right crc32, no MAC
    assert await tokens(c) == baseline
    assert sh.stats["row_cache_rejects"] == 1
    assert await counter(c, "knot_cache_rejects_total", service=f"shard_{i}", tier="shard_lru") == 1
    np.testing.assert_array_equal(sh.row_cache.peek(t)[1], vec)
    await c.drain()


# ------------------------------------------------------------ the shared-memory directory


def test_the_shared_memory_directory_must_be_private(tmp_path):
    d = tmp_path / "shm"
    d.mkdir(mode=0o700)
    check_private(d)
    os.chmod(d, 0o770)
    with pytest.raises(ShmError, match="mode 770: other users could write"):
        check_private(d)
    os.chmod(d, 0o700)
    link = tmp_path / "link"
    link.symlink_to(d)
    with pytest.raises(ShmError, match="not a directory"):
        check_private(link)
    with pytest.raises(ShmError, match="No such file"):
        check_private(tmp_path / "gone")


async def test_a_host_refuses_to_start_on_a_shared_directory_others_may_write(tmp_path):
    d = tmp_path / "shm"
    d.mkdir(mode=0o700)
    os.chmod(d, 0o777)
    settings = HostSettings.from_env({"KNOT_SERVICE": "services.station", "KNOT_SHM_DIR": str(d)})
    async with contextlib.AsyncExitStack() as stack:
        with pytest.raises(ConfigError, match="KNOT_SHM_DIR: .* mode 777"):
            await open_runtime(settings, stack)

