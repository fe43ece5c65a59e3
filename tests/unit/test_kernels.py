"""deploy.kernels (the C extension _qmatmul): matmul on the quantized blocks, as llama.cpp's CPU path.

Three kinds of proof:
- exact: the activation quantization (Q8_0 / Q8_K) and the whole product equal a pure-numpy
  emulation of the same integer block dot products and float32 operations, bit for bit;
- invariance: each ISA's kernels this CPU runs (avx512, avx2, each chosen explicitly) equal the
  portable C reference, any thread count equals one thread, and a T-token call equals T
  one-token calls, bit for bit;
- closeness: against the numpy reference x @ dequantize(W).T, the error stays within the
  bound of the activation's rounding to 8 bits: sum_i |w_i| * (half a quantization step of x_i).
"""
from __future__ import annotations

import os

import numpy as np
import pytest

from common import matmul as mm
from common import ops, settings
from common.ops import Ops
from common.quant import QUANT_TYPES, QTensor
from deploy import kernels
from tests.unit.test_quant import random_raw

# Skipped where the extension did not build (it is optional: numpy serves matmul); a failure under
# CI=true (tests/conftest.py, needs_kernels).
pytestmark = pytest.mark.needs_kernels
_qmatmul = kernels._qmatmul

TYPES = ["Q4_0", "Q5_0", "Q8_0", "Q4_K", "Q6_K"]
K_TYPES = {"Q4_K", "Q6_K"}  # activations quantized to Q8_K; the others to Q8_0
f32 = np.float32


@pytest.fixture(autouse=True)
def _threads():
    kernels.set_threads(2)  # two threads even on a one-CPU machine: the split is what is tested
    yield
    kernels.uninstall()


@pytest.fixture(params=kernels.isas())
def isa(request):
    """Each kernel set this CPU runs, chosen explicitly (the import took the best one)."""
    best = kernels.get_isa()
    kernels.set_isa(request.param)
    yield request.param
    kernels.set_isa(best)


def qtensor(ggml_type: str, ne0: int, ne1: int, seed: int = 0) -> QTensor:
    """Random blocks with finite f16 scales (tiny, subnormal and negative ones too)."""
    raw = random_raw(ggml_type, ne1, ne0, np.random.default_rng(seed))
    return QTensor(f"blk.0.{ggml_type}.weight", ggml_type, (ne0, ne1), raw.reshape(-1))


