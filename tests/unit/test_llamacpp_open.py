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
