"""Attention KV cache of one sequence, and the prefill chunking rule.

Decode appends one token's k, v per layer; prefill appends a chunk. Positions come from the
caller and are stored beside the keys: attention masks by position (key pos <= query pos),
so a chunked prefill sees exactly what an unchunked one does.
"""
from __future__ import annotations

import numpy as np

_MIN_CAPACITY = 16


class KVCache:
    """Keys and values per layer, each (n_tokens, n_kv_head, head_dim), in arrival order.

    A station only ever appends the layers it runs, so layers are created on first use.
    `dtype` is the storage type; attention always reads float32.
    """

    def __init__(self, n_kv_head: int, head_dim: int, dtype=np.float32):
        self.n_kv_head, self.head_dim = n_kv_head, head_dim
        self.dtype = np.dtype(dtype)
        self._k: dict[int, np.ndarray] = {}    # layer -> (capacity, n_kv, hd)
        self._v: dict[int, np.ndarray] = {}
        self._pos: dict[int, np.ndarray] = {}  # layer -> (capacity,) int64
        self._n: dict[int, int] = {}
        self._nbytes = 0  # of the arrays above, kept current by _reserve (stations read it per phase)

    def n_tokens(self, layer: int) -> int:
        return self._n.get(layer, 0)

    @property
    def nbytes(self) -> int:
        return self._nbytes

    def append(self, layer: int, k: np.ndarray, v: np.ndarray, positions: np.ndarray):
        """Add k, v (T, n_kv, hd) at positions (T,); return all (S, n_kv, hd) x2 and (S,) so far."""
        T = k.shape[0]
        assert k.shape == v.shape == (T, self.n_kv_head, self.head_dim), f"{k.shape=} {v.shape=}"
        assert positions.shape == (T,), f"{positions.shape=}"
        n = self._n.get(layer, 0)
        self._reserve(layer, n + T)
        self._k[layer][n:n + T] = k
        self._v[layer][n:n + T] = v
        self._pos[layer][n:n + T] = positions
        self._n[layer] = n = n + T
        k_all, v_all = self._k[layer][:n], self._v[layer][:n]
        if self.dtype != np.float32:
            k_all, v_all = k_all.astype(np.float32), v_all.astype(np.float32)
        return k_all, v_all, self._pos[layer][:n]

    def n_positions(self) -> int:
        """Entries of the longest layer (every layer of a sequence holds as many once a forward is done)."""
        return max(self._n.values(), default=0)

    def truncate(self, n_tokens: int) -> None:
        """Forget every entry past the first n_tokens in all layers (rewind a sequence)."""
        for layer in self._n:
            self._n[layer] = min(self._n[layer], n_tokens)

    def _reserve(self, layer: int, need: int) -> None:
        # Capacity doubles, so a long decode copies O(n) in total rather than O(n^2).
        have = self._k[layer].shape[0] if layer in self._k else 0
        if need <= have:
            return
        cap = max(_MIN_CAPACITY, need, 2 * have)
        n = self._n.get(layer, 0)
        shape = (cap, self.n_kv_head, self.head_dim)
        k, v, pos = np.empty(shape, self.dtype), np.empty(shape, self.dtype), np.empty(cap, np.int64)
        if n:
            k[:n], v[:n], pos[:n] = self._k[layer][:n], self._v[layer][:n], self._pos[layer][:n]
        if layer in self._k:
            self._nbytes -= self._k[layer].nbytes + self._v[layer].nbytes + self._pos[layer].nbytes
        self._nbytes += k.nbytes + v.nbytes + pos.nbytes
        self._k[layer], self._v[layer], self._pos[layer] = k, v, pos


def default_chunk_size(n_tokens: int) -> int:
    """The seed's prefill chunk: floor(P/2), and at least 1."""
    return max(1, n_tokens // 2)


def prefill_chunks(n_tokens: int, chunk_size: int | None = None) -> list[tuple[int, int]]:
    """[start, end) ranges covering [0, n_tokens) in order, each at most chunk_size long."""
    size = default_chunk_size(n_tokens) if chunk_size is None else chunk_size
    if size < 1:
        raise ValueError(f"chunk_size {size} < 1")
    return [(a, min(a + size, n_tokens)) for a in range(0, n_tokens, size)]
