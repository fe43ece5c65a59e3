"""A closed bucket (issue 52 item 4), as files: the cluster's secrets hold the bucket's keys, the
generated docker-compose.yml wants them (MinIO's root user, every service's AWS_*), and the offline
stand-in runs SeaweedFS with them as its one identity, out of argv. The servers themselves refuse
anonymous and wrong-key calls in tests/integration/test_closed_bucket.py."""
from __future__ import annotations

import json
import os
import re
import stat
import subprocess
import sys

import pytest
import yaml

from deploy import cluster_secrets, compose_writer, seaweedfs
from deploy.local import compose_reader

ROOT = compose_reader.REPO_ROOT
IMAGE_PATH = "/usr/local/lib/knot/seaweedfs.py"


def test_knot_secrets_writes_the_buckets_keys_minio_accepts(tmp_path, capsys):
    from deploy.cli import main

    env_file = tmp_path / ".env"
    assert main(["secrets", "--file", str(env_file)]) == 0
    values = cluster_secrets.read(env_file)
    assert stat.S_IMODE(env_file.stat().st_mode) == 0o600
    # MinIO's own generator's form: 20 and 40 letters and digits (an access key is a SigV4 field)
    assert re.fullmatch(r"[A-Za-z0-9]{20}", values["MINIO_ROOT_USER"])
    assert re.fullmatch(r"[A-Za-z0-9]{40}", values["MINIO_ROOT_PASSWORD"])
    out = capsys.readouterr().out
    assert "MINIO_ROOT_PASSWORD" in out and values["MINIO_ROOT_PASSWORD"] not in out
    assert main(["secrets", "--file", str(env_file)]) == 0 and cluster_secrets.read(env_file) == values, "kept"
    assert cluster_secrets.ensure(tmp_path / "other.env")["MINIO_ROOT_PASSWORD"] != values["MINIO_ROOT_PASSWORD"]


def test_compose_wants_the_keys_and_gives_every_service_the_buckets_own():
    text = compose_reader.COMPOSE_FILE.read_text()
    doc = yaml.safe_load(text)
    for var in ("MINIO_ROOT_USER", "MINIO_ROOT_PASSWORD"):
        want = f"${{{var}:?{compose_writer.REQUIRED_HINTS[var]}}}"
        assert doc["services"]["minio"]["environment"][var] == want
        assert f"${{{var}:-" not in text, f"{var} has no default: a well-known key would open the bucket"
    env = {"KNOT_REDIS_PASSWORD": "p", "KNOT_INTERNAL_SECRET": "k" * 43}
    with pytest.raises(compose_reader.ComposeError, match="MINIO_ROOT_USER is not set: .*run knot secrets"):
        compose_reader.load(compose_reader.COMPOSE_FILE, env)
    keys = {"MINIO_ROOT_USER": "A" * 20, "MINIO_ROOT_PASSWORD": "b" * 40}
    services = compose_reader.load(compose_reader.COMPOSE_FILE, {**env, **keys})["services"]
    ours = [s for s in services.values() if "S3_ENDPOINT_URL" in s.get("environment", {})]
    assert len(ours) == len(services) - 2  # all but the stores
    assert all(s["environment"]["AWS_ACCESS_KEY_ID"] == "A" * 20 and
               s["environment"]["AWS_SECRET_ACCESS_KEY"] == "b" * 40 for s in ours)
    assert services["minio"]["environment"] == keys


def test_the_offline_stand_in_runs_seaweedfs_with_the_minio_services_keys():
    override = yaml.safe_load((ROOT / "deploy/docker/offline.yml").read_text().replace("!reset", ""))
    minio = override["services"]["minio"]
    assert minio["command"] is None and "environment" not in minio, "the image's command, compose's MINIO_ROOT_*"
    assert minio["healthcheck"]["test"] == ["CMD", "python3", IMAGE_PATH, "check", "http://127.0.0.1:9000"]
    dockerfile = (ROOT / "deploy/docker/standins.Dockerfile").read_text()
    stage = dockerfile[dockerfile.index("AS seaweedfs"):dockerfile.index("AS valkey")]
    assert f"COPY seaweedfs.py {IMAGE_PATH}" in stage
    cmd = json.loads(re.search(r"^CMD (\[.*?\])$", stage, re.S | re.M).group(1).replace("\\\n", ""))
    assert cmd[:5] == ["python3", IMAGE_PATH, "serve", "/data", "-ip=127.0.0.1"] and "-s3.port=9000" in cmd
    assert not any(a.startswith(("-s3.config", "-dir")) for a in cmd), "serve adds them; no key is an argument"
    script = (ROOT / "scripts/docker-images.sh").read_text()
    assert 'cp deploy/seaweedfs.py "$ctx/seaweedfs.py"' in script
    assert script.index("seaweedfs.py") < script.index("for target in seaweedfs"), "in the context before the build"


def test_the_stand_in_module_needs_only_the_standard_library(tmp_path):
    """It runs alone in the image: isolated mode, from another directory, nothing of the project importable."""
    module = ROOT / "deploy" / "seaweedfs.py"
    p = subprocess.run([sys.executable, "-I", str(module), "check", "http://127.0.0.1:9"], cwd=tmp_path,
                       env={"MINIO_ROOT_USER": "u" * 20, "MINIO_ROOT_PASSWORD": "p" * 40},
                       capture_output=True, text=True, timeout=30)
    assert p.returncode == 1 and not p.stderr, p.stderr  # nothing listens there: unhealthy, and no ImportError
    p = subprocess.run([sys.executable, "-I", str(module), "serve", str(tmp_path)], cwd=tmp_path,
                       env={}, capture_output=True, text=True, timeout=30)
    assert p.returncode == 1 and "MINIO_ROOT_USER and MINIO_ROOT_PASSWORD must be set" in p.stderr
    imports = re.findall(r"^(?:from|import) (\S+)", module.read_text(), re.M)
    assert not [m for m in imports if m.split(".")[0] in ("deploy", "common", "services", "tests")], imports


def test_the_identities_file_holds_one_identity_mode_600(tmp_path):
    path = tmp_path / seaweedfs.IDENTITIES_FILE
    path.write_text("{}")
    os.chmod(path, 0o644)  # a leftover of another mode: rewritten 0600
    seaweedfs.write_identities(str(path), "A" * 20, "b" * 40)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    (identity,) = json.loads(path.read_text())["identities"]
    assert identity["credentials"] == [{"accessKey": "A" * 20, "secretKey": "b" * 40}]
    assert set(identity["actions"]) == {"Admin", "Read", "List", "Tagging", "Write"}
    with pytest.raises(ValueError, match="access key and a secret key"):
        seaweedfs.write_identities(str(path), "", "b" * 40)
    a, b = seaweedfs.weed_env({"PATH": "/bin"}), seaweedfs.weed_env({"PATH": "/bin"})
    assert set(seaweedfs.JWT_KEYS) <= set(a) and all(a[k] != b[k] for k in seaweedfs.JWT_KEYS), "fresh per start"
