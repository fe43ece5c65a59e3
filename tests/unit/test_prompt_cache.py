"""Prompt caching (issue 50, item 3): block keys, the coordinator's index, the stations' block
store, and through the in-process cluster: a prompt that starts with cached blocks prefills only
the rest, and its tokens equal a cold run's and the single process's, greedy and seeded; eviction
under a small cache; several clients' prefixes kept side by side; a fluid station says it keeps none."""
from __future__ import annotations

import asyncio

import numpy as np
import pytest

from common import wire
from common.kvcache import KVCache
from common.kvcache import PREFILL_CHUNK_TOKENS, prefill_chunks
from common.ops import EXACT_ROWS
from common.prefix import PREFIX_BLOCK_TOKENS, ROOT, block_keys, resume_at, reusable_blocks
from common.runtime import Request
from common.sampling import SamplingParams
from deploy.engine_local import LocalEngine
from services.station import handler as station
from services.station.prefix_store import PrefixStore
from tests.inprocess import build_cluster
from tests.tiny_gguf import TinySpec, tiny_knot

B, C = PREFIX_BLOCK_TOKENS, PREFILL_CHUNK_TOKENS
SPEC = TinySpec(n_layers=2, hidden=32, ffn=64, n_head=2, n_kv_head=1, context=4096, seed=5)
WIDE = TinySpec(n_layers=2, hidden=512, ffn=1024, n_head=8, n_kv_head=2, context=1024, seed=6)


# ------------------------------------------------------------------ keys and the index

def test_block_keys_name_whole_prefixes():
    a = list(range(3 * B + 7))
    b = a[:B] + [a[B] + 1] + a[B + 1:]  # differs in block 1
    ka, kb = block_keys(a), block_keys(b)
    assert len(ka) == 4 and ka[0] == kb[0] == ROOT
    assert ka[1] == kb[1]  # the first block is shared
    assert ka[2] != kb[2] and ka[3] != kb[3]  # from the first difference on, every key differs
    assert block_keys(a[:2 * B]) == ka[:3]  # a key depends on its prefix only
    assert len({*ka}) == 4


def test_a_prompt_always_computes_its_last_token():
    assert [reusable_blocks(n) for n in (0, 1, B, B + 1, 2 * B, 2 * B + 1)] == [0, 0, 0, 1, 1, 2]


def test_a_prompt_resumes_where_its_rows_are_computed_as_a_cold_chunks():
    """resume_at: inside a chunk, the resumed rows run as one product exactly when the cold chunk's
    do (common.ops.row_by_row); else an earlier block. The chunks after it are the cold ones."""
    assert C == 4 * B and EXACT_ROWS < B
    assert resume_at(C + 3 * B + 10, 99) == 6  # C + 3B would leave 10 rows, row by row: C + 2B leaves 74
    assert resume_at(C + B + 10, 99) == 4  # C + B leaves 10 rows: back to the chunk's start
    assert resume_at(C + 3 * B + 10, 3) == 3  # no more than the stations hold
    assert resume_at(C + 3 * B + EXACT_ROWS + 1, 99) == 7  # 34 rows: one product, as the cold chunk's
    assert resume_at(3 * B + 10, 99) == 2  # the first chunk: its cold rows are one product (S = T)
    assert resume_at(B + 5, 1) == 0 and resume_at(10 * B, 0) == 0
    assert prefill_chunks(C + 100, start=B) == [(B, C), (C, C + 100)]
    assert prefill_chunks(C + 100, start=C) == [(C, C + 100)] and prefill_chunks(C + 100) == [(0, C), (C, C + 100)]


# ------------------------------------------------------------------ the envelope

def test_an_envelope_carries_its_prefix_and_block_keys():
    x = np.arange(12, dtype=np.float32).reshape(3, 4)
    p, b, b2 = bytes(range(16)), bytes(range(16, 32)), bytes(range(32, 48))
    for prefix, blocks in ((p, (b,)), (p, (b, b2)), (None, (b,)), (p, ()), (None, ())):
        env = wire.Envelope("r", "prefill", 256, 259, x, False, prefix, blocks)
        out = wire.decode_envelope(wire.encode_envelope(env))
        assert (out.prefix, out.blocks, out.position, out.seq_len) == (prefix, blocks, 256, 259)
        assert np.array_equal(out.array, x)
    with pytest.raises(ValueError, match="16 bytes"):
        wire.encode_envelope(wire.Envelope("r", "prefill", 0, 3, x, False, b"short"))
    with pytest.raises(ValueError, match="16 bytes"):
        wire.encode_envelope(wire.Envelope("r", "prefill", 0, 3, x, False, p, (b, b"short")))
    data = bytearray(wire.encode_envelope(wire.Envelope("r", "prefill", 0, 3, x, False, p, (b, b2))))
    with pytest.raises(wire.WireError):  # a key cut short
        wire.decode_envelope(bytes(data[:25]))
    head = 20 + 1 + 16  # the header, the id "r", the prefix key
    assert data[head] == 2
    zero = bytearray(data)
    zero[head] = 0  # BLOCK with no key (the crc would also fail: the count is checked first)
    with pytest.raises(wire.MalformedFrame, match="no block key"):
        wire.decode_envelope(bytes(zero))
    data[18] |= 8  # a flag this decoder does not know
    with pytest.raises(wire.MalformedFrame, match="flags"):
        wire.decode_envelope(bytes(data))


