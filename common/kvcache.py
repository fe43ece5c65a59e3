"""Attention KV cache of one sequence, and the prefill chunking rule.

Decode appends one token's k, v per layer; prefill appends a chunk. Positions come from the
caller and are stored beside the keys: attention masks by position (key pos <= query pos),
so a chunked prefill sees exactly what an unchunked one does.

Keys and values are stored token-major, (capacity, n_kv, hd), and hold float16 numbers whatever
the storage dtype (the attn phase rounds them first, as llama.cpp's f16 cache holds them), so the
storage type changes bytes, never numbers: default_kv_dtype() says which. Attention's products are
exact in float64 and summed there, by the C kernels or a slice of keys at a time by numpy
(common/models/qwen2.py, attention()).
"""
from __future__ import annotations

from typing import Callable, Iterable

import numpy as np

from common.ops import installed

# Capacity grows in whole blocks of tokens and by at least an eighth: a long decode copies O(n)
# in total, and a cache holds at most an eighth (or one block) more than its tokens.
KV_BLOCK_TOKENS = 256

# The prefill chunk: a prompt enters the layers in chunks of at most this many tokens, so a
# phase's activations are bounded by the chunk (and attention's by chunk x tile), whatever the
# prompt's length. Boundaries depend on the prompt's length alone (prefill_chunks), so a replay
# cuts a prompt exactly where the first run did.
PREFILL_CHUNK_TOKENS = 256


def kv_capacity(have: int, need: int) -> int:
    """The capacity (tokens) a layer grows to when it holds `have` and must hold `need` > have."""
    want = max(need, have + have // 8)
    return -(-want // KV_BLOCK_TOKENS) * KV_BLOCK_TOKENS


def largest(fits: Callable[[int], bool], hi: int) -> int:
    """The largest n in [0, hi] with fits(n), for a fits that holds up to some n and not beyond; 0 if
    none (how many tokens' caches, or rows, a memory budget holds)."""
    if fits(hi):
        return hi
    lo = 0  # fits(lo) or lo == 0; not fits(hi)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo


def default_kv_dtype() -> np.dtype:
    """A new cache's storage type: the installed ops' kv_dtype (common.ops), float16 where the C
    kernels run (they read it as fast as float32, in half the bytes, as llama.cpp's f16 cache),
    float32 on numpy's path (Workers, KNOT_KERNELS=off), whose float16 -> float64 copies cost about
    twice float32's."""
    return installed().kv_dtype


class KVCache:
    """Keys and values per layer, each (capacity, n_kv_head, head_dim), in arrival order.

    A station only ever appends the layers it runs, so layers are created on first use.
    `dtype` is the storage type (None: default_kv_dtype()): float16 (llama.cpp's cache type) holds
    the values the attn phase appends exactly, float32 the same values in twice the bytes.
    """

    def __init__(self, n_kv_head: int, head_dim: int, dtype=None):
        self.n_kv_head, self.head_dim = n_kv_head, head_dim
        self.dtype = np.dtype(dtype) if dtype is not None else default_kv_dtype()
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

    def token_bytes(self) -> int:
        """Bytes one token of capacity takes in one layer: its k, its v and its position."""
        return 2 * self.n_kv_head * self.head_dim * self.dtype.itemsize + np.dtype(np.int64).itemsize

    def nbytes_after(self, layers: Iterable[int], n_new: int) -> int:
        """What this cache will hold once n_new more tokens are appended to each of `layers` (the
        layers it does not hold yet start empty), plus the largest reallocation on the way, when
        a layer's old and new arrays are both alive for the copy."""
        total, copy = self._nbytes, 0
        for layer in layers:
            have = self._k[layer].shape[0] if layer in self._k else 0
            n = self._n.get(layer, 0)
            if n + n_new > have:
                total += (kv_capacity(have, n + n_new) - have) * self.token_bytes()
                copy = max(copy, have * self.token_bytes())
        return total + copy

    def nbytes_bound(self, n_tokens: int, n_layers: int) -> int:
        """The most a cache of n_tokens in n_layers layers can hold, however it grew (capacity is at
        most an eighth and a block over), plus the copy that grew it last."""
        cap = -(-(n_tokens + n_tokens // 8) // KV_BLOCK_TOKENS) * KV_BLOCK_TOKENS
        return self.token_bytes() * (n_layers * cap + n_tokens)

    def append(self, layer: int, k: np.ndarray, v: np.ndarray, positions: np.ndarray):
        """Add k, v (T, n_kv, hd) at positions (T,) -> everything so far as views: k, v (S, n_kv, hd)
        in the storage dtype, positions (S,)."""
        T = k.shape[0]
        assert k.shape == v.shape == (T, self.n_kv_head, self.head_dim), f"{k.shape=} {v.shape=}"
        assert positions.shape == (T,), f"{positions.shape=}"
        n = self._n.get(layer, 0)
        self._reserve(layer, n + T)
        self._k[layer][n:n + T] = k
        self._v[layer][n:n + T] = v
        self._pos[layer][n:n + T] = positions
        self._n[layer] = n = n + T
        return self._k[layer][:n], self._v[layer][:n], self._pos[layer][:n]

    def layer(self, layer: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """What layer holds, as views: k, v (S, n_kv, hd) in the storage dtype, positions (S,)."""
        n = self._n.get(layer, 0)
        if n == 0:
            empty = np.empty((0, self.n_kv_head, self.head_dim), self.dtype)
            return empty, empty, np.empty(0, np.int64)
        return self._k[layer][:n], self._v[layer][:n], self._pos[layer][:n]

    def n_positions(self) -> int:
        """Entries of the longest layer (every layer of a sequence holds as many once a forward is done)."""
        return max(self._n.values(), default=0)

    def truncate(self, n_tokens: int) -> None:
        """Forget every entry past the first n_tokens in all layers (rewind a sequence)."""
        for layer in self._n:
            self._n[layer] = min(self._n[layer], n_tokens)

    def _reserve(self, layer: int, need: int) -> None:
        have = self._k[layer].shape[0] if layer in self._k else 0
        if need <= have:
            return
        cap = kv_capacity(have, need)
        n = self._n.get(layer, 0)
        shape = (cap, self.n_kv_head, self.head_dim)
        k, v, pos = np.empty(shape, self.dtype), np.empty(shape, self.dtype), np.empty(cap, np.int64)
        if n:
            k[:n], v[:n], pos[:n] = self._k[layer][:n], self._v[layer][:n], self._pos[layer][:n]
        if layer in self._k:
            self._nbytes -= self._k[layer].nbytes + self._v[layer].nbytes + self._pos[layer].nbytes
        self._nbytes += k.nbytes + v.nbytes + pos.nbytes
        self._k[layer], self._v[layer], self._pos[layer] = k, v, pos


def prefill_chunks(n_tokens: int, chunk_size: int = PREFILL_CHUNK_TOKENS, start: int = 0) -> list[tuple[int, int]]:
    """[a, b) ranges covering [start, n_tokens) in order: the chunks cut at multiples of chunk_size
    from position 0, the first one's rows before `start` left out (a prompt resumed after cached
    blocks, common/prefix.py); a pure function of its arguments."""
    if chunk_size < 1:
        raise ValueError(f"chunk_size {chunk_size} < 1")
    return [(max(a, start), min(a + chunk_size, n_tokens))
            for a in range(start - start % chunk_size, n_tokens, chunk_size)]