def activations(T: int, ne0: int, seed: int = 1) -> np.ndarray:
    """Normal rows with a wide dynamic range across 32-element blocks, and one all-zero block."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((T, ne0)).astype(f32)
    x *= (10.0 ** rng.integers(-3, 3, (T, ne0 // 32, 1))).repeat(32, axis=2).reshape(T, ne0).astype(f32)
    x[:, 32:64] = 0
    return x


# ---- numpy emulation: activation quantization
# ref: x86 quants.c quantize_row_q8_0 (AVX2: id = 127 / amax, round half to even, d stored f16)

def q8_0_numpy(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """x (T, ne0) -> qs int8 (T, ne0), d float32 (T, ne0 / 32) as the dot product reads it."""
    T, ne0 = x.shape
    xb = x.reshape(T, ne0 // 32, 32)
    amax = np.abs(xb).max(axis=2)
    d = (amax / f32(127)).astype(np.float16).astype(f32)
    with np.errstate(divide="ignore"):
        idv = np.where(amax != 0, f32(127) / amax, f32(0)).astype(f32)
    qs = np.rint(xb * idv[..., None]).astype(np.int8)
    return qs.reshape(T, ne0), d


# ref: ggml-quants.c quantize_row_q8_K_ref (iscale = -127 / signed max, d = 1 / iscale in f32)
def q8_k_numpy(x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """x (T, ne0) -> qs int8 (T, ne0), d float32 (T, ne0 / 256), bsums int16 (T, ne0 / 16)."""
    T, ne0 = x.shape
    xb = x.reshape(T, ne0 // 256, 256)
    mx = np.take_along_axis(xb, np.abs(xb).argmax(axis=2)[..., None], axis=2)[..., 0]  # first max
    zero = mx == 0
    with np.errstate(divide="ignore"):
        iscale = np.where(zero, f32(0), f32(-127) / np.where(zero, f32(1), mx)).astype(f32)
    qs = np.minimum(np.rint(xb * iscale[..., None]), 127).astype(np.int8)
    d = np.where(zero, f32(0), f32(1) / np.where(zero, f32(1), iscale)).astype(f32)
    bsums = qs.reshape(T, ne0 // 16, 16).sum(axis=2, dtype=np.int64).astype(np.int16)
    return qs.reshape(T, ne0), d, bsums


# ---- numpy emulation: weight quants as integers (independent of common.quant)

def f16(blocks: np.ndarray, at: int) -> np.ndarray:
    return blocks[:, at:at + 2].copy().view(np.float16).astype(f32)[:, 0]


def legacy_ints(w: QTensor) -> tuple[np.ndarray, np.ndarray]:
    """Q4_0 / Q5_0 / Q8_0 -> signed quants int64 (ne1, nb, 32), d float32 (ne1, nb)."""
    ne0, ne1 = w.shape
    t = QUANT_TYPES[w.ggml_type]
    blocks = w.data.reshape(-1, t.block_bytes)
    if w.ggml_type == "Q8_0":
        q = blocks[:, 2:].view(np.int8).astype(np.int64)
    else:
        at = 2 if w.ggml_type == "Q4_0" else 6
        qs = blocks[:, at:at + 16].astype(np.int64)
        q = np.concatenate([qs & 0x0F, qs >> 4], axis=1)  # elements 0..15 low, 16..31 high nibbles
        if w.ggml_type == "Q4_0":
            q -= 8
        else:
            qh = blocks[:, 2:6].copy().view(np.uint32).astype(np.int64)  # (n, 1)
            q |= ((qh >> np.arange(32)) & 1) << 4
            q -= 16
    return q.reshape(ne1, -1, 32), f16(blocks, 0).reshape(ne1, -1)


def q4_k_ints(w: QTensor):
    """-> q int64 (ne1, nb, 256) in 0..15, sc, m int64 (ne1, nb, 8), d, dmin float32 (ne1, nb)."""
    ne0, ne1 = w.shape
    blocks = w.data.reshape(-1, QUANT_TYPES["Q4_K"].block_bytes)
    s = blocks[:, 4:16].astype(np.int64)
    sc = np.concatenate([s[:, 0:4] & 63, (s[:, 8:12] & 0x0F) | ((s[:, 0:4] >> 6) << 4)], axis=1)
    m = np.concatenate([s[:, 4:8] & 63, (s[:, 8:12] >> 4) | ((s[:, 4:8] >> 6) << 4)], axis=1)
    qs = blocks[:, 16:].astype(np.int64).reshape(-1, 4, 32)
    q = np.stack([qs & 0x0F, qs >> 4], axis=2).reshape(-1, 256)  # 64j + l low, 64j + 32 + l high
    return (q.reshape(ne1, -1, 256), sc.reshape(ne1, -1, 8), m.reshape(ne1, -1, 8),
            f16(blocks, 0).reshape(ne1, -1), f16(blocks, 2).reshape(ne1, -1))


def q6_k_ints(w: QTensor):
    """-> q int64 (ne1, nb, 256) in -32..31, sc int64 (ne1, nb, 16), d float32 (ne1, nb)."""
    ne0, ne1 = w.shape
    blocks = w.data.reshape(-1, QUANT_TYPES["Q6_K"].block_bytes)
    ql = blocks[:, :128].astype(np.int64).reshape(-1, 2, 2, 32)  # (n, half, 32-byte run, l)
    qh = blocks[:, 128:192].astype(np.int64).reshape(-1, 2, 1, 32)
    low = np.concatenate([ql & 0x0F, ql >> 4], axis=2)  # (n, half, k, l): k = 0, 1 low; 2, 3 high
    high = (qh >> (2 * np.arange(4)).reshape(1, 1, 4, 1)) & 3
    q = (low | high << 4) - 32
    sc = blocks[:, 192:208].view(np.int8).astype(np.int64)
    return q.reshape(ne1, -1, 256), sc.reshape(ne1, -1, 16), f16(blocks, 208).reshape(ne1, -1)


def hsum8(a: np.ndarray) -> np.ndarray:
    """ggml's hsum_float_8 order over the last axis of 8 lanes."""
    a = [a[..., k] for k in range(8)]
    return ((a[0] + a[4]) + (a[2] + a[6])) + ((a[1] + a[5]) + (a[3] + a[7]))


def hsum4(a: np.ndarray) -> np.ndarray:
    return (a[..., 0] + a[..., 2]) + (a[..., 1] + a[..., 3])


def accumulate(lanes: np.ndarray, d: np.ndarray) -> np.ndarray:
    """lanes int (T, ne1, nb, L), d float32 (T, ne1, nb) -> float32 (T, ne1, L): acc += lane * d,
    block after block, as the kernels do (a multiply, then an add: no fused multiply-add)."""
    acc = np.zeros(lanes.shape[:2] + lanes.shape[3:], f32)
    for b in range(lanes.shape[2]):
        acc = acc + lanes[:, :, b].astype(f32) * d[:, :, b, None]
    return acc


