"""The size of each Worker `knot deploy cloudflare` writes, as uploaded: its modules (src/ and
python_modules/, as wrangler and the workerd lane read them) with numpy 2.0.2 vendored as
`pywrangler sync` does, raw and gzip-compressed (a tar.gz of the modules: what the upload limits
count). docs/cloudflare.md's table comes from

    PYTHONPATH=$PWD python -m tests.cloudflare.bundle_sizes

over the 0.5B's layout (the code does not depend on the model; one Worker per role is shown).
"""
from __future__ import annotations

import io
import tarfile
import tempfile
from pathlib import Path

from deploy import wrangler
from tests.cloudflare import workerd_runtime


def modules(worker_dir: Path, numpy_dir: Path | None) -> list[tuple[str, Path]]:
    """(module name, file) as workerd_lane/lane.mjs loads them: no caches, no dist-info."""
    out = []
    roots = [(worker_dir / "src", ""), (worker_dir / "python_modules", "python_modules/")]
    if numpy_dir is not None:
        roots.append((numpy_dir, "python_modules/"))
    for root, prefix in roots:
        if not root.exists():
            continue
        for f in sorted(p for p in root.rglob("*") if p.is_file()):
            name = prefix + str(f.relative_to(root))
            if "__pycache__" not in name and ".dist-info/" not in name:
                out.append((name, f))
    return out


def sizes(mods: list[tuple[str, Path]]) -> tuple[int, int, int]:
    """(files, bytes, bytes as a tar.gz)."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz", compresslevel=6) as tar:
        for name, f in mods:
            tar.add(f, arcname=name)
    return len(mods), sum(f.stat().st_size for _, f in mods), buf.tell()


def main() -> None:
    numpy_dir = workerd_runtime.runtime_dir() / "numpy"
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        workers = wrangler.plan(24, 151936, "model.knot")
        wrangler.write(out, workers)
        print("| Worker | modules | bytes | gzip | with numpy 2.0.2: modules | bytes | gzip |")
        print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
        seen = set()
        for w in workers:
            if w.role in seen:
                continue
            seen.add(w.role)
            n, raw, gz = sizes(modules(out / w.name, None))
            n_np, raw_np, gz_np = sizes(modules(out / w.name, numpy_dir))
            print(f"| {w.name} | {n} | {raw / 1024:.0f} KiB | {gz / 1024:.0f} KiB | {n_np} | {raw_np / 2**20:.1f} MiB "
                  f"| {gz_np / 2**20:.1f} MiB |")


if __name__ == "__main__":
    main()
