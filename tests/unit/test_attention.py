"""Tiled attention (online softmax over key tiles) against the one-tile computation: equal within
the float16 rounding of the weights on random data, the same greedy tokens on a tiny model, and temporaries bounded
by the tile instead of by the prompt. The properties hold on both paths of attention's products: numpy's
float64 matmuls (what Workers run) and the C kernels (deploy/kernels/attn.h), which compute the same numbers."""
from __future__ import annotations

import tracemalloc

import numpy as np
import pytest

from common import ops
from common.kvcache import KVCache
from common.models import qwen2
from common.ops import Ops, to_f16
from common.sampling import SamplingParams
from common.speculative import MAX_DRAFT
from deploy import kernels


@pytest.fixture(params=["numpy", pytest.param("kernel", marks=pytest.mark.needs_kernels)])
def impl(request) -> Ops:
    """Attention's products on numpy's float64 matmuls (common.ops.Ops) or on the C kernels
    (deploy.kernels.KernelOps), also installed for the models the test builds (conftest restores
    the session's after the test)."""
    impl = kernels.KernelOps() if request.param == "kernel" else Ops()
    ops.install(impl)
    return impl


def qkv(T: int, S: int, n_head: int = 4, n_kv: int = 2, hd: int = 16, seed: int = 0):
    """Random q (T, n_head, hd) and k, v (S, n_kv, hd)."""
    rng = np.random.default_rng(seed)
    q = rng.normal(0, 2.0, (T, n_head, hd)).astype(np.float32)  # scale 2: peaked rows, as attention sinks make
    k = rng.normal(size=(S, n_kv, hd)).astype(np.float32)
    v = rng.normal(size=(S, n_kv, hd)).astype(np.float32)
    return q, k, v


def f16_weights_atol(v: np.ndarray) -> float:
    """How far the tiled result may be from the one-tile one: each rounds a key's weight to float16
    (2^-11 relative), the one-tile computation its probability and a tile its exp(s - m), so the
    outputs (weights summing to 1 over the values) differ by at most 2 * 2^-11 * max |v|."""
    return 2 * 2.0 ** -11 * float(np.abs(v.astype(np.float32)).max())


@pytest.mark.parametrize("T,S,tile", [(1, 300, 64), (37, 300, 64), (37, 300, 128), (64, 1000, 192), (5, 70, 64)])
def test_tiled_equals_one_tile_on_random_data(T, S, tile, impl):
    """A prefill chunk: T queries at the last T positions over S keys, in tiles of `tile` keys."""
    q, k, v = qkv(T, S, seed=T + S)
    k_pos, q_pos = np.arange(S), np.arange(S - T, S)
    want = impl.attend(q, k, v, q_pos, k_pos, tile=S)
    got = impl.attend(q, k, v, q_pos, k_pos, tile=tile)
    np.testing.assert_allclose(got, want, rtol=0, atol=f16_weights_atol(v))


def test_tiled_handles_any_positions_and_rows_that_see_nothing_in_a_tile(impl):
    """Query rows at arbitrary positions (a speculative verify frame, a batch's rows) and keys in
    any order: the mask is by position alone, and a row whose keys all sit in other tiles still
    gets exactly its own softmax."""
    S, T = 260, 9
    q, k, v = qkv(T, S, seed=5)
    rng = np.random.default_rng(6)
    k_pos = rng.permutation(S)
    q_pos = np.array([0, 259, 3, 128, 64, 65, 200, 1, 255])
    want = impl.attend(q, k, v, q_pos, k_pos, tile=S)
    for tile in (64, 128):
        got = impl.attend(q, k, v, q_pos, k_pos, tile=tile)
        np.testing.assert_allclose(got, want, rtol=0, atol=f16_weights_atol(v))
    # Row 0 sees key position 0 only: its output is that key's value row, whatever the tiles.
    g = 2
    key0 = int(np.flatnonzero(k_pos == 0)[0])
    got0 = impl.attend(q, k, v, q_pos, k_pos, tile=64).reshape(T, 4, 16)[0]
    np.testing.assert_allclose(got0, np.repeat(v[key0], g, axis=0), rtol=1e-6)


def test_float16_storage_converts_per_tile():
    q, k, v = qkv(16, 300, seed=2)
    k16, v16 = k.astype(np.float16), v.astype(np.float16)
    pos = np.arange(300)
    want = Ops().attend(q, k16.astype(np.float32), v16.astype(np.float32), pos[-16:], pos, tile=300)
    got = Ops().attend(q, k16, v16, pos[-16:], pos, tile=64)
    np.testing.assert_allclose(got, want, rtol=0, atol=f16_weights_atol(v16))
    # One tile: the same bits whether the cache stores float16 or float32 copies of the same values.
    np.testing.assert_array_equal(Ops().attend(q, k16, v16, pos[-16:], pos, tile=300), want)