# ------------------------------------------------------------------ the store

def _filled(n: int, layers=range(2)) -> KVCache:
    kv = KVCache(1, 4, np.float32)
    rng = np.random.default_rng(n)
    for layer in layers:
        kv.append(layer, rng.standard_normal((n, 1, 4)).astype(np.float32),
                  rng.standard_normal((n, 1, 4)).astype(np.float32), np.arange(n))
    return kv


def test_the_store_restores_exact_blocks_and_evicts_leaves_first():
    blk = 4
    kv = _filled(3 * blk)
    layers = range(2)
    store = PrefixStore(capacity_bytes=1 << 20, block_tokens=blk)
    k1, k2, k3 = b"1" * 16, b"2" * 16, b"3" * 16
    assert store.put(k1, None, 0, kv, layers, 1 << 20) and store.put(k2, k1, blk, kv, layers, 1 << 20)
    assert store.put(k3, k2, 2 * blk, kv, layers, 1 << 20)
    assert store.held([ROOT, k1, k2, k3]) == 3 and store.held([ROOT, k1, b"x" * 16]) == 1
    out = KVCache(1, 4, np.float32)
    assert store.restore(k2, 2 * blk, out, layers)
    for layer in layers:
        assert all(np.array_equal(a, b[:2 * blk]) for a, b in zip(out.layer(layer), kv.layer(layer)))
    assert not store.restore(k2, 3 * blk, KVCache(1, 4, np.float32), layers)  # k2 does not end at 12
    assert (store.hits, store.misses, store.reused_tokens) == (1, 1, 2 * blk)
    # the restore touched k2 then k1: k3, a leaf, is the least recently used and goes first
    store.evict_one()
    assert list(store.blocks) == [k2, k1] and store.held([ROOT, k1, k2, k3]) == 2
    one = store.block_bytes(kv, 2)
    assert one == 2 * blk * 4 * 4 * 2 and store.nbytes == 2 * one
    # less room than a block beside them: k3 would fit only by evicting its own prefix, so it is refused
    assert not store.put(k3, k2, 2 * blk, kv, layers, room=one - 1)
    assert store.nbytes == 2 * one and store.held([ROOT, k1, k2, k3]) == 2
    # a chain stored block by block: each new block touches its ancestors, so the first block is the
    # newest and the last one goes first (a long prompt keeps its head)
    chain = PrefixStore(capacity_bytes=1 << 20, block_tokens=blk)
    assert chain.put(k1, None, 0, kv, layers, 1 << 20) and chain.put(k2, k1, blk, kv, layers, 1 << 20)
    assert chain.put(k3, k2, 2 * blk, kv, layers, 1 << 20)
    assert list(chain.blocks) == [k3, k2, k1]
    assert not chain.put(b"s" * 16, b"s" * 16, 3 * blk, _filled(4 * blk), layers, 1 << 20)  # its own parent: no loop
    assert not chain.put(b"t" * 16, b"x" * 16, 3 * blk, _filled(4 * blk), layers, 1 << 20)  # a prefix not here
    assert not store.put(b"4" * 16, k3, 3 * blk, kv, layers, 1 << 20)  # kv holds no 4th block
    # a prompt longer than the cache keeps its head: its later blocks are refused, not stored by
    # evicting the prefix they hang from (which would leave nothing restorable)
    two = PrefixStore(capacity_bytes=2 * one, block_tokens=blk)
    four = _filled(4 * blk)
    keys = [bytes([65 + i]) * 16 for i in range(4)]
    stored = [two.put(keys[i], keys[i - 1] if i else None, i * blk, four, layers, 1 << 20) for i in range(4)]
    assert stored == [True, True, False, False] and two.held([ROOT, *keys]) == 2 and two.refused == 2  # 3: an orphan
    assert two.put(b"o" * 16, None, 0, kv, layers, 1 << 20)  # another prompt's block: the LRU (a leaf) goes
    assert set(two.blocks) == {keys[0], b"o" * 16} and two.held([ROOT, *keys]) == 1
    small = PrefixStore(capacity_bytes=one - 1, block_tokens=blk)
    assert not small.put(k1, None, 0, kv, layers, 1 << 20) and small.refused == 1


