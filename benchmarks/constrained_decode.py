"""What a JSON schema costs decode (issue 50, item 5): streamed chat completions against a running
cluster (`knot cluster up`), with response_format json_schema against without, alternating.

    python benchmarks/constrained_decode.py [--url http://127.0.0.1:8000] [--max-tokens 64]
                                            [--rounds 5] [--json FILE]

Each request is streamed, greedy, speculation off; its decode rate is (chunks - 1) / (last chunk -
first chunk), so prefill is left out. Prints each side's median and their ratio (the goal: >= 0.9),
and the time of a first request with a new schema (llguidance compiles it; later ones are cached).
--json appends the figures as records (deploy/records.py).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time
import urllib.request
from pathlib import Path

from deploy import records
from deploy.machine import describe

MESSAGES = [{"role": "user", "content": "List twenty programming languages and what each is good for."}]
SCHEMA = {"type": "object", "properties": {"languages": {"type": "array", "items": {
    "type": "object", "properties": {"name": {"type": "string"}, "good_for": {"type": "string"}},
    "required": ["name", "good_for"], "additionalProperties": False}}},
    "required": ["languages"], "additionalProperties": False}


def stream(url: str, body: dict) -> tuple[float, float, int]:
    """(seconds to the first content chunk, decode tok/s after it, chunks)."""
    req = urllib.request.Request(url + "/v1/chat/completions", json.dumps({**body, "stream": True}).encode(),
                                 {"Content-Type": "application/json"})
    t0, times = time.perf_counter(), []
    with urllib.request.urlopen(req, timeout=900) as r:
        for line in r:
            if not line.startswith(b"data: {"):
                continue
            delta = json.loads(line[6:])["choices"][0]["delta"]
            if delta.get("content"):
                times.append(time.perf_counter())
    if len(times) < 2:
        raise SystemExit(f"fewer than two content chunks: {body}")
    return times[0] - t0, (len(times) - 1) / (times[-1] - times[0]), len(times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--url", default="http://127.0.0.1:8000")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--json", type=Path, default=None, metavar="FILE", help="append the figures as records")
    args = p.parse_args()
    base = {"messages": MESSAGES, "max_tokens": args.max_tokens, "temperature": 0, "speculation": "off"}
    schema = {"type": "json_schema", "json_schema": {"name": "languages", "schema": SCHEMA}}
    fresh = {"type": "json_schema", "json_schema": {"name": "fresh", "schema": {**SCHEMA, "title": os.urandom(6).hex()}}}
    first_s, _, _ = stream(args.url, {**base, "response_format": fresh, "max_tokens": 2})  # a grammar not cached
    stream(args.url, base)  # warm both paths
    plain, constrained = [], []
    for i in range(args.rounds):
        order = [(plain, base), (constrained, {**base, "response_format": schema})]
        for out, body in order if i % 2 == 0 else order[::-1]:
            out.append(stream(args.url, body)[1])
    a, b = statistics.median(plain), statistics.median(constrained)
    machine = describe()
    print(f"{machine.get('cpu')} (family {machine.get('family')}, model {machine.get('model')})")
    print(f"decode, no schema:   {a:6.2f} tok/s (median of {args.rounds})")
    print(f"decode, JSON schema: {b:6.2f} tok/s  ratio {b / a:.3f} (goal >= 0.9)")
    print(f"first request with a new schema: {first_s:.2f} s to its first token (its compile included; the first "
          f"grammar after the coordinator's boot also builds llguidance's tokenizer)")
    if args.json:
        cmd = "python benchmarks/constrained_decode.py " + f"--max-tokens {args.max_tokens} --rounds {args.rounds}"
        day = time.strftime("%Y-%m-%d", time.gmtime())
        m = records.machine_of(machine)
        records.append(args.json, [
            records.record(day, m, cmd, "decode, JSON schema / none", round(b / a, 3), "ratio",
                           f"{b:.2f} against {a:.2f} tok/s"),
            records.record(day, m, cmd, "first token with a new schema", round(first_s, 2), "s", "compile included")])


if __name__ == "__main__":
    main()
