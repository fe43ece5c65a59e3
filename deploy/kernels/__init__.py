"""Matmul kernels that compute on the quantized blocks (the C extension `_qmatmul`), and the other
ops of a forward in C (KernelOps: attention's products in float64, rmsnorm, RoPE, silu).

`install()` makes KernelOps the process's common.ops: models built from then on compute with it,
the matmuls of the types it supports on their quantized blocks included. The extension is
optional: when it was not built, install() logs why and installs nothing, and everything stays on
numpy's reference (common.ops.Ops).

Numerics follow llama.cpp's CPU path: each activation row is quantized to Q8_0 (Q4_0, Q5_0,
Q8_0 weights) or Q8_K (Q4_K, Q6_K), then integer block dot products are scaled per block.

One build runs on any x86-64: the extension picks, at import, the best kernels the CPU runs
(isas(): "scalar", "avx2", "avx512"), and every one gives the same bits. KNOT_KERNELS chooses:
    auto (or unset)         the best one
    scalar | avx2 | avx512  that one (an error at start if the CPU does not run it)
    off | numpy             the numpy reference path, no C at all
"""
from __future__ import annotations

import functools
import logging
import os
from typing import Callable, Mapping, Sequence

import numpy as np

from common import settings
from common import ops
from common.ops import Ops, attn_tile_keys, score_scale
from common.quant import QTensor
from deploy.machine import usable_cpus

log = logging.getLogger(__name__)

try:
    from deploy.kernels import _qmatmul
    UNAVAILABLE_REASON = ""
except ImportError as e:  # not built: no compiler, or the optional build failed
    _qmatmul = None
    UNAVAILABLE_REASON = f"C extension deploy.kernels._qmatmul not built ({e})"

KERNELS_ENV = "KNOT_KERNELS"
OFF_VALUES = ("off", "0", "no", "numpy")
THREADS_ENV = "KNOT_THREADS"
SPIN_ENV = "KNOT_SPIN_US"
_install_attempted = False  # install() ran once in this process (ensure_installed's flag)


def available() -> bool:
    return _qmatmul is not None


def supported_types() -> list[str]:
    """ggml type names the extension has kernels for ([] when it is not built)."""
    return sorted(_qmatmul.TYPES) if _qmatmul else []


def threads_from_env(env: Mapping[str, str]) -> int:
    """KNOT_THREADS, default: the CPUs this process may run on (ConfigError, a ValueError, when invalid)."""
    n = settings.read(env, THREADS_ENV, "kernels")
    if n is None:
        return usable_cpus()
    return n


def spin_us_from_env(env: Mapping[str, str]) -> float | None:
    """KNOT_SPIN_US: how long an idle pool worker spins before it sleeps, in microseconds
    (None: the pool's 1,000).

    Why it matters: one process alone wants its workers hot between back-to-back matmuls, but
    13 services sharing 2 cores lose a core for that long after every forward."""
    return settings.read(env, SPIN_ENV, "kernels")


# kernel(x (T, ne0) float32, w with numpy shape (ne1, ne0)) -> (T, ne1) float32
Kernel = Callable[[np.ndarray, QTensor], np.ndarray]


def make_kernel(ggml_type: str, simd: bool = True, parallel: bool = True) -> Kernel:
    """kernel(x (T, ne0) float32, w (ne1, ne0) of ggml_type) -> (T, ne1) float32.

    simd=False runs the portable reference code, parallel=False the caller's thread only;
    both give the same bits as the defaults (tests check it)."""
    type_id = _qmatmul.TYPES[ggml_type]

    def kernel(x: np.ndarray, w: QTensor) -> np.ndarray:
        ne0, ne1 = w.shape
        x = np.ascontiguousarray(x, np.float32)
        y = np.empty((len(x), ne1), np.float32)
        _qmatmul.matmul(type_id, x, _blocks(w), y, len(x), ne0, ne1, simd, parallel)  # (T, ne0) @ W.T -> (T, ne1)
        return y

    kernel.__name__ = f"qmatmul_{ggml_type}"
    return kernel


def _blocks(w: QTensor):
    """w's raw blocks as the extension reads them: one C-contiguous buffer (a strided view is copied)."""
    data = w.data
    if isinstance(data, np.ndarray) and not data.flags.c_contiguous:
        data = np.ascontiguousarray(data)
    return data


