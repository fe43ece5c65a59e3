"""The strict side of the oracle rule (issue 55): the llama.cpp comparison excuses steps within
llama.cpp's own spread, so the errors too small for it must fail somewhere else. A kernel that
reads one block's scale one ULP off changes the bits of exactly that weight row's outputs, and the
bit-for-bit check every kernel passes (tests/unit/test_kernels.py: assert_bits against the numpy
emulation) fails it, on every ISA this CPU runs."""
from __future__ import annotations

import numpy as np
import pytest

from common.quant import QUANT_TYPES, QTensor
from deploy import kernels
# isa: test_kernels' fixture, each kernel set this CPU runs
from tests.unit.test_kernels import CASES, activations, assert_bits, isa, matmul_numpy, qtensor  # noqa: F401

pytestmark = pytest.mark.needs_kernels

# Byte offset of a block's f16 scale `d` (ggml-common.h: block_q4_0, block_q5_0, block_q8_0 and
# block_q4_K begin with it; block_q6_K ends with it, after ql[128], qh[64] and scales[16]).
SCALE_AT = {"Q4_0": 0, "Q5_0": 0, "Q8_0": 0, "Q4_K": 0, "Q6_K": 208}


def one_ulp_off(w: QTensor, row: int, block: int) -> QTensor:
    """w with one block's scale moved by one unit in the last place (away from the largest f16)."""
    t = QUANT_TYPES[w.ggml_type]
    per_row = w.shape[0] // t.block_elems
    raw = w.data.copy()
    at = (row * per_row + block) * t.block_bytes + SCALE_AT[w.ggml_type]
    bits = raw[at:at + 2].view(np.uint16)
    bits[0] += -1 if bits[0] & 0x7FFF == 0x7BFF else 1
    return QTensor(w.name, w.ggml_type, w.shape, raw)


@pytest.mark.parametrize("ggml_type, ne0, ne1", CASES)
def test_one_blocks_scale_one_ulp_off_fails_the_bit_check(ggml_type, ne0, ne1, isa):
    w = qtensor(ggml_type, ne0, ne1)
    x = activations(3, ne0)  # its second 32-element block is all zeros: the block below is not
    row, block = ne1 // 2, 2 if QUANT_TYPES[ggml_type].block_elems == 32 else 1
    want = matmul_numpy(x, w)
    assert_bits(kernels.make_kernel(ggml_type)(x, w), want)  # the true weights pass
    got = kernels.make_kernel(ggml_type)(x, one_ulp_off(w, row, block))
    with pytest.raises(AssertionError):
        assert_bits(got, want)
    differs = np.flatnonzero((got.view(np.uint32) != want.view(np.uint32)).any(axis=0))
    assert differs.tolist() == [row], differs  # that row's outputs, and only those
