"""y = x @ W.T for a quantized weight W, with bounded float32 temporaries.

The numpy path dequantizes W a tile of whole rows at a time into one reused float32 buffer of at
most `tile_bytes`, so a 7B layer never exists in float32 at once. It is the reference: models
call it as ops.matmul (common.ops.Ops), and the C kernels' ops (deploy.kernels.KernelOps)
compute the types they take on the quantized blocks instead.
"""
from __future__ import annotations

import numpy as np

from common.quant import QTensor, dequantize_rows, row_nbytes

# Default bound of the float32 tile the numpy path dequantizes at a time.
DEFAULT_TILE_BYTES = 4 << 20


def tile_rows(ne0: int, ne1: int, tile_bytes: int = DEFAULT_TILE_BYTES) -> int:
    """Rows of W (numpy shape (ne1, ne0)) the numpy path dequantizes at a time: whole rows whose
    float32 fits tile_bytes, at least one. Its tile is 4 * ne0 * tile_rows(...) bytes."""
    return max(1, min(ne1, tile_bytes // (4 * ne0)))


def matmul(x: np.ndarray, w: QTensor, tile_bytes: int = DEFAULT_TILE_BYTES) -> np.ndarray:
    """x (T, ne0) or (ne0,) float32 @ W.T, W numpy shape (ne1, ne0) -> (T, ne1) or (ne1,) float32.

    tile_bytes bounds the float32 tile that W is dequantized into.
    """
    if len(w.shape) != 2:
        raise ValueError(f"matmul {w.name}: W must be 2-D, shape is {list(w.shape)}")
    ne0, ne1 = w.shape
    if x.dtype != np.float32 or x.ndim not in (1, 2) or x.shape[-1] != ne0:
        raise ValueError(f"matmul {w.name}: x must be float32 (T, {ne0}) or ({ne0},), "
                         f"got {x.dtype} {x.shape}")
    y = matmul_tiled(x.reshape(1, ne0) if x.ndim == 1 else x, w, tile_bytes)
    return y[0] if x.ndim == 1 else y


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
