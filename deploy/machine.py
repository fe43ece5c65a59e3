"""What machine a measurement ran on: the CPU (/proc/cpuinfo), the CPUs this process may use,
memory, the kernel and the matmul kernels chosen, as one dict and one line.

Why: `knot bench`'s ratios against llama.cpp move with the machine (docs/performance.md: a Zen 1
without VNNI, a Zen 4 whose 512-bit operations run as two halves, Intel with AMX refused), so a
figure is read with the machine it came from, and the bench prints it beside its table.
"""
from __future__ import annotations

import os
import platform
from pathlib import Path

CPUINFO = Path("/proc/cpuinfo")
MEMINFO = Path("/proc/meminfo")

# (flag in /proc/cpuinfo, how the line names it): the ones the kernels and llama.cpp choose by
FEATURES = (("avx2", "AVX2"), ("avx512f", "AVX-512F"), ("avx512_vnni", "AVX-512 VNNI"),
            ("avx_vnni", "AVX-VNNI"), ("amx_tile", "AMX"))


def parse_cpuinfo(text: str) -> dict:
    """/proc/cpuinfo's first processor -> {"model_name", "family", "model", "flags"} (flags: a set;
    absent fields: None, no flags: empty)."""
    first: dict[str, str] = {}
    for line in text.splitlines():
        if not line.strip():
            if first:
                break  # the first processor's block is enough
            continue
        key, sep, value = line.partition(":")
        if sep:
            first.setdefault(key.strip(), value.strip())

    def as_int(key: str) -> int | None:
        try:
            return int(first[key])
        except (KeyError, ValueError):
            return None

    return {"model_name": first.get("model name"), "family": as_int("cpu family"), "model": as_int("model"),
            "flags": set(first.get("flags", "").split())}


def cpu_flags(cpuinfo: Path = CPUINFO) -> set[str]:
    """The CPU's flags (empty where /proc/cpuinfo cannot be read)."""
    try:
        return parse_cpuinfo(cpuinfo.read_text())["flags"]
    except OSError:
        return set()


def usable_cpus() -> int:
    """The CPUs this process may run on (its affinity where the platform has one): the kernels'
    default thread count."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def mem_total_bytes(meminfo: Path = MEMINFO) -> int | None:
    try:
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024  # kB
    except (OSError, ValueError, IndexError):
        pass
    return None


def describe(cpuinfo: Path = CPUINFO, meminfo: Path = MEMINFO) -> dict:
    """The machine as a dict (JSON-ready): cpu model, family, model, features, cpus, mem_total_bytes,
    system, kernels (deploy.kernels.describe(): the ISA and threads the matmuls run)."""
    try:
        cpu = parse_cpuinfo(cpuinfo.read_text())
    except OSError:
        cpu = parse_cpuinfo("")
    from deploy import kernels

    return {
        "cpu": cpu["model_name"] or platform.processor() or platform.machine(),
        "family": cpu["family"], "model": cpu["model"],
        "features": [name for flag, name in FEATURES if flag in cpu["flags"]],
        "cpus": usable_cpus(),
        "mem_total_bytes": mem_total_bytes(meminfo),
        "system": f"{platform.system()} {platform.release()}",
        "kernels": kernels.describe(),
    }


def memory_read_gb_s(threads: int | None = None, nbytes: int = 512 << 20, rounds: int = 3) -> float:
    """What the machine reads from memory: float64 sums over nbytes (far more than any cache holds),
    split over `threads` threads at once (default: the usable CPUs), the best of rounds, GB/s.

    Why: decode streams every weight once a token, so a machine's class is its ISA, its cores and
    this figure (issue 54); the kernels' own GB/s (benchmarks/bench_kernels.py) are read against it.
    numpy's reductions release the GIL, so the threads read at once."""
    import threading
    import time

    import numpy as np

    n = max(1, threads or usable_cpus())
    buf = np.ones(max(n, nbytes // 8), dtype=np.float64)  # written once: every page is mapped before timing
    parts = np.array_split(buf, n)
    best = 0.0
    for _ in range(max(1, rounds)):
        workers = [threading.Thread(target=np.add.reduce, args=(p,)) for p in parts]
        t0 = time.perf_counter()
        for w in workers:
            w.start()
        for w in workers:
            w.join()
        best = max(best, buf.nbytes / (time.perf_counter() - t0) / 1e9)
    return best


def one_line(m: dict) -> str:
    """e.g. "AMD EPYC (family 25 model 17), 2 CPUs, AVX2 AVX-512F AVX-512 VNNI, 23.4 GiB, Linux 6.18.44;
    matmuls: avx512 kernels, 2 threads", with ", reads <memory_read_gb_s> GB/s" after the memory where
    it was measured, then "; llama.cpp: <its build's features>" where the bench loaded it."""
    fam = f" (family {m['family']} model {m['model']})" if m.get("family") is not None else ""
    mem = f", {m['mem_total_bytes'] / 2**30:.1f} GiB" if m.get("mem_total_bytes") else ""
    if m.get("memory_read_gb_s"):
        mem += f", reads {m['memory_read_gb_s']:.1f} GB/s"
    feats = " ".join(m.get("features") or []) or "no AVX2"
    llama = f"; llama.cpp: {m['llama_cpp']}" if m.get("llama_cpp") else ""
    return f"{m['cpu']}{fam}, {m['cpus']} CPUs, {feats}{mem}, {m['system']}; matmuls: {m['kernels']}{llama}"
