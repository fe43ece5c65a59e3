"""workerd, Cloudflare's runtime, for the Python Workers offline: everything fetched from registries
(npm, PyPI, apt), verified, and built once into ~/.cache/knot/cloudflare (like the models).

Stock Python Workers cannot start offline: workerd downloads its Pyodide bundle from a Cloudflare
host and checks it against a hash compiled into the binary. The bundle named `dev` (compatibility
flag `python_workers_development`) is read from `--pyodide-bundle-disk-cache-dir` and not checked,
so this module builds one, the way workerd's own build does (src/pyodide/helpers.bzl):

    workerd 1.20250803.0 (npm,        a release whose production Pyodide is 0.27.7 (the version
      via miniflare 4.20250803.1)     whose numpy 2.0.2 wheel the Pyodide tests use), the newest
                                      of those with a miniflare of its own on npm
    Pyodide 0.27.7 (npm)              pyodide.asm.js, pyodide.asm.wasm, python_stdlib.zip
    esbuild 0.25.8 (npm)              bundles workerd's emscriptenSetup.ts with pyodide.asm.js
    capnp (Debian capnproto,          `capnp eval` writes the bundle (jsg Modules.Bundle)
      libcapnp-dev)
    workerd_lane/glue/                that release's Apache-2.0 sources (README.md there names them)

all npm packages from the committed workerd_lane/package-lock.json (sha512 integrity); the bundle
built from them must have the sha256 pinned here (the build is reproducible).

That release maps the `dev` bundle to the package lock of Pyodide 0.26 ("20240829.4"), and loads
the CPython modules Pyodide unvendors (hashlib, lzma, pydecimal, pydoc_data, sqlite3, ssl, test)
as Cloudflare's tarballs from a Google Cloud bucket, or from `--pyodide-package-disk-cache-dir`
(read as they are). No registry carries those tarballs, so the package cache holds an empty
tarball for each: under the lane `_hashlib` (OpenSSL's hashes; hashlib falls back to CPython's
built-in md5/sha1/sha2/sha3/blake2), `lzma`, `_pydecimal`, `pydoc_data`, `sqlite3`, `ssl` and
`test` are missing. The project imports none of them (tests/cloudflare/test_workerd.py shows it).

numpy is vendored into each Worker's python_modules/, as `pywrangler sync` does on deploy: the
files of Pyodide 0.27.7's numpy 2.0.2 wheel (tools.numpy_wheel: sha256 from pyodide-lock.json).
"""
from __future__ import annotations

import gzip
import hashlib
import io
import json
import os
import shutil
import stat
import subprocess
import tarfile
import tempfile
import zipfile
from pathlib import Path

from tests.cloudflare import cloudflare_tools
from tests.cloudflare.cloudflare_tools import ToolError, sha256

LANE = Path(__file__).resolve().parent / "workerd_lane"
GLUE = LANE / "glue"
PYODIDE_VERSION = "0.27.7"
WORKERD_VERSION = "1.20250803.0"
# sha256 of pyodide_dev.capnp.bin built from the pinned inputs (a changed input or tool changes it)
BUNDLE_SHA256 = "555406791252567d706cd009357c558c4d382d968bf4b08c62917cea381b06bb"
# the compatibility date the lane's Workers run with: not after the binary's own date (workerd
# refuses later ones), so the generated 2026-11-01 is replaced; the flags give what that date implies
COMPATIBILITY_DATE = "2025-08-01"
EXTRA_FLAGS = ["python_workers_development", "python_no_global_handlers"]
# what workerd 1.20250803.0 loads for the `dev` bundle (the 0.26 lock's cpython_module packages)
STDLIB_PACKAGES_TAG = "20240829.4"
STDLIB_PACKAGES = ("hashlib", "lzma", "pydecimal", "pydoc_data", "sqlite3", "ssl", "test")

# pyodide.asm.js patches: src/pyodide/helpers.bzl at workerd v1.20250803.0 (Apache-2.0), in order.
_PRELUDE = '''
    import {
        addEventListener,
        getRandomValues,
        location,
        monotonicDateNow,
        newWasmModule,
        patchedApplyFunc,
        patchDynlibLookup,
        reportUndefinedSymbolsPatched,
        wasmInstantiate,
        patched_PyEM_CountFuncParams,
    } from "pyodide-internal:pool/builtin_wrappers";
    '''
