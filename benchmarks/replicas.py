"""What replicas cost and buy (issue 56, item 5), on clusters this script starts (`knot cluster up`):
aggregate decode at 1, 8 and 32 concurrent requests with 1 and 2 replicas of every station and
shard, and, with 2, the time from a replica's death (kill -9) to the stream's next token.

    python benchmarks/replicas.py [--model qwen2.5-coder-0.5b] [--concurrency 1,8,32]
                                  [--max-tokens 48] [--kills 3] [--json FILE]
    python benchmarks/replicas.py --url URL [--api-key-file F] [--label L] ...   aggregate decode only,
                                  of a running cluster (a Swarm: scripts/test-swarm.sh with KNOT_SWARM_KEEP=1)

Aggregate decode: N streamed completions started at once, each of a different short prompt,
greedy; the tokens each stream sent after its first, over the span from the earliest first token to
the latest last one. Failover: a stream of --fail-tokens tokens whose station replica (exit range),
then shard replica, is killed after a quarter and after half of them; the longest wait for a token
from the kill on, against the stream's median inter-token gap, and the stream's
text must equal a fault-free run's (else the run stops). The killed replica is restarted by the
supervisor and rejoins before the next round. Both clusters run the resident profile. --json
appends the figures as records (deploy/records.py).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import signal
import statistics
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

from common.topology import replica_service
from deploy import launcher, records
from deploy.machine import describe

PROMPTS = ["def fibonacci(n):", "class Stack:", "import json\n\ndef load(path):", "def quicksort(xs):",
           "# parse a CSV line\ndef parse(line):", "def is_prime(n):", "async def fetch(url):",
           "def merge(a, b):"]


HEADERS = {"Content-Type": "application/json"}  # and the API key, with --api-key-file


def stream(url: str, prompt: str, max_tokens: int, out: dict, on_event=None) -> None:
    """One streamed greedy completion: out gets its chunks' arrival times and text."""
    req = urllib.request.Request(url + "/v1/completions", json.dumps(
        {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True}).encode(), HEADERS)
    times, text = [], []
    with urllib.request.urlopen(req, timeout=1800) as r:
        for line in r:
            if not line.startswith(b"data: {"):
                continue
            event = json.loads(line[6:])
            if "error" in event:
                raise RuntimeError(f"error event: {event}")
            times.append(time.perf_counter())
            text.append(event["choices"][0]["text"])
            if on_event is not None:
                on_event(len(times))
    out.update(times=times, text="".join(text))


