"""Builds the optional C matmul kernels, deploy/kernels/ (the rest is in pyproject.toml).

The extension is optional: when it does not compile, `pip install` still succeeds and matmul
stays on the numpy path (deploy.kernels.install() logs why and installs nothing).

It is built for the baseline ISA, so the same build (a wheel, a Docker image) runs on any
x86-64: the AVX2 and AVX-512 kernels are compiled under function-level targets (simd_*.c) and
chosen at import by what the CPU has. KNOT_KERNELS_MARCH=native raises the baseline of the
rest (the thread pool, the glue) to the building machine's ISA, for a build that stays there.
"""
import os
import sys

from setuptools import Extension, setup

KERNELS = "deploy/kernels"

if sys.platform == "win32":
    cflags = ["/O2"]
else:
    march = os.environ.get("KNOT_KERNELS_MARCH", "")
    # -ffp-contract=off: no fused multiply-adds, so every ISA rounds exactly as the reference
    cflags = ["-O3", "-ffp-contract=off", "-pthread"] + ([f"-march={march}"] if march else [])

setup(ext_modules=[Extension("deploy.kernels._qmatmul",
                             [f"{KERNELS}/{c}" for c in ("_qmatmul.c", "simd_avx2.c", "simd_avx512.c")],
                             depends=[f"{KERNELS}/{h}" for h in ("quants.h", "quants_avx2.h", "attn.h", "attn_avx2.h", "pool.h")],
                             extra_compile_args=cflags,
                             extra_link_args=[] if sys.platform == "win32" else ["-pthread"],
                             optional=True)])
