"""Qwen2: config, tensor names, the four phases of a layer, vocabulary-slice embedding and LM head.

Pure numpy, float32 throughout. Every weight product goes through common.matmul.matmul
(y = x @ W.T for a quantized W), so a faster kernel can replace it without touching this file.

A layer runs as four phases so a station can hold one phase of one layer at a time
(seed section 2, the fluid-memory invariant); common/layers.py runs them in order:
    attn      attn_norm, q/k/v (+ biases), RoPE, causal GQA, o, residual
    ffn_gate  ffn_norm, silu(gate)            -> FfnState (gate weights may then be evicted)
    ffn_up    act *= up(xn)                   -> FfnState
    ffn_down  h = residual + down(act)

Order of operations mirrors llama.cpp's qwen2 graph (src/llama-model.cpp, llm_build_qwen2) and
ggml's CPU ops where the order changes float32 results; the refs are cited at each place.
Attention rounds as llama.cpp's does (an f16 KV cache, q and the probabilities rounded to f16) and
sums in float64, so its bits do not depend on the CPU's BLAS (attention() below). llama.cpp's Q8
activation quantization is the C kernels' (deploy/kernels), not this file's: docs/fidelity.md.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Sequence

import numpy as np

from common.kvcache import KVCache
from common.matmul import get_attention_kernel, matmul, matmul_many
from common.models.base import MissingTensorError, Model, PhaseWeights, Sequences
from common.quant import QTensor

PHASES = ("attn", "ffn_gate", "ffn_up", "ffn_down")

# GGUF tensor names of each phase, as suffixes of "blk.{layer}.".
# Qwen2 has biases on q/k/v but not on o.
_PHASE_SUFFIXES = {
    "attn": (
        "attn_norm.weight",
        "attn_q.weight", "attn_q.bias",
        "attn_k.weight", "attn_k.bias",
        "attn_v.weight", "attn_v.bias",
        "attn_output.weight",
    ),
    "ffn_gate": ("ffn_norm.weight", "ffn_gate.weight"),
    "ffn_up": ("ffn_up.weight",),
    "ffn_down": ("ffn_down.weight",),
}

# The small 1-D tensors every forward reads (norm weights, biases): whoever holds the layers keeps
# them for life, and streams only the matrices.
_RESIDENT_SUFFIXES = frozenset({"attn_norm.weight", "attn_q.bias", "attn_k.bias", "attn_v.bias", "ffn_norm.weight"})


@dataclass(frozen=True)
class Qwen2Config:
    n_layer: int
    dim: int            # embedding_length
    ffn_dim: int        # feed_forward_length
    n_head: int
    n_kv_head: int
    rope_base: float
    norm_eps: float
    context_length: int
    vocab_size: int

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_head

    @classmethod
    def from_hparams(cls, hp: Mapping) -> "Qwen2Config":
        """From the knot header's hparams (keys as in common/knot.py HPARAM_KEYS)."""
        cfg = cls(
            n_layer=int(hp["block_count"]),
            dim=int(hp["embedding_length"]),
            ffn_dim=int(hp["feed_forward_length"]),
            n_head=int(hp["head_count"]),
            n_kv_head=int(hp["head_count_kv"]),
            rope_base=float(hp["rope_freq_base"]),
            norm_eps=float(hp["rms_eps"]),
            context_length=int(hp["context_length"]),
            vocab_size=int(hp["vocab_size"]),
        )
        if cfg.dim % cfg.n_head or cfg.n_head % cfg.n_kv_head or cfg.head_dim % 2:
            raise ValueError(f"hparams: dim {cfg.dim}, n_head {cfg.n_head}, n_kv_head "
                             f"{cfg.n_kv_head} do not give an even head_dim with whole groups")
        return cfg


def phase_tensors(layer: int, phase: str) -> list[str]:
    """The GGUF names of exactly the tensors `phase` of `layer` reads."""
    if phase not in _PHASE_SUFFIXES:
        raise ValueError(f"unknown phase {phase!r}, expected one of {PHASES}")
    return [f"blk.{layer}.{s}" for s in _PHASE_SUFFIXES[phase]]


