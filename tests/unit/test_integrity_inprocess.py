"""Issue 12, weights verified end to end, on the real handlers in one process (tests/inprocess.py):
a replaced knot is served from one version or refused, never mixed; a cache entry that is not
what was stored (at any tier) is a counted miss, refetched, and the tokens stay the baseline's.
tests/integration/test_integrity.py repeats the knot replacement and the KV poisoning against
real SeaweedFS, Redis and service processes."""
from __future__ import annotations

import re

import numpy as np
import pytest

from common import wire
from common.integrity import Seal
from common.knot import parse_header
from common.runtime import Context, PreconditionFailed, Request, Response
from common.sampling import SamplingParams
from deploy.encoder import encode
from deploy.engine_local import LocalEngine
from services.coordinator import handler as coordinator_handler
from services.embed_cache import decode_row, row_key
from services.knot_source import KNOT_ETAG_HEADER
from services.shard import handler as shard_handler
from services.station import handler as station_handler
from services.station.tensors import SealedTensor
from tests.inprocess import FLUID_BUDGET_BYTES, FLUID_ONE_LAYER_BUDGET_BYTES, KNOT_KEY, KV_KEY, build_cluster
from tests.tiny_gguf import TinySpec, write_tiny_gguf

PROMPT = "the def the"
N = 8  # tokens generated per request


@pytest.fixture(scope="module")
def engine(tiny_knot):
    return LocalEngine.open(tiny_knot)


@pytest.fixture(scope="module")
def other_knot(tmp_path_factory):
    """A knot of the same size and layout, other weights: what a re-encoded upload looks like."""
    d = tmp_path_factory.mktemp("other")
    out = d / "other.knot"
    encode(write_tiny_gguf(d / "other.gguf", TinySpec(seed=1)), out, progress=False)
    return out


def reference(path_or_engine, max_tokens=N) -> list[int]:
    e = path_or_engine if isinstance(path_or_engine, LocalEngine) else LocalEngine.open(path_or_engine)
    return e.generate(e.tokenizer.encode(PROMPT), SamplingParams(), max_tokens=max_tokens).token_ids


def with_row_replaced(src, dst, tensor: str, row: int, from_row: int):
    """The issue's probe: the same knot, same size, one row's bytes changed (the header untouched)."""
    data = bytearray(src.read_bytes())
    h = parse_header(bytes(data))
    a, b = h.row_range(tensor, row, row + 1)
    c, d = h.row_range(tensor, from_row, from_row + 1)
    data[a:b] = data[c:d]
    dst.write_bytes(bytes(data))
    return dst


# The coordinator keeps no rows, so every generation asks the shards for its prompt's rows (the
# tiers below it are under test); its own rows: test_the_coordinator_keeps_rows_...
NO_ROW_CACHE = {"EMBED_ROW_CACHE_BYTES": "0"}


async def tokens(c) -> list[int]:
    r = await c.generate(prompt=PROMPT, max_tokens=N)
    assert r.status == 200, r.body
    return r.json()["tokens"]


async def metrics(c) -> str:
    return (await c.coordinator.fetch(Request("GET", "/metrics"))).text()


def counter(text: str, name: str, **labels) -> float:
    sel = ",".join(f'{k}="{v}"' for k, v in labels.items())
    m = re.search(rf"^{name}{re.escape('{' + sel + '}' if sel else '')} (\S+)$", text, re.M)
    assert m, f"{name}{{{sel}}} not in /metrics"
    return float(m.group(1))


def owner(c, token: int) -> int:
    return next(i for i, (a, b) in enumerate(c.shard_ranges) if a <= token < b)


def warden(host, cls: str, name: str):
    return host._instances[(cls, name)].obj


# ------------------------------------------------------------ the knot replaced in the bucket