_NO_EVAL = ("(() => {throw new Error('Internal Emscripten code tried to eval, this should not happen, please file a bug "
            "report with your requirements.txt file\\'s contents')})()")
REPLACEMENTS = [
    ("var _createPyodideModule", _PRELUDE + "export const _createPyodideModule"),
    ("globalThis._createPyodideModule = _createPyodideModule;", ""),
    ("new WebAssembly.Module", "newWasmModule"),
    ("WebAssembly.instantiate", "wasmInstantiate"),
    ("Date.now", "monotonicDateNow"),
    ("reportUndefinedSymbols()", "reportUndefinedSymbolsPatched(Module)"),
    ("crypto.getRandomValues(", "getRandomValues(Module, "),
    ("eval(func)", _NO_EVAL),
    ("eval(data)", _NO_EVAL),
    ("eval(UTF8ToString(ptr))", _NO_EVAL),
    ("!libData", "!(libData ??= patchDynlibLookup(Module, libName))"),
    ("getMemory(", "Module.getMemoryPatched(Module, libName, "),
    ("nullToUndefined(func.apply(", "nullToUndefined(patchedApplyFunc(API, func, "),
    ("nullToUndefined(Function.prototype.apply.apply",
     "nullToUndefined(API.config.jsglobals.Function.prototype.apply.apply"),
    ("function _PyEM_CountFuncParams(func){",
     "function _PyEM_CountFuncParams(func){ return patched_PyEM_CountFuncParams(Module, func);"),
]
# the two that target other Pyodide versions (0.26's and 0.28's asm.js) and match nothing in 0.27.7's
NOT_IN_0_27 = {"nullToUndefined(func.apply(", "function _PyEM_CountFuncParams(func){"}
ESBUILD_EXTERNAL = ["child_process", "crypto", "fs", "path", "url", "vm", "ws", "node:child_process", "node:crypto",
                    "node:fs", "node:path", "node:url", "node:vm"]
BUNDLE_CAPNP = '''@0xbcc8f57c63814005;
using Modules = import "/workerd/jsg/modules.capnp";
const pyodideRuntimeBundle :Modules.Bundle = (modules = [
  (name = "pyodideRuntime-internal:python_stdlib.zip", data = embed "%(v)s/generated/python_stdlib.zip", type = internal),
  (name = "pyodideRuntime-internal:pyodide.asm.wasm", data = embed "%(v)s/generated/pyodide.asm.wasm", type = internal),
  (name = "pyodideRuntime-internal:emscriptenSetup.js", data = embed "%(v)s/generated/emscriptenSetup.js", type = internal)
]);
'''
ESBUILD_SCRIPT = '''
import * as esbuild from %(esbuild)s;
import config from "./internal/pool/esbuild.config.mjs";
await esbuild.build({...config, entryPoints: ["internal/pool/emscriptenSetup.ts"], bundle: true, format: "esm",
                     target: "esnext", external: %(external)s, outfile: "%(v)s/generated/emscriptenSetup.js",
                     logLevel: "error"});
'''


def node_modules() -> Path:
    return cloudflare_tools.node_modules(LANE)


def workerd_binary() -> Path:
    path = node_modules() / "@cloudflare" / "workerd-linux-64" / "bin" / "workerd"
    if not path.is_file():
        raise ToolError(f"{path}: npm did not install workerd's linux-64 binary")
    return path


def miniflare_module() -> Path:
    return node_modules() / "miniflare" / "dist" / "src" / "index.js"


def _capnp() -> str:
    capnp = shutil.which("capnp")
    if capnp is None or not Path("/usr/include/capnp/c++.capnp").is_file():
        raise ToolError("capnp and its schemas are not installed: apt-get install capnproto libcapnp-dev "
                        "(scripts/setup.sh does)")
    return capnp


def _key(*parts: bytes) -> str:
    h = hashlib.sha256()
    for p in parts:
        h.update(hashlib.sha256(p).digest())
    return h.hexdigest()[:16]


def _glue_files() -> list[Path]:
    return sorted(p for p in GLUE.rglob("*") if p.is_file())