def _take(w: Mapping[str, QTensor], layer: int, phase: str) -> list[QTensor]:
    out = []
    for name in phase_tensors(layer, phase):
        t = w.get(name)
        if t is None:
            raise MissingTensorError(phase, layer, name)
        out.append(t)
    return out


def _vec(t: QTensor) -> np.ndarray:
    """A 1-D tensor (norm weight, bias) as float32 (n,)."""
    if t.ggml_type == "F32":  # the usual case: a read-only view, no copy per phase and token
        return t.data.view(np.float32)
    return t.dequantize().reshape(-1).astype(np.float32, copy=False)


# ---------------------------------------------------------------------------- math

def rmsnorm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    """x (T, d) f32 -> (T, d) f32: x * (1/sqrt(mean(x^2) + eps)) * weight.

    In the attention kernel's rmsnorm where there is one: the same bits in one call. Why: in the
    decode loop each of these ~8 numpy calls paid for the code and data the weight product before it
    had evicted (benchmarks/cluster_profile.py --only station)."""
    kern = get_attention_kernel()
    if kern is not None and kern.rmsnorm is not None:
        out = kern.rmsnorm(x, weight, eps)
        if out is not None:
            return out
    # ref: ggml-cpu ops.cpp ggml_compute_forward_rms_norm_f32: the sum of squares is in
    # double, the scale in float, then ggml_mul by the weight as a separate op.
    mean = (np.square(x.astype(np.float64)).sum(axis=-1, keepdims=True) / x.shape[-1])
    scale = (1.0 / np.sqrt(mean.astype(np.float32) + np.float32(eps))).astype(np.float32)
    return (x * scale) * weight