@pytest.mark.parametrize("tensor", ["token_embd.weight", "output.weight"])
async def test_a_knot_with_changed_rows_and_its_header_untouched_is_refused_and_counted(tiny_knot, tmp_path, engine,
                                                                                       tensor):
    """Issue 52's probe: the knot replaced under the same key, one row of the embedding (read by rows)
    or of the LM head (read as each shard's slice) overwritten, the header untouched: the chunk
    digests catch it on every read, so no reply carries a token; the original back gives the baseline."""
    c = await build_cluster(tiny_knot, tmp_path, 2, 3)
    baseline = await tokens(c)
    assert baseline == reference(engine)  # every tier now holds the prompt's rows
    ids = engine.tokenizer.encode(PROMPT)
    row = ids[-1] if tensor == "token_embd.weight" else baseline[0]  # the row that decides the first token
    changed = with_row_replaced(tiny_knot, tmp_path / "changed.knot", tensor, row, row + 1)
    assert reference(changed) != baseline, "the changed row must change the tokens for this test to mean anything"
    assert parse_header(changed.read_bytes()).digest == parse_header(tiny_knot.read_bytes()).digest

    await c.bucket.put(KNOT_KEY, changed.read_bytes())
    for _ in range(2):  # the version is not mistaken for good on a second look
        r = await c.generate(prompt=PROMPT, max_tokens=N)
        assert r.status == 503, r.body
        assert r.json()["error"] == "IntegrityFailure" and "KnotCorrupt" in r.json()["message"], r.body
        assert re.search(rf"tensor {tensor}: chunk \d+ \(bytes \d+:\d+ of the tensor\)", r.json()["message"])
    text = await metrics(c)
    assert sum(counter(text, "knot_r2_corrupt_reads_total", service=f"shard_{i}") for i in range(3)) >= 2

    await c.bucket.put(KNOT_KEY, tiny_knot.read_bytes())  # the original back: nothing of the changed one stays
    assert await tokens(c) == baseline
    await c.drain()


async def test_another_knot_under_the_key_is_refused_by_the_pin_and_the_loaded_one_served_on(tiny_knot, other_knot,
                                                                                            tmp_path, engine):
    """Issue 52, item 2: a self-consistent other knot uploaded under the key does not become the served
    model. The services keep the version they loaded (every weight resident here: the same tokens);
    what needs the bucket is refused naming both digests."""
    c = await build_cluster(tiny_knot, tmp_path, 2, 2)
    baseline = await tokens(c)
    ours, theirs = (parse_header(p.read_bytes()).digest for p in (tiny_knot, other_knot))
    card = (await c.coordinator.fetch(Request("GET", "/v1/models"))).json()["data"][0]
    assert card["knot_digest"] == ours
    await c.bucket.put(KNOT_KEY, other_knot.read_bytes())
    for _ in range(2):
        assert await tokens(c) == baseline
    card = (await c.coordinator.fetch(Request("GET", "/v1/models"))).json()["data"][0]
    assert card["knot_digest"] == ours
    # A prompt whose rows no tier holds: a read of the bucket, which holds the refused knot. The shard
    # that reads it learns of the new object then (503); the next request checks it and names the refusal.
    for _ in range(2):
        r = await c.generate(prompt="tu re in de", max_tokens=N)
        assert r.status == 503 and r.json()["error"] == "IntegrityFailure", r.body
    assert f"digest {theirs}, refused: this service is pinned to {ours}" in r.json()["message"], r.body
    await c.drain()


async def test_a_knot_digest_setting_that_the_bucket_does_not_match_is_a_503_naming_both(tiny_knot, tmp_path):
    ours = parse_header(tiny_knot.read_bytes()).digest
    c = await build_cluster(tiny_knot, tmp_path, 1, 2, coordinator_vars={"KNOT_DIGEST": "ab" * 32})
    r = await c.generate(prompt=PROMPT, max_tokens=N)
    assert r.status == 503 and r.json()["error"] == "KnotNotPinned", r.body
    assert f"has digest {ours}; this service is pinned to {'ab' * 32}" in r.json()["message"]
    c.coordinator.env.update({"KNOT_DIGEST": "not-a-digest"})
    r = await c.generate(prompt=PROMPT, max_tokens=N)
    assert r.status == 503 and "KNOT_DIGEST" in r.json()["message"] and "64 lowercase hex" in r.json()["message"]
    c.coordinator.env.update({"KNOT_DIGEST": ours})
    assert (await c.generate(prompt=PROMPT, max_tokens=N)).status == 200
    await c.drain()


class ReplaceAfter:
    """A station binding that replaces the knot in the bucket after its n-th forward."""

    def __init__(self, inner, bucket, data: bytes, n: int):
        self.inner, self.bucket, self.data, self.n = inner, bucket, data, n
        self.forwards = 0

    async def fetch(self, request: Request) -> Response:
        resp = await self.inner.fetch(request)
        if request.path == "/forward":
            self.forwards += 1
            if self.forwards == self.n:
                await self.bucket.put(KNOT_KEY, self.data)
        return resp


