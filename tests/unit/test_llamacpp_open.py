"""deploy/llamacpp.py: llama.cpp's extra buffer types are turned off only where the CPU has AMX."""
from __future__ import annotations

from deploy.llamacpp import cpu_has_amx


def test_amx_is_read_from_the_cpu_flags(tmp_path):
    with_amx = tmp_path / "amx"
    with_amx.write_text("flags\t\t: fpu avx2 avx512f amx_bf16 amx_tile amx_int8\n")
    without = tmp_path / "plain"
    without.write_text("flags\t\t: fpu avx2 avx512f avx512_vnni\n")
    assert cpu_has_amx(with_amx) and not cpu_has_amx(without)
    assert not cpu_has_amx(tmp_path / "missing")


def test_the_filter_refuses_only_the_amx_permission_request():
    """In a child process: after deny_amx, arch_prctl(ARCH_REQ_XCOMP_PERM) fails with EPERM, while
    arch_prctl(ARCH_GET_XCOMP_PERM) and other calls still work."""
    import subprocess
    import sys

    code = (
        "import ctypes, os\n"
        "from deploy.llamacpp import deny_amx, SYS_ARCH_PRCTL, ARCH_REQ_XCOMP_PERM\n"
        "libc = ctypes.CDLL(None, use_errno=True)\n"
        "deny_amx()\n"
        "r = libc.syscall(SYS_ARCH_PRCTL, ARCH_REQ_XCOMP_PERM, 18); e = ctypes.get_errno()\n"
        "mask = ctypes.c_ulong(0)\n"
        "g = libc.syscall(SYS_ARCH_PRCTL, 0x1022, ctypes.byref(mask))\n"
        "print(r, e, g, os.getpid() > 0)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["-1", "1", "0", "True"], out.stdout  # EPERM = 1
