"""common.quant against the oracle gguf-py: bit-exact on random, zero and hand-computed blocks,
row ranges equal slices of the whole, and the traps (alignment, unknown types, short data)."""
from __future__ import annotations


import gguf
import numpy as np
import pytest
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType
from hypothesis import given, settings, strategies as st

from common import quant
from common.quant import (HUGE_PAGE_BYTES, QUANT_TYPES, Arena, BlockAlignmentError, ByteLengthError, QTensor,
                          QuantError, UnsupportedQuantType, dequantize, dequantize_rows, huge_buffer, resident_copy,
                          row_byte_range, row_nbytes, tensor_nbytes, type_name)

TYPES = list(QUANT_TYPES)
FLOAT_TYPES = ("F32", "F16", "BF16")

# Byte offsets of the f16 scale fields (d, dmin / m) of one block.
# ref: ggml-common.h block_q4_0 .. block_q6_K
F16_FIELDS = {"Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2), "Q8_0": (0,),
              "Q2_K": (80, 82), "Q3_K": (108,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}


def ne0_for(ggml_type: str) -> int:
    """A row length that fits the type: 896 (Qwen2.5-0.5B hidden) unless the block is 256."""
    return 1024 if QUANT_TYPES[ggml_type].block_elems == 256 else 896


def random_raw(ggml_type: str, n_rows: int, ne0: int, rng) -> np.ndarray:
    """Random blocks, finite f16 scales (subnormals and zeros too) -> uint8 (n_rows, row_bytes)."""
    t = QUANT_TYPES[ggml_type]
    blocks = rng.integers(0, 256, (n_rows * ne0 // t.block_elems, t.block_bytes), dtype=np.uint8)
    for at in F16_FIELDS.get(ggml_type, ()):
        scale = rng.standard_normal(len(blocks)) * 10.0 ** rng.integers(-7, 2, len(blocks))
        blocks[:, at:at + 2] = scale.astype(np.float16).view(np.uint8).reshape(-1, 2)
    return blocks.reshape(n_rows, -1)


def oracle(raw: np.ndarray, ggml_type: str) -> np.ndarray:
    return gguf.quants.dequantize(raw, GGMLQuantizationType[ggml_type])


def assert_bits_equal(ours: np.ndarray, ref: np.ndarray):
    """Bit-exact: same shape, same float32 bit patterns (so -0.0 != 0.0 and NaN payloads count)."""
    assert ours.dtype == np.float32 and ref.dtype == np.float32
    assert ours.shape == ref.shape
    np.testing.assert_array_equal(ours.view(np.uint32), ref.view(np.uint32))


def test_table_matches_ggml():
    for name, t in QUANT_TYPES.items():
        q = GGMLQuantizationType[name]
        assert t.name == name and t.ggml_id == q.value
        assert (t.block_elems, t.block_bytes) == GGML_QUANT_SIZES[q]
        assert type_name(q.value) == name


def test_type_name_unknown_id_raises():
    with pytest.raises(UnsupportedQuantType, match="tensor blk.0.attn_q.weight: ggml type id 16 "):
        type_name(int(GGMLQuantizationType.IQ2_XXS), "blk.0.attn_q.weight")


# ---- bit-exact against gguf-py

@pytest.mark.parametrize("ggml_type", TYPES)
def test_random_blocks_bit_exact(ggml_type):
    rng = np.random.default_rng(sum(map(ord, ggml_type)))
    ne0 = ne0_for(ggml_type)
    n_rows = 150  # > quant.CHUNK_ELEMS elements: two chunks, the second one partial
    raw = random_raw(ggml_type, n_rows, ne0, rng)
    if ggml_type in FLOAT_TYPES:  # every bit pattern: NaN payloads, infinities, subnormals
        raw = rng.integers(0, 256, raw.shape, dtype=np.uint8)
    assert n_rows * ne0 > quant.CHUNK_ELEMS
    assert_bits_equal(dequantize(raw, ggml_type, (ne0, n_rows)), oracle(raw, ggml_type))


@pytest.mark.parametrize("ggml_type", TYPES)
def test_zero_blocks_bit_exact(ggml_type):
    ne0 = ne0_for(ggml_type)
    raw = np.zeros((3, row_nbytes(ggml_type, ne0)), np.uint8)
    ours = dequantize(raw, ggml_type, (ne0, 3))
    assert_bits_equal(ours, oracle(raw, ggml_type))
    assert not ours.any()  # zeros, possibly -0.0 (Q4_0: 0 * (0 - 8))


@pytest.mark.parametrize("chunk_elems", [1, 100, 1000, 4096])
@pytest.mark.parametrize("ggml_type", ["Q4_0", "Q5_1", "Q8_0", "Q3_K", "Q4_K", "Q6_K", "F16"])
def test_chunking_is_invisible(ggml_type, chunk_elems, monkeypatch):
    rng = np.random.default_rng(7)
    ne0 = ne0_for(ggml_type)
    raw = random_raw(ggml_type, 9, ne0, rng)
    whole = dequantize(raw, ggml_type, (ne0, 9))
    monkeypatch.setattr(quant, "CHUNK_ELEMS", chunk_elems)
    assert_bits_equal(dequantize(raw, ggml_type, (ne0, 9)), whole)


def f16_bytes(x: float) -> bytes:
    return np.float16(x).tobytes()


def test_hand_computed_q8_0():
    # Q8_0, 34 B: d f16 | qs 32 int8.  y = q * d
    qs = np.array([-128, -127, -1, 0, 1, 2, 3, 127] * 4, np.int8)
    block = f16_bytes(0.5) + qs.tobytes()
    assert len(block) == 34
    want = np.array([-64, -63.5, -0.5, 0, 0.5, 1, 1.5, 63.5] * 4, np.float32)
    ours = dequantize(block, "Q8_0", (32,))
    np.testing.assert_array_equal(ours, want)
    assert_bits_equal(ours, oracle(np.frombuffer(block, np.uint8), "Q8_0"))


def test_hand_computed_q4_0():
    # Q4_0, 18 B: d f16 | 16 bytes; byte i = element i (low nibble) | element i + 16 (high nibble).
    # y = (q - 8) * d
    lo = np.arange(16, dtype=np.uint8)  # elements 0..15 -> q = 0..15
    hi = np.full(16, 9, np.uint8)  # elements 16..31 -> q = 9
    block = f16_bytes(-2.0) + (lo | (hi << 4)).tobytes()
    want = np.concatenate([(np.arange(16) - 8) * -2.0, np.full(16, -2.0)]).astype(np.float32)
    ours = dequantize(block, "Q4_0", (32,))
    np.testing.assert_array_equal(ours, want)
    assert_bits_equal(ours, oracle(np.frombuffer(block, np.uint8), "Q4_0"))


def q4_k_scalar(block: bytes) -> np.ndarray:
    """A straight port of ggml-quants.c dequantize_row_q4_K + get_scale_min_k4, one block."""
    f32 = np.float32
    d, dmin = (f32(v) for v in np.frombuffer(block[:4], np.float16))
    scales, q = block[4:16], block[16:]

    def scale_min(j):
        if j < 4:
            return scales[j] & 63, scales[j + 4] & 63
        return ((scales[j + 4] & 0xF) | ((scales[j - 4] >> 6) << 4),
                (scales[j + 4] >> 4) | ((scales[j] >> 6) << 4))

    y = []
    for j in range(4):  # 64 elements at a time
        sc1, m1 = scale_min(2 * j)
        sc2, m2 = scale_min(2 * j + 1)
        d1, mm1, d2, mm2 = d * f32(sc1), dmin * f32(m1), d * f32(sc2), dmin * f32(m2)
        y += [d1 * f32(q[32 * j + l] & 0xF) - mm1 for l in range(32)]
        y += [d2 * f32(q[32 * j + l] >> 4) - mm2 for l in range(32)]
    return np.array(y, np.float32)


def q6_k_scalar(block: bytes) -> np.ndarray:
    """A straight port of ggml-quants.c dequantize_row_q6_K, one block."""
    f32 = np.float32
    ql, qh = block[:128], block[128:192]
    sc = np.frombuffer(block[192:208], np.int8)
    d = f32(np.frombuffer(block[208:210], np.float16)[0])
    y = np.zeros(256, np.float32)
    for n in range(2):  # 128 elements at a time
        for l in range(32):
            s = 8 * n + l // 16
            a, b, h = ql[64 * n + l], ql[64 * n + l + 32], qh[32 * n + l]
            qs = ((a & 0xF) | ((h >> 0) & 3) << 4, (b & 0xF) | ((h >> 2) & 3) << 4,
                  (a >> 4) | ((h >> 4) & 3) << 4, (b >> 4) | ((h >> 6) & 3) << 4)
            for g in range(4):
                y[128 * n + 32 * g + l] = d * f32(sc[s + 2 * g]) * f32(qs[g] - 32)
    return y


@pytest.mark.parametrize("ggml_type, scalar", [("Q4_K", q4_k_scalar), ("Q6_K", q6_k_scalar)])
def test_k_quants_match_scalar_port_of_ggml(ggml_type, scalar):
    rng = np.random.default_rng(3)
    raw = random_raw(ggml_type, 1, 256 * 3, rng).reshape(3, -1)
    for block in raw:
        assert_bits_equal(dequantize(block, ggml_type, (256,)), scalar(block.tobytes()))


# ---- row ranges

ROWS = 40
TENSORS = {t: random_raw(t, ROWS, ne0_for(t), np.random.default_rng(11)) for t in TYPES}
WHOLE = {t: dequantize(raw, t, (ne0_for(t), ROWS)) for t, raw in TENSORS.items()}


@settings(max_examples=60, deadline=None)
@given(ggml_type=st.sampled_from(TYPES), a=st.integers(0, ROWS), b=st.integers(0, ROWS))
def test_row_range_equals_slice_of_whole(ggml_type, a, b):
    a, b = min(a, b), max(a, b)
    ne0 = ne0_for(ggml_type)
    flat = TENSORS[ggml_type].reshape(-1)
    start, end = row_byte_range(ggml_type, ne0, a, b)
    assert (start, end) == (a * row_nbytes(ggml_type, ne0), b * row_nbytes(ggml_type, ne0))
    rows = dequantize_rows(flat[start:end], ggml_type, ne0, "t")
    assert_bits_equal(rows, WHOLE[ggml_type][a:b])
    t = QTensor("t", ggml_type, (ne0, ROWS), flat)
    assert_bits_equal(t.rows(a, b).dequantize(), WHOLE[ggml_type][a:b])


def test_row_byte_range_rejects_reversed_and_negative():
    with pytest.raises(QuantError, match=r"\[5, 3\)"):
        row_byte_range("Q8_0", 896, 5, 3)
    with pytest.raises(QuantError):
        row_byte_range("Q8_0", 896, -1, 3)


def test_dequantize_rows_into_out():
    raw = TENSORS["Q4_K"][:4]
    out = np.empty((4, 1024), np.float32)
    got = dequantize_rows(raw, "Q4_K", 1024, "t", out=out)
    assert np.shares_memory(got, out)
    assert_bits_equal(out, WHOLE["Q4_K"][:4])
    with pytest.raises(QuantError, match="out must be"):
        dequantize_rows(raw, "Q4_K", 1024, "t", out=np.empty((3, 1024), np.float32))


# ---- the traps

@pytest.mark.parametrize("ggml_type", ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0"])
def test_896_wide_rows_in_32_element_types(ggml_type):
    raw = random_raw(ggml_type, 4, 896, np.random.default_rng(5))
    assert row_nbytes(ggml_type, 896) == 28 * QUANT_TYPES[ggml_type].block_bytes
    assert dequantize(raw, ggml_type, (896, 4)).shape == (4, 896)


def test_896_wide_row_in_256_element_type_raises():
    for call in (lambda: row_nbytes("Q4_K", 896, "blk.0.attn_q.weight"),
                 lambda: tensor_nbytes("Q4_K", (896, 896), "blk.0.attn_q.weight"),
                 lambda: dequantize(bytes(504), "Q4_K", (896,), "blk.0.attn_q.weight"),
                 lambda: dequantize_rows(bytes(504), "Q4_K", 896, "blk.0.attn_q.weight")):
        with pytest.raises(BlockAlignmentError) as e:
            call()
        for part in ("blk.0.attn_q.weight", "896", "Q4_K", "256"):
            assert part in str(e.value)


def test_unsupported_type_names_tensor_and_type():
    # The seed's first trap: the old code returned zeros for any type it did not know.
    for call in (lambda: dequantize(bytes(136), "IQ4_NL", (256,), "blk.3.ffn_down.weight"),
                 lambda: dequantize_rows(bytes(136), "IQ4_NL", 256, "blk.3.ffn_down.weight"),
                 lambda: row_nbytes("IQ4_NL", 256, "blk.3.ffn_down.weight"),
                 lambda: QTensor("blk.3.ffn_down.weight", "IQ4_NL", (256,), bytes(136))):
        with pytest.raises(UnsupportedQuantType) as e:
            call()
        assert "blk.3.ffn_down.weight" in str(e.value) and "IQ4_NL" in str(e.value)
    assert issubclass(UnsupportedQuantType, QuantError) and issubclass(QuantError, ValueError)


def test_wrong_byte_length_names_got_and_expected():
    want = tensor_nbytes("Q8_0", (896, 2))
    assert want == 2 * 28 * 34
    with pytest.raises(ByteLengthError, match=rf"attn_k.weight: {want - 1} bytes, expected {want}"):
        dequantize(bytes(want - 1), "Q8_0", (896, 2), "blk.0.attn_k.weight")
    with pytest.raises(ByteLengthError, match=rf"{want + 34} bytes, expected {want}"):
        QTensor("blk.0.attn_k.weight", "Q8_0", (896, 2), bytes(want + 34))
    with pytest.raises(ByteLengthError, match="not a whole number"):
        dequantize_rows(bytes(want - 34), "Q8_0", 896, "blk.0.attn_k.weight")


def test_rejects_non_uint8_arrays_and_bad_shapes():
    with pytest.raises(QuantError, match="uint8"):
        dequantize(np.zeros(34, np.int8), "Q8_0", (32,))
    with pytest.raises(QuantError, match="invalid shape"):
        dequantize(b"", "Q8_0", ())
    with pytest.raises(QuantError, match="invalid shape"):
        tensor_nbytes("Q8_0", (32, -1))


# ---- inputs and QTensor

def test_bytes_memoryview_bytearray_and_array_agree():
    raw = TENSORS["Q6_K"][:2]
    want = WHOLE["Q6_K"][:2]
    b = raw.tobytes()
    for data in (b, bytearray(b), memoryview(b), raw, raw.reshape(-1)):
        assert_bits_equal(dequantize(data, "Q6_K", (1024, 2)), want)


@pytest.mark.parametrize("ggml_type", TYPES)
def test_unaligned_input(ggml_type):
    # mmap'd tensors may start at any byte offset; the f16 / uint32 views must still work
    raw = TENSORS[ggml_type][:3].reshape(-1)
    buf = np.empty(raw.size + 1, np.uint8)
    buf[1:] = raw
    assert_bits_equal(dequantize(buf[1:], ggml_type, (ne0_for(ggml_type), 3)), WHOLE[ggml_type][:3])


def test_qtensor_views_and_properties():
    flat = TENSORS["Q5_0"].reshape(-1)
    t = QTensor("blk.0.ffn_up.weight", "Q5_0", [896, ROWS], flat)
    assert t.shape == (896, ROWS) and t.row_len == 896 and t.n_rows == ROWS
    assert t.nbytes == flat.size == tensor_nbytes("Q5_0", (896, ROWS))
    assert np.shares_memory(t.data, flat)  # no copy of the raw bytes
    r = t.rows(3, 7)
    assert r.shape == (896, 4) and r.name == t.name
    assert np.shares_memory(r.data, flat)
    assert_bits_equal(t.dequantize(), WHOLE["Q5_0"])
    assert t.rows(5, 5).dequantize().shape == (0, 896)
    with pytest.raises(QuantError, match=r"rows \[3, 41\) out of range for 40 rows"):
        t.rows(3, 41)
    with pytest.raises(QuantError, match="out of range"):
        t.rows(4, 3)
    with pytest.raises(QuantError, match="2-D"):
        QTensor("norm", "F32", (896,), bytes(896 * 4)).rows(0, 1)
    with pytest.raises(AttributeError):
        t.name = "other"  # frozen


@pytest.mark.parametrize("nbytes", [0, 1000, (4 << 20) - 1, 4 << 20, (18 << 20) + 12345])
def test_huge_buffer_starts_on_a_huge_page_from_4_mib(nbytes):
    b = huge_buffer(nbytes)
    assert b.dtype == np.uint8 and b.shape == (nbytes,) and b.flags.writeable and b.flags.c_contiguous
    if nbytes >= 4 << 20:  # where numpy asks for huge pages: all of it inside 2 MiB stretches
        assert b.ctypes.data % HUGE_PAGE_BYTES == 0
    b[:] = 7  # every byte is ours
    assert int(b.sum()) == 7 * nbytes


@pytest.mark.parametrize("data", [bytes(range(256)) * 20000, bytearray(b"\x01\x02" * 100),
                                  np.arange(3000, dtype=np.float32)])
def test_resident_copy_is_a_read_only_copy_of_the_bytes(data):
    out = resident_copy(data)
    assert out.dtype == np.uint8 and out.tobytes() == bytes(memoryview(data).cast("B"))
    assert not out.flags.writeable and not np.shares_memory(out, np.frombuffer(data, np.uint8))
    with pytest.raises(ValueError):
        out[0] = 1


def test_an_arena_keeps_each_name_at_its_own_aligned_place():
    rng = np.random.default_rng(0)
    sizes = {"a": 100, "b": 3 << 20, "c": 1, "d": 64 * 1000}
    data = {n: rng.integers(0, 256, k, dtype=np.uint8) for n, k in sizes.items()}
    arena = Arena(sizes)
    assert arena.nbytes == 128 + (3 << 20) + 64 + 64 * 1000  # each place rounded up to 64 bytes
    got = {n: arena.copy(n, data[n].tobytes() if n == "b" else data[n]) for n in sizes}
    owner = got["a"].base
    for n, out in got.items():
        assert out.tobytes() == data[n].tobytes() and not out.flags.writeable
        assert out.base is owner and out.ctypes.data % Arena.ALIGN == owner.ctypes.data % Arena.ALIGN
    for x, y in [("a", "b"), ("b", "c"), ("c", "d"), ("a", "d")]:  # no two places overlap
        assert not np.shares_memory(got[x], got[y])
    again = arena.copy("b", data["b"])  # the same tensor again: the same place, not more memory
    assert again.ctypes.data == got["b"].ctypes.data and again.tobytes() == data["b"].tobytes()
    # a name it was not made for, or another size, is not its to hold: the caller copies on its own
    assert arena.copy("e", b"x") is None
    assert arena.copy("a", bytes(101)) is None and got["a"].tobytes() == data["a"].tobytes()


def test_f32_1d_and_3d_shapes():
    a = np.arange(2 * 3 * 32, dtype=np.float32)
    assert_bits_equal(dequantize(a.view(np.uint8), "F32", (32, 3, 2)), a.reshape(2, 3, 32))
    t = QTensor("norm", "F32", (32,), a[:32].view(np.uint8))
    assert t.n_rows == 1 and t.dequantize().shape == (32,)


# ---- the real model

MAX_WHOLE_ELEMS = 8 << 20  # larger tensors (token_embd) are checked on row ranges


@pytest.mark.realmodel
def test_real_model_every_type_bit_exact(real_gguf_05b):
    """Every (type, shape) of the real 0.5B (fetched and cached by the shared fixture)."""
    reader = gguf.GGUFReader(real_gguf_05b)
    seen: set[tuple[str, tuple[int, ...]]] = set()
    for t in reader.tensors:
        ggml_type = t.tensor_type.name
        shape = tuple(int(n) for n in t.shape)  # GGUF order, ne0 first
        if (ggml_type, shape) in seen:
            continue
        seen.add((ggml_type, shape))
        raw = np.asarray(t.data).view(np.uint8).reshape(-1)
        nb = row_nbytes(ggml_type, shape[0], t.name)
        assert raw.size == tensor_nbytes(ggml_type, shape, t.name)
        raw = raw.reshape(-1, nb)
        if int(np.prod(shape)) <= MAX_WHOLE_ELEMS:
            assert_bits_equal(dequantize(raw, ggml_type, shape, t.name),
                              oracle(raw, ggml_type).reshape(shape[::-1]))
        else:
            n = len(raw)
            for a, b in ((0, 257), (n // 2, n // 2 + 100), (n - 300, n)):
                rows = dequantize_rows(raw[a:b], ggml_type, shape[0], t.name)
                assert_bits_equal(rows, oracle(raw[a:b], ggml_type))
    types = {ty for ty, _ in seen}
    assert {"F32", "Q4_K", "Q6_K", "Q5_0", "Q8_0"} <= types, types
