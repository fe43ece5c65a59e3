"""The llama.cpp reference (llama-cpp-python), opened the same way by `knot bench` and the fidelity
tests (tests/oracle).

Why AMX is refused: on CPUs that advertise AMX (Sapphire Rapids and later), a llama.cpp built
with -march=native repacks the weights of some matrices (the 1.5B's, not the 0.5B's) for AMX, and
its first AMX matmul (`ldtilecfg` in ggml_backend_amx_mul_mat) dies with a general protection
fault on these virtual machines, even after arch_prctl(ARCH_REQ_XCOMP_PERM) has granted the tile
state: every oracle run of the 1.5B segfaulted (llama-cpp-python 0.3.36). ggml offers
its AMX buffer type only when that arch_prctl succeeds, so a seccomp filter that makes it fail
(EPERM) leaves llama.cpp on the kernels it runs everywhere else, repacking included. Turning
off all extra buffer types instead (use_extra_bufts) also avoids the fault, but changes
llama.cpp's numbers on every CPU: the 0.5B's "sql" prompt then diverges at a 0.165 gap.
"""
from __future__ import annotations

import ctypes
import errno
import struct
from pathlib import Path

from deploy.machine import CPUINFO, cpu_flags

# seccomp (linux/seccomp.h, linux/filter.h, linux/audit.h)
PR_SET_NO_NEW_PRIVS, PR_SET_SECCOMP, SECCOMP_MODE_FILTER = 38, 22, 2
SECCOMP_RET_ALLOW, SECCOMP_RET_ERRNO = 0x7FFF0000, 0x00050000
AUDIT_ARCH_X86_64 = 0xC000003E
SYS_ARCH_PRCTL, ARCH_REQ_XCOMP_PERM = 158, 0x1023
BPF_LD_W_ABS, BPF_JEQ_K, BPF_RET_K = 0x20, 0x15, 0x06
# struct seccomp_data: int nr; u32 arch; u64 instruction_pointer; u64 args[6]
NR_OFFSET, ARCH_OFFSET, ARG0_OFFSET = 0, 4, 16

_amx_denied = False


def cpu_has_amx(cpuinfo: Path = CPUINFO) -> bool:
    return "amx_tile" in cpu_flags(cpuinfo)


def amx_filter() -> bytes:
    """The BPF program: arch_prctl(ARCH_REQ_XCOMP_PERM, ...) -> EPERM, every other call allowed."""
    def op(code: int, k: int, jt: int = 0, jf: int = 0) -> bytes:
        return struct.pack("HBBI", code, jt, jf, k)  # struct sock_filter

    return b"".join([
        op(BPF_LD_W_ABS, ARCH_OFFSET),
        op(BPF_JEQ_K, AUDIT_ARCH_X86_64, 0, 5),  # another ABI: allow
        op(BPF_LD_W_ABS, NR_OFFSET),
        op(BPF_JEQ_K, SYS_ARCH_PRCTL, 0, 3),
        op(BPF_LD_W_ABS, ARG0_OFFSET),  # the low 32 bits of args[0] (little-endian)
        op(BPF_JEQ_K, ARCH_REQ_XCOMP_PERM, 0, 1),
        op(BPF_RET_K, SECCOMP_RET_ERRNO | errno.EPERM),
        op(BPF_RET_K, SECCOMP_RET_ALLOW),
    ])


def deny_amx() -> None:
    """Install the filter in this process (and its children), once. OSError if the kernel refuses."""
    global _amx_denied
    if _amx_denied:
        return
    libc = ctypes.CDLL(None, use_errno=True)
    prog = amx_filter()

    class SockFprog(ctypes.Structure):
        _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_char_p)]

    fprog = SockFprog(len(prog) // 8, prog)
    if libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0 or \
            libc.prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.byref(fprog), 0, 0) != 0:
        e = ctypes.get_errno()
        raise OSError(e, f"seccomp filter refused: {errno.errorcode.get(e, e)}")
    _amx_denied = True


def open_llama(path: str | Path, **kwargs):
    """llama_cpp.Llama(path, **kwargs), with AMX refused first where the CPU has it (see above).
    Must run before the process loads any model: ggml lists its buffer types once."""
    import llama_cpp

    if cpu_has_amx():
        deny_amx()
    llm = llama_cpp.Llama(str(path), **kwargs)
    llm.amx_denied = _amx_denied
    return llm
