"""common.matmul: equals x @ dequantize(W).T, keeps float32 temporaries to one tile."""
from __future__ import annotations

import tracemalloc

import numpy as np
import pytest

from common.matmul import matmul
from common.quant import QUANT_TYPES, QTensor
from tests.unit.test_quant import random_raw



def qtensor(ggml_type: str, ne0: int, ne1: int, seed: int = 0) -> QTensor:
    raw = random_raw(ggml_type, ne1, ne0, np.random.default_rng(seed))
    if ggml_type in ("F32", "F16", "BF16"):  # finite weights: random bits would give NaN products
        a = np.random.default_rng(seed).standard_normal((ne1, ne0)).astype(np.float32)
        raw = {"F32": a, "F16": a.astype(np.float16),
               "BF16": (a.view(np.uint32) >> 16).astype(np.uint16)}[ggml_type].view(np.uint8)
    return QTensor(f"blk.0.{ggml_type}.weight", ggml_type, (ne0, ne1), raw.reshape(-1))


def assert_matmul_close(y: np.ndarray, x: np.ndarray, W: np.ndarray):
    """Tiling changes only how BLAS blocks each dot product: per element, the difference from
    x @ W.T stays within float32 rounding of sum |x_i w_i|."""
    ref = x @ W.T
    assert y.dtype == np.float32 and y.shape == ref.shape
    bound = 1e-6 * (np.abs(x) @ np.abs(W).T)
    assert np.all(np.abs(y - ref) <= bound), float(np.max(np.abs(y - ref) / bound))


CASES = [("Q4_K", 1024, 300), ("Q6_K", 512, 77), ("Q5_0", 896, 130), ("Q8_0", 896, 301),
         ("Q2_K", 256, 40), ("Q4_0", 64, 33), ("F16", 896, 51), ("BF16", 96, 20), ("F32", 896, 50)]


@pytest.mark.parametrize("ggml_type, ne0, ne1", CASES)
@pytest.mark.parametrize("T", [1, 5])
def test_matmul_equals_dense(ggml_type, ne0, ne1, T):
    w = qtensor(ggml_type, ne0, ne1)
    W = w.dequantize()  # (ne1, ne0)
    x = np.random.default_rng(T).standard_normal((T, ne0)).astype(np.float32)
    # one tile, 7 rows per tile (partial last tile), one row per tile (tile_bytes < a row)
    for tile_bytes in (4 << 20, 7 * 4 * ne0, 1):
        assert_matmul_close(matmul(x, w, tile_bytes), x, W)
    y1 = matmul(x[0], w, tile_bytes=7 * 4 * ne0)  # x (ne0,) -> (ne1,)
    assert y1.shape == (ne1,)
    assert_matmul_close(y1[None], x[:1], W)


def test_single_tile_is_exact():
    # With one tile the product is the same BLAS call as the dense one: bit-identical.
    w = qtensor("Q4_K", 1024, 64)
    x = np.random.default_rng(0).standard_normal((3, 1024)).astype(np.float32)
    np.testing.assert_array_equal(matmul(x, w), x @ w.dequantize().T)


def test_rows_of_a_tensor():
    # A vocabulary slice of the head: matmul over w.rows(a, b) is the slice of the full product.
    w = qtensor("Q8_0", 896, 120)
    x = np.random.default_rng(1).standard_normal((2, 896)).astype(np.float32)
    W = w.dequantize()
    assert_matmul_close(matmul(x, w.rows(30, 90), tile_bytes=10 * 4 * 896), x, W[30:90])


def test_rejects_bad_inputs():
    w = qtensor("Q8_0", 64, 8)
    with pytest.raises(ValueError, match=r"float32 \(T, 64\)"):
        matmul(np.zeros((2, 63), np.float32), w)
    with pytest.raises(ValueError, match="float32"):
        matmul(np.zeros((2, 64), np.float64), w)
    with pytest.raises(ValueError, match="float32"):
        matmul(np.zeros((1, 2, 64), np.float32), w)
    with pytest.raises(ValueError, match="2-D"):
        matmul(np.zeros(64, np.float32), QTensor("v", "Q8_0", (64,), bytes(68)))


def traced_peak_bytes(fn) -> tuple[int, object]:
    """Peak bytes allocated (numpy reports its buffers to tracemalloc) while fn() runs."""
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        tracemalloc.reset_peak()
        result = fn()
        return tracemalloc.get_traced_memory()[1] - base, result
    finally:
        tracemalloc.stop()


def test_peak_memory_is_one_tile_not_the_whole_weight(record_property):
    # 7B ffn_up is Q4_K (ne0 3584, ne1 18944): 271 MB as float32. A quarter of its rows keeps the
    # test fast and is still 68 MB as float32.
    ne0, ne1, T, tile_bytes = 3584, 18944 // 4, 4, 4 << 20
    w = qtensor("Q4_K", ne0, ne1)
    x = np.random.default_rng(3).standard_normal((T, ne0)).astype(np.float32)
    w_f32_bytes = ne0 * ne1 * 4
    peak, y = traced_peak_bytes(lambda: matmul(x, w, tile_bytes))
    record_property("peak_extra_bytes", peak)
    print(f"\nQ4_K W {ne1}x{ne0}: {w.nbytes / 1e6:.1f} MB quantized, "
          f"{w_f32_bytes / 1e6:.1f} MB float32; matmul peak extra {peak / 1e6:.2f} MB "
          f"(tile {tile_bytes / 1e6:.2f} MB, y {y.nbytes / 1e6:.3f} MB)")
    # the tile, the output, and the codecs' uint8 chunk temporaries (< 1 MB)
    assert peak <= tile_bytes + y.nbytes + (1 << 20), peak
    assert peak < w_f32_bytes / 10
    # and the answer is right: compare a few hundred rows with the dense product
    W = w.rows(1000, 1300).dequantize()
    assert_matmul_close(y[:, 1000:1300], x, W)


def test_f32_weights_are_not_copied():
    ne0, ne1 = 1024, 2048  # 8 MB of float32
    w = qtensor("F32", ne0, ne1)
    x = np.random.default_rng(4).standard_normal((2, ne0)).astype(np.float32)
    peak, y = traced_peak_bytes(lambda: matmul(x, w, tile_bytes=1 << 20))
    assert peak <= y.nbytes + (64 << 10), peak
    np.testing.assert_array_equal(y, x @ w.data.view(np.float32).reshape(ne1, ne0).T)


def test_every_type_has_a_path():
    x = np.ones((1, 256), np.float32)
    for ggml_type in QUANT_TYPES:
        assert matmul(x, qtensor(ggml_type, 256, 3)).shape == (1, 3)
