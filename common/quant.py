"""ggml tensor types: the one size table, row byte ranges, and vectorized dequantization.

Every codec is bit-exact with gguf-py's `gguf.quants.dequantize` (same float32 operations in
the same order). Shapes are GGUF order `[ne0, ne1, ...]`, ne0 = row length; the numpy
array of a tensor has the reversed shape `(..., ne1, ne0)`.

Pure numpy + stdlib (must import under Pyodide): no gguf import here.
"""
from __future__ import annotations

import math
import operator
from dataclasses import dataclass
from typing import Callable, Mapping, NamedTuple

import numpy as np

QK = 32  # elements per block of the legacy quants (Q4_0 .. Q8_0)
QK_K = 256  # elements per super-block of the K-quants
K_SCALE_SIZE = 12  # packed 6-bit scales and mins of Q4_K / Q5_K


class QuantType(NamedTuple):
    name: str
    ggml_id: int
    block_elems: int
    block_bytes: int


# The one table. Block bytes are written as the sum of the block's fields, as in gguf-py.
QUANT_TYPES: dict[str, QuantType] = {t.name: t for t in (
    QuantType("F32", 0, 1, 4),
    QuantType("F16", 1, 1, 2),
    QuantType("Q4_0", 2, QK, 2 + QK // 2),
    QuantType("Q4_1", 3, QK, 2 + 2 + QK // 2),
    QuantType("Q5_0", 6, QK, 2 + 4 + QK // 2),
    QuantType("Q5_1", 7, QK, 2 + 2 + 4 + QK // 2),
    QuantType("Q8_0", 8, QK, 2 + QK),
    QuantType("Q2_K", 10, QK_K, QK_K // 16 + QK_K // 4 + 2 + 2),
    QuantType("Q3_K", 11, QK_K, QK_K // 8 + QK_K // 4 + 12 + 2),
    QuantType("Q4_K", 12, QK_K, 2 + 2 + K_SCALE_SIZE + QK_K // 2),
    QuantType("Q5_K", 13, QK_K, 2 + 2 + K_SCALE_SIZE + QK_K // 8 + QK_K // 2),
    QuantType("Q6_K", 14, QK_K, QK_K // 2 + QK_K // 4 + QK_K // 16 + 2),
    QuantType("BF16", 30, 1, 2),
)}
_BY_ID = {t.ggml_id: t.name for t in QUANT_TYPES.values()}


class QuantError(ValueError):
    """Base of every error raised here."""


class UnsupportedQuantType(QuantError):
    """A ggml type we cannot decode. Never fall back to zeros (seed section 8)."""


class BlockAlignmentError(QuantError):
    """ne0 is not a multiple of the type's block size: rows would cut a block in two."""


class ByteLengthError(QuantError):
    """The raw bytes do not match the shape."""


# Linux backs an anonymous allocation with transparent huge pages only over the 2 MiB-aligned
# stretches it holds, and numpy asks for them (madvise) on allocations from 4 MiB on.
HUGE_PAGE_BYTES = 2 << 20
NUMPY_HUGE_MIN_BYTES = 4 << 20
# Pyodide's wasm32 (32-bit pointers): one linear memory, no pages to align to, and every byte counts
_WASM32 = np.dtype(np.intp).itemsize < 8


def huge_buffer(nbytes: int) -> np.ndarray:
    """A writable uint8 buffer of nbytes, from 4 MiB on starting at a 2 MiB boundary, so every
    byte of it can sit on transparent huge pages (where the kernel offers them).

    Why aligned: a plain 18 MB numpy buffer (a 0.5B shard's head slice) held 16 MB on huge pages;
    its first and last partial 2 MiB stretches stayed on 4 KiB ones. The bytes before the boundary
    are allocated but never touched, so they take no memory. Under Pyodide a plain buffer."""
    if nbytes < NUMPY_HUGE_MIN_BYTES or _WASM32:
        return np.empty(nbytes, dtype=np.uint8)
    raw = np.empty(nbytes + HUGE_PAGE_BYTES, dtype=np.uint8)
    start = -raw.ctypes.data % HUGE_PAGE_BYTES
    return raw[start:start + nbytes]


def resident_copy(data) -> np.ndarray:
    """Weights to keep for many products, as a private uint8 numpy array (a copy of `data`).

    Why copy bytes already in memory: a bytes object from a read sits on 4 KiB pages, while a
    huge_buffer from 4 MiB on sits on transparent huge pages. A decode product streams its weights
    from DRAM once per token, and over 4 KiB pages the TLB misses show (benchmarks/bench_kernels.py;
    docs/performance.md, "Levers tried"). Without huge pages
    (Pyodide, THP off) it is a plain copy.
    Read-only, as the bytes were: nothing may change weights in place."""
    src = np.frombuffer(data, dtype=np.uint8)
    out = huge_buffer(src.nbytes)
    out[:] = src
    out.flags.writeable = False
    return out


class Arena:
    """Copies of named tensors in one huge_buffer, each at a place of its own (64-byte aligned), so
    that tensors under 4 MiB sit on huge pages too. A tensor copied again goes to the same place:
    the arena never holds more than its names' bytes. For weights kept for good (a single
    process's); the caller must copy again only the same bytes, since a product may be reading them.

    Why: a single process's weights are views of the model file's map, on 4 KiB pages, and the
    0.5B's layer tensors are all under 4 MiB, what numpy puts on huge pages by itself; its decode
    runs faster from one arena than from the map (docs/lab/2026-12-05-single-process-weights-huge-pages-kernel.md)."""

    ALIGN = 64

    def __init__(self, sizes: Mapping[str, int]):
        self._slots: dict[str, tuple[int, int]] = {}
        at = 0
        for name, n in sizes.items():
            self._slots[name] = (at, n)
            at += -(-n // self.ALIGN) * self.ALIGN
        self._buf = huge_buffer(at)

    @property
    def nbytes(self) -> int:
        return self._buf.nbytes

    @property
    def names(self) -> list[str]:
        return list(self._slots)

    def copy(self, name: str, data) -> np.ndarray | None:
        """A read-only copy of data's bytes at name's place, or None: a name the arena was not made
        for, or bytes of another size."""
        slot = self._slots.get(name)
        if slot is None:
            return None
        src = np.frombuffer(data, dtype=np.uint8)
        if slot[1] != src.nbytes:
            return None
        out = self._buf[slot[0]:slot[0] + slot[1]]
        out[:] = src
        out.flags.writeable = False
        return out


def type_name(ggml_id: int, name: str = "<tensor>") -> str:
    """ggml type id (e.g. 12) -> ggml name (e.g. "Q4_K"); UnsupportedQuantType for other ids."""
    try:
        return _BY_ID[ggml_id]
    except KeyError:
        raise UnsupportedQuantType(f"tensor {name}: ggml type id {ggml_id} is not supported "
                                   f"(supported: {_supported()})") from None


def _supported() -> str:
    return ", ".join(f"{t.name}={t.ggml_id}" for t in QUANT_TYPES.values())


def _lookup(ggml_type: str, name: str) -> QuantType:
    try:
        return QUANT_TYPES[ggml_type]
    except (KeyError, TypeError):
        raise UnsupportedQuantType(f"tensor {name}: ggml type {ggml_type!r} is not supported "
                                   f"(supported: {_supported()})") from None


def _dims(shape, name: str) -> tuple[int, ...]:
    try:
        dims = tuple(operator.index(n) for n in shape)
    except TypeError:
        raise QuantError(f"tensor {name}: shape {shape!r} is not a sequence of ints") from None
    if not dims or any(n < 0 for n in dims):
        raise QuantError(f"tensor {name}: invalid shape {list(dims)}")
    return dims


def row_nbytes(ggml_type: str, ne0: int, name: str = "<tensor>") -> int:
    """Bytes of one row of ne0 elements (blocks never straddle rows)."""
    t = _lookup(ggml_type, name)
    if ne0 % t.block_elems:
        raise BlockAlignmentError(f"tensor {name}: row length ne0={ne0} is not a multiple of the "
                                  f"{t.name} block size {t.block_elems}")
    return ne0 // t.block_elems * t.block_bytes


def tensor_nbytes(ggml_type: str, shape, name: str = "<tensor>") -> int:
    """Bytes of a whole tensor; shape in GGUF order [ne0, ne1, ...]."""
    dims = _dims(shape, name)
    return math.prod(dims[1:]) * row_nbytes(ggml_type, dims[0], name)


def row_byte_range(ggml_type: str, ne0: int, row_start: int, row_end: int,
                   name: str = "<tensor>") -> tuple[int, int]:
    """[start, end) byte offsets of rows [row_start, row_end), relative to the tensor start."""
    if not 0 <= row_start <= row_end:
        raise QuantError(f"tensor {name}: invalid row range [{row_start}, {row_end})")
    nb = row_nbytes(ggml_type, ne0, name)
    return row_start * nb, row_end * nb


def _as_u8(data, name: str) -> np.ndarray:
    """bytes / memoryview / uint8 ndarray -> flat uint8 ndarray, zero-copy when contiguous."""
    if isinstance(data, np.ndarray):
        if data.dtype != np.uint8:
            raise QuantError(f"tensor {name}: raw data must be uint8, got {data.dtype}")
        return data.reshape(-1)
    return np.frombuffer(data, dtype=np.uint8)


def dequantize(data, ggml_type: str, shape, name: str = "<tensor>") -> np.ndarray:
    """Raw bytes of a whole tensor -> new float32 array of numpy shape reversed(shape)."""
    dims = _dims(shape, name)
    raw = _as_u8(data, name)
    want = tensor_nbytes(ggml_type, dims, name)
    if raw.size != want:
        raise ByteLengthError(f"tensor {name}: {raw.size} bytes, expected {want} "
                              f"for {ggml_type} shape {list(dims)}")
    # GGUF dims are stored reversed: ne0 is the fastest (last numpy) axis.
    return _dequantize_blocks(raw, ggml_type, None).reshape(dims[::-1])


def dequantize_rows(data, ggml_type: str, ne0: int, name: str = "<tensor>",
                    out: np.ndarray | None = None) -> np.ndarray:
    """Raw bytes of whole rows -> float32 (n_rows, ne0); written into `out` when given."""
    raw = _as_u8(data, name)
    nb = row_nbytes(ggml_type, ne0, name)
    if nb == 0 or raw.size % nb:
        raise ByteLengthError(f"tensor {name}: {raw.size} bytes is not a whole number of "
                              f"{ggml_type} rows of {nb} bytes (ne0={ne0})")
    n_rows = raw.size // nb
    if out is not None and (out.shape != (n_rows, ne0) or out.dtype != np.float32
                            or not out.flags.c_contiguous):
        raise QuantError(f"tensor {name}: out must be C-contiguous float32 {(n_rows, ne0)}, "
                         f"got {out.dtype} {out.shape}")
    return _dequantize_blocks(raw, ggml_type, out).reshape(n_rows, ne0)


# Blocks are decoded in chunks of about this many elements: large enough to amortize numpy's
# per-call overhead, small enough that the codecs' uint8 temporaries (a few bytes per element)
# stay cache-sized and bounded however large the tensor is.
CHUNK_ELEMS = 1 << 17


def _dequantize_blocks(raw: np.ndarray, ggml_type: str, out: np.ndarray | None) -> np.ndarray:
    """Flat uint8 of whole blocks -> flat float32, decoded chunk by chunk into `out`."""
    t = QUANT_TYPES[ggml_type]
    codec = _CODECS[ggml_type]
    n_blocks = raw.size // t.block_bytes
    blocks = raw.reshape(n_blocks, t.block_bytes)
    y = np.empty(n_blocks * t.block_elems, np.float32) if out is None else out.reshape(-1)
    y_blocks = y.reshape(n_blocks, t.block_elems)
    step = max(1, CHUNK_ELEMS // t.block_elems)
    for i in range(0, n_blocks, step):
        codec(blocks[i:i + step], y_blocks[i:i + step])
    return y


# ---- block codecs: codec(blocks (n, block_bytes) uint8, out (n, block_elems) float32) -> None
#
# numpy is fast on long contiguous loops and slow on short strided runs (~10 ns per run). So a
# codec does its bit twiddling with whole-array ops over all block bytes (header bytes included,
# their results unused), gathers the integer quants into element order with one strided op,
# casts them into `out`, and scales `out` in place, broadcasting the float32 scales: no float32
# temporaries. numpy's uint8 left shift is not vectorized, so `x << 4` is written `x * 16`.
# The float32 operations and their order are gguf-py's, so the results are bit-identical.

_CODECS: dict[str, Callable[[np.ndarray, np.ndarray], None]] = {}


def _codec(ggml_type: str):
    def register(fn):
        _CODECS[ggml_type] = fn
        return fn
    return register


def _f16(blocks: np.ndarray, at: int) -> np.ndarray:
    """The f16 field at byte offset `at` of each block -> float32 (n, 1)."""
    return blocks[:, at:at + 2].view(np.float16).astype(np.float32)


def _nibbles(x: np.ndarray) -> np.ndarray:
    """uint8 (n, m) -> (2, n, m): low nibbles, high nibbles."""
    nib = np.empty((2,) + x.shape, np.uint8)
    np.bitwise_and(x, 0x0F, out=nib[0])
    np.right_shift(x, 4, out=nib[1])
    return nib


def _bit_fields(x: np.ndarray, bits: int) -> np.ndarray:
    """uint8 (n, m) -> (8 // bits, n, m): field k is (x >> (bits * k)) & (2**bits - 1)."""
    shifts = np.arange(0, 8, bits, dtype=np.uint8).reshape(-1, 1, 1)
    f = x >> shifts
    f &= (1 << bits) - 1
    return f


@_codec("F32")
def _f32(blocks, out):
    np.copyto(out, blocks.view(np.float32))


@_codec("F16")
def _f16_codec(blocks, out):
    np.copyto(out, blocks.view(np.float16))


# BF16, 2 B: the high half of a float32
@_codec("BF16")
def _bf16(blocks, out):
    np.left_shift(blocks.view(np.uint16), 16, out=out.view(np.uint32), dtype=np.uint32)


# Q4_0, 18 B: d f16 | qs 16 (4-bit: low nibbles are elements 0..15, high nibbles 16..31)
# ref: ggml-quants.c dequantize_row_q4_0
@_codec("Q4_0")
def _q4_0(blocks, out):
    n = len(blocks)
    nib = _nibbles(blocks).view(np.int8)  # (2, n, 18)
    nib -= 8
    np.copyto(out.reshape(n, 2, 16), nib[:, :, 2:].transpose(1, 0, 2))
    out *= _f16(blocks, 0)  # y = (q - 8) * d


# Q4_1, 20 B: d f16 | m f16 | qs 16 (4-bit, as Q4_0)
# ref: ggml-quants.c dequantize_row_q4_1
@_codec("Q4_1")
def _q4_1(blocks, out):
    n = len(blocks)
    nib = _nibbles(blocks)  # (2, n, 20)
    np.copyto(out.reshape(n, 2, 16), nib[:, :, 4:].transpose(1, 0, 2))
    out *= _f16(blocks, 0)
    out += _f16(blocks, 2)  # y = d * q + m


def _q5_quants(blocks: np.ndarray, at_qh: int) -> np.ndarray:
    """Q5_0/Q5_1: qh 4 B at `at_qh`, then qs 16 B -> uint8 (n, 32) quants 0..31."""
    n = len(blocks)
    q = np.unpackbits(blocks[:, at_qh:at_qh + 4], axis=1, bitorder="little")  # bit j of the u32 LE
    q *= 16  # << 4
    nib = _nibbles(blocks)  # (2, n, block_bytes)
    q3 = q.reshape(n, 2, 16)
    q3 |= nib[:, :, at_qh + 4:].transpose(1, 0, 2)
    return q


# Q5_0, 22 B: d f16 | qh 4 (u32 LE, 5th bit of element j at bit j) | qs 16 (4-bit, as Q4_0)
# ref: ggml-quants.c dequantize_row_q5_0
@_codec("Q5_0")
def _q5_0(blocks, out):
    q = _q5_quants(blocks, 2).view(np.int8)
    q -= 16
    np.copyto(out, q)
    out *= _f16(blocks, 0)  # y = (q - 16) * d


# Q5_1, 24 B: d f16 | m f16 | qh 4 | qs 16 (as Q5_0)
# ref: ggml-quants.c dequantize_row_q5_1
@_codec("Q5_1")
def _q5_1(blocks, out):
    np.copyto(out, _q5_quants(blocks, 4))
    out *= _f16(blocks, 0)
    out += _f16(blocks, 2)  # y = d * q + m


# Q8_0, 34 B: d f16 | qs 32 (int8)
# ref: ggml-quants.c dequantize_row_q8_0
@_codec("Q8_0")
def _q8_0(blocks, out):
    np.copyto(out, blocks[:, 2:].view(np.int8))
    out *= _f16(blocks, 0)  # y = q * d


# Q2_K, 84 B: scales 16 (low nibble scale, high nibble min) | qs 64 (2-bit) | d f16 | dmin f16
# 16 groups of 16; qs byte 32*h + l holds element 128*h + 32*s + l at bits 2s..2s+1
# ref: ggml-quants.c dequantize_row_q2_K
@_codec("Q2_K")
def _q2_k(blocks, out):
    n = len(blocks)
    at_qs = QK_K // 16
    at_d = at_qs + QK_K // 4
    sc = blocks[:, :at_qs]
    dl = _f16(blocks, at_d) * (sc & 0x0F)  # float32 (n, 16)
    ml = _f16(blocks, at_d + 2) * (sc >> 4)
    q = _bit_fields(blocks, 2)[:, :, at_qs:at_d]  # (s, n, 64)
    np.copyto(out.reshape(n, 2, 4, 32), q.reshape(4, n, 2, 32).transpose(1, 2, 0, 3))
    y = out.reshape(n, 16, 16)
    y *= dl.reshape(n, 16, 1)
    y -= ml.reshape(n, 16, 1)  # y = dl * q - ml


# Q3_K, 110 B: hmask 32 (3rd bit, set = no offset) | qs 64 (2-bit, as Q2_K) | scales 12 | d f16
# 16 scales of 6 bits: low 4 bits in bytes 0..7 (low nibbles first), high 2 bits in bytes 8..11;
# 3rd bit of element 32*j + l is bit j of hmask[l]
# ref: ggml-quants.c dequantize_row_q3_K
@_codec("Q3_K")
def _q3_k(blocks, out):
    n = len(blocks)
    at_qs = QK_K // 8
    at_sc = at_qs + QK_K // 4
    scales = blocks[:, at_sc:at_sc + 12]
    lo = _nibbles(scales[:, :8]).transpose(1, 0, 2).reshape(n, 16)  # scale j: nibble j // 8
    hi = _bit_fields(scales[:, 8:], 2).transpose(1, 0, 2).reshape(n, 16)  # 2-bit field j // 4
    sc = (lo | hi * 16).view(np.int8) - 32
    dl = _f16(blocks, at_sc + 12) * sc  # float32 (n, 16)
    ql = _bit_fields(blocks, 2)[:, :, at_qs:at_sc]  # (s, n, 64)
    qh = _bit_fields(np.ascontiguousarray(blocks[:, :at_qs]), 1)  # (j, n, 32)
    qh *= 4  # << 2
    # q = 2 low bits - 4, unless the hmask bit is set: (ql | hbit << 2) - 4
    q = np.empty((n, 2, 4, 32), np.uint8)
    np.bitwise_or(ql.reshape(4, n, 2, 32).transpose(1, 2, 0, 3),
                  qh.reshape(2, 4, n, 32).transpose(2, 0, 1, 3), out=q)
    q = q.view(np.int8)
    q -= 4
    y = out.reshape(n, 16, 16)
    np.copyto(y, q.reshape(n, 16, 16))
    y *= dl.reshape(n, 16, 1)  # y = dl * q


def _scale_min_k4(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K/Q5_K: the 12 packed bytes at offset 4 -> float32 d * sc (n, 8), dmin * m (n, 8).

    byte 0..3  EEaaaaaa  sc 0..3, bits 4..5 of sc 4..7
    byte 4..7  FFbbbbbb  m 0..3, bits 4..5 of m 4..7
    byte 8..11 ffffeeee  bits 0..3 of sc 4..7 (low nibble) and of m 4..7 (high nibble)
    Unpacked 4 at a time in uint32 lanes (the masks keep the bytes apart).
    ref: ggml-quants.c get_scale_min_k4
    """
    n = len(blocks)
    w = blocks[:, 4:4 + K_SCALE_SIZE].view(np.uint32)  # (n, 3)
    sc = np.empty((n, 2), np.uint32)
    m = np.empty((n, 2), np.uint32)
    np.bitwise_and(w[:, 0], 0x3F3F3F3F, out=sc[:, 0])
    np.bitwise_and(w[:, 1], 0x3F3F3F3F, out=m[:, 0])
    sc[:, 1] = (w[:, 2] & 0x0F0F0F0F) | ((w[:, 0] >> 2) & 0x30303030)
    m[:, 1] = ((w[:, 2] >> 4) & 0x0F0F0F0F) | ((w[:, 1] >> 2) & 0x30303030)
    return _f16(blocks, 0) * sc.view(np.uint8), _f16(blocks, 2) * m.view(np.uint8)


# Q4_K, 144 B: d f16 | dmin f16 | scales 12 (6-bit packed) | qs 128 (4-bit)
# qs byte 32*j + l: low nibble -> element 64*j + l, high nibble -> 64*j + 32 + l (8 groups of 32)
# ref: ggml-quants.c dequantize_row_q4_K
@_codec("Q4_K")
def _q4_k(blocks, out):
    n = len(blocks)
    dl, ml = _scale_min_k4(blocks)  # float32 (n, 8)
    q = _nibbles(blocks)[:, :, 4 + K_SCALE_SIZE:]  # (nibble, n, 128)
    np.copyto(out.reshape(n, 4, 2, 32), q.reshape(2, n, 4, 32).transpose(1, 2, 0, 3))
    y = out.reshape(n, 8, 32)
    y *= dl.reshape(n, 8, 1)
    y -= ml.reshape(n, 8, 1)  # y = dl * q - ml


# Q5_K, 176 B: d f16 | dmin f16 | scales 12 (6-bit packed) | qh 32 | qs 128 (4-bit, as Q4_K)
# 5th bit of element 32*j + l is bit j of qh[l]
# ref: ggml-quants.c dequantize_row_q5_K
@_codec("Q5_K")
def _q5_k(blocks, out):
    n = len(blocks)
    dl, ml = _scale_min_k4(blocks)  # float32 (n, 8)
    at_qh = 4 + K_SCALE_SIZE
    at_qs = at_qh + QK_K // 8
    ql = _nibbles(blocks)[:, :, at_qs:]  # (nibble, n, 128)
    qh = _bit_fields(np.ascontiguousarray(blocks[:, at_qh:at_qs]), 1)  # (j, n, 32)
    qh *= 16  # << 4
    q = np.empty((n, 4, 2, 32), np.uint8)
    np.bitwise_or(ql.reshape(2, n, 4, 32).transpose(1, 2, 0, 3),
                  qh.reshape(4, 2, n, 32).transpose(2, 0, 1, 3), out=q)
    y = out.reshape(n, 8, 32)
    np.copyto(y, q.reshape(n, 8, 32))
    y *= dl.reshape(n, 8, 1)
    y -= ml.reshape(n, 8, 1)  # y = dl * q - ml


# Q6_K, 210 B: ql 128 (low 4 bits) | qh 64 (high 2 bits) | scales 16 (int8) | d f16
# per half h of 128 elements, group g of 32, l < 32:
#   low 4 bits: ql[64h + l] (g=0) / ql[64h + 32 + l] (g=1), high nibbles of the same for g=2 / g=3
#   high 2 bits: bits 2g..2g+1 of qh[32h + l]
# ref: ggml-quants.c dequantize_row_q6_K
@_codec("Q6_K")
def _q6_k(blocks, out):
    n = len(blocks)
    at_qh = QK_K // 2
    at_sc = at_qh + QK_K // 4
    dl = _f16(blocks, at_sc + QK_K // 16) * blocks[:, at_sc:at_sc + QK_K // 16].view(np.int8)
    ql = _nibbles(blocks)[:, :, :at_qh]  # (nibble, n, 128)
    qh = _bit_fields(np.ascontiguousarray(blocks[:, at_qh:at_sc]), 2)  # (g, n, 64)
    qh *= 16  # << 4
    q = np.empty((n, 2, 2, 2, 32), np.uint8)  # (n, h, g // 2, g % 2, l)
    np.bitwise_or(ql.reshape(2, n, 2, 2, 32).transpose(1, 2, 0, 3, 4),
                  qh.reshape(2, 2, n, 2, 32).transpose(2, 3, 0, 1, 4), out=q)
    q = q.view(np.int8)
    q -= 32
    y = out.reshape(n, 16, 16)
    np.copyto(y, q.reshape(n, 16, 16))
    y *= dl.reshape(n, 16, 1)  # y = dl * (q - 32)


assert set(_CODECS) == set(QUANT_TYPES), sorted(set(QUANT_TYPES) ^ set(_CODECS))


@dataclass(frozen=True)
class QTensor:
    """A tensor's raw ggml bytes with its type and GGUF-order shape."""
    name: str
    ggml_type: str
    shape: tuple[int, ...]  # GGUF order [ne0, ne1, ...]
    data: np.ndarray  # uint8, len == tensor_nbytes(ggml_type, shape)

    def __post_init__(self):
        dims = _dims(self.shape, self.name)
        raw = _as_u8(self.data, self.name)
        want = tensor_nbytes(self.ggml_type, dims, self.name)
        if raw.size != want:
            raise ByteLengthError(f"tensor {self.name}: {raw.size} bytes, expected {want} "
                                  f"for {self.ggml_type} shape {list(dims)}")
        object.__setattr__(self, "shape", dims)
        object.__setattr__(self, "data", raw)

    @property
    def nbytes(self) -> int:
        return self.data.size

    @property
    def row_len(self) -> int:
        return self.shape[0]

    @property
    def n_rows(self) -> int:
        return math.prod(self.shape[1:])

    def dequantize(self) -> np.ndarray:
        """float32 array of numpy shape reversed(shape)."""
        return dequantize(self.data, self.ggml_type, self.shape, self.name)

    def rows(self, a: int, b: int) -> QTensor:
        """Rows [a, b) of a 2-D tensor, sharing this tensor's bytes (zero-copy)."""
        if len(self.shape) != 2:
            raise QuantError(f"tensor {self.name}: rows() needs a 2-D tensor, "
                             f"shape is {list(self.shape)}")
        if not 0 <= a <= b <= self.shape[1]:
            raise QuantError(f"tensor {self.name}: rows [{a}, {b}) out of range "
                             f"for {self.shape[1]} rows")
        start, end = row_byte_range(self.ggml_type, self.shape[0], a, b, self.name)
        return QTensor(self.name, self.ggml_type, (self.shape[0], b - a), self.data[start:end])
