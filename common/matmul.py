"""y = x @ W.T for a quantized weight W, with bounded float32 temporaries.

The numpy path dequantizes W a tile of whole rows at a time into one reused float32 buffer of at
most `tile_bytes`, so a 7B layer never exists in float32 at once. It is the reference and the
fallback: `register_kernel` routes one ggml type to a faster kernel (C: deploy.kernels) without
touching callers. Models call these through their common.ops.Ops (ops.matmul).
"""
from __future__ import annotations

from typing import Callable, Sequence

import numpy as np

from common.quant import QUANT_TYPES, QTensor, UnsupportedQuantType, dequantize_rows, row_nbytes

# kernel(x (T, ne0) float32, w with numpy shape (ne1, ne0)) -> (T, ne1) float32
Kernel = Callable[[np.ndarray, QTensor], np.ndarray]

_KERNELS: dict[str, Kernel] = {}


def register_kernel(ggml_type: str, kernel: Kernel | None) -> Kernel | None:
    """Route matmul of a ggml type to `kernel` (None: the numpy path again); return the old one."""
    if ggml_type not in QUANT_TYPES:
        raise UnsupportedQuantType(f"cannot register a matmul kernel for ggml type {ggml_type!r}")
    old = _KERNELS.pop(ggml_type, None)
    if kernel is not None:
        _KERNELS[ggml_type] = kernel
    return old


# Default bound of the float32 tile the numpy path dequantizes at a time.
DEFAULT_TILE_BYTES = 4 << 20


def tile_rows(ne0: int, ne1: int, tile_bytes: int = DEFAULT_TILE_BYTES) -> int:
    """Rows of W (numpy shape (ne1, ne0)) the numpy path dequantizes at a time: whole rows whose
    float32 fits tile_bytes, at least one. Its tile is 4 * ne0 * tile_rows(...) bytes."""
    return max(1, min(ne1, tile_bytes // (4 * ne0)))


def get_kernel(ggml_type: str) -> Kernel | None:
    """The registered kernel of a ggml type, or None when the numpy path serves it."""
    return _KERNELS.get(ggml_type)


def matmul(x: np.ndarray, w: QTensor, tile_bytes: int = DEFAULT_TILE_BYTES) -> np.ndarray:
    """x (T, ne0) or (ne0,) float32 @ W.T, W numpy shape (ne1, ne0) -> (T, ne1) or (ne1,) float32.

    tile_bytes bounds the float32 tile of the numpy path (a registered kernel ignores it).
    """
    if len(w.shape) != 2:
        raise ValueError(f"matmul {w.name}: W must be 2-D, shape is {list(w.shape)}")
    ne0, ne1 = w.shape
    if x.dtype != np.float32 or x.ndim not in (1, 2) or x.shape[-1] != ne0:
        raise ValueError(f"matmul {w.name}: x must be float32 (T, {ne0}) or ({ne0},), "
                         f"got {x.dtype} {x.shape}")
    x2 = x.reshape(1, ne0) if x.ndim == 1 else x
    kernel = _KERNELS.get(w.ggml_type)
    if kernel is None:
        y = matmul_tiled(x2, w, tile_bytes)
    else:
        y = kernel(x2, w)
        assert y.shape == (len(x2), ne1) and y.dtype == np.float32, \
            f"{w.ggml_type} kernel returned {y.dtype} {y.shape}, expected float32 {(len(x2), ne1)}"
    return y[0] if x.ndim == 1 else y


def matmul_many(x: np.ndarray, ws: Sequence[QTensor]) -> list[np.ndarray]:
    """[matmul(x, w) for w in ws], the same bits, in one kernel call where every w's type routes to a
    kernel sharing one `many` (deploy.kernels: x quantized once per activation format, one parallel
    pass). Why: a layer's q, k and v of one decode row were three calls, each paying the wrapper and
    waking the workers, for products of 0.1-0.6 MB."""
    kernels = [_KERNELS.get(w.ggml_type) for w in ws]
    many = getattr(kernels[0], "many", None) if ws else None
    if many is not None and all(getattr(k, "many", None) is many for k in kernels[1:]) and x.ndim == 2 \
            and x.dtype == np.float32 and all(len(w.shape) == 2 and w.shape[0] == x.shape[1] for w in ws):
        ys = many(x, ws)
        if ys is not None:
            return ys
    return [matmul(x, w) for w in ws]


def matmul_tiled(x: np.ndarray, w: QTensor, tile_bytes: int = DEFAULT_TILE_BYTES) -> np.ndarray:
    """The numpy reference: x (T, ne0) f32 @ W.T -> (T, ne1) f32, W dequantized by row tiles."""
    ne0, ne1 = w.shape
    y = np.empty((len(x), ne1), np.float32)
    if w.ggml_type == "F32":
        W = w.data.view(np.float32).reshape(ne1, ne0)  # zero-copy view of the raw bytes
        np.matmul(x, W.T, out=y)  # (T, ne0) @ (ne0, ne1) -> (T, ne1)
        return y
    rows = tile_rows(ne0, ne1, tile_bytes)
    tile = np.empty((rows, ne0), np.float32)
    nb = row_nbytes(w.ggml_type, ne0, w.name)
    for a in range(0, ne1, rows):
        b = min(a + rows, ne1)
        W = dequantize_rows(w.data[a * nb:b * nb], w.ggml_type, ne0, w.name, out=tile[:b - a])
        np.matmul(x, W.T, out=y[:, a:b])  # (T, ne0) @ (ne0, b - a) -> (T, b - a)
    return y
