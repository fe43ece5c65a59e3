"""The Docker deployment as files: supervision and limits in the generated docker-compose.yml,
cheap healthchecks, the offline override and the scripts that build what it names."""
from __future__ import annotations

import re

import yaml

from deploy import compose_writer
from deploy.launcher import default_layout
from deploy.local import compose_reader

ROOT = compose_reader.REPO_ROOT
SIZE = re.compile(r"(\d+)([kmg])")
SECRETS = {"KNOT_REDIS_PASSWORD": "generated", "KNOT_INTERNAL_SECRET": "k" * 43,
           "MINIO_ROOT_USER": "bucket-key", "MINIO_ROOT_PASSWORD": "bucket-secret-key"}  # what `knot secrets` writes to .env; compose refuses to start without them


def size_bytes(text: str) -> int:
    n, unit = SIZE.fullmatch(text).groups()
    return int(n) << {"k": 10, "m": 20, "g": 30}[unit]


def test_every_container_is_supervised_and_limited():
    doc = compose_reader.load(compose_reader.COMPOSE_FILE, SECRETS)  # the defaults, as `docker compose up` sees them
    for name, s in doc["services"].items():
        assert s["restart"] == ("no" if name == "init" else "unless-stopped"), name
        assert s["memswap_limit"] == s["mem_limit"], name  # no swap beyond the limit
        assert 64 << 20 <= size_bytes(s["mem_limit"]) <= 3 << 30, (name, s["mem_limit"])
        test = (s.get("healthcheck") or {}).get("test", [])
        assert "python" not in test, f"{name}: a healthcheck that starts an interpreter"
    assert size_bytes(doc["services"]["station-0"]["mem_limit"]) > int(
        doc["services"]["station-0"]["environment"]["MEMORY_BUDGET_BYTES"])
    assert size_bytes(doc["services"]["layer-warden"]["mem_limit"]) > int(
        doc["services"]["layer-warden"]["environment"]["MEMORY_BUDGET_BYTES"])


def test_only_the_coordinator_publishes_on_loopback_by_default():
    doc = compose_reader.load(compose_reader.COMPOSE_FILE, SECRETS)
    assert {n for n, s in doc["services"].items() if s.get("ports")} == {"coordinator"}
    assert doc["services"]["coordinator"]["ports"] == ["127.0.0.1:8000:8080"]
    doc = compose_reader.load(compose_reader.COMPOSE_FILE,
                              {**SECRETS, "KNOT_PUBLISH_ADDRESS": "0.0.0.0", "KNOT_PORT": "9001"})
    assert doc["services"]["coordinator"]["ports"] == ["0.0.0.0:9001:8080"]


def test_http_probe_is_bash_only_and_the_launcher_reads_its_url():
    test = compose_writer.http_probe("http://127.0.0.1:8080/readyz")
    assert test[:3] == ("CMD", "bash", "-c") and "/dev/tcp/127.0.0.1/8080" in test[3]
    assert compose_writer.probe_url(list(test)) == "http://127.0.0.1:8080/readyz"
    assert compose_writer.probe_url(["CMD", "redis-cli", "ping"]) is None
    doc = compose_reader.load(compose_reader.COMPOSE_FILE, {**SECRETS, "KNOT_MODEL": "m", "KNOT_KEY": "k"})
    specs = {s.name: s for s in compose_reader.plan(doc)}
    assert specs["coordinator"].healthcheck_url == "http://127.0.0.1:8080/readyz"


def test_the_image_builds_on_a_chosen_base():
    doc = compose_reader.load(compose_reader.COMPOSE_FILE, SECRETS)
    builds = [s["build"] for s in doc["services"].values() if "build" in s]
    assert builds and all(b["args"] == {"PYTHON_IMAGE": "python:3.11-slim"} for b in builds)
    dockerfile = (ROOT / "deploy/docker/Dockerfile").read_text()
    assert "ARG PYTHON_IMAGE=python:3.11-slim" in dockerfile
    assert dockerfile.count("FROM ${PYTHON_IMAGE}") == 2  # a build stage and a runtime stage
    ignore = [line for line in (ROOT / ".dockerignore").read_text().splitlines() if line and line[0] != "#"]
    assert ignore[0] == "*" and "**/*.so" in ignore  # the sources only: no host-built kernels


def test_offline_override_replaces_exactly_the_stores_with_the_images_the_script_builds():
    layout = default_layout()
    stores = {s.name for s in layout.services if compose_writer.CONTAINERS[s.role].image is not None}
    override = yaml.safe_load((ROOT / "deploy/docker/offline.yml").read_text().replace("!reset", ""))
    assert set(override["services"]) == stores == {"minio", "redis"}
    script = (ROOT / "scripts/docker-images.sh").read_text()
    for s in override["services"].values():
        repo, tag = s["image"].split(":")
        assert f"{repo.split('/')[1]}:{tag}" in script, s["image"]
    assert override["services"]["redis"]["healthcheck"]["test"][:2] == ["CMD", "bash"]
    # SeaweedFS's: a signed ListBuckets answers 200 and an anonymous one 403 (tests/unit/test_closed_bucket_files.py)
    assert override["services"]["minio"]["healthcheck"]["test"][:4] == ["CMD", "python3",
                                                                       "/usr/local/lib/knot/seaweedfs.py", "check"]