def matmul_numpy(x: np.ndarray, w: QTensor) -> np.ndarray:
    """The kernels' arithmetic in numpy: exact integer lanes per block (lane k holds elements
    4k..4k+3 of each run of 32), then float32 ops in the kernels' order."""
    T = len(x)
    if w.ggml_type in K_TYPES:
        aq, ad, bs = q8_k_numpy(x)
        nb = aq.shape[1] // 256
        aq = aq.astype(np.int64).reshape(T, 1, nb, 256)
        bs = bs.astype(np.int64).reshape(T, 1, nb, 16)
        if w.ggml_type == "Q4_K":
            q, sc, m, d, dmin = q4_k_ints(w)  # element 64j + 32h + l: sub-block 2j + h, lane l // 4
            prod = (q[None] * aq).reshape(T, *q.shape[:2], 4, 2, 8, 4).sum(-1)
            lanes = (prod * sc.reshape(*sc.shape[:2], 4, 2, 1)[None]).sum((3, 4))
            bs32 = bs.reshape(T, 1, nb, 8, 2).sum(-1)
            mins = (m[None] * bs32).reshape(T, *m.shape[:2], 4, 2).sum(-1)  # lane i: sub-blocks 2i, 2i+1
            return (hsum8(accumulate(lanes, ad[:, None] * d[None]))
                    - hsum4(accumulate(mins, ad[:, None] * dmin[None])))
        q, sc, d = q6_k_ints(w)  # element 32c + l: scale (32c + l) // 16, lane l // 4
        prod = (q[None] + 32) * aq * sc.repeat(16, axis=2)[None]
        lanes = prod.reshape(T, *q.shape[:2], 8, 8, 4).sum((3, 5))
        lanes -= 32 * (sc[None] * bs).reshape(T, *sc.shape[:2], 8, 2).sum(-1)
        return hsum8(accumulate(lanes, ad[:, None] * d[None]))
    aq, ad = q8_0_numpy(x)
    q, d = legacy_ints(w)
    aq = aq.astype(np.int64).reshape(T, 1, -1, 32)
    lanes = (q[None] * aq).reshape(T, *q.shape[:2], 8, 4).sum(-1)  # (T, ne1, nb, 8)
    return hsum8(accumulate(lanes, d[None] * ad[:, None]))  # f16(w.d) * x.d


def assert_bits(a: np.ndarray, b: np.ndarray):
    assert a.dtype == b.dtype == f32 and a.shape == b.shape, (a.dtype, b.dtype, a.shape, b.shape)
    np.testing.assert_array_equal(a.view(np.uint32), b.view(np.uint32))


# ---- exact