def build_bundle(dest: Path) -> Path:
    """pyodide_dev.capnp.bin for workerd's `dev` Pyodide, into dest/ (built in a temporary dir)."""
    nm = node_modules()
    pyodide = nm / "pyodide"
    version = json.loads((pyodide / "package.json").read_text())["version"]
    if version != PYODIDE_VERSION:
        raise ToolError(f"npm pyodide is {version}, the lane pins {PYODIDE_VERSION}")
    with tempfile.TemporaryDirectory(prefix="knot-pyodide-bundle-") as tmp:
        work = Path(tmp)
        shutil.copytree(GLUE, work, dirs_exist_ok=True)
        gen = work / version / "generated"  # esbuild.config.mjs finds the version dir by its leading 0
        gen.mkdir(parents=True)
        src = (pyodide / "pyodide.asm.js").read_text(encoding="utf-8")
        for old, new in REPLACEMENTS:
            if old not in src and old not in NOT_IN_0_27:
                raise ToolError(f"pyodide.asm.js {version}: no {old!r} to patch")
            src = src.replace(old, new)
        (gen / "pyodide.asm.js").write_text(src, encoding="utf-8")
        for name in ("pyodide.asm.wasm", "python_stdlib.zip"):
            shutil.copy(pyodide / name, gen / name)
        (work / "esbuild.mjs").write_text(ESBUILD_SCRIPT % {
            "esbuild": json.dumps(str(nm / "esbuild" / "lib" / "main.js")),
            "external": json.dumps(ESBUILD_EXTERNAL), "v": version})
        proc = subprocess.run([str(cloudflare_tools.node()), "esbuild.mjs"], cwd=work, capture_output=True, text=True)
        if proc.returncode != 0:
            raise ToolError(f"esbuild of emscriptenSetup.ts failed: {(proc.stdout + proc.stderr)[-1500:]}")
        (work / "bundle.capnp").write_text(BUNDLE_CAPNP % {"v": version})
        out = dest / "pyodide_dev.capnp.bin"
        dest.mkdir(parents=True, exist_ok=True)
        partial = out.with_suffix(".partial")
        with open(partial, "wb") as f:
            proc = subprocess.run([_capnp(), "eval", "bundle.capnp", "pyodideRuntimeBundle", "-I", str(work),
                                   "-I", "/usr/include", "-o", "binary"], cwd=work, stdout=f, stderr=subprocess.PIPE,
                                  text=True, env={**os.environ, "PWD": str(work)})
        if proc.returncode != 0:
            raise ToolError(f"capnp eval failed: {proc.stderr[-1500:]}")
        got = sha256(partial)
        if got != BUNDLE_SHA256:
            raise ToolError(f"pyodide_dev.capnp.bin: sha256 {got}, pinned {BUNDLE_SHA256} (an input or a tool "
                            "changed: check it, then pin the new hash in tests/cloudflare/workerd_runtime.py)")
        os.replace(partial, out)
    return out


def _empty_tar_gz() -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.USTAR_FORMAT):
        pass
    return gzip.compress(buf.getvalue(), mtime=0)


def runtime_dir() -> Path:
    """The cache of the lane's runtime: bundle/ (the dev bundle), packages/ (the package disk cache),
    numpy/ (the wheel's files for python_modules/) and workerd (a wrapper adding the cache flags,
    which miniflare runs through MINIFLARE_WORKERD_PATH)."""
    lock = (LANE / "package-lock.json").read_bytes()
    key = _key(lock, *(p.read_bytes() for p in _glue_files()), BUNDLE_SHA256.encode(), Path(__file__).read_bytes())
    d = cloudflare_tools.root() / f"workerd-{key}"
    marker = d / ".built"
    if marker.is_file():
        return d
    binary = workerd_binary()
    tmp = Path(tempfile.mkdtemp(dir=cloudflare_tools.root(), prefix="workerd-partial-"))
    try:
        build_bundle(tmp / "bundle")
        pkgs = tmp / "packages" / "python-package-bucket" / STDLIB_PACKAGES_TAG
        pkgs.mkdir(parents=True)
        for name in STDLIB_PACKAGES:
            (pkgs / f"{name}-1.0.0.tar.gz").write_bytes(_empty_tar_gz())
        with zipfile.ZipFile(cloudflare_tools.numpy_wheel()) as z:
            z.extractall(tmp / "numpy")
        wrapper = tmp / "workerd"
        wrapper.write_text(f'#!/bin/sh\nexec "{binary}" "$@" --pyodide-bundle-disk-cache-dir="{d / "bundle"}" '
                           f'--pyodide-package-disk-cache-dir="{d / "packages"}"\n')
        wrapper.chmod(wrapper.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
        if d.exists():
            shutil.rmtree(d)
        os.replace(tmp, d)
        marker.write_text(key)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return d
