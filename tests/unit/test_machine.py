"""deploy/machine.py: the machine `knot bench` prints beside its figures, read from /proc files."""
from __future__ import annotations

from deploy import kernels
from deploy.machine import describe, memory_read_gb_s, one_line, parse_cpuinfo

TWO_CPUS = """processor\t: 0
vendor_id\t: AuthenticAMD
cpu family\t: 25
model\t\t: 17
model name\t: AMD EPYC
flags\t\t: fpu sse avx2 avx512f avx512vl avx512_vnni

processor\t: 1
vendor_id\t: AuthenticAMD
cpu family\t: 25
model\t\t: 17
model name\t: another name the first processor's block wins over
flags\t\t: fpu
"""


def test_parse_cpuinfo_reads_the_first_processor():
    cpu = parse_cpuinfo(TWO_CPUS)
    assert cpu["model_name"] == "AMD EPYC"
    assert (cpu["family"], cpu["model"]) == (25, 17)
    assert {"avx2", "avx512f", "avx512_vnni"} <= cpu["flags"] and "amx_tile" not in cpu["flags"]


def test_parse_cpuinfo_without_the_fields_gives_none_and_no_flags():
    cpu = parse_cpuinfo("processor\t: 0\nmodel\t\t: not a number\n")
    assert cpu == {"model_name": None, "family": None, "model": None, "flags": set()}
    assert parse_cpuinfo("")["flags"] == set()


def test_describe_names_the_features_memory_and_kernels(tmp_path):
    (tmp_path / "cpuinfo").write_text(TWO_CPUS)
    (tmp_path / "meminfo").write_text("MemTotal:       24576000 kB\nMemFree:         1000 kB\n")
    m = describe(tmp_path / "cpuinfo", tmp_path / "meminfo")
    assert m["cpu"] == "AMD EPYC" and (m["family"], m["model"]) == (25, 17)
    assert m["features"] == ["AVX2", "AVX-512F", "AVX-512 VNNI"]  # in FEATURES' order; no AMX, no AVX-VNNI
    assert m["mem_total_bytes"] == 24576000 * 1024
    assert m["cpus"] >= 1 and m["kernels"] == kernels.describe()
    line = one_line(m)
    assert line.startswith("AMD EPYC (family 25 model 17), ") and "AVX2 AVX-512F AVX-512 VNNI" in line
    assert "23.4 GiB" in line and line.endswith(f"matmuls: {kernels.describe()}")
    assert one_line({**m, "llama_cpp": "AVX2 FMA"}).endswith(f"matmuls: {kernels.describe()}; llama.cpp: AVX2 FMA")
    assert "23.4 GiB, reads 32.9 GB/s, Linux" in one_line({**m, "memory_read_gb_s": 32.9})


def test_memory_read_speed_is_a_positive_rate_on_any_thread_count():
    for threads in (1, 3):
        v = memory_read_gb_s(threads, nbytes=4 << 20, rounds=2)
        assert 0.05 < v < 10_000, v


def test_describe_without_proc_files_still_describes(tmp_path):
    m = describe(tmp_path / "missing", tmp_path / "missing too")
    assert m["cpu"] and m["features"] == [] and m["mem_total_bytes"] is None
    assert "no AVX2" in one_line(m)