async def test_a_generation_never_mixes_two_knot_versions(tiny_knot, other_knot, tmp_path, engine):
    """The knot is replaced between two decode steps while the phases are read from the bucket
    (no wardens, stations at about the least their forwards need): the generation fails with 503
    rather than go on with the new weights, and the next one runs wholly on the new version."""
    c = await build_cluster(tiny_knot, tmp_path, 2, 2, station_budget_bytes=FLUID_ONE_LAYER_BUDGET_BYTES,
                            wardens=False)
    assert await tokens(c) == reference(engine)
    c.coordinator.env._items["STATION_1"] = ReplaceAfter(c.stations[1], c.bucket, other_knot.read_bytes(), 3)
    coordinator_handler._booted.clear()  # it boots again with the wrapped binding
    r = await c.generate(prompt=PROMPT, max_tokens=N)
    assert r.status == 503, r.body
    assert r.json()["error"] == "IntegrityFailure" and "changed in the bucket" in r.json()["message"]
    # Another model under the key is not what the services loaded: refused by the pin (KNOT_DIGEST unset:
    # the first digest loaded), naming both digests and how to move the pin; never its tokens.
    ours, theirs = (parse_header(p.read_bytes()).digest for p in (tiny_knot, other_knot))
    for _ in range(2):
        r = await c.generate(prompt=PROMPT, max_tokens=N)
        assert r.status == 503 and r.json()["error"] == "IntegrityFailure", r.body
        assert theirs in r.json()["message"] and ours in r.json()["message"], r.body
        assert "knot cluster reload" in r.json()["message"] and "KNOT_DIGEST" in r.json()["message"]
    for env in (c.coordinator.env, *c.station_envs, *(sh.env for sh in c.shards)):  # the operator's pin
        env.update({"KNOT_DIGEST": theirs})
    assert await tokens(c) == reference(other_knot)
    await c.drain()


async def test_a_hop_from_another_version_fails_the_request_instead_of_degrading(tiny_knot, tmp_path):
    c = await build_cluster(tiny_knot, tmp_path, 1, 2)
    await tokens(c)
    st = await c.stations[0].fetch(Request("GET", "/stats"))
    etag = st.headers[KNOT_ETAG_HEADER]
    # A station asked for a version it does not serve, while the bucket holds its own: 503, naming its own.
    frame = wire.encode_envelope(wire.Envelope("x", "prefill", 0, 1, np.zeros((1, 256), np.float32)))
    r = await c.stations[0].fetch(Request("POST", "/forward", {KNOT_ETAG_HEADER: "another"}, frame))
    assert r.status == 503 and r.json()["error"] == "KnotVersionMismatch" and r.headers[KNOT_ETAG_HEADER] == etag

    class OtherVersion:  # a shard whose replies say they come from another version
        def __init__(self, inner):
            self.inner = inner

        async def fetch(self, request):
            resp = await self.inner.fetch(request)
            resp.headers[KNOT_ETAG_HEADER] = "another"
            return resp

    c.coordinator.env._items["SHARD_1"] = OtherVersion(c.shards[1])
    coordinator_handler._booted.clear()
    r = await c.generate(prompt=PROMPT, max_tokens=2)
    assert r.status == 503 and r.json()["error"] == "IntegrityFailure" and "'another'" in r.json()["message"]
    await c.drain()


async def test_the_directory_bucket_reads_only_the_version_asked_for(tmp_path):
    from deploy.local.embedded_bindings import DirectoryBucket

    b = DirectoryBucket(tmp_path)
    v1 = await b.put("k", b"a" * 100)
    assert (await b.get("k", (0, 10), if_match=v1.etag)).body == b"a" * 10
    v2 = await b.put("k", b"b" * 100)  # same size
    assert v2.etag != v1.etag
    with pytest.raises(PreconditionFailed, match="not '" + re.escape(v1.etag)):
        await b.get("k", (0, 10), if_match=v1.etag)
    assert (await b.get("k", (0, 10), if_match=v2.etag)).body == b"b" * 10


# ------------------------------------------------------------ poisoned cache entries, tier by tier