def test_to_f16_is_numpys_float16_rounding():
    """Every float32 input, rounded as numpy's (IEEE) float16 conversion rounds it: random values over
    float16's whole range and past it, each tie between two float16 numbers and its neighbours,
    float16's subnormals and the smaller numbers that round to them or to zero, signs, inf, nan."""
    rng = np.random.default_rng(0)
    f16 = np.arange(0x7C01, dtype=np.uint16).view(np.float16).astype(np.float64)  # +0 ... inf
    ties = ((f16[:-2] + f16[1:-1]) / 2).astype(np.float32)     # halfway between neighbours
    x = np.concatenate([
        rng.standard_normal(200_000).astype(np.float32) * np.float32(10.0) ** rng.integers(-9, 6, 200_000),
        np.exp(-rng.random(100_000) * 103).astype(np.float32),  # softmax weights down to 1e-45
        f16.astype(np.float32), ties, np.nextafter(ties, np.float32(0)), np.nextafter(ties, np.float32(np.inf)),
        np.float32([65504, 65519.99, 65520, 70000, 3e38, np.inf, 2 ** -24, 2 ** -25, 2 ** -25 * 1.0001, 0.0]),
    ]).astype(np.float32)
    x = np.concatenate([x, -x, np.float32([np.nan])])
    with np.errstate(over="ignore"):  # past 65504 numpy says it overflows to inf, as it should
        want = x.astype(np.float16).astype(np.float32)
    got = to_f16(x)
    assert got.dtype == np.float32
    np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))  # -0.0 and nan included


def test_slices_of_keys_for_the_float64_copies_do_not_change_the_bits(monkeypatch):
    """The float64 copies are made a slice of keys at a time (ATTN_CONVERT_BYTES). Where the keys
    are cut changes no score (each is one sum over head_dim) and no output bit (float64 sums of
    exact products, rounded once to float32): a decode row and a prefill chunk, with the 0.5B's
    14 query heads over 2 kv heads of 64, are the same bits in slices of 1, 7 and all keys."""
    rng = np.random.default_rng(11)
    S = 300
    k = to_f16((rng.standard_normal((S, 2, 64)) * 3).astype(np.float32))
    v = to_f16(rng.standard_normal((S, 2, 64)).astype(np.float32))
    for T in (1, 24):
        q = rng.standard_normal((T, 14, 64)).astype(np.float32)
        q_pos, k_pos = np.arange(S - T, S), np.arange(S)
        want = Ops().attend(q, k, v, q_pos, k_pos)
        for keys in (1, 7):
            monkeypatch.setattr(ops, "_convert_keys", lambda n_kv, hd, rows, keys=keys: keys)
            np.testing.assert_array_equal(Ops().attend(q, k, v, q_pos, k_pos), want)
        monkeypatch.undo()


def test_tile_keys_bound_the_scores_and_decode_takes_one_tile():
    tile_bytes = ops.ATTN_TILE_BYTES
    for n_head, T in [(14, 256), (28, 256), (12, 1), (14, 3000)]:
        tile = ops.attn_tile_keys(n_head, T)
        assert tile % ops.ATTN_TILE_ALIGN == 0 and tile >= ops.ATTN_TILE_ALIGN
        assert 4 * n_head * T * tile <= tile_bytes or tile == ops.ATTN_TILE_ALIGN
    # A decode step of a 32-head model over a 32k context: one tile, the untiled computation.
    assert ops.attn_tile_keys(32, 1) >= 32768


def peak_bytes(fn) -> int:
    """Peak bytes numpy allocated while fn ran (numpy reports its buffers to tracemalloc)."""
    tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        base = tracemalloc.get_traced_memory()[0]
        fn()
        return tracemalloc.get_traced_memory()[1] - base
    finally:
        tracemalloc.stop()


def test_temporaries_are_bounded_by_chunk_times_tile_not_by_the_prompt():
    """A 256-row chunk at the end of an 8k-token prompt: the one-tile computation would hold
    (n_head, T, S) float32 scores (32 MiB here); the tiled one about one tile's worth."""
    T, S, n_head = 256, 8192, 4
    q, k, v = qkv(T, S, n_head=n_head)
    q_pos, k_pos = np.arange(S - T, S), np.arange(S)
    full_scores = 4 * n_head * T * S
    tiled = peak_bytes(lambda: Ops().attend(q, k, v, q_pos, k_pos))
    accounted = ops.attention_bytes(n_head, 16, T, S, n_kv=2)
    # the bound: a tile's scores, and the float64 copies of a slice of keys beside them
    assert tiled <= accounted < full_scores / 4 + ops.ATTN_CONVERT_BYTES, (tiled, accounted, full_scores)
    assert accounted < 1.3 * tiled, "the bound is the real footprint, not a guess far above it"


