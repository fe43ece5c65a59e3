"""wrangler 4 (Node 22, both from npm, cached) accepts every config `knot deploy cloudflare` writes:
`wrangler deploy --dry-run --outdir` bundles each Worker offline. The bundle sizes are printed
(docs/cloudflare.md quotes them) and must stay under the Workers script size limit."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from deploy import cluster_secrets, wrangler
from tests.cloudflare import cloudflare_tools

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
    return subprocess.run([*cloudflare_tools.wrangler_command(), "deploy", "--dry-run", "--outdir",
                           str(worker_dir / "dist")], cwd=worker_dir, env=env, capture_output=True, text=True, timeout=300)


def test_wrangler_dry_run_accepts_every_generated_worker(generated, tmp_path):
    dirs = sorted(d for d in generated.iterdir() if (d / "wrangler.json").is_file())
    assert len(dirs) == 13
    cloudflare_tools.node_modules()  # one npm ci before the parallel runs
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


def _configs(out: Path) -> dict[str, dict]:
    return {d.name: json.loads((d / "wrangler.json").read_text())
            for d in sorted(out.iterdir()) if (d / "wrangler.json").is_file()}


def test_no_generated_internal_worker_could_be_published(generated):
    """Every config the command wrote, read back: only the coordinator is on workers.dev, nothing has a
    route or preview URLs, every Worker signs and checks its calls, and the coordinator wants an API key."""
    configs = _configs(generated)
    assert len(configs) == 13
    assert wrangler.exposure_problems(configs) == []
    for name, cfg in configs.items():
        secrets = cfg["vars"]["KNOT_SECRETS"].split(",")
        assert "KNOT_INTERNAL_SECRET" in secrets and "KNOT_INTERNAL_SECRET" not in cfg["vars"], name
        assert cfg["preview_urls"] is False and "route" not in cfg and "routes" not in cfg, name
        assert cfg["workers_dev"] is (name == "knot-coordinator"), name
    co = configs["knot-coordinator"]
    assert "KNOT_API_KEY" in co["vars"]["KNOT_SECRETS"].split(",") and "KNOT_API_KEY" not in co["vars"]
    # the check itself catches each way out
    leaky = json.loads(json.dumps(configs))
    leaky["knot-shard-3"]["workers_dev"] = True
    leaky["knot-station-0"].pop("workers_dev")
    leaky["knot-layer-warden"]["routes"] = [{"pattern": "warden.example.com/*"}]
    leaky["knot-cobordism-warden"]["preview_urls"] = True
    leaky["knot-shard-0"]["vars"]["KNOT_SECRETS"] = ""
    leaky["knot-coordinator"]["vars"]["KNOT_SECRETS"] = "KNOT_INTERNAL_SECRET"
    found = "\n".join(wrangler.exposure_problems(leaky))
    for name in ("knot-shard-3", "knot-station-0", "knot-layer-warden", "knot-cobordism-warden", "knot-shard-0",
                 "knot-coordinator"):
        assert name in found, (name, found)
    assert wrangler.exposure_problems({"knot-coordinator": leaky["knot-coordinator"]}, public=True) == []
    # the README sets the secrets and uploads through the S3 API, never `wrangler r2 object put`
    readme = (generated / "README.md").read_text()
    assert "npx wrangler r2 object put" not in readme and " --upload" in readme
    assert readme.count("npx wrangler secret put KNOT_INTERNAL_SECRET") == 13
    assert "npx wrangler secret put KNOT_API_KEY" in readme and "Authorization: Bearer" in readme
    secrets_env = generated / "secrets.env"
    assert secrets_env.stat().st_mode & 0o777 == 0o600
    assert {"KNOT_API_KEY", "KNOT_INTERNAL_SECRET"} <= set(cluster_secrets.read(secrets_env))


def test_public_writes_a_coordinator_without_a_key_and_keeps_the_secrets(tmp_path):
    out = tmp_path / "public"
    for _ in range(2):
        proc = subprocess.run([sys.executable, "-m", "deploy.cli", "deploy", "cloudflare", "--out", str(out),
                               "--model", "qwen2.5-coder-0.5b", "--public", "--plan", "free"],
                              capture_output=True, text=True)
        assert proc.returncode == 0, proc.stderr
        first = cluster_secrets.read(out / "secrets.env") if _ == 0 else first
    assert cluster_secrets.read(out / "secrets.env") == first and "KNOT_API_KEY" not in first  # kept, not regenerated
    co = _configs(out)["knot-coordinator"]
    assert co["vars"]["KNOT_SECRETS"] == "KNOT_INTERNAL_SECRET" and co["vars"]["SUBREQUEST_LIMIT"] == "50"
    assert "free 50 subrequests -> 3 tokens" in proc.stdout and "paid 10,000 subrequests -> 908 tokens" in proc.stdout
    assert wrangler.exposure_problems(_configs(out), public=True) == []