async def test_a_kv_value_of_the_right_length_and_wrong_content_is_a_counted_miss(tiny_knot, tmp_path, engine):
    c = await build_cluster(tiny_knot, tmp_path, 2, 2)
    baseline = await tokens(c)
    await c.drain()  # the KV writes
    etag = (await c.bucket.head(KNOT_KEY)).etag
    ids = sorted(set(engine.tokenizer.encode(PROMPT)))
    for t in ids:
        key = row_key(f"{KNOT_KEY}@{etag}", t)
        value = bytearray(await c.kv.get(key))
        # The top byte (sign, exponent) of the row's last 64 floats: far off, and the same length.
        value[-253::4] = bytes(b ^ 0x40 for b in value[-253::4])
        await c.kv.put(key, bytes(value))
    shard_handler._booted.clear()  # new shard isolates and evicted DOs: only KV still holds the rows
    coordinator_handler._booted.clear()  # (and a new coordinator isolate: its rows are gone too)
    c.cobordism_wardens._instances.clear()
    assert await tokens(c) == baseline
    text = await metrics(c)
    poisoned = 0
    for i, (a, b) in enumerate(c.shard_ranges):
        w = warden(c.cobordism_wardens, "CobordismWarden", f"{KNOT_KEY}|{a}-{b}")
        mine = len([t for t in ids if a <= t < b])
        assert (await w.stats_dict())["rejects"].get("kv", 0) == mine
        assert counter(text, "knot_cache_rejects_total", service=f"shard_{i}", tier="kv") == mine
        poisoned += mine
    assert poisoned == len(ids)
    await c.drain()  # deleted, then rewritten from R2
    want = engine.weight("token_embd.weight").dequantize()
    for t in ids:
        key = row_key(f"{KNOT_KEY}@{etag}", t)
        np.testing.assert_array_equal(decode_row(KV_KEY, key, await c.kv.get(key), etag, t, 256), want[t])


async def test_a_poisoned_cobordism_warden_entry_is_a_counted_miss(tiny_knot, tmp_path, engine):
    c = await build_cluster(tiny_knot, tmp_path, 2, 2, coordinator_vars=NO_ROW_CACHE)
    baseline = await tokens(c)
    t = engine.tokenizer.encode(PROMPT)[0]
    i = owner(c, t)
    a, b = c.shard_ranges[i]
    w = warden(c.cobordism_wardens, "CobordismWarden", f"{KNOT_KEY}|{a}-{b}")
    ram = w.served.caches.ram
    seal, frame = ram.peek(("token_embd.weight", t))
    bad = bytearray(frame.payload)
    bad[5] ^= 0x10
    ram.put(("token_embd.weight", t), (seal, wire.TensorFrame(frame.name, frame.ggml_type, frame.shape, bytes(bad),
                                                               frame.row_start)), seal.nbytes)
    shard_handler._booted.clear()  # the shards' own LRUs are empty: the rows come from the warden
    assert await tokens(c) == baseline
    assert (await w.stats_dict())["rejects"] == {"ram": 1}
    assert counter(await metrics(c), "knot_cache_rejects_total", service=f"shard_{i}", tier="cobordism_warden_ram") == 1
    await c.drain()


async def test_a_poisoned_layer_warden_entry_is_a_counted_miss(tiny_knot, tmp_path):
    """A valid frame of the right length with other bytes: the station finds it against the knot's crc32."""
    c = await build_cluster(tiny_knot, tmp_path, 1, 2, station_budget_bytes=FLUID_BUDGET_BYTES)  # fluid: phases come from the warden
    baseline = await tokens(c)
    assert baseline == reference(tiny_knot)
    w = warden(c.layer_wardens, "LayerWarden", f"{KNOT_KEY}|0-2")
    name = "blk.0.ffn_up.weight"
    seal, encoded = w.served.caches.peek(name)
    frame = wire.decode_tensor(encoded)
    bad = bytearray(frame.payload)
    bad[100] ^= 0x01
    w.served.caches.put(name, (seal, wire.encode_tensor(wire.TensorFrame(name, frame.ggml_type, frame.shape,
                                                                         bytes(bad)))), seal.nbytes)
    before = (await c.stations[0].fetch(Request("GET", "/stats"))).json()
    assert await tokens(c) == baseline
    await c.drain()
    after = (await c.stations[0].fetch(Request("GET", "/stats"))).json()
    text = await metrics(c)
    # the station refused the frame and read R2; the warden dropped the entry
    assert after["invalidations"] == before["invalidations"] + 1 and after["r2_tensors"] == before["r2_tensors"] + 1
    assert (await w.stats_dict())["rejects"] == {"reader": 1}
    assert counter(text, "knot_cache_rejects_total", service="station_0", tier="layer_warden_frame") == 1
    assert wire.decode_tensor(w.served.caches.peek(name)[1]).payload == frame.payload  # clean again