@functools.lru_cache(maxsize=None)
def _make_many(simd: bool, parallel: bool):
    """many(x (T, ne0) float32, ws) -> [x @ W.T for W in ws] in one call (x quantized once per activation
    format, one parallel pass), each the bits of its own kernel call; None for what it does not take
    (more than MANY_MAX products, a type without a kernel)."""

    def many(x: np.ndarray, ws) -> list[np.ndarray] | None:
        if not 1 <= len(ws) <= MANY_MAX or any(w.ggml_type not in _qmatmul.TYPES for w in ws):
            return None
        x = np.ascontiguousarray(x, np.float32)
        T, ne0 = x.shape
        ys = [np.empty((T, w.shape[1]), np.float32) for w in ws]
        products = [(_qmatmul.TYPES[w.ggml_type], _blocks(w), y, w.shape[1]) for w, y in zip(ws, ys)]
        _qmatmul.matmul_many(x, T, ne0, products, simd, parallel)
        return ys

    return many


MANY_MAX = 8  # products per matmul_many call (_qmatmul.c MM_MANY_MAX)


def numpy_exp_loop() -> bool:
    """Hand the extension np.exp's float32 loop (ufunc._get_strided_loop, numpy >= 1.24), once per
    process; False where numpy has no such API. The fused calls (silu, a sequence's attention rows)
    run it, so their exp is numpy's bits on this CPU (its SIMD polynomial, or libm's expf)."""
    if _exp_loop:
        return _exp_loop[0]
    try:
        f32 = np.dtype(np.float32)
        _, call_info = np.exp._resolve_dtypes_and_context((f32, f32))
        np.exp._get_strided_loop(call_info, fixed_strides=(4, 4))
        _qmatmul.set_exp_loop(call_info)
        ok = True
    except Exception as e:  # a private API: an older or newer numpy, or a loop that needs the GIL
        # not a fallback in the numbers: the unfused path computes the same bits, in more calls
        log.info("no fused silu and attention rows: numpy gives no exp loop (%s: %s)", type(e).__name__, e)
        ok = False
    _exp_loop.append(ok)
    return ok


_exp_loop: list[bool] = []


# what the attention kernels take (attn.h): float32 or float16 caches, head dims a multiple of 16 up to 256
ATTN_HEAD_DIMS = range(16, 257, 16)
ATTN_KV_DTYPES = (np.dtype(np.float32), np.dtype(np.float16))
# The longest row whose float64 sum the kernels give numpy's bits for: numpy casts a float32 row to
# float64 in buffers of this many values (NPY_BUFSIZE) and sums a longer row buffer by buffer.
ROW_SUMS_MAX = 8192


