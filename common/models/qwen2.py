"""Qwen2: config, tensor names, the four phases of a layer, vocabulary-slice embedding and LM head.

The math reads as the model: every op (weight products, rmsnorm, RoPE, attention, silu) is one
call on `ops`, the common.ops.Ops the model was built with: numpy's reference, or a subclass with
the same bits (deploy.kernels.KernelOps, C). This file never asks which one runs.

A layer runs as four phases so a station can hold one phase of one layer at a time
(seed section 2, the fluid-memory invariant); common/layers.py runs them in order:
    attn      attn_norm, q/k/v (+ biases), RoPE, causal GQA, o, residual
    ffn_gate  ffn_norm, silu(gate)            -> FfnState (gate weights may then be evicted)
    ffn_up    act *= up(xn)                   -> FfnState
    ffn_down  h = residual + down(act)

Order of operations mirrors llama.cpp's qwen2 graph (src/llama-model.cpp, llm_build_qwen2) and
ggml's CPU ops where the order changes float32 results (common/ops.py cites them). Attention
rounds as llama.cpp's does (an f16 KV cache, q and the probabilities rounded to f16) and sums in
float64, so its bits do not depend on the CPU's BLAS. llama.cpp's Q8 activation quantization is
the C kernels' (deploy/kernels), not numpy's: docs/fidelity.md.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Sequence

import numpy as np

from common.kvcache import KVCache
from common.models.base import MissingTensorError, Model, PhaseWeights, Sequences
from common.ops import NUMPY_BUFFER_BYTES, Ops, attention_bytes
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


# ---------------------------------------------------------------------------- phases

@dataclass
class FfnState:
    """What the FFN carries between its phases, so gate can be evicted before up is loaded."""
    residual: np.ndarray   # (T, dim) the attn phase output, added back by ffn_down
    xn: np.ndarray | None  # (T, dim) ffn_norm(residual); dropped once ffn_up has used it
    act: np.ndarray        # (T, ffn_dim) silu(gate) after ffn_gate, silu(gate) * up after ffn_up


def attn_phase(ops: Ops, cfg: Qwen2Config, layer: int, x: np.ndarray, w: Mapping[str, QTensor],
               kv: KVCache, positions: np.ndarray) -> np.ndarray:
    """x (T, dim) -> x + attn(attn_norm(x)) (T, dim). Appends this chunk's k, v to `kv`."""
    return attn_phase_batch(ops, cfg, layer, x, w, [(kv, positions)])