def test_greedy_tokens_equal_with_tiny_tiles(tiny_gguf, monkeypatch, impl):
    """The tiny model decodes the same greedy tokens when every attention runs in tiles of 4 keys."""
    from deploy.engine_local import LocalEngine

    eng = LocalEngine.open(tiny_gguf)
    ids = eng.tokenizer.encode("the cat in the hat sat on the mat and then the dog came by")
    want = eng.generate(ids, SamplingParams(), max_tokens=24)
    monkeypatch.setattr(ops, "ATTN_TILE_ALIGN", 4)
    monkeypatch.setattr(ops, "ATTN_TILE_BYTES", 1)
    assert ops.attn_tile_keys(4, 1) == 4
    got = eng.generate(ids, SamplingParams(), max_tokens=24)
    assert got.token_ids == want.token_ids and len(want.token_ids) == 24


def test_scores_are_the_same_bits_in_any_tile(impl):
    """Each score is a float64 sum of exact products rounded once to float32, whatever the tile or
    the slices of keys copied at a time: tiling changes only how the softmax's pieces are combined."""
    q, k, v = qkv(8, 300, seed=9)
    pos = np.arange(300)
    qg = np.ascontiguousarray(to_f16(q).reshape(8, 2, 2, 16).transpose(1, 2, 0, 3), impl.q_dtype)
    whole = impl._scores(qg, k, pos[-8:], pos)
    np.testing.assert_array_equal(impl._scores(qg, k[64:128], pos[-8:], pos[64:128]), whole[..., 64:128])


def exact_sum_qkv(T: int, S: int, n_head: int, n_kv: int, hd: int, seed: int):
    """q, k, v whose float64 sums are exact in any order: f16 numbers of magnitude in [2^-4, 16]
    (or 0), so a product is a multiple of 2^-28 below 2^8, and every partial sum fits 53 bits;
    the weights' f16 rounding (>= 2^-24) times such values likewise for up to ~2^13 keys."""
    rng = np.random.default_rng(seed)

    def draw(shape):
        x = rng.uniform(2.0 ** -4, 16.0, shape) * rng.choice([-1.0, 1.0], shape)
        x[rng.random(shape) < 0.05] = 0.0
        return x.astype(np.float16).astype(np.float32)
    return draw((T, n_head, hd)) / np.float32(4), draw((S, n_kv, hd)) / np.float32(4), draw((S, n_kv, hd))


@pytest.mark.needs_kernels
@pytest.mark.parametrize("T,S,tile", [(1, 1500, None), (7, 400, None), (64, 1000, 192), (1, 40, None)])
def test_kernels_and_numpy_give_the_same_bits(T, S, tile):
    """Where every float64 sum is exact, the order of the sums cannot matter: the C kernels' fixed
    order and BLAS's equal bit for bit, one tile and tiled, at the 0.5B's and 1.5B's head shapes.
    (On real keys the sums can round in float64, and the two agree unless that rounding straddles
    a float32 boundary: the llama.cpp oracle tests run the kernels.)"""
    for n_head, n_kv, hd in [(14, 2, 64), (12, 2, 128)]:
        q, k, v = exact_sum_qkv(T, S, n_head, n_kv, hd, seed=S + hd)
        q_pos, k_pos = np.arange(S - T, S), np.arange(S)
        want = Ops().attend(q, k, v, q_pos, k_pos, tile=tile)
        kern = kernels.KernelOps()
        np.testing.assert_array_equal(kern.attend(q, k, v, q_pos, k_pos, tile=tile).view(np.uint32),
                                      want.view(np.uint32))
        # a float16 cache (the kernel reads f16), and a float64 one, which the kernel declines:
        # numpy's float64 matmuls from its float32 q
        for dtype in (np.float16, np.float64):
            got = kern.attend(q, k.astype(dtype), v.astype(dtype), q_pos, k_pos, tile=tile)
            np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))


# ------------------------------------------------------------------ the station's accounting

def phase_weights(dim: int, ffn: int, n_kv: int, hd: int) -> dict:
    """Layer 0's tensors, F32 (matmul allocates only its output for them, as the C kernels do)."""
    from common.quant import QTensor

    rng = np.random.default_rng(0)
    kvd = n_kv * hd
    shapes = {"attn_norm.weight": (dim,), "attn_q.weight": (dim, dim), "attn_q.bias": (dim,),
              "attn_k.weight": (kvd, dim), "attn_k.bias": (kvd,), "attn_v.weight": (kvd, dim),
              "attn_v.bias": (kvd,), "attn_output.weight": (dim, dim), "ffn_norm.weight": (dim,),
              "ffn_gate.weight": (ffn, dim), "ffn_up.weight": (ffn, dim), "ffn_down.weight": (dim, ffn)}
    out = {}
    for name, shape in shapes.items():
        a = (rng.normal(size=shape) * 0.05).astype(np.float32)
        out["blk.0." + name] = QTensor("blk.0." + name, "F32", tuple(reversed(shape)), a.reshape(-1).view(np.uint8))
    return out


