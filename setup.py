"""Builds the optional C matmul kernels, deploy/kernels/_qmatmul.c (the rest is in pyproject.toml).

The extension is optional: when it does not compile, `pip install` still succeeds and matmul
stays on the numpy path (deploy.kernels.install() logs why and registers nothing).
KNOT_KERNELS_MARCH picks the -march of the build (default "native": the building machine's ISA).
"""
import os
import sys

from setuptools import Extension, setup

if sys.platform == "win32":
    cflags = ["/O2"]
else:
    march = os.environ.get("KNOT_KERNELS_MARCH", "native")
    # -ffp-contract=off: no fused multiply-adds, so every ISA rounds exactly as the reference
    cflags = ["-O3", "-ffp-contract=off", "-pthread"] + ([f"-march={march}"] if march else [])

setup(ext_modules=[Extension("deploy.kernels._qmatmul", ["deploy/kernels/_qmatmul.c"],
                             depends=[f"deploy/kernels/{h}" for h in ("quants.h", "quants_avx2.h", "pool.h")],
                             extra_compile_args=cflags,
                             extra_link_args=[] if sys.platform == "win32" else ["-pthread"],
                             optional=True)])
