"""The llama.cpp reference (llama-cpp-python), opened the same way by `knot bench` and the fidelity
tests (tests/oracle).

Why extra buffer types may be off: on CPUs that advertise AMX (Sapphire Rapids and later), a
llama.cpp built with -march=native repacks weights for AMX, and its first AMX matmul (`ldtilecfg`
in ggml_backend_amx_mul_mat) dies with a general protection fault on these virtual machines, even
after arch_prctl(ARCH_REQ_XCOMP_PERM) grants the tile state: the 1.5B's oracle run segfaulted
every time (llama-cpp-python 0.3.36, 2026-12-01). Without extra buffer types llama.cpp runs its
plain CPU kernels. Where the CPU has no AMX nothing changes, so figures stay comparable there.
"""
from __future__ import annotations

from pathlib import Path

CPUINFO = Path("/proc/cpuinfo")


def cpu_has_amx(cpuinfo: Path = CPUINFO) -> bool:
    try:
        return " amx_tile" in cpuinfo.read_text()
    except OSError:
        return False


def open_llama(path: str | Path, **kwargs):
    """llama_cpp.Llama(path, **kwargs), with llama.cpp's extra (repacking) buffer types off where
    the CPU has AMX (see above). `extra_bufts_off` on the result says which way it went."""
    import llama_cpp
    from llama_cpp import llama as llama_module

    off = cpu_has_amx()
    default_params = llama_module.llama_cpp.llama_model_default_params
    if off:  # Llama() takes no such argument: it starts from llama_model_default_params()
        def no_extra_bufts():
            params = default_params()
            params.use_extra_bufts = False
            return params

        llama_module.llama_cpp.llama_model_default_params = no_extra_bufts
    try:
        llm = llama_cpp.Llama(str(path), **kwargs)
    finally:
        llama_module.llama_cpp.llama_model_default_params = default_params
    llm.extra_bufts_off = off
    return llm