def state_bytes(st) -> int:
    if isinstance(st, qwen2.FfnState):
        return sum(a.nbytes for a in (st.residual, st.xn, st.act) if a is not None)
    return st.nbytes


# (dim, ffn, n_head, n_kv): the tiny test model's shape and the 0.5B's.
SHAPES = {"tiny": (64, 96, 4, 2), "0.5b": (896, 4864, 14, 2)}


@pytest.mark.parametrize("shape", sorted(SHAPES))
@pytest.mark.parametrize("T,S", [(1, 1), (1, 8192), (256, 256), (256, 2048), (64, 1000)])
def test_activation_bytes_bound_every_phase_as_measured(shape, T, S, numpy_matmul):
    """model.activation_bytes(T, S), what a station accounts for a phase's temporaries, is at least
    what each phase really holds (the state it was handed included), measured by tracemalloc,
    and no more than 1.5x the largest phase's."""
    dim, ffn, n_head, n_kv = SHAPES[shape]
    hp = dict(block_count=1, embedding_length=dim, feed_forward_length=ffn, head_count=n_head,
              head_count_kv=n_kv, rope_freq_base=1e6, rms_eps=1e-6, context_length=32768, vocab_size=100)
    model = qwen2.Qwen2.from_hparams(hp)
    hd = model.cfg.head_dim
    w = phase_weights(dim, ffn, n_kv, hd)
    kv = KVCache(n_kv, hd)
    if S > T:
        old = np.zeros((S - T, n_kv, hd), np.float32)
        kv.append(0, old, old, np.arange(S - T))
    kv._reserve(0, S)  # the KV's growth is accounted apart (nbytes_after), not as an activation
    seqs = [(kv, np.arange(S - T, S))]
    state = np.random.default_rng(1).normal(size=(T, dim)).astype(np.float32)
    measured = {}
    for phase in model.phases:
        held = state_bytes(state)
        box = []
        measured[phase] = peak_bytes(lambda: box.append(model.run_phase(0, phase, state, w, seqs))) + held
        state = box.pop()
    accounted = model.activation_bytes(T, S)
    assert max(measured.values()) <= accounted, (measured, accounted)
    # Beyond 1.5x the measured peak only: the C kernels' quantized inputs (which tracemalloc cannot
    # see) and a fixed allowance for numpy's casting buffers.
    slack = 3 * T * max(dim, ffn) + 2 * ops.NUMPY_BUFFER_BYTES
    assert accounted <= 1.5 * max(measured.values()) + slack, (measured, accounted)


@pytest.mark.parametrize("T", [2, 6, 9, 33])
def test_a_short_batch_of_rows_is_each_row_decoded_alone(T, impl):
    """A speculative verify trip's rows (Ops.attention, T <= EXACT_ROWS) are bit for bit what
    decoding them one at a time gives: row t over the first S - T + 1 + t keys, alone. (A product
    of T rows sums in another order, ~1e-6 apart, which the next layers' Q8 rounding grew to 0.3-0.56
    in a logit of the 1.5B.) Realistic shapes: the 0.5B's 14 query heads over 2 kv heads of 64."""
    rng = np.random.default_rng(T)
    n_kv, g, hd, S = 2, 7, 64, 120
    q = rng.standard_normal((T, n_kv * g, hd)).astype(np.float32)
    k = (rng.standard_normal((S, n_kv, hd)) * 3).astype(np.float32)
    v = rng.standard_normal((S, n_kv, hd)).astype(np.float32)
    k_pos = np.arange(S)
    q_pos = k_pos[S - T:]
    rows = impl.attention(q, k, v, q_pos, k_pos)
    for t in range(T):
        n = S - T + 1 + t
        np.testing.assert_array_equal(rows[t], impl.attend(q[t:t + 1], k[:n], v[:n], q_pos[t:t + 1], k_pos[:n])[0])
    assert ops.EXACT_ROWS == MAX_DRAFT + 1, "a verify trip of the longest draft is exact"