class KernelOps(Ops):
    """common.ops.Ops with the C kernels: attention's products (attn.h, the float64 sums of numpy's
    matmuls in one fixed order on every ISA, thread count and batch), rmsnorm, RoPE and silu, each
    with the reference's bits. Each method takes what the kernels take (a float32 or float16 cache,
    head dims a multiple of 16 up to 256, float32 C-contiguous arrays) and hands anything else to
    the numpy reference (super()). The matmuls route by ggml type in common.matmul (install()).

    simd=False runs the portable reference C, parallel=False the caller's thread only; both give
    the same bits as the defaults (tests check it)."""

    kv_dtype = np.dtype(np.float16)  # the kernels read it as fast as float32, in half the bytes
    q_dtype = np.dtype(np.float32)   # scores() takes q as float32 (f16 numbers, exact)
    quantized_types = frozenset(_qmatmul.TYPES) if _qmatmul else frozenset()

    def __init__(self, simd: bool = True, parallel: bool = True):
        self.simd, self.parallel = simd, parallel
        # the fused calls (silu, a sequence's attention rows) run numpy's exp loop, so its bits
        self.fused = numpy_exp_loop()

    def matmul(self, x: np.ndarray, w: QTensor) -> np.ndarray:
        if (w.ggml_type not in self.quantized_types or len(w.shape) != 2 or x.dtype != np.float32
                or x.ndim not in (1, 2) or x.shape[-1] != w.shape[0]):
            return super().matmul(x, w)  # float32 weights (BLAS), and the reference's errors
        ne0, ne1 = w.shape
        x2 = np.ascontiguousarray(x.reshape(-1, ne0))
        y = np.empty((len(x2), ne1), np.float32)
        _qmatmul.matmul(_qmatmul.TYPES[w.ggml_type], x2, _blocks(w), y, len(x2), ne0, ne1,
                        self.simd, self.parallel)  # (T, ne0) @ W.T -> (T, ne1)
        return y[0] if x.ndim == 1 else y

    def matmul_many(self, x: np.ndarray, ws: Sequence[QTensor]) -> list[np.ndarray]:
        # Why one call: a layer's q, k and v of one decode row were three calls, each paying the
        # wrapper and waking the workers, for small products.
        if x.ndim == 2 and x.dtype == np.float32 and all(len(w.shape) == 2 and w.shape[0] == x.shape[1] for w in ws):
            ys = _make_many(self.simd, self.parallel)(x, ws)
            if ys is not None:
                return ys
        return super().matmul_many(x, ws)

    def rmsnorm(self, x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
        # Why in C: in the decode loop each of numpy's ~8 calls paid for the code and data the weight
        # product before it had evicted (benchmarks/cluster_profile.py --only station).
        if (x.dtype != np.float32 or weight.dtype != np.float32 or x.ndim != 2 or weight.shape != (x.shape[1],)
                or not x.flags.c_contiguous or not weight.flags.c_contiguous):
            return super().rmsnorm(x, weight, eps)
        out = np.empty(x.shape, np.float32)
        _qmatmul.rms_norm(x, weight, out, x.shape[0], x.shape[1], float(eps))  # (T, d) -> (T, d)
        return out

    def silu(self, x: np.ndarray) -> np.ndarray:
        if not self.fused or x.dtype != np.float32 or not x.flags.c_contiguous:
            return super().silu(x)
        out = np.empty(x.shape, np.float32)
        _qmatmul.silu(x, out, x.size)
        return out

    def rope_qkv(self, q: np.ndarray, k: np.ndarray, v: np.ndarray, bq: np.ndarray, bk: np.ndarray,
                 bv: np.ndarray, cos: np.ndarray, sin: np.ndarray, n_head: int,
                 n_kv: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        # one call, in place, where numpy makes ~35 calls on a decode step's small rows
        N, hd = q.shape[0], cos.shape[-1] * 2
        arrays = (q, k, v, bq, bk, bv, cos, sin)
        if (any(a.dtype != np.float32 or not a.flags.c_contiguous for a in arrays)
                or not all(a.flags.writeable for a in (q, k, v))  # written in place
                or q.shape != (N, n_head * hd) or k.shape != (N, n_kv * hd) or v.shape != (N, n_kv * hd)
                or cos.shape != (N, hd // 2) or sin.shape != (N, hd // 2)
                or np.may_share_memory(q, k) or np.may_share_memory(q, v) or np.may_share_memory(k, v)):
            return super().rope_qkv(q, k, v, bq, bk, bv, cos, sin, n_head, n_kv)
        _qmatmul.rope_qkv(q, k, v, bq, bk, bv, cos, sin, N, n_head, n_kv, hd)  # sizes checked there
        return q.reshape(N, n_head, hd), k.reshape(N, n_kv, hd), v.reshape(N, n_kv, hd)

    # ------------------------------------------------------------------ attention

    def _takes(self, q: np.ndarray, kv: np.ndarray) -> bool:
        return kv.dtype in ATTN_KV_DTYPES and q.shape[-1] in ATTN_HEAD_DIMS and kv.ndim == 3

    def scores(self, qg: np.ndarray, k: np.ndarray) -> np.ndarray:
        n_kv, hd = qg.shape[0], qg.shape[-1]
        if not self._takes(qg, k) or qg.dtype != np.float32 or k.shape[1:] != (n_kv, hd):
            return super().scores(qg, k)
        S = k.shape[0]
        out = np.empty((*qg.shape[:-1], S), np.float32)
        _qmatmul.attn_scores(np.ascontiguousarray(qg), np.ascontiguousarray(k), out, n_kv, qg.size // (n_kv * hd), S,
                             hd, self.simd, self.parallel, k.dtype == np.float16)
        return out  # (n_kv, g, T, S)

    def values(self, p: np.ndarray, v: np.ndarray, out: np.ndarray) -> np.ndarray:
        n_kv, S, hd = p.shape[0], p.shape[-1], out.shape[-1]
        if (not self._takes(out, v) or p.dtype != np.float32 or v.shape != (S, n_kv, hd)
                or out.shape != (*p.shape[:-1], hd) or out.dtype != np.float64
                or not out.flags.c_contiguous):  # out is written in place
            return super().values(p, v, out)
        _qmatmul.attn_values(np.ascontiguousarray(p), np.ascontiguousarray(v), out, n_kv, p.size // (n_kv * S), S, hd,
                             self.simd, self.parallel, v.dtype == np.float16)
        return out  # (n_kv, g, T, hd) f64, += f16(p) @ v

    def attend_rows(self, q: np.ndarray, k: np.ndarray, v: np.ndarray, q_pos: np.ndarray,
                    k_pos: np.ndarray) -> np.ndarray:
        """The rows in the kernels' row calls, the bits of attend() of each row alone: one fused call
        (scores, numpy's exp loop, sums, values), or two around numpy's exp with the sums between.
        Why: a decode row's attention was ~40 numpy calls, more than its products took. Past one
        tile of a row's keys (attend() goes tile by tile) the reference serves."""
        T, n_head, hd = q.shape
        S, n_kv = k.shape[:2]
        if (not self._takes(q, k) or q.dtype != np.float32 or k.shape[2] != hd or v.shape != k.shape
                or v.dtype != k.dtype or n_head % n_kv or not 1 <= T <= S or S > attn_tile_keys(n_head, 1)):
            return super().attend_rows(q, k, v, q_pos, k_pos)
        scale = float(score_scale(hd))
        q, k, v = np.ascontiguousarray(q), np.ascontiguousarray(k), np.ascontiguousarray(v)
        q_pos, k_pos = np.ascontiguousarray(q_pos, np.int64), np.ascontiguousarray(k_pos, np.int64)
        out = np.empty((T, n_head * hd), np.float32)
        if self.fused and S <= ROW_SUMS_MAX:
            _qmatmul.attn_rows(q, k, v, q_pos, k_pos, out, n_kv, n_head, T, S, hd, scale, self.simd, self.parallel,
                               k.dtype == np.float16)
            return out
        p = np.empty(n_head * (T * (S - T + 1) + T * (T - 1) // 2), np.float32)  # row t: (n_head, S - T + 1 + t)
        _qmatmul.attn_rows_scores(q, k, q_pos, k_pos, p, n_kv, n_head, T, S, hd, scale, self.simd, self.parallel,
                                  k.dtype == np.float16)  # f16(q)·k, times scale, -inf where masked, less the row's max
        np.exp(p, out=p)
        _qmatmul.attn_rows_values(p, self.row_sums(p, T, S, n_head), v, out, n_kv, n_head, T, S, hd,
                                  self.simd, self.parallel, v.dtype == np.float16)  # each row / its sum, f16, @ v
        return out

    def row_sums(self, p: np.ndarray, T: int, S: int, n_head: int) -> np.ndarray:
        """p: T rows' scores after exp, row t's (n_head, n_t) block after the one before, n_t = S - T + 1 + t
        -> (T, n_head) float64, the bits of numpy's float64 sum of each row's block (in C up to
        ROW_SUMS_MAX keys, whose sums numpy makes in one buffer)."""
        sums = np.empty((T, n_head), np.float64)
        if p.dtype == np.float32 and p.ndim == 1 and p.flags.c_contiguous and S <= ROW_SUMS_MAX:
            _qmatmul.attn_row_sums(p, sums, T, S, n_head)  # p's length checked there
            return sums
        p, a = p.reshape(-1), 0
        for t in range(T):  # each row's sums over its own (n_head, n_t) block, as softmax_ sums it alone
            n_t = S - T + 1 + t
            sums[t] = p[a:a + n_head * n_t].reshape(n_head, n_t).sum(axis=-1, dtype=np.float64)
            a += n_head * n_t
        return sums


def isas() -> list[str]:
    """The kernel sets this build has and this CPU runs, worst to best ([] when not built)."""
    return list(_qmatmul.ISAS) if _qmatmul else []


def get_isa() -> str:
    return _qmatmul.get_isa()


def set_isa(name: str) -> None:
    """Run the kernels of one ISA from now on (ValueError when not built or not runnable here)."""
    _qmatmul.set_isa(name)


def isa_from_env(env: Mapping[str, str]) -> str | None:
    """KNOT_KERNELS as an ISA name: None for the numpy path, else one of isas() (auto: the best).
    ConfigError (a ValueError) for an ISA this machine does not run."""
    choice = settings.read(env, KERNELS_ENV, "kernels")
    if choice in OFF_VALUES:
        return None
    if choice == "auto":
        return isas()[-1] if _qmatmul else None
    if choice not in isas():
        raise settings.ConfigError(f"Config {KERNELS_ENV!r}={choice!r}: this machine runs "
                                   f"{', '.join(['auto', *isas(), 'off'])}"
                                   + ("" if _qmatmul else f" ({UNAVAILABLE_REASON})"), name=KERNELS_ENV)
    return choice


def describe() -> str:
    """e.g. "avx512 kernels, 2 threads" (the ISA chosen at run time)."""
    return f"{_qmatmul.get_isa()} kernels, {_qmatmul.get_threads()} threads" if _qmatmul else UNAVAILABLE_REASON


def set_threads(n: int) -> None:
    """Threads per matmul, the calling thread included."""
    _qmatmul.set_threads(n)


def one_blas_thread() -> bool:
    """Run numpy's BLAS (attention's matmuls) on one thread in this process; False when threadpoolctl
    is missing (Pyodide has no threads to limit).

    Why: OpenBLAS's result depends on its thread count. On an AVX2 Zen 1, the 1.5B's greedy tokens
    from one process with 2 BLAS threads parted from the cluster's (whose services run one) at token
    42 of a HumanEval prompt; with one thread both gave the same. Every process that installs the
    kernels (the services, the CLI, the tests, LocalEngine's first use) now computes attention alike,
    and the kernels' own pool is what uses the cores."""
    try:
        from threadpoolctl import threadpool_limits
    except ImportError:
        return False
    threadpool_limits(1, user_api="blas")
    return True


def install(threads: int | None = None, env: Mapping[str, str] = os.environ) -> list[str]:
    """Install the C kernels' ops (KernelOps) for models built from now on; return the ggml types
    whose matmuls they compute ([] if not built, or off).

    threads: per matmul, the caller included (default: KNOT_THREADS, else the CPU count).
    KNOT_KERNELS picks the ISA (see the module doc); off keeps the numpy reference path (what
    Cloudflare's Python Workers run)."""
    global _install_attempted
    _install_attempted = True
    one_blas_thread()
    isa = isa_from_env(env)
    if isa is None:
        log.info("matmul stays on numpy: %s", f"{KERNELS_ENV} is off" if _qmatmul else UNAVAILABLE_REASON)
        return []
    _qmatmul.set_isa(isa)
    spin = spin_us_from_env(env)
    n = threads if threads is not None else threads_from_env(env)
    _qmatmul.set_threads(n) if spin is None else _qmatmul.set_threads(n, spin)
    ops.install(KernelOps())
    log.info("C kernels (%s): matmul of %s; attention, rmsnorm, RoPE and silu", describe(),
             ", ".join(supported_types()))
    return supported_types()


def ensure_installed(env: Mapping[str, str] = os.environ) -> None:
    """install() unless this process already ran it (the CLI does at start; a library user of
    LocalEngine has not). Why: without it matmul silently runs the numpy reference, whose float32
    products differ from the kernels' Q8-quantized activations by up to ~0.1 in a logit, so the
    same prompt through `knot generate`, the cluster and a script would pick different tokens at
    near-ties (issue 15). An explicit uninstall() after the first install is left alone."""
    if not _install_attempted:
        install(env=env)


def uninstall() -> None:
    """Install numpy's reference ops (common.ops.Ops) again, for models built from now on."""
    ops.install(Ops())