async def test_a_poisoned_shard_row_cache_entry_is_a_counted_miss(tiny_knot, tmp_path, engine):
    c = await build_cluster(tiny_knot, tmp_path, 2, 2, coordinator_vars=NO_ROW_CACHE)
    baseline = await tokens(c)
    t = engine.tokenizer.encode(PROMPT)[0]
    i = owner(c, t)
    sh = await shard_handler.shard_for(c.shards[i].env)
    seal, vec = sh.row_cache.peek(t)
    sh.row_cache.put(t, (seal, vec + 1), vec.nbytes)
    assert await tokens(c) == baseline
    assert sh.stats["row_cache_rejects"] == 1
    assert counter(await metrics(c), "knot_cache_rejects_total", service=f"shard_{i}", tier="shard_lru") == 1
    await c.drain()


async def test_a_kept_tensor_of_another_version_is_a_counted_miss(tiny_knot, tmp_path):
    c = await build_cluster(tiny_knot, tmp_path, 1, 2)  # 128 MiB: the station keeps every tensor
    baseline = await tokens(c)
    st = await station_handler.station_for(c.station_envs[0], Context(c.tasks.add))
    name = "blk.1.ffn_down.weight"
    kept = st.memory.kept.peek(name)
    assert not kept.tensor.data.flags.writeable and kept.seal.etag == st.loader.source.etag
    other = SealedTensor(Seal("another", kept.seal.crc32, kept.seal.nbytes), kept.tensor)
    st.memory.kept.put(name, other, kept.seal.nbytes)
    assert await tokens(c) == baseline
    assert st.loader.stats["kept_rejected"] == 1 and st.memory.kept.peek(name).seal.etag == st.loader.source.etag
    assert counter(await metrics(c), "knot_cache_rejects_total", service="station_0", tier="station_kept") == 1
    await c.drain()


async def test_the_coordinator_keeps_rows_sealed_and_never_a_degraded_one(tiny_knot, tmp_path, engine):
    """EMBED_ROW_CACHE_BYTES: a decode step whose token's row the coordinator kept makes no embed hop
    and gives the same tokens; a kept row whose seal fails is asked of its shard again (counted in
    /metrics); a row a degraded shard could not give (zeros) is never kept."""
    off = await build_cluster(tiny_knot, tmp_path / "off", 2, 2, coordinator_vars=NO_ROW_CACHE)
    want = await tokens(off)
    r = (await off.generate(prompt=PROMPT, max_tokens=N)).json()
    assert r["timings"]["hops"]["embed"]["calls"] == N, "without kept rows, every step embeds"
    await off.drain()
    assert want == reference(engine)
    c = await build_cluster(tiny_knot, tmp_path, 2, 2)
    first = (await c.generate(prompt=PROMPT, max_tokens=N)).json()
    again = (await c.generate(prompt=PROMPT, max_tokens=N)).json()
    assert first["tokens"] == again["tokens"] == want
    assert "embed" not in again["timings"]["hops"], "every row of the second run was kept"
    co = await coordinator_handler.coordinator_for(c.coordinator.env)
    ids = engine.tokenizer.encode(PROMPT)
    seal_, row = co.pipeline.rows.peek(ids[-1])
    bad = row.copy()
    bad[0] += 1.0
    co.pipeline.rows.put(ids[-1], (seal_, bad), bad.nbytes)  # as if the kept copy had been overwritten
    assert await tokens(c) == want
    assert co.pipeline.row_rejects == 1
    text = await metrics(c)
    assert counter(text, "knot_embed_row_cache", what="rejected") == 1 and counter(text, "knot_embed_row_cache",
                                                                                    what="hits") > 0
    # a shard that fails, degraded around: its tokens' rows are zeros, and none of them is kept
    co.pipeline.rows = type(co.pipeline.rows)(co.pipeline.rows.budget_bytes)
    t = ids[0]
    i = owner(c, t)
    shard_handler._booted.clear()

    async def down(request, env, ctx):
        return Response.from_json({"error": "unavailable", "message": "down for the test"}, 503)

    real, c.shards[i].handler = c.shards[i].handler, down
    r = await c.generate(prompt=PROMPT, max_tokens=2, shard_failure="degrade")
    assert r.status == 200 and r.json()["degraded_shards"], r.body
    kept = set(co.pipeline.rows.keys())
    a, b = c.shard_ranges[i]
    assert kept and not any(a <= k < b for k in kept), (kept, (a, b))
    c.shards[i].handler = real
    await c.drain()