# ------------------------------------------------------------------ through the cluster

@pytest.fixture(scope="module")
def knot(tmp_path_factory):
    return tiny_knot(tmp_path_factory.mktemp("prompt-cache"), SPEC)


@pytest.fixture(scope="module")
def engine(knot):
    return LocalEngine.open(knot)


def digits(n: int, offset: int = 0) -> str:
    """n tokens: the pre-tokenizer makes every digit a token of its own."""
    return "".join(str((i * 7 + offset) % 10) for i in range(n))


async def stats(c) -> list[dict]:
    return [(await st.fetch(Request("GET", "/stats"))).json()["prefix_cache"] for st in c.stations]


async def generate(c, prompt: str, **kw) -> dict:
    r = await c.generate(prompt=prompt, **kw)
    assert r.status == 200, r.body
    return r.json()


async def test_a_cached_prefix_gives_the_cold_tokens(knot, engine, tmp_path):
    c = await build_cluster(knot, tmp_path, 2, 2)
    first = digits(C + 100)
    cold = await generate(c, first, max_tokens=6)
    assert cold["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    n1 = len(cold["prompt_tokens"])
    assert [s["stored"] for s in await stats(c)] == [n1 // B] * 2  # the whole blocks; the tail is not one
    # the same context with a new last part, as an agent re-sends it
    second = first + digits(300, 3)
    n2 = n1 + 300
    # the first prompt's blocks, which end inside a chunk; then more: the first hit kept its own
    first_hit, second_hit = resume_at(n2, n1 // B), resume_at(n2, reusable_blocks(n2))
    assert first_hit * B % C and second_hit > first_hit
    for blocks, kw in ((first_hit, {}), (second_hit, {"temperature": 0.9, "seed": 11, "top_k": 5})):
        hit = await generate(c, second, max_tokens=8, **kw)
        assert hit["usage"]["prompt_tokens_details"]["cached_tokens"] == blocks * B
        miss = await generate(c, second, max_tokens=8, cache_prompt=False, **kw)
        assert miss["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        assert hit["prompt_tokens"] == miss["prompt_tokens"]
        assert hit["tokens"] == miss["tokens"]
        sampling = SamplingParams(**kw)
        assert hit["tokens"] == engine.generate(hit["prompt_tokens"], sampling, max_tokens=8).token_ids
    # the identical prompt again: every block but the one holding its last token comes from the cache
    again = await generate(c, second, max_tokens=8)
    n = len(again["prompt_tokens"])
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == resume_at(n, reusable_blocks(n)) * B
    for s in await stats(c):
        assert s["hits"] == 3 and s["misses"] == 0 and s["holds"], s
    card = (await c.coordinator.fetch(Request("GET", "https://coordinator/v1/models"))).json()["data"][0]
    assert card["prompt_cache"]["on"] and all(s["holds"] for s in card["prompt_cache"]["stations"])
    metrics = (await c.coordinator.fetch(Request("GET", "https://coordinator/metrics"))).body.decode()
    assert 'knot_prompt_cache_lookups_total{result="hit"} 3.0' in metrics
    assert 'knot_station_prompt_cache_total{event="hit",station="0"} 3.0' in metrics
    await c.drain()


async def test_a_small_cache_evicts_least_recently_used_blocks(knot, engine, tmp_path):
    """Room for three blocks: three prompts of two blocks each push the first one's out; re-sent, it
    runs from 0 with the same tokens, and keeps its blocks again."""
    kv = KVCache(SPEC.n_kv_head, SPEC.hidden // SPEC.n_head, np.float16)
    three = 3 * PrefixStore(0).block_bytes(kv, 1)
    c = await build_cluster(knot, tmp_path, 2, 2, station_vars={"PREFIX_CACHE_BYTES": str(three)})
    prompts = [digits(2 * B + 5, k) for k in range(3)]
    for p in prompts:
        await generate(c, p, max_tokens=2)
    for s in await stats(c):
        assert s["capacity_bytes"] == three and s["bytes"] <= three and s["evictions"] >= 3, s
    resent = await generate(c, prompts[0] + digits(40, 9), max_tokens=6)
    assert resent["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert resent["tokens"] == engine.generate(resent["prompt_tokens"], SamplingParams(), max_tokens=6).token_ids
    again = await generate(c, prompts[0] + digits(50, 8), max_tokens=2)
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == 2 * B
    metrics = (await c.coordinator.fetch(Request("GET", "https://coordinator/metrics"))).body.decode()
    assert 'knot_prompt_cache_lookups_total{result="none"} 4.0' in metrics  # 3 cold prompts and the re-sent one
    await c.drain()


async def test_blocks_gone_between_the_question_and_the_prompt_run_it_cold(knot, engine, tmp_path, monkeypatch):
    """A station that said it held the blocks and no longer does when the prompt reaches it (an
    eviction in between): it refuses, the prompt runs from 0, the tokens are a cold run's."""
    c = await build_cluster(knot, tmp_path, 2, 2)
    p = digits(2 * B + 30)
    await generate(c, p, max_tokens=2)
    booted = sorted(station._booted._booted.values(), key=lambda st: st.settings.layer_start)
    while booted[1].prefix.evict_one():
        pass
    monkeypatch.setattr(PrefixStore, "held", lambda self, keys: len(keys) - 1)  # they say they hold it all
    r = await generate(c, p + digits(20, 4), max_tokens=5)
    assert r["usage"]["prompt_tokens_details"]["cached_tokens"] == 0 and r["replays"] == 0
    assert r["tokens"] == engine.generate(r["prompt_tokens"], SamplingParams(), max_tokens=5).token_ids
    assert [s["misses"] for s in await stats(c)] == [0, 1]
    metrics = (await c.coordinator.fetch(Request("GET", "https://coordinator/metrics"))).body.decode()
    assert 'knot_prompt_cache_lookups_total{result="miss"} 1.0' in metrics
    await c.drain()


async def test_a_station_refuses_a_malformed_prefix_question(knot, tmp_path):
    c = await build_cluster(knot, tmp_path, 2, 2)
    for bad in ("yes", 1):
        r = await c.generate(prompt="12", max_tokens=1, cache_prompt=bad)
        assert r.status == 400 and b"cache_prompt must be true or false" in r.body, r.body
    for body in (b"x" * 17, b"\0" * 16 * 1000):
        r = await c.stations[0].fetch(Request("POST", "/prefix", {}, body))
        assert r.status == 400 and b"block keys" in r.body, r.body
    r = await c.stations[0].fetch(Request("POST", "/prefix", {}, ROOT + b"k" * 16))
    assert r.status == 200 and r.json() == {"blocks": 0}
    await c.drain()


async def test_concurrent_clients_keep_their_prefixes(knot, engine, tmp_path):
    """Several clients' contexts stay side by side (not the last prompt only): each re-sent context hits."""
    c = await build_cluster(knot, tmp_path, 2, 2)
    contexts = [digits(B + 30, k) for k in range(4)]
    await asyncio.gather(*(generate(c, p, max_tokens=2) for p in contexts))
    replies = await asyncio.gather(*(generate(c, p + digits(20, 1), max_tokens=4) for p in contexts))
    for r in replies:
        assert r["usage"]["prompt_tokens_details"]["cached_tokens"] == B
        assert r["tokens"] == engine.generate(r["prompt_tokens"], SamplingParams(), max_tokens=4).token_ids
    await c.drain()


async def test_a_restarted_station_has_no_blocks_and_the_prompt_runs_cold(knot, engine, tmp_path):
    c = await build_cluster(knot, tmp_path, 2, 2)
    p = digits(B + 50)
    await generate(c, p, max_tokens=2)
    station._booted.clear()  # every station boots again, with an empty prompt cache
    r = await generate(c, p + digits(10, 2), max_tokens=5)
    assert r["usage"]["prompt_tokens_details"]["cached_tokens"] == 0 and r["replays"] == 0
    assert r["tokens"] == engine.generate(r["prompt_tokens"], SamplingParams(), max_tokens=5).token_ids
    await c.drain()


async def test_a_fluid_station_keeps_no_prompt_and_says_so(tmp_path):
    """A wider tiny model whose layers (4.7 MB) a 7 MiB station streams."""
    path = tiny_knot(tmp_path, WIDE, "wide")
    engine = LocalEngine.open(path)
    c = await build_cluster(path, tmp_path, 1, 2, station_budget_bytes=7 << 20)
    r = await generate(c, digits(B + 20), max_tokens=3)
    r = await generate(c, digits(B + 20) + "1", max_tokens=3)
    assert r["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert r["tokens"] == engine.generate(r["prompt_tokens"], SamplingParams(), max_tokens=3).token_ids
    card = (await c.coordinator.fetch(Request("GET", "https://coordinator/v1/models"))).json()["data"][0]
    st = card["prompt_cache"]["stations"][0]
    assert not card["prompt_cache"]["on"] and not st["holds"] and "budget" in st["why_not"], card
    memory = (await c.stations[0].fetch(Request("GET", "/stats"))).json()["memory"]
    assert not memory["fits"], memory  # it is fluid
    await c.drain()