@pytest.mark.parametrize("n_head,cells", [(14, [(0, 256), (512, 768), (1024, 1280)]), (12, [(256, 512), (768, 1024)])])
def test_a_prompt_rows_bits_do_not_depend_on_where_its_chunk_starts_or_ends(n_head, cells, impl):
    """Prompt caching's premise (common/prefix.py): a row of a prompt chunk (cut on the grid of
    PREFILL_TILE_ROWS) has the same bits in any chunk of its cell that holds it, whatever the chunk's
    first row and last: a prefill resumed at a block inside a chunk, over blocks an earlier and
    shorter prompt computed, gives the cold rows. In one tile (the first cells) or many, as long as
    the chunk is not row_by_row. The 0.5B's heads (tiles of 256 keys) and the 1.5B's (whose 341-key
    tiles are cut to 256); keys at 3x so that the softmax is peaked and the f16 weights span far."""
    rng = np.random.default_rng(n_head)
    n_kv, hd = 2, 64
    S_max = cells[-1][1]
    q = rng.standard_normal((S_max, n_head, hd)).astype(np.float32)
    k = to_f16(rng.standard_normal((S_max, n_kv, hd)).astype(np.float32) * 3)
    v = to_f16(rng.standard_normal((S_max, n_kv, hd)).astype(np.float32))
    pos = np.arange(S_max)
    assert ops.prefill_tile_keys(n_head, 40) == ops.prefill_tile_keys(n_head, 256) == 256
    for lo, hi in cells:
        cold = impl.attention(q[lo:hi], k[:hi], v[:hi], pos[lo:hi], pos[:hi])  # the whole chunk of the cell
        for a, b in ((lo, hi - 20), (lo + 64, hi), (lo + 128, lo + 200), (lo + 192, lo + 192 + 40)):
            assert not ops.row_by_row(b - a, b)
            got = impl.attention(q[a:b], k[:b], v[:b], pos[a:b], pos[:b])
            np.testing.assert_array_equal(got, cold[a - lo:b - lo], err_msg=f"rows [{a}, {b}) of [{lo}, {hi})")


def test_the_cache_stores_float16_where_the_kernels_read_it_and_float32_on_numpy():
    """The storage type changes a session's bytes, never its numbers: float16 halves them where the
    C kernels run, numpy's path keeps float32 (its float16 copies to float64 cost twice as much)."""
    ops.install(Ops())
    kv32 = KVCache(2, 64)
    assert kv32.dtype == np.float32 and kv32.token_bytes() == 2 * 2 * 64 * 4 + 8
    if kernels.available():
        ops.install(kernels.KernelOps())
        kv16 = KVCache(2, 64)
        assert kv16.dtype == np.float16 and kv16.token_bytes() == 2 * 2 * 64 * 2 + 8
        assert KVCache(2, 64, dtype=np.float32).dtype == np.float32  # an explicit type is kept


@pytest.mark.needs_kernels
@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("simd", [True, False])
def test_the_kernels_row_calls_give_each_rows_attention_bit_for_bit(simd, fused, monkeypatch):
    """A sequence's rows through the kernels' row calls (KernelOps.attend_rows) are attend() of each
    row alone, bit for bit: the fused one (scores, numpy's exp loop, sums and values in one call) and
    the two calls around numpy's exp and sums. Decode steps (T = 1) and verify trips, float16 and
    float32 caches, keys masked by position, more query heads per kv head than a call takes (17 > 16),
    and hd 16, which the AVX-512 values kernel leaves to the reference."""
    kern = kernels.KernelOps(simd=simd)
    assert kern.fused, "numpy gives its exp loop here (>= 1.24)"
    kern.fused = fused
    calls = []
    fused_rows = kernels._qmatmul.attn_rows
    monkeypatch.setattr(kernels._qmatmul, "attn_rows", lambda *a: calls.append(a) or fused_rows(*a))
    rng = np.random.default_rng(7)
    for case in range(60):
        n_kv, g, hd = int(rng.choice([1, 2, 4])), int(rng.choice([1, 6, 7, 17])), int(rng.choice([16, 64, 128]))
        T = int(rng.integers(1, 10))
        S = T + int(rng.integers(0 if T == 1 else 1, 200))
        dtype = np.float16 if case % 2 else np.float32
        q = (rng.standard_normal((T, n_kv * g, hd)) * rng.choice([0.1, 1.0, 5.0])).astype(np.float32)
        k = to_f16(rng.standard_normal((S, n_kv, hd)).astype(np.float32)).astype(dtype)
        v = to_f16(rng.standard_normal((S, n_kv, hd)).astype(np.float32)).astype(dtype)
        k_pos = np.arange(S, dtype=np.int64) if case % 3 else rng.permutation(S).astype(np.int64)
        q_pos = k_pos[S - T:].copy() if case % 5 else rng.integers(0, S, T).astype(np.int64)
        got = kern.attend_rows(q, k, v, q_pos, k_pos)
        assert got.shape == (T, n_kv * g * hd)
        want = np.concatenate([Ops().attend(q[t:t + 1], k[:S - T + 1 + t], v[:S - T + 1 + t], q_pos[t:t + 1],
                                            k_pos[:S - T + 1 + t]) for t in range(T)])
        np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32), err_msg=f"case {case}")
    assert len(calls) == (60 if fused else 0)
    # past one tile of a decode row's keys, attend() goes tile by tile: the row calls leave it to the reference
    S = ops.attn_tile_keys(2, 1) + 1
    q, k, v = qkv(1, S, n_head=2, n_kv=1)
    calls.clear()
    got = kern.attend_rows(q, k, v, np.array([S - 1]), np.arange(S))
    np.testing.assert_array_equal(got.view(np.uint32), kern.attend(q, k, v, np.array([S - 1]), np.arange(S)).view(np.uint32))
    assert not calls