def attn_phase_batch(ops: Ops, cfg: Qwen2Config, layer: int, x: np.ndarray, w: Mapping[str, QTensor],
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
    xn = ops.rmsnorm(x, _vec(norm_w), cfg.norm_eps)
    # (N, dim) @ Wq.T, Wk.T, Wv.T -> (N, n_head * hd), (N, n_kv * hd), (N, n_kv * hd)
    q, k, v = ops.matmul_many(xn, (wq, wk, wv))
    cos, sin = rope_cos_sin(positions, hd, cfg.rope_base)
    # -> q (N, n_head, hd), k and v (N, n_kv, hd): biases, RoPE, k and v rounded to f16 for the cache
    q, k, v = ops.rope_qkv(q, k, v, _vec(bq), _vec(bk), _vec(bv), cos, sin, cfg.n_head, cfg.n_kv_head)
    outs, a0 = [], 0
    for (kv, _), p in zip(seqs, pos):
        a1 = a0 + p.shape[0]
        k_all, v_all, k_pos = kv.append(layer, k[a0:a1], v[a0:a1], p)  # (S_i, n_kv, hd) x2, (S_i,)
        outs.append(ops.attention(q[a0:a1], k_all, v_all, p, k_pos))  # (T_i, n_head * hd)
        a0 = a1
    assert a0 == N, f"sequences hold {a0} rows, x has {N}"
    a = outs[0] if len(outs) == 1 else np.concatenate(outs)     # (N, n_head * hd)
    y = ops.matmul(a, wo)                                       # (N, dim) @ Wo.T -> (N, dim); no o bias
    return np.add(x, y, out=y)                                  # x + y, into the product's array


def ffn_gate_phase(ops: Ops, cfg: Qwen2Config, layer: int, x: np.ndarray,
                   w: Mapping[str, QTensor]) -> FfnState:
    """x (T, dim) -> FfnState(residual=x, xn=ffn_norm(x), act=silu(xn @ Wg.T) (T, ffn_dim))."""
    norm_w, wg = _take(w, layer, "ffn_gate")
    xn = ops.rmsnorm(x, _vec(norm_w), cfg.norm_eps)
    gate = ops.matmul(xn, wg)                                   # (T, dim) @ Wg.T -> (T, ffn_dim)
    return FfnState(residual=x, xn=xn, act=ops.silu(gate))


def ffn_up_phase(ops: Ops, cfg: Qwen2Config, layer: int, st: FfnState,
                 w: Mapping[str, QTensor]) -> FfnState:
    """act = silu(gate) * (xn @ Wu.T), (T, ffn_dim); xn is no longer needed after this."""
    (wu,) = _take(w, layer, "ffn_up")
    assert st.xn is not None, "ffn_up ran twice on the same state"
    up = ops.matmul(st.xn, wu)                                  # (T, dim) @ Wu.T -> (T, ffn_dim)
    # ref: ggml_vec_swiglu_f32: silu(g) * u, the same float32 product as here.
    return FfnState(residual=st.residual, xn=None, act=np.multiply(st.act, up, out=up))


def ffn_down_phase(ops: Ops, cfg: Qwen2Config, layer: int, st: FfnState,
                   w: Mapping[str, QTensor]) -> np.ndarray:
    """-> residual + act @ Wd.T, (T, dim)."""
    (wd,) = _take(w, layer, "ffn_down")
    assert st.xn is None, "ffn_down before ffn_up"
    y = ops.matmul(st.act, wd)                                  # (T, ffn_dim) @ Wd.T -> (T, dim)
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


def output_norm(ops: Ops, cfg: Qwen2Config, h: np.ndarray, norm_w: QTensor) -> np.ndarray:
    """h (T, dim) -> (T, dim), the final RMSNorm before the LM head."""
    return ops.rmsnorm(h, _vec(norm_w), cfg.norm_eps)


def lm_head(ops: Ops, h: np.ndarray, output_rows: QTensor) -> np.ndarray:
    """h (T, dim), already output-normed -> logits (T, n_rows) for the rows' vocabulary slice.

    Concatenating the slices in vocabulary order gives the full head.
    """
    return ops.matmul(h, output_rows)                           # (T, dim) @ W.T -> (T, n_rows)


# ---------------------------------------------------------------------------- the registry's entry

class Qwen2(Model):
    architecture = "qwen2"
    phases = PHASES
    cfg: Qwen2Config

    @classmethod
    def from_hparams(cls, hparams: Mapping, ops: Ops | None = None) -> "Qwen2":
        return cls(Qwen2Config.from_hparams(hparams), ops)

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
        return 3 * T * max(c.dim, c.ffn_dim) + max(attn, ffn, norm) + NUMPY_BUFFER_BYTES

    def run_phase(self, layer: int, phase: str, state, w: PhaseWeights, seqs: Sequences):
        if phase == "attn":
            return attn_phase_batch(self.ops, self.cfg, layer, state, w, seqs)
        if phase == "ffn_gate":
            return ffn_gate_phase(self.ops, self.cfg, layer, state, w)
        if phase == "ffn_up":
            return ffn_up_phase(self.ops, self.cfg, layer, state, w)
        if phase == "ffn_down":
            return ffn_down_phase(self.ops, self.cfg, layer, state, w)
        raise ValueError(f"unknown phase {phase!r}, expected one of {PHASES}")

    def embed(self, tokens, rows: QTensor, vocab_start: int, vocab_end: int) -> np.ndarray:
        return embed(tokens, rows, vocab_start, vocab_end)

    def final_norm(self, h: np.ndarray, norm_w: QTensor) -> np.ndarray:
        return output_norm(self.ops, self.cfg, h, norm_w)

    def lm_head(self, h: np.ndarray, rows: QTensor) -> np.ndarray:
        return lm_head(self.ops, h, rows)