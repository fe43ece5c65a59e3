"""A short request's latency during a long prompt's prefill (issue 52 item 7), against a running
cluster (`knot cluster up`). CI does not run it (tests/integration/test_fair_scheduling_cluster.py
checks the order on the tiny model).

    python benchmarks/fair_scheduling.py [--url http://127.0.0.1:8000] [--long-tokens 4000] [--short-tokens 8]
                                         [--runs 3] [--out FILE]

Per run: the short request alone, then the long prompt (max_tokens 1) and, once it has run for
--after-s, the short request again while the long one prefills. Both greedy. Prints each run's
latencies and whether the long prompt was still running when the short request ended; --out
writes them as JSON.
"""
from __future__ import annotations

import argparse
import json
import threading
import time
import urllib.request

SHORT_PROMPT = "def fibonacci(n):"
# ~12 tokens of code a line; repeated, then cut to the token count asked for
LONG_LINE = "    total = total + values[index] * weights[index]  # accumulate\n"


def post(url: str, path: str, body: dict, timeout_s: float = 900.0) -> dict:
    req = urllib.request.Request(url + path, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout_s) as r:
        return json.loads(r.read())


def long_prompt(url: str, n_tokens: int) -> str:
    """About n_tokens of code (the text of its first n_tokens tokens; /generate takes text)."""
    text = "def score(values, weights):\n    total = 0\n" + LONG_LINE * (n_tokens // 8)
    ids = post(url, "/tokenize", {"prompt": text})["tokens"]
    if len(ids) < n_tokens:
        raise SystemExit(f"the long prompt has {len(ids)} tokens, fewer than {n_tokens}")
    return post(url, "/detokenize", {"tokens": ids[:n_tokens]})["prompt"]


def timed(url: str, body: dict, out: dict) -> None:
    t0 = time.perf_counter()
    reply = post(url, "/generate", body)
    out["s"], out["tokens"], out["prompt_tokens"] = time.perf_counter() - t0, len(reply["tokens"]), \
        len(reply["prompt_tokens"])
    out["ttft_s"] = reply["timings"]["time_to_first_token_ms"] / 1e3


def run(url: str, prompt: str, short_tokens: int, after_s: float) -> dict:
    short = {"prompt": SHORT_PROMPT, "max_tokens": short_tokens, "speculation": "off"}
    alone: dict = {}
    timed(url, short, alone)
    long_out: dict = {}
    t0 = time.perf_counter()
    th = threading.Thread(target=timed, args=(url, {"prompt": prompt, "max_tokens": 1}, long_out))
    th.start()
    time.sleep(after_s)
    during: dict = {}
    timed(url, short, during)
    running = th.is_alive()
    th.join()
    return {"short_alone_s": round(alone["s"], 3), "short_during_s": round(during["s"], 3),
            "short_tokens": during["tokens"], "long_prompt_tokens": long_out["prompt_tokens"],
            "long_s": round(long_out["s"], 3),
            "short_started_at_s": round(after_s, 3), "long_still_running": running,
            "long_prefill_s": round(long_out["ttft_s"], 3), "wall_s": round(time.perf_counter() - t0, 3)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--url", default="http://127.0.0.1:8000")
    ap.add_argument("--long-tokens", type=int, default=4000)
    ap.add_argument("--short-tokens", type=int, default=8)
    ap.add_argument("--after-s", type=float, default=3.0, help="send the short request this long after the long one")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--out")
    a = ap.parse_args()
    prompt = long_prompt(a.url, a.long_tokens)
    rows = []
    for i in range(a.runs):
        r = run(a.url, prompt, a.short_tokens, a.after_s)
        rows.append(r)
        print(json.dumps({"run": i, **r}), flush=True)
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"url": a.url, "long_tokens": a.long_tokens, "runs": rows}, f, indent=1)


if __name__ == "__main__":
    main()
