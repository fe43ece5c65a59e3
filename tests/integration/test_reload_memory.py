"""Issue 52 item 8 on real processes (the coordinator, 2 stations, 8 shards and both wardens as
docker-compose.yml defines them, on SeaweedFS and Redis): the knot uploaded again 10 times, a
request after each, and every service's RSS after the tenth reload within 10% of its RSS after the
first. Each upload is the same bytes in parts of another size, so S3 gives it a new etag: a new
version that every service loads (the pinned digest is the same). The stations hold their layer
(~8 MB each) once, where they used to hold another version's per reload.

benchmarks/reload_rss.py measures the same on a `knot cluster up` cluster of the real 0.5B
(docs/reliability.md)."""
from __future__ import annotations

import json
import re
import time

import pytest
from boto3.s3.transfer import TransferConfig

from deploy.local.server_bindings import s3_client
from tests.integration.conftest import BUCKET, PIPELINE, http, pipeline_services

KNOT_KEY = "reload-memory.knot"
PROMPT = "the def the"
RELOADS = 10
SETTLE_S = 1.0  # after a request: the background work it left (wait_until) ends
MAX_GROWTH = 1.10


@pytest.fixture(scope="module")
def s3(s3_settings, upload):
    upload("tests/reload-memory-marker.knot")  # makes sure the bucket exists
    return s3_client(s3_settings)


def put(s3, knot, i: int) -> str:
    """The knot's bytes again, in parts of 5 MiB + i KiB -> the object's new etag."""
    cfg = TransferConfig(multipart_threshold=1, multipart_chunksize=(5 << 20) + (i << 10))
    s3.upload_file(str(knot.path), BUCKET, KNOT_KEY, Config=cfg)
    return s3.head_object(Bucket=BUCKET, Key=KNOT_KEY)["ETag"]


@pytest.fixture(scope="module")
def cluster(procs, s3, knot):
    put(s3, knot, 0)
    with pipeline_services(procs, knot.path, KNOT_KEY) as p:
        yield p


def tokens(cluster) -> list[int]:
    for _ in range(10):  # a hop mid-reload may answer 503; the next request finds it loaded
        status, _, raw = http("POST", cluster.url("coordinator") + "/generate", {"prompt": PROMPT, "max_tokens": 6},
                              timeout_s=120)
        if status != 503:
            break
        time.sleep(0.5)
    assert status == 200, raw
    return json.loads(raw)["tokens"]


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))


def metric(cluster, name: str) -> dict[str, float]:
    """The series of one metric of the coordinator's /metrics: labels -> value."""
    _, _, raw = http("GET", cluster.url("coordinator") + "/metrics")
    return {m.group(1) or "": float(m.group(2)) for line in raw.decode().splitlines()
            if (m := re.match(rf"^{name}(\{{[^}}]*\}})? (\S+)$", line))}


def test_rss_after_ten_reloads_stays_within_ten_percent_of_after_one(cluster, s3, knot):
    baseline = tokens(cluster)
    etags = {s3.head_object(Bucket=BUCKET, Key=KNOT_KEY)["ETag"]}
    rss: list[dict[str, int]] = []
    for i in range(1, RELOADS + 1):
        etag = put(s3, knot, i)
        assert etag not in etags, f"upload {i} kept an earlier etag {etag}: no new version to reload"
        etags.add(etag)
        assert tokens(cluster) == baseline
        time.sleep(SETTLE_S)
        rss.append({name: rss_bytes(cluster.running[name].pid) for name in PIPELINE})

    assert sum(metric(cluster, "knot_version_reloads_total").values()) == RELOADS
    per_service = metric(cluster, "knot_service_version_reloads_total")
    assert per_service and all(v == RELOADS for v in per_service.values()), per_service
    mib = {name: [round(r[name] / 2**20, 1) for r in rss] for name in PIPELINE}
    grown = {name: f"{mib[name][0]} -> {mib[name][-1]} MiB" for name in PIPELINE
             if rss[-1][name] > MAX_GROWTH * rss[0][name]}
    assert not grown, f"RSS after {RELOADS} reloads over {MAX_GROWTH}x that after one: {grown}; every sample: {mib}"
