"""What tracing costs (issue 53): decode tok/s with a request's trace on against off, and the cluster
page's polling load on the coordinator, against a running cluster (`knot cluster up`).

    python benchmarks/tracing_cost.py [--url http://127.0.0.1:8000] [--max-tokens 64] [--rounds 6]
                                      [--poll-s 20] [--json FILE]

Decode: per round, two greedy /generate requests of the same prompt (speculation off), one traced
(no traceparent: the coordinator starts a trace) and one not (a traceparent whose flags say not
sampled: nothing recorded, no traceparent on its hops), in alternating order; each reply's
timings.decode_tok_s, and the coordinator's CPU time per token over the request. Prints the medians
and their ratio (the issue's goal: >= 0.97).

Polling: the coordinator's CPU seconds (from /proc, its pid found by its listening port with `ss`)
over --poll-s idle, then over --poll-s while GET /cluster is polled once a second, as the page does;
and the latency of a poll that gathers the services' /stats against one served from the snapshot.
--json appends the figures as records (deploy/records.py), e.g. to benchmarks/results/zen4.jsonl.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import time
import urllib.request
from pathlib import Path
from urllib.parse import urlsplit

from deploy import records
from deploy.machine import describe

PROMPT = "def quicksort(items):"
UNSAMPLED = "00-{}-00f067aa0ba902b7-00"


def post(url: str, path: str, body: dict, headers: dict | None = None, timeout_s: float = 600.0) -> dict:
    req = urllib.request.Request(url + path, json.dumps(body).encode(),
                                 {"Content-Type": "application/json", **(headers or {})})
    with urllib.request.urlopen(req, timeout=timeout_s) as r:
        return json.loads(r.read())


def get(url: str, path: str, timeout_s: float = 30.0) -> float:
    t0 = time.perf_counter()
    with urllib.request.urlopen(url + path, timeout=timeout_s) as r:
        r.read()
    return time.perf_counter() - t0


def decode(url: str, max_tokens: int, rounds: int) -> dict:
    """Each request's decode tok/s and the coordinator's CPU ms per token it generated, traced or not
    (CPU time: less disturbed than wall time by other work on the machine)."""
    body = {"prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0, "speculation": "off"}
    pid = coordinator_pid(url)
    post(url, "/generate", body)  # warm: the stations' kept layers, the shards' rows
    tok_s: dict[bool, list[float]] = {True: [], False: []}
    cpu_ms: dict[bool, list[float]] = {True: [], False: []}
    for i in range(rounds):
        for traced in ((True, False) if i % 2 == 0 else (False, True)):
            headers = {} if traced else {"traceparent": UNSAMPLED.format(os.urandom(16).hex())}
            c0 = cpu_s(pid)
            reply = post(url, "/generate", body, headers)
            cpu_ms[traced].append(round(1e3 * (cpu_s(pid) - c0) / len(reply["tokens"]), 3))
            tok_s[traced].append(reply["timings"]["decode_tok_s"])
    med = {k: statistics.median(v) for k, v in tok_s.items()}
    cpu = {k: statistics.median(v) for k, v in cpu_ms.items()}
    return {"decode_tok_s_on": tok_s[True], "decode_tok_s_off": tok_s[False], "median_on": med[True],
            "median_off": med[False], "ratio": round(med[True] / med[False], 4),
            "coordinator_cpu_ms_per_token_on": cpu[True], "coordinator_cpu_ms_per_token_off": cpu[False]}


def coordinator_pid(url: str) -> int:
    port = urlsplit(url).port or 80
    out = subprocess.run(["ss", "-ltnpH", f"sport = :{port}"], capture_output=True, text=True, check=True).stdout
    m = re.search(r"pid=(\d+)", out)
    if m is None:
        raise SystemExit(f"no process found listening on port {port} (ss -ltnp)")
    return int(m.group(1))


def cpu_s(pid: int) -> float:
    fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


def polling(url: str, seconds: float) -> dict:
    pid = coordinator_pid(url)
    c0 = cpu_s(pid)
    time.sleep(seconds)
    idle = cpu_s(pid) - c0
    gathered, cached = [], []
    c0, t_end = cpu_s(pid), time.monotonic() + seconds
    while time.monotonic() < t_end:
        gathered.append(get(url, "/cluster"))  # the snapshot is older than its 1 s: this one gathers
        cached.append(get(url, "/cluster"))  # within the second: served from the snapshot
        time.sleep(max(0.0, 1.0 - gathered[-1] - cached[-1]))
    polled = cpu_s(pid) - c0
    return {"poll_s": seconds, "coordinator_cpu_s_idle": round(idle, 3), "coordinator_cpu_s_polled": round(polled, 3),
            "cpu_fraction_of_a_core_added": round((polled - idle) / seconds, 4),
            "gathering_poll_ms_median": round(1e3 * statistics.median(gathered), 2),
            "cached_poll_ms_median": round(1e3 * statistics.median(cached), 2)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--url", default="http://127.0.0.1:8000")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--poll-s", type=float, default=20.0)
    ap.add_argument("--json", type=Path, help="append the figures as records to this .jsonl")
    a = ap.parse_args()
    model = json.loads(urllib.request.urlopen(a.url + "/v1/models", timeout=30).read())["data"][0]["id"]
    t0 = time.gmtime()
    row = {**decode(a.url, a.max_tokens, a.rounds), **polling(a.url, a.poll_s)}
    print(json.dumps(row, indent=1))
    if a.json:
        records.append(a.json, as_records(row, model, a, t0))


def as_records(row: dict, model: str, a, t0: time.struct_time) -> list[dict]:
    machine = records.machine_of(describe())
    command = (f"python benchmarks/tracing_cost.py --max-tokens {a.max_tokens} --rounds {a.rounds} --poll-s {a.poll_s:g}"
               " (against knot cluster up --model " + model + ")")
    note = (f"{time.strftime('%H:%M', t0)}-{time.strftime('%H:%M', time.gmtime())} UTC, load average "
            f"{os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs (other work shared them), decode tok/s on "
            f"{min(row['decode_tok_s_on']):.1f}-{max(row['decode_tok_s_on']):.1f}, off "
            f"{min(row['decode_tok_s_off']):.1f}-{max(row['decode_tok_s_off']):.1f}")
    day = time.strftime("%Y-%m-%d", t0)
    figures = [("decode, tracing on / off (medians)", row["ratio"], "x"),
               ("coordinator CPU per token, tracing on", row["coordinator_cpu_ms_per_token_on"], "ms"),
               ("coordinator CPU per token, tracing off", row["coordinator_cpu_ms_per_token_off"], "ms"),
               ("cluster page polling once a second, coordinator CPU", 100 * row["cpu_fraction_of_a_core_added"], "%"),
               ("GET /cluster gathering the services' /stats (median)", row["gathering_poll_ms_median"], "ms"),
               ("GET /cluster from its snapshot (median)", row["cached_poll_ms_median"], "ms")]
    return [records.record(day, machine, command, metric, value, unit, note, model=model)
            for metric, value, unit in figures]


if __name__ == "__main__":
    main()