@pytest.mark.needs_kernels
def test_the_kernels_rope_qkv_gives_numpys_bits():
    """q, k and v after their products (biases, RoPE, k and v rounded to f16) in one C call are
    numpy's float32 operations bit for bit: decode rows and prefill chunks, any positions, values
    that round to f16 subnormals, to zero and past 65504 to inf, and signed zeros. The kernel writes
    q, k and v in place; arrays of another dtype or layout it leaves to the reference (Ops)."""
    kern = kernels.KernelOps()
    rng = np.random.default_rng(11)
    for case in range(40):
        n_kv, g, hd = int(rng.choice([1, 2, 4])), int(rng.choice([1, 6, 7])), int(rng.choice([2, 16, 64, 128]))
        cfg = qwen2.Qwen2Config(n_layer=1, dim=n_kv * g * hd, ffn_dim=8, n_head=n_kv * g, n_kv_head=n_kv,
                                rope_base=float(rng.choice([1e4, 1e6])), norm_eps=1e-6, context_length=1 << 15,
                                vocab_size=8)
        N = int(rng.choice([1, 2, 9, 70]))
        scale = rng.choice([1e-6, 1.0, 40.0, 3e4])  # f16 subnormals and zeros ... past 65504: inf
        q, k, v = ((rng.standard_normal((N, h * hd)) * scale).astype(np.float32)
                   for h in (cfg.n_head, n_kv, n_kv))
        bq, bk, bv = ((rng.standard_normal(h * hd) * scale).astype(np.float32) for h in (cfg.n_head, n_kv, n_kv))
        k[0, 0] = bk[0] = v[0, 0] = bv[0] = -0.0  # signed zeros through the bias (and RoPE)
        v[0, -1], bv[-1] = -1e-9, -0.0           # below half f16's least subnormal: rounds to -0
        positions = rng.integers(0, 30000, N) if case % 2 else np.arange(100, 100 + N)
        cos, sin = qwen2.rope_cos_sin(positions, hd, cfg.rope_base)
        want = Ops().rope_qkv(q.copy(), k.copy(), v.copy(), bq, bk, bv, cos, sin, cfg.n_head, n_kv)
        got = kern.rope_qkv(q, k, v, bq, bk, bv, cos, sin, cfg.n_head, n_kv)
        for name, a, b in zip("qkv", got, want):
            assert a.shape == b.shape, (name, a.shape, b.shape)
            np.testing.assert_array_equal(a.view(np.uint32), b.view(np.uint32), err_msg=f"case {case}, {name}")
        assert np.shares_memory(got[0], q) and np.shares_memory(got[2], v), "written in place"
        assert [float(got[2].reshape(N, -1)[0, j]) for j in (0, -1)] == [0.0, 0.0]
        assert np.signbit(got[2].reshape(N, -1)[0, [0, -1]]).all(), "-0 + -0 and f16(-1e-9) are -0"
    # what the kernel does not take, the reference computes: the same numbers, never None
    q, k, v = ((rng.standard_normal((N, h * hd)) * scale).astype(np.float32) for h in (cfg.n_head, n_kv, n_kv))
    ro = q.copy()
    ro.flags.writeable = False
    for args in [(q.astype(np.float64), k, v), (q[:, ::-1], k, v), (q, k, k), (ro, k, v)]:  # k and v one buffer; read-only
        want = Ops().rope_qkv(*(a.copy() for a in args), bq, bk, bv, cos, sin, cfg.n_head, n_kv)
        got = kern.rope_qkv(*args, bq, bk, bv, cos, sin, cfg.n_head, n_kv)
        for a, b in zip(got, want):
            np.testing.assert_array_equal(a, b)


