"""`knot cluster up|status|down` end to end: its processes are the default layout's (docker-compose.yml's)."""
import asyncio
import json
import os
import signal
import stat
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import redis

from deploy import cluster_secrets, launcher, seaweedfs, servers
from deploy.local.server_bindings import S3Settings, S3Bucket

from .conftest import http, knot_cli, wait_for


def test_cluster_up_status_down_and_upload_once(tmp_path, knot):
    run_dir = tmp_path / "cluster"
    up = knot_cli(run_dir, "up", "--model", str(knot.path))
    try:
        assert up.returncode == 0, up.stderr
        state = json.loads((run_dir / "cluster.json").read_text())["services"]
        planned = launcher.plan(launcher.default_layout(), cluster_secrets.read(run_dir / launcher.SECRETS_FILE))
        assert [s["name"] for s in state] == [s.name for s in planned]  # the process set is the file's
        by_name = {s["name"]: s for s in state}
        assert (by_name["minio"]["kind"], by_name["redis"]["kind"], by_name["init"]["kind"]) == \
               ("seaweedfs", "redis", "oneshot")
        for name in ("layer-warden", "cobordism-warden"):
            status, _, body = http("GET", by_name[name]["url"] + "/healthz")
            assert status == 200 and json.loads(body)["service"] == name
            assert (run_dir / "logs" / f"{name}.log").read_text().count('"msg": "listening on') == 1

        status = knot_cli(run_dir, "status")
        assert status.returncode == 0, status.stdout + status.stderr
        serving = [s for s in planned if s.kind == "process" and not s.oneshot]
        assert len(serving) == 13  # 2 wardens, 2 stations, 8 shards, the coordinator
        assert status.stdout.count(" ready ") == len(serving) and status.stdout.count(" done ") == 1
        # the last line of `up` is the coordinator's URL, and it serves
        url = up.stdout.strip().splitlines()[-1]
        assert url == by_name["coordinator"]["url"]
        code, _, body = http("POST", url + "/generate", {"prompt": "the def", "max_tokens": 3}, timeout_s=120)
        assert code == 200 and len(json.loads(body)["tokens"]) == 3, body

        # Redis requires the password generated for this cluster; the services use it.
        secrets_file = run_dir / launcher.SECRETS_FILE
        assert stat.S_IMODE(secrets_file.stat().st_mode) == 0o600
        password = cluster_secrets.read(secrets_file)["KNOT_REDIS_PASSWORD"]
        with pytest.raises(redis.exceptions.AuthenticationError):
            redis.Redis.from_url(by_name["redis"]["url"], socket_timeout=5).ping()
        with redis.Redis.from_url(by_name["redis"]["url"], password=password, socket_timeout=5) as r:
            wait_for(lambda: r.dbsize() > 0, 20, "the CobordismWarden's rows in the KV")  # it authenticated
        assert password not in (run_dir / "cluster.json").read_text()
        for s in state:  # no process carries it in its command line (`ps` shows those to every user)
            if servers.pid_alive(s["pid"]) and s["kind"] != "oneshot":
                assert password.encode() not in Path(f"/proc/{s['pid']}/cmdline").read_bytes(), s["name"]

        # init uploaded the knot under the key derived from --model, with the cluster's bucket keys,
        # the only ones SeaweedFS takes (tests/integration/test_closed_bucket.py)
        keys = cluster_secrets.read(secrets_file)
        bucket = S3Bucket(S3Settings(by_name["minio"]["url"], keys["MINIO_ROOT_USER"], keys["MINIO_ROOT_PASSWORD"]),
                          "knots")
        meta = asyncio.run(bucket.head("tiny.knot"))
        asyncio.run(bucket.close())
        assert meta is not None and meta.size == len(knot.data)
        assert seaweedfs.anonymous_status(by_name["minio"]["url"]) == 403
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(by_name["minio"]["url"] + "/knots/tiny.knot", timeout=10).close()
        assert refused.value.code == 403, "an anonymous GET of the knot"
    finally:
        down = knot_cli(run_dir, "down")
    assert down.returncode == 0, down.stderr
    assert not any(servers.pid_alive(s["pid"]) for s in state)
    assert knot_cli(run_dir, "status").returncode == 3

    again = knot_cli(run_dir, "up", "--model", str(knot.path))
    try:
        assert again.returncode == 0, again.stderr
        assert "already present" in (run_dir / "logs" / "init.log").read_text()  # only the first start uploads
        assert cluster_secrets.read(secrets_file)["KNOT_REDIS_PASSWORD"] == password  # kept across restarts
        redis_url = {s["name"]: s for s in json.loads((run_dir / "cluster.json").read_text())["services"]}["redis"]["url"]
        with redis.Redis.from_url(redis_url, password=password, socket_timeout=5) as r:
            assert r.ping()
    finally:
        assert knot_cli(run_dir, "down").returncode == 0
    # The password appears in no log, no state file and no output of the launcher.
    outputs = [up.stdout, up.stderr, status.stdout, status.stderr, again.stdout, again.stderr]
    files = [p for p in run_dir.rglob("*") if p.is_file() and p.name not in ("secrets.env", "redis.conf",
                                                                             seaweedfs.IDENTITIES_FILE)
             and p.suffix in (".log", ".json", ".txt", "")]
    assert {"coordinator.log", "cobordism-warden.log", "redis.log", "init.log"} <= {p.name for p in files}
    for secret in (password, keys["MINIO_ROOT_PASSWORD"]):
        leaks = [str(p) for p in files if secret.encode() in p.read_bytes()]
        leaks += [f"output {i}" for i, text in enumerate(outputs) if secret in text]
        assert not leaks, leaks


