"""The ops a model's forward is made of, as one interface: `Ops` is the numpy reference.

    ops.matmul(x, w), ops.matmul_many(x, ws)   y = x @ W.T for quantized weights W (common.matmul)
    ops.rmsnorm(x, weight, eps)                RMSNorm, float64 sum of squares as ggml's
    ops.rope_qkv(q, k, v, bq, bk, bv, cos, sin, n_head, n_kv)
                                               biases, NeoX RoPE, k and v rounded to f16
    ops.attention(q, k, v, q_pos, k_pos)       causal grouped-query attention of one sequence
    ops.silu(x)                                x / (1 + exp(-x))

A faster implementation subclasses Ops and overrides what it computes faster, with the same bits
(deploy.kernels.KernelOps: C). It decides for itself which inputs it takes (dtype, shape, ISA) and
hands the others to super(), so a caller always gets the reference's answer and never asks
whether a kernel exists. A process runs one Ops: install() sets it once (deploy.kernels.install
sets the C one), and a model takes it at construction (common.models.base.Model), as gpt-fast's
convert_for_runtime swaps modules once and leaves model.py pure math.

Pure numpy and stdlib: this is what Pyodide (Cloudflare's Python Workers) runs.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np

from common.matmul import matmul
from common.quant import QTensor


# Attention runs over the keys in tiles, flash-attention style: an online softmax keeps a running
# max and sum per query row, so its temporaries are the (n_head, T, tile) scores of one tile, not
# (n_head, T, S). A tile's scores take about ATTN_TILE_BYTES; a decode step (T = 1) fits every key
# of a 32k context in one tile, which is exactly the untiled computation.
ATTN_TILE_BYTES = 4 << 20
ATTN_TILE_ALIGN = 64  # tiles start at multiples of this many keys
# The float64 copies of keys, values and float16 probabilities are made this many bytes at a time,
# whatever the tile: float64 sums do not depend on where the keys are cut (below).
ATTN_CONVERT_BYTES = 2 << 20


# A prompt chunk's tiles are sized for this many rows whatever its own rows, a whole multiple of
# them (prefill_tile_keys), and its last tile is padded with masked keys to the next multiple of
# them: so a row's bits depend on its own keys alone, not on where its chunk starts or ends, and a
# prefill resumed after cached blocks (common/prefix.py) computes each row as a cold prefill does.
# Why a multiple: chunks are cut at multiples of this (common.kvcache.PREFILL_CHUNK_TOKENS), so
# whether a chunk fits one tile depends on which chunk it is, not on its length.
PREFILL_TILE_ROWS = 256


def attn_tile_keys(n_head: int, T: int) -> int:
    """Keys per tile for T query rows: as many as keep the tile's float32 scores (n_head, T, tile)
    within ATTN_TILE_BYTES; a multiple of ATTN_TILE_ALIGN, and at least that."""
    n = ATTN_TILE_BYTES // (4 * n_head * T)
    return max(ATTN_TILE_ALIGN, n - n % ATTN_TILE_ALIGN)


def prefill_tile_keys(n_head: int, T: int) -> int:
    """Keys per tile of a prompt chunk of T rows: attn_tile_keys for PREFILL_TILE_ROWS rows rounded
    down to a multiple of PREFILL_TILE_ROWS (at least one), the same for every T up to that; past
    it, fewer keys, so that the tile stays within ATTN_TILE_BYTES."""
    if T > PREFILL_TILE_ROWS:
        return attn_tile_keys(n_head, T)
    n = attn_tile_keys(n_head, PREFILL_TILE_ROWS)
    return max(PREFILL_TILE_ROWS, n - n % PREFILL_TILE_ROWS)


def row_by_row(T: int, S: int) -> bool:
    """Whether attention() runs T rows over S keys one row at a time (a decode step or verify trip)
    rather than as one prompt chunk (EXACT_ROWS)."""
    return T == 1 or (T <= EXACT_ROWS and S != T)


def _convert_keys(n_kv: int, hd: int, rows: int) -> int:
    """Keys per float64 copy: a key's k or v row (n_kv, hd) in float64, and its scores or
    probabilities of every head and query row (rows = n_head * T): to_f16's float32 result beside
    its float64 copy, or the scores' float64 product, within ATTN_CONVERT_BYTES."""
    return max(1, ATTN_CONVERT_BYTES // (8 * n_kv * hd + 12 * rows))


def attention_bytes(n_head: int, hd: int, T: int, S: int, n_kv: int | None = None) -> int:
    """An upper bound of Ops.attention()'s temporaries for T query rows over S keys (any T_i <= T,
    S_i <= S of a batch's sequences, run one after another, stay within it); n_kv: the kv heads
    (None: as many as n_head, an upper bound)."""
    # one tile: a chunk's (prefill_tile_keys), or one row's at a time (row_by_row)
    scores = 4 * n_head * max(T * min(S, prefill_tile_keys(n_head, T)), min(S, attn_tile_keys(n_head, 1)))
    mask = scores // (4 * n_head)                                # (T, tile) bool
    convert = min(ATTN_CONVERT_BYTES, S * (8 * (n_kv or n_head) * hd + 12 * n_head * T))  # _convert_keys
    # q in float64, the float64 output and one slice's product into it; m, l, alpha per row
    rows = T * n_head * (3 * 8 * hd + 3 * 8)
    # _padded's keys, values and positions past S (a prompt chunk's, never a single row's)
    padded = 0 if T == 1 else min(S + PREFILL_TILE_ROWS, prefill_tile_keys(n_head, T)) * (8 * (n_kv or n_head) * hd + 8)
    return scores + mask + convert + rows + padded + NUMPY_BUFFER_BYTES


# numpy's casting buffers (8192 elements of the wider type, both ways), e.g. a float32 sum in double.
NUMPY_BUFFER_BYTES = 2 * 8192 * 8


# llama.cpp's attention (flash attention off) reads an f16 KV cache, rounds q to f16 for K·q and
# the softmax's probabilities to f16 for V·p (ggml's mul_mat converts src1 to the f16 vec_dot_type).
# We round the same values the same way (IEEE round to nearest even, as F16C), so the keys and
# values are f16 numbers (rope_qkv rounds them before the cache keeps them) whatever dtype
# the cache stores. Why f16 at all: OpenBLAS's kernels for different CPUs summed float32 attention
# in orders that parted the 0.5B's greedy tokens within a few steps, so our tokens depended on the
# CPU (docs/fidelity.md, "Attention that does not depend on the CPU"). A product of two f16 numbers is exact in float64
# and the products' sums in float64 are exact or within a float64 rounding, so the float32 result
# is the same bits whatever order BLAS sums in and however the keys are sliced for the copies
# (tiles past ATTN_TILE_BYTES are another matter: _attend_tiles).
def to_f16(x: np.ndarray) -> np.ndarray:
    """x float32 rounded to float16 (round to nearest even), still float32: the values of
    x.astype(np.float16), without numpy's conversion, which takes ~10-60 ns an element on small
    numbers (float16 subnormals: a long context's probabilities). Adding c = 2^(e + 13), e the
    exponent of |x|, leaves float32's last bit at 2^(e - 10): the sum rounds |x| to 11 significant
    bits, and subtracting c is exact; c >= 1/2 rounds below 2^-14 to multiples of 2^-24, float16's
    subnormals. Past 65504, float16's largest, it is inf."""
    a = np.abs(x, dtype=np.float32)
    c = a.view(np.int32) & np.int32(0x7F800000)  # |x|'s exponent bits
    c += np.int32(13 << 23)
    c = c.view(np.float32)                       # 2^(e + 13)
    np.maximum(c, np.float32(0.5), out=c)  # (a huge |x| wraps c negative: it is inf below anyway)
    a += c
    a -= c
    np.copyto(a, np.float32(np.inf), where=a > np.float32(65504))
    return np.copysign(a, x, out=a)



def rope_neox(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """x (T, n_h, hd), cos/sin (T, hd/2) -> (T, n_h, hd); NeoX pairing: (i, i + hd/2)."""
    # Qwen2 is a NeoX-style rope (rotate-half), not the interleaved (2i, 2i+1) of LLaMA's GGUF.
    half = x.shape[-1] // 2
    x0, x1 = x[..., :half], x[..., half:]                  # (T, n_h, hd/2) each
    c, s = cos[:, None, :], sin[:, None, :]                 # (T, 1, hd/2)
    return np.concatenate([x0 * c - x1 * s, x0 * s + x1 * c], axis=-1)


def softmax_(x: np.ndarray) -> np.ndarray:
    """Softmax over the last axis with max subtraction, in place (x is returned); -inf entries get 0."""
    x -= x.max(axis=-1, keepdims=True)
    np.exp(x, out=x)
    # ref: ggml_vec_soft_max_f32 sums in double, then scales by 1/sum.
    x *= (1.0 / x.sum(axis=-1, keepdims=True, dtype=np.float64)).astype(np.float32)
    return x



def score_scale(hd: int) -> np.float32:
    """What every score is multiplied by, 1 / sqrt(hd) in float32 (llama.cpp's kq_scale): _scores
    and the kernels' row calls (deploy.kernels.KernelOps.attend_rows) take it from here."""
    return np.float32(1.0 / np.sqrt(np.float32(hd)))


def _padded(k: np.ndarray, v: np.ndarray, k_pos: np.ndarray, n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """k, v (t, n_kv, hd), k_pos (t,) -> the same with n - t keys after them: zeros at a position no
    query reaches (masked: their weight is exactly 0, and 0 times a zero value adds nothing)."""
    t = k.shape[0]
    kp, vp = np.zeros((n, *k.shape[1:]), k.dtype), np.zeros((n, *v.shape[1:]), v.dtype)
    kp[:t], vp[:t] = k, v
    pp = np.full(n, np.iinfo(np.int64).max, np.int64)
    pp[:t] = k_pos
    return kp, vp, pp


def _f64_slices(x: np.ndarray, rows: int):
    """Keys or values x (t, n_kv, hd) -> (a, (n_kv, c, hd) float64) for each slice [a, a + c) of as
    many keys as _convert_keys allows beside `rows` scores each, copied into one reused buffer."""
    t, n_kv, hd = x.shape
    step = min(t, _convert_keys(n_kv, hd, rows))
    buf = np.empty((n_kv, step, hd), np.float64)
    for a in range(0, t, step):
        xc = x[a:a + step]
        xf = buf[:, :xc.shape[0]]
        xf[...] = xc.transpose(1, 0, 2)                          # (c, n_kv, hd) -> (n_kv, c, hd)
        yield a, xf


# Up to this many rows of one sequence (a decode step; a speculative verify trip, MAX_DRAFT + 1 in
# common/speculative.py), attention runs one row at a time, each over the keys its decode step
# saw. Why: a batch's softmax and its tiles are those of T rows (a prefill's tiles hold fewer keys
# than a decode's), so a batch's rows need not be the bits each row gives alone, and the next
# layers' Q8 rounding of the activations grew such differences to 0.3-0.56 in a logit of the 1.5B:
# a verified draft must be the token decoding gives, or greedy speculation changes the output at
# near-ties. The matmul kernels, norms and RoPE are row-exact already. Longer prefill chunks keep
# one product.
EXACT_ROWS = 33


class Ops:
    """The numpy reference of every op: float32 activations, attention's products summed in float64
    (the bits do not depend on the CPU's BLAS). A subclass overrides a method with the same bits."""

    # The KV cache's storage type this implementation reads best (common.kvcache.default_kv_dtype).
    # float32 here: numpy's float16 -> float64 copies cost about twice float32's.
    kv_dtype = np.dtype(np.float32)
    # q's dtype in scores(): numpy's float64 matmul takes float64 (a kernel may take float32)
    q_dtype = np.dtype(np.float64)
    # ggml types whose products run on the quantized blocks; numpy dequantizes every type to float32
    # first, so a holder that can afford it keeps such weights dequantized (deploy/engine_local.py)
    quantized_types: frozenset[str] = frozenset()

    def matmul(self, x: np.ndarray, w: QTensor) -> np.ndarray:
        """x (T, ne0) or (ne0,) f32 @ W.T, W numpy shape (ne1, ne0) -> (T, ne1) or (ne1,) f32
        (common.matmul: W dequantized a bounded tile of rows at a time)."""
        return matmul(x, w)

    def matmul_many(self, x: np.ndarray, ws: Sequence[QTensor]) -> list[np.ndarray]:
        """[self.matmul(x, w) for w in ws]: a layer's q, k and v (a subclass may run them in one pass)."""
        return [self.matmul(x, w) for w in ws]

    def rmsnorm(self, x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
        """x (T, d) f32 -> (T, d) f32: x * (1/sqrt(mean(x^2) + eps)) * weight, a new array."""
        # ref: ggml-cpu ops.cpp ggml_compute_forward_rms_norm_f32: the sum of squares is in
        # double, the scale in float, then ggml_mul by the weight as a separate op.
        mean = (np.square(x.astype(np.float64)).sum(axis=-1, keepdims=True) / x.shape[-1])
        scale = (1.0 / np.sqrt(mean.astype(np.float32) + np.float32(eps))).astype(np.float32)
        return (x * scale) * weight

    def silu(self, x: np.ndarray) -> np.ndarray:
        """x / (1 + exp(-x)), float32, a new array."""
        return x / (np.float32(1.0) + np.exp(-x))

    def rope_qkv(self, q: np.ndarray, k: np.ndarray, v: np.ndarray, bq: np.ndarray, bk: np.ndarray,
                 bv: np.ndarray, cos: np.ndarray, sin: np.ndarray, n_head: int,
                 n_kv: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """q (N, n_head * hd), k and v (N, n_kv * hd) as their products left them, their biases, cos and
        sin (N, hd/2) -> q with RoPE (N, n_head, hd); k with RoPE and v as f16 numbers, as llama.cpp's
        cache holds them (N, n_kv, hd). q, k and v are consumed (an implementation may write them)."""
        N, hd = q.shape[0], 2 * cos.shape[-1]
        q = rope_neox((q + bq).reshape(N, n_head, hd), cos, sin)       # (N, n_head, hd)
        k = to_f16(rope_neox((k + bk).reshape(N, n_kv, hd), cos, sin))  # (N, n_kv, hd)
        v = to_f16((v + bv).reshape(N, n_kv, hd))                       # (N, n_kv, hd)
        return q, k, v

    # ------------------------------------------------------------------ attention

    def attention(self, q: np.ndarray, k: np.ndarray, v: np.ndarray, q_pos: np.ndarray,
                  k_pos: np.ndarray) -> np.ndarray:
        """One sequence's T new rows over its cache, whose last T entries are their own keys:
        q (T, n_head, hd) f32, k/v (S, n_kv, hd) (the cache's dtype; f16 numbers), q_pos (T,), k_pos
        (S,) -> (T, n_head * hd) f32. Query t sees key s iff k_pos[s] <= q_pos[t]. A decode step, and
        up to EXACT_ROWS rows appended to a cache that held some already (a verify trip: S > T), go
        row by row (attend_rows): the same bits as decoding them one by one. A prompt's first chunk
        and longer chunks are one product (attend), as the llama.cpp oracle tests measured it
        (docs/fidelity.md), in tiles that do not depend on T (prefill_tile_keys), the last one
        padded: a row's bits depend on its keys alone, so a chunk's rows equal the same rows of any
        chunk of the same cell of PREFILL_TILE_ROWS that is not row_by_row either
        (tests/unit/test_attention.py)."""
        T, S = q.shape[0], k.shape[0]
        if row_by_row(T, S):
            return self.attend_rows(q, k, v, q_pos, k_pos)
        cell_end = -(-S // PREFILL_TILE_ROWS) * PREFILL_TILE_ROWS
        return self.attend(q, k, v, q_pos, k_pos, prefill_tile_keys(q.shape[1], T), pad_to=cell_end)

    def attend_rows(self, q: np.ndarray, k: np.ndarray, v: np.ndarray, q_pos: np.ndarray,
                    k_pos: np.ndarray) -> np.ndarray:
        """attention()'s rows one at a time: row t is attend() alone over the first S - T + 1 + t
        keys, as its decode step saw them. -> (T, n_head * hd) f32."""
        T, S = q.shape[0], k.shape[0]
        if T == 1:
            return self.attend(q, k, v, q_pos, k_pos)
        return np.concatenate([self.attend(q[t:t + 1], k[:S - T + 1 + t], v[:S - T + 1 + t], q_pos[t:t + 1],
                                           k_pos[:S - T + 1 + t]) for t in range(T)])

    def attend(self, q: np.ndarray, k: np.ndarray, v: np.ndarray, q_pos: np.ndarray, k_pos: np.ndarray,
               tile: int | None = None, pad_to: int | None = None) -> np.ndarray:
        """Causal grouped-query attention of T rows in one product, tiled over the keys: q (T, n_head,
        hd) f32, k/v (S, n_kv, hd), q_pos (T,), k_pos (S,) -> (T, n_head * hd) f32.
        tile: keys per tile (default attn_tile_keys); S <= tile is the one-tile computation.
        pad_to: the keys go on to pad_to (>= S) with masked zeros in the last tile (or the one tile),
        so that every sum runs over the same keys whatever S is short of it (attention(): the end
        of S's cell of PREFILL_TILE_ROWS, where tiles end too)."""
        T, n_head, hd = q.shape
        S, n_kv, _ = k.shape
        g = n_head // n_kv  # query heads per kv head: head h reads kv head h // g (ggml broadcast)
        if tile is None:
            tile = attn_tile_keys(n_head, T)
        qg = np.ascontiguousarray(to_f16(q).reshape(T, n_kv, g, hd).transpose(1, 2, 0, 3),
                                  self.q_dtype)  # -> (n_kv, g, T, hd), f16 numbers
        if S <= tile:  # softmax(scores) (n_kv, g, T, S), gone once it has weighed the values
            if pad_to and pad_to > S:  # within the tile (a chunk of over PREFILL_TILE_ROWS may have less)
                k, v, k_pos = _padded(k, v, k_pos, min(pad_to, max(tile, S)))
            out = self._weighted_values(softmax_(self._scores(qg, k, q_pos, k_pos)), v)  # (n_kv, g, T, hd) f64
        else:
            out = self._attend_tiles(qg, k, v, q_pos, k_pos, tile, pad_to)
        out = np.ascontiguousarray(out.transpose(2, 0, 1, 3), np.float32)  # (n_kv, g, T, hd) -> (T, n_kv, g, hd)
        return out.reshape(T, n_head * hd)                                  # -> (T, n_head * hd), a view

    def scores(self, qg: np.ndarray, k: np.ndarray) -> np.ndarray:
        """qg (n_kv, g, T, hd) or (n_kv, R, hd) (f16 numbers, in q_dtype), k (t, n_kv, hd) -> (n_kv, g, T, t)
        or (n_kv, R, t) f32: each q·k a float64 sum of exact products, rounded once: the same bits in
        any tile, batch or BLAS."""
        s = np.empty((*qg.shape[:-1], k.shape[0]), np.float32)
        qd = qg if qg.dtype == np.float64 else qg.astype(np.float64)  # a subclass's q_dtype
        heads = (slice(None),) + (None,) * (qg.ndim - 3)  # kv head i of k beside qg[i], over its g
        for a, kf in _f64_slices(k, qg.size // qg.shape[-1]):
            s[..., a:a + kf.shape[1]] = np.matmul(qd, kf.transpose(0, 2, 1)[heads])  # (n_kv, g, T, hd) @ (n_kv, 1, hd, c)
        return s

    def values(self, p: np.ndarray, v: np.ndarray, out: np.ndarray) -> np.ndarray:
        """p (n_kv, g, T, t) or (n_kv, R, t) f32 weights, v (t, n_kv, hd), out (n_kv, g, T, hd) or (n_kv, R, hd)
        f64 -> out += f16(p) @ v, summed in float64 a bounded slice of keys at a time."""
        heads = (slice(None),) + (None,) * (p.ndim - 3)  # kv head i of v beside p[i], over its g
        for a, vf in _f64_slices(v, p.size // p.shape[-1]):
            w = to_f16(p[..., a:a + vf.shape[1]]).astype(np.float64)  # (n_kv, g, T, c)
            out += np.matmul(w, vf[heads])                            # (n_kv, g, T, c) @ (n_kv, 1, c, hd) -> (n_kv, g, T, hd)
            del w  # before the next slice's
        return out

    def _scores(self, qg: np.ndarray, k: np.ndarray, q_pos: np.ndarray, k_pos: np.ndarray) -> np.ndarray:
        """Scaled, masked scores of one tile: qg (n_kv, g, T, hd), k (t, n_kv, hd) -> (n_kv, g, T, t) f32."""
        s = self.scores(qg, k)
        # ref: ggml_soft_max_ext(kq, mask, scale): scale first, then add the mask, then softmax.
        s *= score_scale(qg.shape[-1])
        masked = k_pos[None, :] > q_pos[:, None]                    # (T, t)
        if masked.any():  # in place, broadcast over the heads (boolean indexing would build index arrays)
            np.copyto(s, np.float32(-np.inf), where=masked)
        return s

    def _weighted_values(self, p: np.ndarray, v: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        """p (n_kv, g, T, t) f32 weights, v (t, n_kv, hd) -> out += f16(p) @ v, (n_kv, g, T, hd) f64
        (a new one when out is None)."""
        if out is None:
            out = np.zeros((*p.shape[:3], v.shape[-1]), np.float64)
        return self.values(p, v, out)

    def _attend_tiles(self, qg, k, v, q_pos, k_pos, tile: int, pad_to: int | None = None) -> np.ndarray:
        """The keys in tiles of `tile`, with an online softmax (ref: FlashAttention, Dao et al. 2022,
        algorithm 1): per query row a running max m and sum l; the output accumulates exp(s - m) @ V
        and is rescaled by exp(m_old - m_new) whenever the max grows. -> (n_kv, g, T, hd) f64.
        The weights rounded to f16 here are a tile's exp(s - m), not the normalized probabilities of
        the one-tile computation (a row's sum is known only after its last tile): past one tile the
        result equals it within that rounding, about 5e-4 relative, as llama.cpp's flash-attention
        path also differs from its plain one."""
        S = k.shape[0]
        rows = qg.shape[:3]                                          # (n_kv, g, T)
        m = np.full((*rows, 1), -np.inf, np.float32)                 # running max of each row
        l = np.zeros((*rows, 1), np.float64)                         # running sum, in double as ggml's softmax
        acc = np.zeros(qg.shape, np.float64)                         # running exp(s - m) @ V, (n_kv, g, T, hd)
        q_last = q_pos.max()
        for a in range(0, S, tile):
            b = min(a + tile, S)
            if k_pos[a:b].min() > q_last:
                continue  # every key of the tile is after every query: masked out entirely
            kt, vt, pt = k[a:b], v[a:b], k_pos[a:b]
            if pad_to and b == S < pad_to:  # the last tile, on to where it ends for any S of the cell
                kt, vt, pt = _padded(kt, vt, pt, min(a + tile, pad_to) - a)
            s = self._scores(qg, kt, q_pos, pt)                        # (n_kv, g, T, t)
            m_new = np.maximum(m, s.max(axis=-1, keepdims=True))
            m_use = np.where(m_new == -np.inf, np.float32(0), m_new)  # a row that has seen no key yet
            s -= m_use
            np.exp(s, out=s)                                          # masked keys -> 0
            alpha = np.exp(m - m_use)                                 # 0 before the row's first key
            l = l * alpha + s.sum(axis=-1, keepdims=True, dtype=np.float64)
            acc *= alpha
            self._weighted_values(s, vt, out=acc)                 # acc += f16(s) @ V
            m = m_new
            del s  # before the next tile's scores: one tile alive at a time
        return acc / l


_installed: list[Ops] = [Ops()]


def install(ops: Ops) -> Ops:
    """Make `ops` this process's (models built from now on take it); return the one it replaces."""
    old, _installed[0] = _installed[0], ops
    return old


def installed() -> Ops:
    """This process's ops: the numpy reference unless install() set another."""
    return _installed[0]