@pytest.mark.needs_kernels
def test_the_kernels_rmsnorm_gives_numpys_bits():
    """rmsnorm in one C call is numpy's: the float64 sum of squares in numpy's pairwise order (8
    accumulators up to 128 values, halves above: row lengths on each side of those bounds; checked
    on the sum itself, since the float32 result rarely shows the order), then the float32 scale and
    products; rows of tiny, huge, zero and mixed-scale values, and an inf, whose row numpy turns to
    NaN and 0 (the same NaN bits). float64, 1-D, strided or mismatched input it leaves to the
    reference (Ops)."""
    kern = kernels.KernelOps()
    rng = np.random.default_rng(12)
    lengths = [1, 7, 8, 9, 15, 16, 64, 127, 128, 129, 136, 255, 256, 257, 896, 1000, 1536, 3584, 4864, 8960]
    for case, d in enumerate(lengths * 2):
        T = int(rng.choice([1, 2, 9, 33]))
        x = rng.standard_normal((T, d)) * rng.choice([1e-20, 1e-3, 1.0, 1e3, 1e18], size=(T, 1))
        if d > 1:
            x[:, : d // 2] *= 1e6  # a row's halves at different scales: the order of the sum shows
        x = x.astype(np.float32)
        if case % 5 == 0:
            x[0] = 0.0  # all zeros: the scale is 1 / sqrt(eps)
        if case % 7 == 3:
            x[-1, -1] = np.inf
        w = (rng.standard_normal(d) * 2).astype(np.float32)
        eps = float(rng.choice([1e-6, 1e-5]))
        with np.errstate(over="ignore", invalid="ignore"):  # the inf's row: inf * 0
            want = Ops().rmsnorm(x, w, eps)
        got = kern.rmsnorm(x, w, eps)
        assert got.shape == want.shape == (T, d) and got.dtype == np.float32
        for row in x:
            assert kernels._qmatmul.sum_sq(row) == float(np.square(row.astype(np.float64)).sum()), (case, d)
        np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32), err_msg=f"case {case}, d={d}")
    x, w = x[:, :-1], w[:-1]  # no inf
    with np.errstate(over="ignore"):  # rows of 1e18: their mean overflows float32, to a scale of 0
        for args in [(x.astype(np.float64), w), (x[0], w), (x[:, ::-1], w), (x, w.astype(np.float64))]:
            np.testing.assert_array_equal(kern.rmsnorm(*args, 1e-6), Ops().rmsnorm(*args, 1e-6))


@pytest.mark.needs_kernels
def test_the_kernels_row_sums_give_numpys_bits():
    """The float64 sums between attention's two row calls (each row's (n_head, n_t) block after
    numpy's exp) in one C call are numpy's, in its pairwise order: a decode row and verify trips'
    rows, blocks of 1 to 8,192 values (numpy's casting buffer). Longer rows, which numpy sums buffer
    by buffer, and arrays of another dtype or shape, numpy sums."""
    kern = kernels.KernelOps()
    rng = np.random.default_rng(13)
    for case, (T, S) in enumerate([(1, 1), (1, 7), (1, 129), (1, 210), (3, 9), (9, 300), (33, 1000), (1, 4097),
                                   (2, 8192), (1, kernels.ROW_SUMS_MAX)]):
        n_head = int(rng.choice([1, 2, 14]))
        n = n_head * (T * (S - T + 1) + T * (T - 1) // 2)
        p = np.exp((rng.standard_normal(n) * rng.choice([0.5, 4.0, 20.0])).astype(np.float32))
        want = np.empty((T, n_head), np.float64)
        a = 0
        for t in range(T):  # numpy's sums, as softmax_ sums each row alone
            n_t = S - T + 1 + t
            want[t] = p[a:a + n_head * n_t].reshape(n_head, n_t).sum(axis=-1, dtype=np.float64)
            a += n_head * n_t
        got = kern.row_sums(p, T, S, n_head)
        assert got.shape == (T, n_head)
        np.testing.assert_array_equal(got.view(np.uint64), want.view(np.uint64), err_msg=f"case {case}, T={T} S={S}")
    for other in (p.astype(np.float64), p.reshape(T, -1)):
        np.testing.assert_array_equal(kern.row_sums(other, T, S, n_head), want)
    big = np.ones(kernels.ROW_SUMS_MAX + 1, np.float32)  # numpy sums it in two buffers
    np.testing.assert_array_equal(kern.row_sums(big, 1, kernels.ROW_SUMS_MAX + 1, 1), [[big.sum(dtype=np.float64)]])
    with pytest.raises(ValueError, match="bytes, expected"):
        kernels._qmatmul.attn_row_sums(p[:-1], np.empty((T, n_head)), T, S, n_head)


@pytest.mark.needs_kernels
def test_attention_rows_take_the_kernels_row_sums(monkeypatch):
    """The two row calls sum through the kernel's row_sums, with the output of numpy's sums (the
    reference's rows): a decode row and a verify trip over an f16 cache."""
    kern = kernels.KernelOps()
    kern.fused = False  # the two row calls, not the fused one
    q, k, v = qkv(T=5, S=40, n_head=14, n_kv=2, hd=64, seed=4)
    k, v = to_f16(k).astype(np.float16), to_f16(v).astype(np.float16)
    calls = []
    row_sums = kernels._qmatmul.attn_row_sums
    monkeypatch.setattr(kernels._qmatmul, "attn_row_sums", lambda *a: calls.append(a) or row_sums(*a))
    for T in (1, 5):
        q_pos, k_pos = np.arange(40 - T, 40), np.arange(40)
        want = Ops().attend_rows(q[:T], k, v, q_pos, k_pos)
        calls.clear()
        got = kern.attend_rows(q[:T], k, v, q_pos, k_pos)
        assert len(calls) == 1
        np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))


