"""Every kernel set this CPU can run was built and is chosen by the extension: a build that lost an
ISA (an old compiler, a changed flag) would otherwise leave its bit-exact tests silently unrun, since
tests/unit/test_kernels.py parametrizes over kernels.isas(), the sets built *and* runnable here."""
from __future__ import annotations

from pathlib import Path

import pytest

from deploy import kernels

# The CPU features each set needs, as deploy/kernels/_qmatmul.c's isa_runs checks them
# (__builtin_cpu_supports names; /proc/cpuinfo spells avx512vnni "avx512_vnni").
ISA_FLAGS = {
    "avx2": {"avx2", "f16c", "fma"},
    "avx512": {"avx2", "f16c", "fma", "avx512f", "avx512vl", "avx512bw", "avx512_vnni"},
}


def cpu_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        pytest.skip("no /proc/cpuinfo: the CPU's features cannot be read independently here")
    for line in text.splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    pytest.skip("/proc/cpuinfo lists no flags (not x86?)")


def runnable_isas(flags: set[str]) -> list[str]:
    """The kernel sets a CPU with these features runs, worst to best (the extension's order)."""
    return ["scalar", *(isa for isa, need in ISA_FLAGS.items() if need <= flags)]


def test_runnable_isas_follow_the_flags():
    assert runnable_isas(set()) == ["scalar"]
    assert runnable_isas({"avx2", "f16c", "fma"}) == ["scalar", "avx2"]
    assert runnable_isas({"avx2", "f16c", "fma", "avx512f", "avx512vl", "avx512bw"}) == ["scalar", "avx2"]
    assert runnable_isas(ISA_FLAGS["avx512"]) == ["scalar", "avx2", "avx512"]


@pytest.mark.needs_kernels
def test_every_isa_this_cpu_runs_is_built():
    want = runnable_isas(cpu_flags())
    assert kernels.isas() == want, (f"this CPU runs {want}, the extension offers {kernels.isas()}: "
                                    f"rebuild deploy/kernels (scripts/setup.sh)")
