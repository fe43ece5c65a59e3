"""wrangler 4 (Node 22, both from npm, cached) accepts every config `knot deploy cloudflare` writes:
`wrangler deploy --dry-run --outdir` bundles each Worker offline. The bundle sizes are printed
(docs/cloudflare.md quotes them) and must stay under the Workers script size limit."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tests.cloudflare import tools

SCRIPT_LIMIT_GZIP_KIB = 3 * 1024  # the Free plan's 3 MB compressed (Paid: 10 MB)
TOTAL = re.compile(r"Total Upload: ([\d.]+) KiB / gzip: ([\d.]+) KiB")


@pytest.fixture(scope="module")
def generated(tmp_path_factory):
    out = tmp_path_factory.mktemp("deploy")
    proc = subprocess.run([sys.executable, "-m", "deploy.cli", "deploy", "cloudflare", "--out", str(out),
                           "--model", "qwen2.5-coder-0.5b"], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert "13 Workers written" in proc.stdout
    return out


def dry_run(worker_dir: Path, home: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "WRANGLER_SEND_METRICS": "false", "HOME": str(home), "XDG_CONFIG_HOME": str(home / ".config"),
           "CI": "true", "NO_COLOR": "1"}
    return subprocess.run([*tools.wrangler_command(), "deploy", "--dry-run", "--outdir", str(worker_dir / "dist")],
                          cwd=worker_dir, env=env, capture_output=True, text=True, timeout=300)


def test_wrangler_dry_run_accepts_every_generated_worker(generated, tmp_path):
    dirs = sorted(d for d in generated.iterdir() if (d / "wrangler.json").is_file())
    assert len(dirs) == 13
    tools.node_modules()  # one npm ci before the parallel runs
    with ThreadPoolExecutor(max_workers=2) as pool:
        results = list(pool.map(lambda d: dry_run(d, tmp_path), dirs))
    sizes = {}
    for d, proc in zip(dirs, results):
        out = proc.stdout + proc.stderr
        assert proc.returncode == 0, f"{d.name}: wrangler failed:\n{out[-2000:]}"
        assert "--dry-run: exiting now." in out, out[-1000:]
        m = TOTAL.search(out)
        assert m, out[-1000:]
        sizes[d.name] = (float(m.group(1)), float(m.group(2)))
        assert (d / "dist" / "entry.py").is_file()
        assert (d / "dist" / "deploy" / "cloudflare" / "entry.py").is_file()
        assert (d / "dist" / "common" / "bpe.py").is_file()
        assert sizes[d.name][1] < SCRIPT_LIMIT_GZIP_KIB, d.name
        for binding in ("env.KNOT_BUCKET (knots)", "R2 Bucket"):
            assert binding in out, f"{d.name}: {binding!r} not in wrangler's binding table"
    co = generated / "knot-coordinator" / "dist" / "python_modules"
    assert {p.name for p in co.iterdir()} >= {"jinja2", "markupsafe", "prometheus_client"}
    print("\nbundle sizes (KiB, gzip KiB):")
    for name, (raw, gz) in sizes.items():
        print(f"  {name:24s} {raw:9.2f} {gz:9.2f}")