@pytest.mark.needs_kernels
def test_the_fused_rows_call_past_numpys_sum_buffer_declines_and_the_two_calls_serve(monkeypatch):
    """A row over more keys than numpy's casting buffer (8,192: its float64 sum goes buffer by buffer)
    is left by the fused call to the two row calls with numpy's sums, which give attend()'s bits; at
    8,192 keys the fused call serves, with the same bits as the two calls."""
    kern, two = kernels.KernelOps(), kernels.KernelOps()
    two.fused = False
    calls = []
    fused_rows = kernels._qmatmul.attn_rows
    monkeypatch.setattr(kernels._qmatmul, "attn_rows", lambda *a: calls.append(a) or fused_rows(*a))
    for S in (kernels.ROW_SUMS_MAX, kernels.ROW_SUMS_MAX + 1):
        q, k, v = qkv(T=1, S=S, n_head=2, n_kv=1, hd=16, seed=S)
        k, v = to_f16(k).astype(np.float16), to_f16(v).astype(np.float16)
        q_pos, k_pos = np.array([S - 1]), np.arange(S)
        calls.clear()
        got = kern.attend_rows(q, k, v, q_pos, k_pos)
        assert len(calls) == (S <= kernels.ROW_SUMS_MAX)
        want = two.attend_rows(q, k, v, q_pos, k_pos)
        np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))
        if S > kernels.ROW_SUMS_MAX:
            with pytest.raises(ValueError, match="S <= 8192"):
                kernels._qmatmul.attn_rows(q, k, v, q_pos, k_pos, np.empty((1, 32), np.float32), 1, 2, 1, S, 16, 0.25)


@pytest.mark.needs_kernels
def test_the_kernels_silu_gives_numpys_bits():
    """silu in one C call (negate, numpy's own exp loop, + 1, divide) is numpy's x / (1 + exp(-x)) bit
    for bit: lengths around the SIMD widths, values whose exp overflows (-> -0), infinities, NaN,
    signed zeros and subnormals. float64 and strided input it leaves to the reference (Ops)."""
    kern = kernels.KernelOps()
    rng = np.random.default_rng(14)
    for n in (1, 7, 8, 15, 16, 17, 33, 896, 4864, 8960, 18944):
        x = (rng.standard_normal(n) * rng.choice([0.01, 1.0, 8.0, 120.0])).astype(np.float32)
        special = np.array([np.inf, -np.inf, np.nan, 0.0, -0.0, -100.0, 100.0, 1e-40, -1e-40], np.float32)
        x[:min(n, special.size)] = special[:n]
        with np.errstate(all="ignore"):
            want = x / (np.float32(1.0) + np.exp(-x))
        got = kern.silu(x)
        assert got.dtype == np.float32 and got.shape == x.shape
        np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32), err_msg=f"n={n}")
        np.testing.assert_array_equal(kern.silu(x.reshape(1, n)).reshape(n).view(np.uint32), want.view(np.uint32))
    with np.errstate(all="ignore"):
        for other in (x.astype(np.float64), x[::2]):
            np.testing.assert_array_equal(kern.silu(other), Ops().silu(other))
    with pytest.raises(ValueError, match="out must not be x"):
        kernels._qmatmul.silu(x, x, x.size)
    with pytest.raises(ValueError, match="bytes, expected"):
        kernels._qmatmul.silu(x, np.empty(x.size - 1, np.float32), x.size)


@pytest.mark.needs_kernels
def test_the_fused_calls_need_numpys_exp_loop():
    """Without the exp loop the fused calls raise, naming it (never an exp of another library), and a
    capsule that is not numpy's call info is refused."""
    q, k, v = qkv(T=1, S=8, n_head=2, n_kv=1, hd=16)
    x = np.ones(4, np.float32)
    assert kernels.numpy_exp_loop()
    try:
        kernels._qmatmul.set_exp_loop(None)
        with pytest.raises(RuntimeError, match="no exp loop"):
            kernels._qmatmul.silu(x, np.empty_like(x), 4)
        with pytest.raises(RuntimeError, match="no exp loop"):
            kernels._qmatmul.attn_rows(q, k, v, np.array([7]), np.arange(8), np.empty((1, 32), np.float32),
                                       1, 2, 1, 8, 16, 0.25)
        with pytest.raises(ValueError):
            kernels._qmatmul.set_exp_loop(np.exp)  # not a capsule
    finally:
        kernels._exp_loop.clear()
        assert kernels.numpy_exp_loop()
    out = np.empty_like(x)
    kernels._qmatmul.silu(x, out, 4)
    np.testing.assert_array_equal(out, x / (np.float32(1.0) + np.exp(-x)))