def test_cluster_with_a_drafter_reads_the_prompt_ahead_and_changes_no_token(tmp_path, knot):
    """`knot cluster up --draft-model`: the drafter is a process of its own; a greedy request without
    a speculation of its own drafts with it (auto), the drafter read the prompt through /prime before
    the first draft, and the tokens are speculation off's. The tiny model drafts for itself."""
    run_dir = tmp_path / "cluster"
    up = knot_cli(run_dir, "up", "--model", str(knot.path), "--draft-model", str(knot.path))
    try:
        assert up.returncode == 0, up.stderr
        url = up.stdout.strip().splitlines()[-1]
        body = {"prompt": "the def the def", "max_tokens": 12, "temperature": 0}
        runs = {}
        for spec in ("off", None):
            code, _, raw = http("POST", url + "/generate", {**body, **({"speculation": spec} if spec else {})},
                                timeout_s=120)
            assert code == 200, raw
            runs[spec] = json.loads(raw)
        s = runs[None]["timings"]["speculation"]
        assert s["source"] == "draft_model" and s["drafted"] > 0, s
        assert runs[None]["tokens"] == runs["off"]["tokens"]
        by_name = {s["name"]: s for s in json.loads((run_dir / "cluster.json").read_text())["services"]}
        stats_url = by_name["drafter"]["url"] + "/stats"
        # The coordinator releases the drafter's session after the response (ctx.wait_until), so
        # /stats may be asked before that release has landed: wait for it, a few seconds at most.
        deadline = time.monotonic() + 10
        while True:
            code, _, raw = http("GET", stats_url, headers=launcher.Cluster(run_dir).signed("GET", stats_url))
            assert code == 200, raw
            stats = json.loads(raw)
            if stats["sessions"] == 0 or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        assert stats["primes"] == 1 and stats["primed_tokens"] == len(runs[None]["prompt_tokens"]), stats
        assert stats["sessions"] == 0, f"not released within 10 s of the response: {stats}"
        # The drafter killed: the next generation goes on without it, with the same tokens, and says so.
        cluster = launcher.Cluster(run_dir)
        row = next(r for r in cluster.status() if r["name"] == "drafter")
        os.kill(row["pid"], signal.SIGKILL)
        code, _, raw = http("POST", url + "/generate", body, timeout_s=120)
        assert code == 200, raw
        r = json.loads(raw)
        assert r["tokens"] == runs["off"]["tokens"], r
        assert r["timings"]["speculation"]["drafter_error"] and r["timings"]["speculation"]["drafted"] == 0, r
    finally:
        assert knot_cli(run_dir, "down").returncode == 0
