"""Replicas (issue 56 items 2 and 4): `knot cluster up --replicas 2` runs two processes of every
station range and shard slice. A stream whose station replica and then shard replica are killed
(kill -9) mid-generation moves to the other replicas, by exact replay for the station, and ends
with the fault-free text and no error event; the killed ones come back (the supervisor) and rejoin.
A stream whose shard has no replica left answering gets 503 naming the shard."""
import json
import os
import re
import signal
import time
from http.client import HTTPConnection
from urllib.parse import urlsplit

from common.topology import replica_service
from deploy import launcher

from .conftest import http, knot_cli, metric, wait_for

PROMPT = "the def the"
MAX_TOKENS = 160
KILL_STATION_AT, KILL_SHARD_AT = 6, 14  # events read before each kill: early, while the generation runs


def completion(url: str, **extra) -> tuple[int, dict]:
    code, _, raw = http("POST", url + "/v1/completions", {"prompt": PROMPT, "max_tokens": MAX_TOKENS,
                                                          "temperature": 0, **extra}, timeout_s=300)
    return code, json.loads(raw)


def replicas(url: str) -> dict[str, dict]:
    """binding -> {"range", "up", "generations"} from the coordinator's /metrics."""
    _, _, raw = http("GET", url + "/metrics")
    out: dict[str, dict] = {}
    for line in raw.decode().splitlines():
        m = re.match(r'knot_replica_(up|generations)\{(.*)\} (\S+)$', line)
        if m:
            labels = dict(re.findall(r'(\w+)="([^"]*)"', m[2]))
            out.setdefault(labels["binding"], {"range": labels["range"]})[m[1]] = float(m[3])
    return out


def pinned(url: str, rng: str) -> str:
    """The service of the replica of range rng ("station_1") that holds a generation."""
    held = [b for b, r in replicas(url).items() if r["range"] == rng and r.get("generations", 0) >= 1]
    assert len(held) == 1, replicas(url)
    return replica_service(held[0])


def kill(cluster: launcher.Cluster, name: str, sig: int = signal.SIGKILL) -> int:
    row = next(r for r in cluster.status() if r["name"] == name)
    os.kill(row["pid"], sig)
    return row["pid"]


def test_a_stream_survives_kill_9_of_a_station_replica_and_a_shard_replica(tmp_path, knot, monkeypatch):
    run_dir = tmp_path / "cluster"
    monkeypatch.setenv("PEER_WAIT_S", "4")  # failover never waits for it; the last replica's 503 does
    cluster = launcher.Cluster(run_dir)
    up = knot_cli(run_dir, "up", "--model", str(knot.path), "--shards", "2", "--replicas", "2")
    assert up.returncode == 0, up.stderr
    try:
        names = {r["name"] for r in cluster.status()}
        assert {"station-0", "station-0-r1", "station-1", "station-1-r1", "shard-0", "shard-0-r1",
                "shard-1", "shard-1-r1"} <= names, names
        url = up.stdout.strip().splitlines()[-1]
        code, baseline = completion(url)
        assert code == 200, baseline
        want = baseline["choices"][0]["text"]
        assert baseline["usage"]["completion_tokens"] > KILL_SHARD_AT + 16, baseline  # long enough to kill inside

        # -------- kill -9 the station replica and then the shard replica a stream is on, mid-stream
        u = urlsplit(url)
        conn = HTTPConnection(u.hostname, u.port, timeout=120)
        conn.request("POST", "/v1/completions", json.dumps({"prompt": PROMPT, "max_tokens": MAX_TOKENS,
                                                            "temperature": 0, "stream": True}),
                     {"Content-Type": "application/json"})
        resp = conn.getresponse()
        assert resp.status == 200
        text, events, killed, after = [], 0, {}, {}
        replays = metric(url, "knot_session_replays_total")
        while (line := resp.readline()) != b"":
            if not line.startswith(b"data: "):
                continue
            data = line[6:].strip()
            if data == b"[DONE]":
                break
            event = json.loads(data)
            assert "error" not in event, event
            text.append(event["choices"][0]["text"])
            events += 1
            for at, rng in ((KILL_STATION_AT, "station_1"), (KILL_SHARD_AT, "shard_0")):
                if events == at:
                    killed[rng] = pinned(url, rng)
                    kill(cluster, killed[rng])
                    after[rng] = events
        resp.close()
        conn.close()
        assert "".join(text) == want, ("".join(text), want)  # the fault-free text, no error
        assert set(killed) == {"station_1", "shard_0"}, killed
        assert events > KILL_SHARD_AT, f"the stream ended ({events} events) before both kills"
        assert metric(url, "knot_session_replays_total") - replays >= 1  # the station's move replayed
        assert metric(url, "knot_replica_outages_total") >= 2

        # -------- the killed replicas come back (the supervisor) and rejoin
        wait_for(lambda: all(r["up"] == 1 for r in replicas(url).values()), timeout_s=120,
                 what="every replica up again", poll_s=0.5)
        code, again = completion(url)
        assert code == 200 and again["choices"][0]["text"] == want, again

        # -------- generations spread: two at once take the two replicas of each range
        code, body = completion(url, n=2)
        assert code == 200 and [c["text"] for c in body["choices"]] == [want, want], body

        # -------- the last replica of a range: a shard none of whose replicas answers is a 503 naming it
        stopped = [kill(cluster, name, signal.SIGSTOP) for name in ("shard-1", "shard-1-r1")]
        try:
            t0 = time.monotonic()
            code, body = completion(url)
            waited = time.monotonic() - t0
        finally:
            for pid in stopped:
                os.kill(pid, signal.SIGCONT)
        assert code == 503, body
        message = body["error"]["message"]
        assert "shard 1" in message and "none of its 2 replicas is up" in message, message
        assert waited < 60, waited
        wait_for(lambda: completion(url)[0] == 200, timeout_s=60, what="the shard answering again")
    finally:
        down = knot_cli(run_dir, "down")
    assert down.returncode == 0, down.stderr