def aggregate(url: str, n: int, max_tokens: int) -> float:
    """Decode tokens per second of n concurrent streams."""
    outs = [{} for _ in range(n)]
    threads = [threading.Thread(target=stream, args=(url, PROMPTS[i % len(PROMPTS)] + f"  # {i}", max_tokens,
                                                     outs[i])) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if any("times" not in o or len(o["times"]) < 2 for o in outs):
        raise RuntimeError("a stream failed or sent under two chunks")
    first, last = min(o["times"][0] for o in outs), max(o["times"][-1] for o in outs)
    return sum(len(o["times"]) - 1 for o in outs) / (last - first)


def replica_loads(url: str) -> dict[str, tuple[str, int]]:
    """binding -> (range, generations pinned) from /v1/models (no call to the peers, unlike /metrics)."""
    with urllib.request.urlopen(url + "/v1/models", timeout=60) as r:
        card = json.load(r)["data"][0]
    return {rep["binding"]: (rng, rep["generations"]) for rng, reps in card["replicas"].items() for rep in reps}


def all_up(url: str) -> bool:
    with urllib.request.urlopen(url + "/metrics", timeout=60) as r:
        return all(float(v) == 1 for v in re.findall(r'knot_replica_up\{[^}]*\} (\S+)', r.read().decode()))


def failover(url: str, cluster: launcher.Cluster, tokens: int, want: str) -> dict:
    """One stream; kill -9 its exit station's replica at a quarter, its shard 0 replica at half. Per
    kill, the longest wait for a token from the kill on: the failover's stall (events already on the
    way when it landed arrive at once, then the replay's)."""
    kills: dict[int, str] = {tokens // 4: "station 1", tokens // 2: "shard 0"}
    pids = {r["name"]: r["pid"] for r in cluster.status()}
    at: dict[str, float] = {}

    def on_event(k: int) -> None:
        rng = kills.get(k)
        if rng is None:
            return
        binding = next(b for b, (r, load) in replica_loads(url).items() if r == rng and load >= 1)
        os.kill(pids[replica_service(binding)], signal.SIGKILL)
        at[rng] = time.perf_counter()

    out: dict = {}
    stream(url, PROMPTS[0], tokens, out, on_event)
    if out["text"] != want:
        raise RuntimeError(f"failover changed the text:\n{out['text']!r}\nfault-free:\n{want!r}")
    times = out["times"]
    gaps = [b - a for a, b in zip(times, times[1:])]

    def stall(t_kill: float) -> float:
        after = [t for t in times if t > t_kill]
        return max(b - a for a, b in zip([t_kill, *after], after))

    return {"median_gap_s": statistics.median(gaps), "station_gap_s": stall(at["station 1"]),
            "shard_gap_s": stall(at["shard 0"])}


def run_cluster(model: str, replicas: int, args) -> dict:
    run_dir = Path(tempfile.mkdtemp(prefix=f"knot-replicas-{replicas}-"))
    cluster = launcher.Cluster(run_dir)
    print(f"-- {replicas} replica(s): starting the cluster in {run_dir}", file=sys.stderr, flush=True)
    wide = str(max(args.concurrency))  # every stream runs at once, none queued
    running = cluster.up(model=model, profile="resident", replicas=replicas,
                         env={**os.environ, "MAX_CONCURRENT_REQUESTS": wide, "MAX_QUEUED_REQUESTS": wide})
    url = next(r.url for r in running if r.published)
    try:
        stream(url, PROMPTS[0], 8, {})  # warm-up: every replica's first forward
        got = {}
        for n in args.concurrency:
            aggregate(url, n, 8)  # warm-up at this width
            got[n] = aggregate(url, n, args.max_tokens)
            print(f"   {n:>2} concurrent: {got[n]:.1f} tok/s aggregate", file=sys.stderr, flush=True)
        result = {"aggregate": got}
        if replicas > 1:
            base: dict = {}
            stream(url, PROMPTS[0], args.fail_tokens, base)
            rounds = []
            for k in range(args.kills):
                deadline = time.monotonic() + 180
                while not all_up(url):
                    if time.monotonic() > deadline:
                        raise RuntimeError("the killed replicas did not rejoin within 180 s")
                    time.sleep(1)
                rounds.append(failover(url, cluster, args.fail_tokens, base["text"]))
                print(f"   failover round {k + 1}: {rounds[-1]}", file=sys.stderr, flush=True)
            result["failover"] = rounds
        return result
    finally:
        cluster.down()


def running_cluster(args, machine: dict) -> None:
    """Aggregate decode of the cluster at args.url, at each concurrency."""
    if args.api_key_file:
        from deploy import cluster_secrets
        HEADERS["Authorization"] = f"Bearer {cluster_secrets.read(args.api_key_file)['KNOT_API_KEY']}"
    stream(args.url, PROMPTS[0], 8, {})
    got = {}
    for n in args.concurrency:
        aggregate(args.url, n, 8)
        got[n] = aggregate(args.url, n, args.max_tokens)
    print(f"{machine.get('cpu')} (family {machine.get('family')}, model {machine.get('model')}), "
          f"{os.cpu_count()} cores; {args.url} ({args.label or 'a running cluster'}), {args.max_tokens} tokens a stream")
    for n in args.concurrency:
        print(f"{n:>3} concurrent: {got[n]:.1f} tok/s aggregate")
    if args.json:
        date, mach = time.strftime("%Y-%m-%d", time.gmtime()), records.machine_of(machine)
        cmd = f"python benchmarks/replicas.py --url URL --label {args.label!r}"
        records.append(args.json, [records.record(date, mach, cmd, f"aggregate decode, {n} concurrent, {args.label}",
                                                  round(got[n], 1), "tok/s", f"{args.max_tokens} tokens a stream",
                                                  model=args.model) for n in args.concurrency])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="qwen2.5-coder-0.5b")
    p.add_argument("--concurrency", default="1,8,32", type=lambda s: [int(x) for x in s.split(",")])
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--fail-tokens", type=int, default=96)
    p.add_argument("--kills", type=int, default=3)
    p.add_argument("--json", type=Path, default=None, metavar="FILE", help="append the figures as records")
    p.add_argument("--url", default=None, help="measure this running cluster's aggregate decode only")
    p.add_argument("--api-key-file", type=Path, default=None, help="a dotenv file with its KNOT_API_KEY")
    p.add_argument("--label", default="", help="with --url: what the cluster is, for the records' metric")
    args = p.parse_args()
    machine = describe()
    if args.url:
        return running_cluster(args, machine)
    results = {r: run_cluster(args.model, r, args) for r in (1, 2)}
    print(f"{machine.get('cpu')} (family {machine.get('family')}, model {machine.get('model')}), "
          f"{os.cpu_count()} cores; {args.model}, resident profile, {args.max_tokens} tokens a stream")
    print(f"{'concurrent':>10} {'1 replica':>12} {'2 replicas':>12} {'ratio':>7}")
    for n in args.concurrency:
        a, b = results[1]["aggregate"][n], results[2]["aggregate"][n]
        print(f"{n:>10} {a:>8.1f} tok/s {b:>8.1f} tok/s {b / a:>6.2f}x")
    rounds = results[2]["failover"]
    gaps = {k: statistics.median(r[k] for r in rounds) for k in ("median_gap_s", "station_gap_s", "shard_gap_s")}
    print(f"kill -9 to the next token (median of {len(rounds)}): station replica {gaps['station_gap_s']:.3f} s, "
          f"shard replica {gaps['shard_gap_s']:.3f} s; an ordinary token gap {gaps['median_gap_s']:.3f} s; "
          f"texts equal to the fault-free run's")
    if args.json:
        date, mach = time.strftime("%Y-%m-%d", time.gmtime()), records.machine_of(machine)
        cmd = f"python benchmarks/replicas.py --model {args.model}"
        out = []
        for n in args.concurrency:
            for r in (1, 2):
                out.append(records.record(date, mach, cmd, f"aggregate decode, {n} concurrent, {r} replica(s)",
                                          round(results[r]["aggregate"][n], 1), "tok/s",
                                          f"{args.max_tokens} tokens a stream, resident", model=args.model))
        for what in ("station", "shard"):
            key = f"{what}_gap_s"
            out.append(records.record(date, mach, cmd, f"failover, kill -9 of a {what} replica to the next token",
                                      round(gaps[key], 3), "s",
                                      f"median of {len(rounds)}; an ordinary token gap {gaps['median_gap_s']:.3f} s; "
                                      f"texts equal to the fault-free run's", model=args.model))
        records.append(args.json, out)


if __name__ == "__main__":
    main()
