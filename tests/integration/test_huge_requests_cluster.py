"""Issue 12 on real processes: huge requests in flight do not delay the coordinator's other
endpoints, are refused with 413 / 400, and leave its memory where it was."""
from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor

from tests.integration.conftest import http
from tests.integration.test_pipeline_cluster import cluster, engine  # noqa: F401 - the same real cluster

QUICK_S = 1.0  # a correctness bound (the event loop is free), not a benchmark


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/statm") as f:
        return int(f.read().split()[1]) * 4096


def test_huge_requests_do_not_stall_the_coordinator(cluster):  # noqa: F811
    url = cluster.url("coordinator")
    pid = cluster.running["coordinator"].pid
    assert http("GET", url + "/v1/models")[0] == 200  # booted
    before = rss_bytes(pid)
    huge = json.dumps({"prompt": "x" * (50 << 20), "max_tokens": 1}).encode()  # 50 MB: over the 4 MiB limit
    big = json.dumps({"prompt": "the def " * (480 << 10), "max_tokens": 1}).encode()  # 3.9 MB: under it
    slowest: dict[str, float] = {}
    with ThreadPoolExecutor(4) as pool:
        posts = [pool.submit(http, "POST", url + path, body, {"Content-Type": "application/json"}, 120.0)
                 for path, body in (("/v1/completions", huge), ("/generate", big), ("/v1/completions", huge))]
        while not all(p.done() for p in posts):
            for path in ("/v1/models", "/readyz", "/metrics"):
                t0 = time.perf_counter()
                status, _, raw = http("GET", url + path, timeout_s=30.0)
                slowest[path] = max(slowest.get(path, 0.0), time.perf_counter() - t0)
                assert status == 200, (path, raw[:200])
        statuses = [p.result()[0] for p in posts]
    assert all(s < QUICK_S for s in slowest.values()), slowest
    assert statuses == [413, 400, 413], statuses
    after = rss_bytes(pid)
    assert after - before < 64 << 20, f"coordinator RSS {before} -> {after} bytes"