def rope_cos_sin(positions: np.ndarray, head_dim: int, base: float) -> tuple[np.ndarray, np.ndarray]:
    """positions (T,) int -> cos, sin (T, head_dim/2) f32, theta_i = pos * base^(-2i/head_dim)."""
    # Every layer of a forward asks for the same positions: the last answer is kept (read-only).
    key = (np.asarray(positions, dtype=np.int64).tobytes(), head_dim, float(base))
    last = _rope_last[0]  # one read: another thread may replace it meanwhile
    if last is not None and last[0] == key:
        return last[1], last[2]
    # ref: ggml-cpu ops.cpp ggml_rope_cache_init: theta starts at pos and is multiplied by
    # theta_scale = powf(base, -2/n_dims) once per pair, in float32. Mirrored step by step so
    # angles at large positions round as llama.cpp's do.
    theta_scale = np.float32(np.power(np.float32(base), np.float32(-2.0) / np.float32(head_dim)))
    theta = np.asarray(positions, dtype=np.float32).copy()          # (T,)
    thetas = np.empty((theta.shape[0], head_dim // 2), np.float32)  # (T, hd/2)
    for i in range(head_dim // 2):
        thetas[:, i] = theta
        theta = theta * theta_scale
    cos, sin = np.cos(thetas), np.sin(thetas)
    cos.flags.writeable = sin.flags.writeable = False
    _rope_last[0] = (key, cos, sin)
    return cos, sin


_rope_last: list = [None]  # [(key, cos, sin)] of the last call


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


def silu(x: np.ndarray) -> np.ndarray:
    """x / (1 + exp(-x)), float32; in the attention kernel's silu where there is one, the same bits
    in one call (its exp is numpy's loop) instead of four numpy passes."""
    kern = get_attention_kernel()
    if kern is not None and kern.silu is not None:
        out = kern.silu(x)
        if out is not None:
            return out
    return x / (np.float32(1.0) + np.exp(-x))


# Attention runs over the keys in tiles, flash-attention style: an online softmax keeps a running
# max and sum per query row, so its temporaries are the (n_head, T, tile) scores of one tile, not
# (n_head, T, S). A tile's scores take about ATTN_TILE_BYTES; a decode step (T = 1) fits every key
# of a 32k context in one tile, which is exactly the untiled computation.
ATTN_TILE_BYTES = 4 << 20
ATTN_TILE_ALIGN = 64  # tiles start at multiples of this many keys
# The float64 copies of keys, values and float16 probabilities are made this many bytes at a time,
# whatever the tile: float64 sums do not depend on where the keys are cut (below).
ATTN_CONVERT_BYTES = 2 << 20


def attn_tile_keys(n_head: int, T: int) -> int:
    """Keys per tile for T query rows: as many as keep the tile's float32 scores (n_head, T, tile)
    within ATTN_TILE_BYTES; a multiple of ATTN_TILE_ALIGN, and at least that."""
    n = ATTN_TILE_BYTES // (4 * n_head * T)
    return max(ATTN_TILE_ALIGN, n - n % ATTN_TILE_ALIGN)


def _convert_keys(n_kv: int, hd: int, rows: int) -> int:
    """Keys per float64 copy: a key's k or v row (n_kv, hd) in float64, and its scores or
    probabilities of every head and query row (rows = n_head * T): to_f16's float32 result beside
    its float64 copy, or the scores' float64 product, within ATTN_CONVERT_BYTES."""
    return max(1, ATTN_CONVERT_BYTES // (8 * n_kv * hd + 12 * rows))


def attention_bytes(n_head: int, hd: int, T: int, S: int, n_kv: int | None = None) -> int:
    """An upper bound of attention()'s temporaries for T query rows over S keys (any T_i <= T,
    S_i <= S of a batch's sequences, run one after another, stay within it); n_kv: the kv heads
    (None: as many as n_head, an upper bound)."""
    scores = min(4 * n_head * T * S, max(ATTN_TILE_BYTES, 4 * n_head * T * ATTN_TILE_ALIGN))  # one tile
    mask = scores // (4 * n_head)                                # (T, tile) bool
    convert = min(ATTN_CONVERT_BYTES, S * (8 * (n_kv or n_head) * hd + 12 * n_head * T))  # _convert_keys
    # q in float64, the float64 output and one slice's product into it; m, l, alpha per row
    rows = T * n_head * (3 * 8 * hd + 3 * 8)
    return scores + mask + convert + rows + _NUMPY_BUFFER_BYTES


# numpy's casting buffers (8192 elements of the wider type, both ways), e.g. a float32 sum in double.
_NUMPY_BUFFER_BYTES = 2 * 8192 * 8


# llama.cpp's attention (flash attention off) reads an f16 KV cache, rounds q to f16 for K·q and
# the softmax's probabilities to f16 for V·p (ggml's mul_mat converts src1 to the f16 vec_dot_type).
# We round the same values the same way (IEEE round to nearest even, as F16C), so the keys and
# values are f16 numbers (attn_phase_batch rounds them before the cache keeps them) whatever dtype
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


def attention(q: np.ndarray, k: np.ndarray, v: np.ndarray,
              q_pos: np.ndarray, k_pos: np.ndarray, tile: int | None = None) -> np.ndarray:
    """Causal grouped-query attention, tiled over the keys.

    q (T, n_head, hd) f32, k/v (S, n_kv, hd) (any float dtype: the cache's; their values are f16
    numbers), q_pos (T,), k_pos (S,) -> (T, n_head * hd) f32. Query t sees key s iff
    k_pos[s] <= q_pos[t], so chunked prefill, decode and rows at any positions need no other
    bookkeeping than the positions.
    tile: keys per tile (default attn_tile_keys); S <= tile is the one-tile computation.
    The two products run in the registered attention kernel (deploy/kernels/attn.h: the same
    float64 sums in one fixed order, in C) when there is one, else in numpy's float64 matmuls.
    """
    T, n_head, hd = q.shape
    S, n_kv, _ = k.shape
    g = n_head // n_kv  # query heads per kv head: head h reads kv head h // g (ggml broadcast)
    if tile is None:
        tile = attn_tile_keys(n_head, T)
    # the kernels take q in float32 (f16 numbers, exact), numpy's float64 matmul in float64
    kern = get_attention_kernel()
    qg = np.ascontiguousarray(to_f16(q).reshape(T, n_kv, g, hd).transpose(1, 2, 0, 3),
                              np.float32 if kern else np.float64)  # -> (n_kv, g, T, hd)
    if S <= tile:  # softmax(scores) (n_kv, g, T, S), gone once it has weighed the values
        out = _weighted_values(softmax_(_scores(qg, k, q_pos, k_pos, kern)), v, kern=kern)  # (n_kv, g, T, hd) f64
    else:
        out = _attend_tiles(qg, k, v, q_pos, k_pos, tile, kern)
    out = np.ascontiguousarray(out.transpose(2, 0, 1, 3), np.float32)  # (n_kv, g, T, hd) -> (T, n_kv, g, hd), one copy
    return out.reshape(T, n_head * hd)                          # -> (T, n_head * hd), a view


# Up to this many rows of one sequence (a decode step; a speculative verify trip, MAX_DRAFT + 1 in
# common/speculative.py), attention runs one row at a time, each over the keys its decode step
# saw. Why: a batch's softmax and its tiles are those of T rows (a prefill's tiles hold fewer keys
# than a decode's), so a batch's rows need not be the bits each row gives alone, and the next
# layers' Q8 rounding of the activations grew such differences to 0.3-0.56 in a logit of the 1.5B:
# a verified draft must be the token decoding gives, or greedy speculation changes the output at
# near-ties. The matmul kernels, norms and RoPE are row-exact already. Longer prefill chunks keep
# one product.
EXACT_ROWS = 33


def attend_sequence(q: np.ndarray, k: np.ndarray, v: np.ndarray, q_pos: np.ndarray, k_pos: np.ndarray) -> np.ndarray:
    """One sequence's T new rows over its cache, whose last T entries are their own keys:
    q (T, n_head, hd), k/v (S, n_kv, hd), q_pos (T,), k_pos (S,) -> (T, n_head * hd). Up to
    EXACT_ROWS rows appended to a cache that held some already (a verify trip: S > T), row t is
    computed alone over the cache as its decode step saw it (the first S - T + 1 + t entries): the
    same bits as decoding the rows one by one. A prompt's first chunk keeps one product, as the
    llama.cpp oracle tests measured it (docs/fidelity.md). Where the attention kernel has row calls,
    the rows (a decode step's one included) go through them: the same bits, two calls for them all
    (_attend_rows)."""
    T, S = q.shape[0], k.shape[0]
    by_row = T == 1 or (T <= EXACT_ROWS and S != T)  # a decode step, or a verify trip's rows
    out = _attend_rows(q, k, v, q_pos, k_pos) if by_row else None
    if out is not None:
        return out
    if T == 1 or not by_row:  # one row, or a prompt's first chunk (never decoded): one product
        return attention(q, k, v, q_pos, k_pos)
    return np.concatenate([attention(q[t:t + 1], k[:S - T + 1 + t], v[:S - T + 1 + t], q_pos[t:t + 1],
                                     k_pos[:S - T + 1 + t]) for t in range(T)])


def _attend_rows(q: np.ndarray, k: np.ndarray, v: np.ndarray, q_pos: np.ndarray, k_pos: np.ndarray) -> np.ndarray | None:
    """attend_sequence's rows in the attention kernel's row calls, or None where it has none (or
    declines, or a row's keys pass one tile): the bits of attention() of each row alone, with
    numpy's exp and float64 sums of softmax_ between the two calls. Why: a decode row's attention
    was ~40 numpy calls, ~0.1 ms each layer and row of the 0.5B, more than its products took."""
    kern = get_attention_kernel()
    T, n_head, hd = q.shape
    S = k.shape[0]
    if kern is None or kern.row_scores is None or S > attn_tile_keys(n_head, 1):
        return None
    if kern.rows is not None:  # the four steps below in one call, the same bits
        out = kern.rows(q, k, v, q_pos, k_pos, float(score_scale(hd)))
        if out is not None:
            return out
    p = kern.row_scores(q, k, q_pos, k_pos, float(score_scale(hd)))
    if p is None:
        return None
    np.exp(p, out=p)
    sums = kern.row_sums(p, T, S, n_head) if kern.row_sums is not None else None
    if sums is None:
        sums = np.empty((T, n_head), np.float64)
        a = 0
        for t in range(T):  # each row's sums over its own (n_head, n_t) block, as softmax_ sums it alone
            n_t = S - T + 1 + t
            sums[t] = p[a:a + n_head * n_t].reshape(n_head, n_t).sum(axis=-1, dtype=np.float64)
            a += n_head * n_t
    return kern.row_values(p, sums, v)


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


def score_scale(hd: int) -> np.float32:
    """What every score is multiplied by, 1 / sqrt(hd) in float32 (llama.cpp's kq_scale): _scores
    and the kernel's row calls (_attend_rows) take it from here."""
    return np.float32(1.0 / np.sqrt(np.float32(hd)))


def _scores(qg: np.ndarray, k: np.ndarray, q_pos: np.ndarray, k_pos: np.ndarray, kern=None) -> np.ndarray:
    """Scaled, masked scores of one tile: qg (n_kv, g, T, hd) f64 (f16 numbers; float32 for the
    kernel kern), k (t, n_kv, hd) -> (n_kv, g, T, t) f32. Each score is a float64 sum of exact
    products, rounded once to float32: the same bits in any tile, batch or BLAS."""
    n_kv, g, T, hd = qg.shape
    s = kern.scores(qg.reshape(n_kv, g * T, hd), k) if kern else None  # (n_kv, g * T, t), or None
    if s is not None:
        s = s.reshape(n_kv, g, T, k.shape[0])
    else:
        s = np.empty((n_kv, g, T, k.shape[0]), np.float32)
        qd = qg if qg.dtype == np.float64 else qg.astype(np.float64)  # a kernel that declined this cache
        for a, kf in _f64_slices(k, n_kv * g * T):
            s[..., a:a + kf.shape[1]] = np.matmul(qd, kf.transpose(0, 2, 1)[:, None])  # (n_kv, g, T, hd) @ (n_kv, 1, hd, c)
    # ref: ggml_soft_max_ext(kq, mask, scale): scale first, then add the mask, then softmax.
    s *= score_scale(hd)
    masked = k_pos[None, :] > q_pos[:, None]                    # (T, t)
    if masked.any():  # in place, broadcast over the heads (boolean indexing would build index arrays)
        np.copyto(s, np.float32(-np.inf), where=masked)
    return s


def _weighted_values(p: np.ndarray, v: np.ndarray, out: np.ndarray | None = None, kern=None) -> np.ndarray:
    """p (n_kv, g, T, t) f32 weights, v (t, n_kv, hd) -> out += f16(p) @ v, (n_kv, g, T, hd) f64
    (a new one when out is None), summed in float64 a bounded slice of keys at a time (numpy), or
    key by key in order (the kernel kern)."""
    n_kv, g, T, t = p.shape
    if out is None:
        out = np.zeros((n_kv, g, T, v.shape[-1]), np.float64)
    if kern and kern.values(p.reshape(n_kv, g * T, t), v, out.reshape(n_kv, g * T, -1)) is not None:
        return out
    for a, vf in _f64_slices(v, n_kv * g * T):
        w = to_f16(p[..., a:a + vf.shape[1]]).astype(np.float64)  # (n_kv, g, T, c)
        out += np.matmul(w, vf[:, None])                          # (n_kv, g, T, c) @ (n_kv, 1, c, hd) -> (n_kv, g, T, hd)
        del w  # before the next slice's
    return out


def _attend_tiles(qg, k, v, q_pos, k_pos, tile: int, kern=None) -> np.ndarray:
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
        s = _scores(qg, k[a:b], q_pos, k_pos[a:b], kern)         # (n_kv, g, T, t)
        m_new = np.maximum(m, s.max(axis=-1, keepdims=True))
        m_use = np.where(m_new == -np.inf, np.float32(0), m_new)  # a row that has seen no key yet
        s -= m_use
        np.exp(s, out=s)                                          # masked keys -> 0
        alpha = np.exp(m - m_use)                                 # 0 before the row's first key
        l = l * alpha + s.sum(axis=-1, keepdims=True, dtype=np.float64)
        acc *= alpha
        _weighted_values(s, v[a:b], out=acc, kern=kern)           # acc += f16(s) @ V
        m = m_new
        del s  # before the next tile's scores: one tile alive at a time
    return acc / l


# ---------------------------------------------------------------------------- phases

@dataclass
class FfnState:
    """What the FFN carries between its phases, so gate can be evicted before up is loaded."""
    residual: np.ndarray   # (T, dim) the attn phase output, added back by ffn_down
    xn: np.ndarray | None  # (T, dim) ffn_norm(residual); dropped once ffn_up has used it
    act: np.ndarray        # (T, ffn_dim) silu(gate) after ffn_gate, silu(gate) * up after ffn_up


def qkv_after_products(cfg: Qwen2Config, q: np.ndarray, k: np.ndarray, v: np.ndarray, bq: np.ndarray,
                       bk: np.ndarray, bv: np.ndarray, cos: np.ndarray,
                       sin: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """q (N, n_head * hd), k and v (N, n_kv * hd) as their products left them, the biases, cos and sin
    (N, hd/2) -> q with RoPE (N, n_head, hd); k with RoPE and v, f16 numbers as llama.cpp's cache
    (N, n_kv, hd). q, k and v are consumed: the kernels' rope_qkv writes them in place, in one call,
    with numpy's bits, where numpy makes ~35 calls on a decode step's small rows."""
    kern = get_attention_kernel()
    if kern is not None and kern.rope_qkv is not None:
        out = kern.rope_qkv(q, k, v, bq, bk, bv, cos, sin, cfg.n_head, cfg.n_kv_head)
        if out is not None:
            return out
    N, hd = q.shape[0], cfg.head_dim
    q = rope_neox((q + bq).reshape(N, cfg.n_head, hd), cos, sin)              # (N, n_head, hd)
    k = to_f16(rope_neox((k + bk).reshape(N, cfg.n_kv_head, hd), cos, sin))  # (N, n_kv, hd)
    v = to_f16((v + bv).reshape(N, cfg.n_kv_head, hd))                       # (N, n_kv, hd)
    return q, k, v


def attn_phase(cfg: Qwen2Config, layer: int, x: np.ndarray, w: Mapping[str, QTensor],
               kv: KVCache, positions: np.ndarray) -> np.ndarray:
    """x (T, dim) -> x + attn(attn_norm(x)) (T, dim). Appends this chunk's k, v to `kv`."""
    return attn_phase_batch(cfg, layer, x, w, [(kv, positions)])


def attn_phase_batch(cfg: Qwen2Config, layer: int, x: np.ndarray, w: Mapping[str, QTensor],
                     seqs: Sequence[tuple[KVCache, np.ndarray]]) -> np.ndarray:
    """The attn phase of several sequences at once: x (N, dim) holds their rows back to back,
    seqs[i] = (kv_i, positions_i (T_i,)) with sum T_i = N -> (N, dim).

    The weight products run once over all N rows (the weights are read once for every
    sequence: batched decode); RoPE, the KV append and attention stay per sequence. Each row's
    result equals its own attn_phase's: the kernels compute every row independently.
    """
    norm_w, wq, bq, wk, bk, wv, bv, wo = _take(w, layer, "attn")
    N = x.shape[0]
    hd = cfg.head_dim
    pos = [np.asarray(p, dtype=np.int64) for _, p in seqs]
    positions = pos[0] if len(pos) == 1 else np.concatenate(pos)  # (N,)
    assert x.shape == (N, cfg.dim) and positions.shape == (N,), f"{x.shape=} {positions.shape=}"
    xn = rmsnorm(x, _vec(norm_w), cfg.norm_eps)
    # (N, dim) @ Wq.T, Wk.T, Wv.T -> (N, n_head * hd), (N, n_kv * hd), (N, n_kv * hd)
    q, k, v = matmul_many(xn, (wq, wk, wv))
    cos, sin = rope_cos_sin(positions, hd, cfg.rope_base)
    q, k, v = qkv_after_products(cfg, q, k, v, _vec(bq), _vec(bk), _vec(bv), cos, sin)
    outs, a0 = [], 0
    for (kv, _), p in zip(seqs, pos):
        a1 = a0 + p.shape[0]
        k_all, v_all, k_pos = kv.append(layer, k[a0:a1], v[a0:a1], p)  # (S_i, n_kv, hd) x2, (S_i,)
        outs.append(attend_sequence(q[a0:a1], k_all, v_all, p, k_pos))  # (T_i, n_head * hd)
        a0 = a1
    assert a0 == N, f"sequences hold {a0} rows, x has {N}"
    a = outs[0] if len(outs) == 1 else np.concatenate(outs)     # (N, n_head * hd)
    y = matmul(a, wo)                                           # (N, dim) @ Wo.T -> (N, dim); no o bias
    return np.add(x, y, out=y)                                  # x + y, into the product's array


def ffn_gate_phase(cfg: Qwen2Config, layer: int, x: np.ndarray,
                   w: Mapping[str, QTensor]) -> FfnState:
    """x (T, dim) -> FfnState(residual=x, xn=ffn_norm(x), act=silu(xn @ Wg.T) (T, ffn_dim))."""
    norm_w, wg = _take(w, layer, "ffn_gate")
    xn = rmsnorm(x, _vec(norm_w), cfg.norm_eps)
    gate = matmul(xn, wg)                                       # (T, dim) @ Wg.T -> (T, ffn_dim)
    return FfnState(residual=x, xn=xn, act=silu(gate))


def ffn_up_phase(cfg: Qwen2Config, layer: int, st: FfnState,
                 w: Mapping[str, QTensor]) -> FfnState:
    """act = silu(gate) * (xn @ Wu.T), (T, ffn_dim); xn is no longer needed after this."""
    (wu,) = _take(w, layer, "ffn_up")
    assert st.xn is not None, "ffn_up ran twice on the same state"
    up = matmul(st.xn, wu)                                      # (T, dim) @ Wu.T -> (T, ffn_dim)
    # ref: ggml_vec_swiglu_f32: silu(g) * u, the same float32 product as here.
    return FfnState(residual=st.residual, xn=None, act=np.multiply(st.act, up, out=up))


def ffn_down_phase(cfg: Qwen2Config, layer: int, st: FfnState,
                   w: Mapping[str, QTensor]) -> np.ndarray:
    """-> residual + act @ Wd.T, (T, dim)."""
    (wd,) = _take(w, layer, "ffn_down")
    assert st.xn is None, "ffn_down before ffn_up"
    y = matmul(st.act, wd)                                      # (T, ffn_dim) @ Wd.T -> (T, dim)
    return np.add(st.residual, y, out=y)


# ---------------------------------------------------------------------------- vocab slices

def embed(tokens: Sequence[int] | np.ndarray, token_embd_rows: QTensor,
          vocab_start: int, vocab_end: int) -> np.ndarray:
    """tokens (T,) -> (T, dim) f32; token_embd_rows holds rows [vocab_start, vocab_end).

    Tokens outside the slice give all-zero rows, so the sum over disjoint slices that cover
    the vocabulary is the full lookup (seed section 3).
    """
    tokens = np.asarray(tokens, dtype=np.int64).reshape(-1)
    dim = token_embd_rows.row_len
    if token_embd_rows.n_rows != vocab_end - vocab_start:
        raise ValueError(f"{token_embd_rows.name}: {token_embd_rows.n_rows} rows for slice "
                         f"[{vocab_start}, {vocab_end})")
    out = np.zeros((tokens.shape[0], dim), np.float32)          # (T, dim), zero = "not my token"
    for i, t in enumerate(tokens):
        if vocab_start <= t < vocab_end:
            r = int(t) - vocab_start
            out[i] = token_embd_rows.rows(r, r + 1).dequantize().reshape(dim)
    return out


def output_norm(cfg: Qwen2Config, h: np.ndarray, norm_w: QTensor) -> np.ndarray:
    """h (T, dim) -> (T, dim), the final RMSNorm before the LM head."""
    return rmsnorm(h, _vec(norm_w), cfg.norm_eps)


def lm_head(h: np.ndarray, output_rows: QTensor) -> np.ndarray:
    """h (T, dim), already output-normed -> logits (T, n_rows) for the rows' vocabulary slice.

    Concatenating the slices in vocabulary order gives the full head.
    """
    return matmul(h, output_rows)                               # (T, dim) @ W.T -> (T, n_rows)


# ---------------------------------------------------------------------------- the registry's entry

class Qwen2(Model):
    architecture = "qwen2"
    phases = PHASES
    cfg: Qwen2Config

    @classmethod
    def from_hparams(cls, hparams: Mapping) -> "Qwen2":
        return cls(Qwen2Config.from_hparams(hparams))

    def phase_tensors(self, layer: int, phase: str) -> list[str]:
        return phase_tensors(layer, phase)

    def is_resident(self, name: str) -> bool:
        return name == self.OUTPUT_NORM or (name.startswith("blk.") and name.split(".", 2)[-1] in _RESIDENT_SUFFIXES)

    def activation_bytes(self, T: int, S: int) -> int:
        # Everything alive while a phase runs, the state it received included (measured against
        # tracemalloc in tests/unit/test_attention.py), plus the C kernels' quantized copy of a
        # matmul's input (at most 2.25 B per element; malloc'd, so tracemalloc cannot see it).
        c = self.cfg
        kvd = c.n_kv_head * c.head_dim
        # x, normed x, q, k, v, RoPE's halves, the attention output, the o product and the sum
        attn = 4 * T * (7 * c.dim + 4 * kvd) + attention_bytes(c.n_head, c.head_dim, T, S, c.n_kv_head)
        ffn = 4 * T * (2 * c.dim + 3 * c.ffn_dim)  # residual, normed x, act, and two (T, ffn_dim) temporaries
        norm = 4 * T * c.dim + 16 * T * c.dim      # x, and rmsnorm's float64 copy and its square
        return 3 * T * max(c.dim, c.ffn_dim) + max(attn, ffn, norm) + _NUMPY_BUFFER_BYTES

    def run_phase(self, layer: int, phase: str, state, w: PhaseWeights, seqs: Sequences):
        if phase == "attn":
            return attn_phase_batch(self.cfg, layer, state, w, seqs)
        if phase == "ffn_gate":
            return ffn_gate_phase(self.cfg, layer, state, w)
        if phase == "ffn_up":
            return ffn_up_phase(self.cfg, layer, state, w)
        if phase == "ffn_down":
            return ffn_down_phase(self.cfg, layer, state, w)
        raise ValueError(f"unknown phase {phase!r}, expected one of {PHASES}")

    def embed(self, tokens, rows: QTensor, vocab_start: int, vocab_end: int) -> np.ndarray:
        return embed(tokens, rows, vocab_start, vocab_end)

    def final_norm(self, h: np.ndarray, norm_w: QTensor) -> np.ndarray:
        return output_norm(self.cfg, h, norm_w)

    def lm_head(self, h: np.ndarray, rows: QTensor) -> np.ndarray:
        return lm_head(h, rows)