@pytest.mark.parametrize("k", [False, True])
@pytest.mark.parametrize("simd", [True, False])
def test_activation_quantization_equals_numpy(k, simd, isa):
    x = activations(5, 1024)
    x[2, :256] = 0  # a whole zero super-block: d = 0, qs = 0
    qs, d, bs = _qmatmul.quantize(x, 5, 1024, k, simd)
    want = q8_k_numpy(x) if k else q8_0_numpy(x)
    np.testing.assert_array_equal(np.frombuffer(qs, np.int8).reshape(5, 1024), want[0])
    np.testing.assert_array_equal(np.frombuffer(d, f32).view(np.uint32), want[1].reshape(-1).view(np.uint32))
    if k:  # per super-block the 16 sums of 16, then the 8 sums of 32 (quants.h, act_t)
        sums16 = want[2].reshape(5, 1024 // 256, 16)
        sums32 = sums16.reshape(5, 1024 // 256, 8, 2).sum(axis=3, dtype=np.int16)
        np.testing.assert_array_equal(np.frombuffer(bs, np.int16).reshape(5, -1),
                                      np.concatenate([sums16, sums32], axis=2).reshape(5, -1))
    else:
        assert bs is None


CASES = [("Q8_0", 896, 37), ("Q4_0", 896, 19), ("Q5_0", 896, 41), ("Q4_K", 1024, 23), ("Q6_K", 512, 29)]


@pytest.mark.parametrize("ggml_type, ne0, ne1", CASES)
# every pass width of the multi-token kernels, 2 to 8 tokens: 2, 3, 6, 7, 9 = 8 + a pass of one, 13 = 8 + 5
@pytest.mark.parametrize("T", [1, 2, 3, 6, 7, 9, 13])
def test_kernel_equals_numpy_emulation(ggml_type, ne0, ne1, T, isa):
    w = qtensor(ggml_type, ne0, ne1)
    x = activations(T, ne0)
    assert_bits(kernels.make_kernel(ggml_type)(x, w), matmul_numpy(x, w))


def test_hand_computed_q8_0(isa):
    # one Q8_0 block, d = 0.5: w = (1, -2, 0, ..., 0, 127); x = (2, 1, 0, ..., 0, -1) * 127 / 127
    block = np.zeros(34, np.uint8)
    block[:2] = np.frombuffer(np.float16(0.5).tobytes(), np.uint8)
    block[2:] = np.array([1, -2] + [0] * 29 + [127], np.int8).view(np.uint8)
    w = QTensor("w", "Q8_0", (32, 1), block)
    x = np.zeros((1, 32), f32)
    x[0, :2] = (127, 63.5)
    x[0, 31] = -127  # amax 127: d = 1, q = x exactly (63.5 rounds to the even 64)
    y = kernels.make_kernel("Q8_0")(x, w)
    assert y.tolist() == [[0.5 * (1 * 127 - 2 * 64 - 127 * 127)]]


# ---- invariance

ODD = [("Q8_0", 896, 301), ("Q4_0", 64, 33), ("Q5_0", 896, 131), ("Q4_K", 1024, 77), ("Q6_K", 768, 53)]


@pytest.mark.parametrize("ggml_type, ne0, ne1", ODD)
@pytest.mark.parametrize("T", [1, 2, 17])
def test_simd_threads_and_batch_agree_bit_for_bit(ggml_type, ne0, ne1, T, isa):
    w = qtensor(ggml_type, ne0, ne1, seed=T)
    x = activations(T, ne0, seed=T + 1)
    y = kernels.make_kernel(ggml_type)(x, w)  # this ISA's kernels, 2 threads
    assert_bits(kernels.make_kernel(ggml_type, simd=False, parallel=False)(x, w), y)
    assert_bits(kernels.make_kernel(ggml_type, parallel=False)(x, w), y)
    kernels.set_threads(3)
    assert_bits(kernels.make_kernel(ggml_type)(x, w), y)
    one = kernels.make_kernel(ggml_type)
    assert_bits(np.concatenate([one(x[t:t + 1], w) for t in range(T)]), y)


def test_big_product_splits_across_threads_bit_for_bit(isa):
    # large enough for the pool (>= 32 KiB of W), many tasks, an odd row count
    w = qtensor("Q4_K", 2048, 1001)
    x = activations(1, 2048)
    y = kernels.make_kernel("Q4_K")(x, w)
    for n in (1, 2, 4):
        kernels.set_threads(n)
        for _ in range(3):
            assert_bits(kernels.make_kernel("Q4_K")(x, w), y)


# ---- one build for every x86-64: the ISA is chosen at run time

def test_isas_reported_best_chosen_and_each_selectable():
    have = kernels.isas()
    assert have[0] == "scalar" and set(have) <= {"scalar", "avx2", "avx512"}
    assert kernels.get_isa() == have[-1]  # the import took the best one
    try:
        for name in have:
            kernels.set_isa(name)
            assert kernels.get_isa() == name and kernels.describe().startswith(f"{name} kernels")
        with pytest.raises(ValueError, match="ISA sse9: not compiled in"):
            kernels.set_isa("sse9")
    finally:
        kernels.set_isa(have[-1])


def test_extension_is_built_for_the_baseline():
    # setup.py compiles the module for plain x86-64 unless asked otherwise: only simd_*.c carry
    # AVX2 / AVX-512 (function-level targets), so the same build runs on any x86-64 CPU.
    march = settings.read(os.environ, "KNOT_KERNELS_MARCH", "tests")
    if march:
        pytest.skip(f"built with KNOT_KERNELS_MARCH={march}")
    assert _qmatmul.BASELINE_AVX2 == 0


def test_knot_kernels_env_picks_the_isa():
    have = kernels.isas()
    assert kernels.isa_from_env({}) == kernels.isa_from_env({"KNOT_KERNELS": "auto"}) == have[-1]
    for off in ("off", "numpy", "0"):
        assert kernels.isa_from_env({"KNOT_KERNELS": off}) is None
    for name in have:
        assert kernels.isa_from_env({"KNOT_KERNELS": name}) == name
    with pytest.raises(ValueError, match="'KNOT_KERNELS' must be one of auto, scalar, avx2, avx512, off"):
        kernels.isa_from_env({"KNOT_KERNELS": "avx1024"})
    for name in {"avx2", "avx512"} - set(have):  # an ISA the CPU lacks is refused at start, not ignored
        with pytest.raises(ValueError, match=f"'KNOT_KERNELS'='{name}': this machine runs auto, scalar"):
            kernels.isa_from_env({"KNOT_KERNELS": name})
    try:
        assert set(kernels.install(threads=2, env={"KNOT_KERNELS": "scalar"})) == set(TYPES)
        assert kernels.get_isa() == "scalar"
        assert kernels.install(threads=2, env={"KNOT_KERNELS": "off"}) == []
    finally:
        kernels.set_isa(have[-1])


# ---- closeness to the numpy reference

def activation_error_bound(x: np.ndarray, k: bool) -> np.ndarray:
    """Per element of x, the largest |x - dequantized q8 x|: half a step, plus the f16 rounding
    of the Q8_0 scale (|q| <= 127 times half an f16 ulp), with a little float slack."""
    T, ne0 = x.shape
    n = 256 if k else 32
    amax = np.abs(x.reshape(T, ne0 // n, n)).max(axis=2, keepdims=True)
    step = amax / 127 * (0.5 + (0 if k else 127 * 2.0 ** -11) + 1e-5)
    return np.broadcast_to(step, (T, ne0 // n, n)).reshape(T, ne0)


@pytest.mark.parametrize("ggml_type, ne0, ne1", ODD)
@pytest.mark.parametrize("T", [1, 5])
@pytest.mark.parametrize("wide", [False, True])
def test_close_to_dequantized_reference(ggml_type, ne0, ne1, T, wide):
    w = qtensor(ggml_type, ne0, ne1)
    W = w.dequantize()  # (ne1, ne0)
    x = activations(T, ne0) if wide else np.random.default_rng(T).standard_normal((T, ne0)).astype(f32)
    y = kernels.make_kernel(ggml_type)(x, w)
    ref = x.astype(np.float64) @ W.T.astype(np.float64)
    scale = np.abs(x) @ np.abs(W.T)  # sum |x_i w_i|
    bound = activation_error_bound(x, ggml_type in K_TYPES).astype(np.float64) @ np.abs(W.T) + 1e-5 * scale
    err = np.abs(y - ref)
    assert np.all(err <= bound), float(np.max(err / bound))
    rel = float(np.max(err[scale > 0] / scale[scale > 0]))
    print(f"{ggml_type} T={T} {'wide-range' if wide else 'normal'} x: "
          f"max |y - x @ W.T| / sum|x w| = {rel:.2e}, max err / bound = {np.max(err[bound > 0] / bound[bound > 0]):.2f}")
    if not wide:  # one scale per block of 32 (Q8_0) or 256 (Q8_K) of a normal row: about 1/254
        assert rel < 1e-2


# ---- registry and errors

def test_install_routes_matmul_and_uninstall_restores():
    w = qtensor("Q5_0", 896, 40)
    x = activations(2, 896)
    assert set(kernels.install(threads=2)) == set(TYPES) == set(kernels.supported_types())
    kern = ops.installed()  # models built from now on compute with it
    assert type(kern) is kernels.KernelOps and "Q5_0" in kern.quantized_types and "Q4_1" not in kern.quantized_types
    assert_bits(kern.matmul(x, w), kernels.make_kernel("Q5_0")(x, w))
    assert_bits(kern.matmul(x[0], w), kernels.make_kernel("Q5_0")(x[:1], w)[0])  # 1-D x
    q41 = qtensor("Q4_1", 896, 8)  # a type without a kernel: the reference's bits
    assert_bits(kern.matmul(x, q41), mm.matmul_tiled(x, q41))
    kernels.uninstall()
    assert type(ops.installed()) is Ops and not ops.installed().quantized_types
    assert_bits(ops.installed().matmul(x, w), mm.matmul_tiled(x, w))


def test_rows_view_and_zero_input(isa):
    w = qtensor("Q8_0", 896, 50)
    x = activations(3, 896)
    k = kernels.make_kernel("Q8_0")
    assert_bits(k(x, w.rows(10, 33)), k(x, w)[:, 10:33])
    assert not np.any(k(np.zeros((2, 896), f32), w))


def test_threads_from_env():
    assert kernels.threads_from_env({"KNOT_THREADS": "3"}) == 3
    assert kernels.threads_from_env({}) >= 1
    for bad in ("zero", "0", "-2"):
        with pytest.raises(ValueError, match="KNOT_THREADS"):
            kernels.threads_from_env({"KNOT_THREADS": bad})
    assert kernels.spin_us_from_env({}) is None
    assert kernels.spin_us_from_env({"KNOT_SPIN_US": "50"}) == 50.0
    for bad in ("fast", "-1", "2e6"):
        with pytest.raises(ValueError, match="KNOT_SPIN_US"):
            kernels.spin_us_from_env({"KNOT_SPIN_US": bad})


def test_bad_shapes_raise():
    w = qtensor("Q4_K", 512, 4)
    y = np.empty((1, 4), f32)
    with pytest.raises(ValueError, match="multiple of 256"):
        _qmatmul.matmul(_qmatmul.TYPES["Q4_K"], np.zeros((1, 500), f32), w.data, y, 1, 500, 4)
    with pytest.raises(ValueError, match="x: .* bytes"):
        _qmatmul.matmul(_qmatmul.TYPES["Q4_K"], np.zeros((1, 256), f32), w.data, y, 1, 512, 4)
    with pytest.raises(ValueError, match="w: .* bytes"):
        _qmatmul.matmul(_qmatmul.TYPES["Q4_K"], np.zeros((1, 512), f32), w.data[:-1], y, 1, 512, 4)
    with pytest.raises(ValueError, match="no kernel"):
        _qmatmul.matmul(3, np.zeros((1, 512), f32), w.data, y, 1, 512, 4)


# ---- several products of one x in one call (a layer's q, k and v)

MANY = [("Q5_0", "Q5_0", "Q8_0"), ("Q4_K", "Q4_K", "Q6_K"), ("Q8_0", "Q4_K", "Q5_0", "Q6_K", "Q4_0")]


@pytest.mark.parametrize("types", MANY)
@pytest.mark.parametrize("T", [1, 2, 17])
def test_matmul_many_gives_each_products_bits(types, T, isa, monkeypatch):
    """matmul_many (x quantized once per activation format, every product's tasks in one pass) gives
    each product's own kernel call bit for bit, on every ISA, for 1 and 3 threads, and mixes Q8_0 and
    Q8_K activations; its shapes of 0.5B-like q, k, v (896 -> 896, 128, 128) included."""
    ne0 = 1024 if any(t in K_TYPES for t in types) else 896
    ws = [qtensor(t, ne0, ne1, seed=i) for i, (t, ne1) in enumerate(zip(types, (ne0, 128, 128, 77, 33)))]
    x = activations(T, ne0, seed=T)
    want = [kernels.make_kernel(w.ggml_type, parallel=False)(x, w) for w in ws]
    calls = []
    one_call = _qmatmul.matmul_many
    monkeypatch.setattr(_qmatmul, "matmul_many", lambda *a: calls.append(len(a[3])) or one_call(*a))
    kern = kernels.KernelOps()  # this ISA's
    for threads in (1, 3):
        kernels.set_threads(threads)
        for got in (kern.matmul_many(x, ws), kernels._make_many(False, True)(x, ws)):  # this ISA's; the reference
            assert len(got) == len(ws)
            for g, wn in zip(got, want):
                assert_bits(g, wn)
    assert calls == [len(ws)] * 4, "KernelOps.matmul_many went through the kernels' one call"


def test_matmul_many_falls_back_per_product_where_a_type_has_no_shared_kernel():
    """Where a product's type routes elsewhere (numpy's F32 here, or nothing installed), matmul_many
    is matmul of each product, the same bits; bad shapes in the C call raise, naming the buffer."""
    rng = np.random.default_rng(3)
    f = rng.standard_normal((16, 64)).astype(f32)
    ws = [qtensor("Q8_0", 64, 8), QTensor("blk.0.f.weight", "F32", (64, 16), f.view(np.uint8).reshape(-1))]
    x = activations(2, 64)
    kern = kernels.KernelOps()
    got = kern.matmul_many(x, ws)
    for g, w in zip(got, ws):
        assert_bits(g, kern.matmul(x, w))
    assert_bits(Ops().matmul_many(x, ws[:1])[0], mm.matmul(x, ws[0]))  # numpy's path
    w = ws[0]
    y = np.empty((2, 8), f32)
    q8 = _qmatmul.TYPES["Q8_0"]
    with pytest.raises(ValueError, match="w: .* bytes"):
        _qmatmul.matmul_many(x, 2, 64, [(q8, w.data, y, 8), (q8, w.data[:-1], y, 8)])
    with pytest.raises(ValueError, match="y: .* bytes"):
        _qmatmul.matmul_many(x, 2, 64, [(q8, w.data, y[:1], 8)])
    with pytest.raises(ValueError, match="x: .* bytes"):
        _qmatmul.matmul_many(x[:1], 2, 64, [(q8, w.data, y, 8)])
    with pytest.raises(ValueError, match="no kernel"):
        _qmatmul.matmul_many(x, 2, 64, [(3, w.data, y, 8)])
    with pytest.raises(ValueError, match="1 to 8"):
        _qmatmul.matmul_many(x, 2, 64, [])


# ---- the thread pool

def test_concurrent_callers_get_their_own_results():
    # Python threads calling at once (the GIL is released): one uses the pool, the others run
    # on their own thread; every result equals the single-threaded one.
    import threading

    cases = [(qtensor(t, ne0, ne1, seed=i), activations(1 + i % 3, ne0, seed=i))
             for i, (t, ne0, ne1) in enumerate(ODD * 2)]
    want = [kernels.make_kernel(w.ggml_type, parallel=False)(x, w) for w, x in cases]
    got: list = [None] * len(cases)

    def run(i):
        w, x = cases[i]
        for _ in range(20):
            got[i] = kernels.make_kernel(w.ggml_type)(x, w)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(cases))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for g, w in zip(got, want):
        assert_bits(g, w)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_forked_child_starts_its_own_workers():
    # The pool's workers do not survive fork; the child must not wait for them.
    w = qtensor("Q4_K", 2048, 301)
    x = activations(1, 2048)
    k = kernels.make_kernel("Q4_K")
    want = k(x, w)  # the parent's pool is running now
    r, wfd = os.pipe()
    pid = os.fork()
    if pid == 0:  # child: compute with the pool, report through the pipe, exit at once
        try:
            os.write(wfd, k(x, w).tobytes())
        finally:
            os._exit(0)
    os.close(wfd)
    import select

    if not select.select([r], [], [], 60)[0]:  # a hung child would otherwise hang the test run
        os.kill(pid, 9)
        os.waitpid(pid, 0)
        pytest.fail("the forked child did not finish its matmul in 60 s")
    with os.fdopen(r, "rb") as f:
        data = f.read()
    os.waitpid(pid, 0)
    assert_bits(np.frombuffer(data, f32).reshape(want.shape), want)


# ---- the real weights

@pytest.mark.realmodel
def test_real_model_blocks_equal_numpy_emulation(real_gguf_05b, isa):
    # Real scales and quants of every type the 0.5b uses: Q5_0, Q8_0, Q4_K, Q6_K.
    from deploy.knotfile import open_model

    model = open_model(real_gguf_05b)
    seen = {}
    for name, e in model.header.tensors.items():
        if len(e.shape) == 2 and e.ggml_type in TYPES and e.ggml_type not in seen:
            seen[e.ggml_type] = model.tensor(name).rows(0, 37)  # rows [0, 37): a zero-copy view
    assert {"Q5_0", "Q8_0", "Q4_K", "Q6_K"} <= set(seen)
    for ggml_type, w in seen.items():
        x = np.random.default_rng(0).standard_normal((5, w.shape[0])).astype(f32)
        y = kernels.make_kernel(ggml_type)(x, w)
        assert_bits(y, matmul_numpy(x, w))
        W = w.dequantize()
        bound = (activation_error_bound(x, ggml_type in K_TYPES).astype(np.float64) @ np.abs(W.T)
                 + 1e-5 * (np.abs(x) @ np.abs(W.T)))
        assert np.all(np.abs(y - x.astype(np.float64) @ W.T) <= bound), ggml_type


def test_a_library_user_of_local_engine_gets_the_kernels(tiny_knot):
    """LocalEngine.open in a fresh interpreter (no CLI, no conftest) runs the C kernels, as the
    services and `knot generate` do: before, a script's engine stayed on the numpy reference, whose
    logits differ from the kernels' by up to ~0.1, and a near-tie then read as a cluster bug
    (issue 15). KNOT_KERNELS=off still keeps it on numpy."""
    import subprocess
    import sys

    code = ("import sys; from deploy.engine_local import LocalEngine; "
            "print('Q4_K' in LocalEngine.open(sys.argv[1]).arch.ops.quantized_types)")
    for setting, want in (("auto", "True"), ("off", "False")):
        env = {**os.environ, "KNOT_KERNELS": setting}
        out = subprocess.run([sys.executable, "-c", code, str(tiny_knot)], env=env, capture_output=True, text=True,
                             check=True, cwd=os.path.dirname(os.path.dirname(os.path.dirname(__file__))))
        assert out.stdout.strip() == want, (setting, out.stdout, out.stderr)


def test_install_runs_numpy_blas_on_one_thread():
    """Attention's matmuls go through numpy's BLAS, whose results depend on its thread count: every
    process that installs the kernels runs it on one, so the single process computes as the services."""
    from threadpoolctl import threadpool_info

    assert kernels.one_blas_thread()
    blas = [p for p in threadpool_info() if p["user_api"] == "blas"]
    assert blas and all(p["num_threads"] == 1 for p in blas), blas


# ---- attention's products (attn.h): float64 sums in one fixed order

def f16_numbers(shape, rng, lo: float = -8.0, hi: float = 8.0) -> np.ndarray:
    """float32 values that are f16 numbers, as the cache's keys and values and the rounded q are."""
    return rng.uniform(lo, hi, shape).astype(np.float16).astype(f32)


def attn_scores_numpy(q: np.ndarray, k: np.ndarray) -> np.ndarray:
    """attn.h's order, in numpy: q (n_kv, R, hd), k (S, n_kv, hd) -> (n_kv, R, S) f32. Lane i sums
    the terms d = i (mod 8) in order of d, then ((l0 + l4) + (l2 + l6)) + ((l1 + l5) + (l3 + l7))."""
    n_kv, R, hd = q.shape
    prod = q.astype(np.float64)[:, :, None, :] * k.transpose(1, 0, 2).astype(np.float64)[:, None]  # (n_kv, R, S, hd), exact
    lanes = np.zeros(prod.shape[:3] + (8,))
    for c in range(hd // 8):
        lanes = lanes + prod[..., 8 * c:8 * c + 8]
    l = [lanes[..., i] for i in range(8)]
    return (((l[0] + l[4]) + (l[2] + l[6])) + ((l[1] + l[5]) + (l[3] + l[7]))).astype(f32)


def attn_values_numpy(p: np.ndarray, v: np.ndarray, out: np.ndarray) -> np.ndarray:
    """attn.h's order, in numpy: out (n_kv, R, hd) += f16(p) (n_kv, R, S) @ v (S, n_kv, hd), key by key."""
    out = out.copy()
    w = p.astype(np.float16).astype(np.float64)
    for s in range(p.shape[-1]):
        out = out + w[:, :, s, None] * v[s].astype(np.float64)[:, None, :]
    return out


ATTN_SHAPES = [(2, 7, 1, 64), (2, 7, 5, 64), (2, 6, 300, 128), (1, 37, 301, 64), (2, 3, 9, 16), (4, 2, 1000, 256)]


@pytest.mark.parametrize("kv_dtype", [np.float32, np.float16])
@pytest.mark.parametrize("n_kv,R,S,hd", ATTN_SHAPES)
def test_attention_products_equal_the_numpy_emulation(n_kv, R, S, hd, kv_dtype, isa):
    """Keys and values as a float32 or a float16 cache stores them (the kernels read either)."""
    rng = np.random.default_rng(S + hd)
    q, k, v = f16_numbers((n_kv, R, hd), rng), f16_numbers((S, n_kv, hd), rng), rng.standard_normal((S, n_kv, hd)).astype(f32)
    k, v = k.astype(kv_dtype), v.astype(kv_dtype)
    p = rng.random((n_kv, R, S), f32) ** 4  # many tiny weights: f16 subnormals
    out0 = rng.standard_normal((n_kv, R, hd))
    for simd in (True, False):
        kern = kernels.KernelOps(simd=simd)
        assert_bits(kern.scores(q, k), attn_scores_numpy(q, k))
        out = out0.copy()
        assert kern.values(p, v, out) is out
        np.testing.assert_array_equal(out.view(np.uint64), attn_values_numpy(p, v, out0).view(np.uint64))


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_attention_products_agree_across_threads_isas_and_row_batches(threads, isa):
    """Each output is one thread's sum in attn.h's order: any thread count, ISA, or set of rows
    sharing a call gives the same bits (a verify trip's rows are their decode steps' rows)."""
    rng = np.random.default_rng(threads)
    n_kv, R, S, hd = 2, 14, 1500, 64
    q, k, v = f16_numbers((n_kv, R, hd), rng), f16_numbers((S, n_kv, hd), rng), f16_numbers((S, n_kv, hd), rng)
    p = rng.random((n_kv, R, S), f32)
    kernels.set_threads(threads)
    ref = kernels.KernelOps(simd=False, parallel=False)
    kern = kernels.KernelOps()
    assert_bits(kern.scores(q, k), ref.scores(q, k))
    assert_bits(kern.scores(q[:, 3:4], k), ref.scores(q, k)[:, 3:4])  # one row alone
    out, out_ref = np.zeros((n_kv, R, hd)), np.zeros((n_kv, R, hd))
    kern.values(p, v, out), ref.values(p, v, out_ref)
    np.testing.assert_array_equal(out.view(np.uint64), out_ref.view(np.uint64))
    one = np.zeros((n_kv, 1, hd))
    kern.values(np.ascontiguousarray(p[:, 5:6]), v, one)
    np.testing.assert_array_equal(one.view(np.uint64), out[:, 5:6].view(np.uint64))


def test_attention_weights_round_to_f16_as_numpy_does():
    """The weights' f16 rounding in C (F16C, or the reference's bit arithmetic) is numpy's
    astype(float16): ties to even, subnormals, the largest f16 and past it (inf)."""
    edges = np.array([0.0, 2.0 ** -25, 2.0 ** -25 * 1.5, 2.0 ** -24, 2.0 ** -14 * (1 - 2.0 ** -11), 2.0 ** -14,
                      1 + 2.0 ** -11, 1 + 3 * 2.0 ** -11, 65504.0, 65519.0, 65520.0, 1e30, 1e-45], f32)
    p = np.concatenate([edges, np.random.default_rng(0).random(4093, f32) ** 8])[None, None]  # (1, 1, 4106)
    S = p.shape[-1]
    for simd in (True, False):
        kern = kernels.KernelOps(simd=simd)
        for s in range(0, S, 997):  # one key per call: out = f16(p_s) * 1
            v = np.ones((1, 1, 16), f32)
            out = np.zeros((1, 1, 16))
            kern.values(np.ascontiguousarray(p[..., s:s + 1]), v, out)
            assert out[0, 0, 0] == np.float64(p[0, 0, s].astype(np.float16)), (s, p[0, 0, s])
        for s, x in enumerate(edges):
            out = np.zeros((1, 1, 16))
            kern.values(np.full((1, 1, 1), x, f32), np.ones((1, 1, 16), f32), out)
            with np.errstate(over="ignore"):  # 65520 and 1e30 round to inf, as they should
                want = np.float64(np.float16(x))
            assert out[0, 0, 0] == want, x


def test_attention_kernel_leaves_what_it_does_not_take_to_the_reference():
    """What the C products do not take, KernelOps hands to common.ops.Ops: the same numbers, never None."""
    kern, ref = kernels.KernelOps(), Ops()
    rng = np.random.default_rng(0)
    q = f16_numbers((2, 3, 64), rng)
    k64 = f16_numbers((5, 2, 64), rng).astype(np.float64)  # a float64 cache
    assert_bits(kern.scores(q, k64), ref.scores(q, k64))
    q72, k72 = f16_numbers((2, 3, 72), rng), f16_numbers((5, 2, 72), rng)  # hd not a multiple of 16
    assert_bits(kern.scores(q72, k72), ref.scores(q72, k72))
    p, v = rng.random((2, 3, 5), f32), f16_numbers((5, 2, 64), rng)
    out, want = np.zeros((2, 3, 64)), np.zeros((2, 3, 64))
    assert kern.values(p, v, out[:, ::-1]) is not None  # out not writable in place by C: numpy's +=
    np.testing.assert_array_equal(out[:, ::-1], ref.values(p, v, want[:, ::-1]))
    with pytest.raises(ValueError, match="expected"):
        _qmatmul.attn_scores(q, np.zeros((5, 2, 64), f32), np.zeros((2, 3, 4), f32), 2, 3, 5, 64)
    with pytest.raises(ValueError, match="multiple of 16"):
        _qmatmul.attn_values(np.zeros((2, 3, 5), f32), np.zeros((5, 2, 8), f32), np.zeros((2, 3, 8)), 2, 3, 5, 8)
