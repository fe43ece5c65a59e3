"""Soak (issue 13 item 6): a bounded run of mixed load on a `knot cluster up` cluster, with one kill -9
of each kind of service, that measures what docs/reliability.md reports. CI does not run it.

    python benchmarks/soak.py [--minutes 20] [--model qwen2.5-coder-0.5b] [--workers 3] [--out DIR]

Load, from --workers threads, each request one of:
    generate   POST /generate, temperature 0: its tokens must equal the baseline's
    complete   POST /v1/completions, temperature 0: its text must equal the baseline's
    stream     the same, streamed (SSE): the concatenated text must equal the baseline's
    hangup     a streamed request closed after its first event, or a whole one whose client gives up
    bad        an invalid body (NaN temperature, top_p 0, a lone surrogate, deep nesting, ...): a 4xx
Faults: one kill -9 of each kind (a shard, a station, each warden, Redis, SeaweedFS, the coordinator),
spread over the run; the launcher's supervisor restarts them.
Every 10 s it samples each service's RSS. Out (default docs/): reliability-soak.json (every count and
sample) and reliability-rss.svg (the RSS of every service over the run, kills marked).

A request "ends well" with a 200 whose tokens equal the baseline, or a deliberate error: a 4xx for a
bad body, a 503/504 with Retry-After or a message while a peer restarts, or a connection that the
coordinator's own kill broke. A 200 with other tokens, a 500, or a hang (no answer in 300 s) is a failure.
"""
from __future__ import annotations

import argparse
import http.client
import json
import os
import random
import signal
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from deploy import launcher, servers  # noqa: E402

PROMPTS = ["def fibonacci(n):", "import os\n", "class Stack:\n    def push(self, x):", "# sort a list of dicts by key\n"]
MAX_TOKENS = 12
KILLS = ("shard-3", "station-1", "layer-warden", "cobordism-warden", "redis", "minio", "coordinator")
BAD_BODIES = [b'{"prompt": "x", "temperature": NaN}', b'{"prompt": "x", "top_p": 0}', b'{"prompt": "x", "seed": -1}',
              b'{"prompt": "\\ud800"}', b"[" * 100_000 + b"]" * 100_000, b'{"prompt": "x", "max_tokens": -1}',
              b'{"prompt": 7}', b"{oops", b'{"prompt": "x", "temperature": 1e999}']
TIMEOUT_S = 300.0


def post(url: str, body: bytes, timeout_s: float = TIMEOUT_S) -> tuple[int, dict, bytes]:
    req = urllib.request.Request(url, data=body, method="POST", headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as r:
            return r.status, dict(r.headers), r.read()
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), e.read()


def sse_text(raw: bytes) -> tuple[str, bool]:
    """The text of a completions stream, and whether it carried an error event."""
    text, error = "", False
    for line in raw.decode().split("\n\n"):
        if not line.startswith("data: {"):
            continue
        ev = json.loads(line[6:])
        if "error" in ev:
            error = True
        for ch in ev.get("choices", []):
            text += ch.get("text") or ""
    return text, error


class Soak:
    def __init__(self, url: str, cluster: launcher.Cluster, baseline: dict):
        self.url, self.cluster, self.baseline = url, cluster, baseline
        self.outcomes: Counter = Counter()  # (kind, outcome) -> n
        self.failures: list[dict] = []
        self.lock = threading.Lock()

    def note(self, kind: str, outcome: str, detail: str = "") -> None:
        with self.lock:
            self.outcomes[(kind, outcome)] += 1
            if outcome.startswith("FAIL"):
                self.failures.append({"t": time.time(), "kind": kind, "outcome": outcome, "detail": detail[:300]})

    def error_outcome(self, code: int, raw: bytes) -> str:
        if code in (503, 504, 429) or (code == 502 and raw):
            return f"{code}"  # deliberate: a peer restarting, the deadline, the queue
        return f"FAIL {code}"

    def one(self, rng: random.Random) -> None:
        kind = rng.choices(["generate", "complete", "stream", "hangup", "bad"], [3, 2, 2, 1, 1])[0]
        prompt = rng.choice(PROMPTS)
        base = self.baseline[prompt]
        body = {"prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0}
        try:
            if kind == "generate":
                code, _, raw = post(self.url + "/generate", json.dumps(body).encode())
                if code == 200:
                    ok = json.loads(raw)["tokens"] == base["tokens"]
                    self.note(kind, "200" if ok else "FAIL 200 other tokens", raw.decode()[:200])
                else:
                    self.note(kind, self.error_outcome(code, raw), raw.decode()[:200])
            elif kind in ("complete", "stream"):
                stream = kind == "stream"
                code, _, raw = post(self.url + "/v1/completions", json.dumps({**body, "stream": stream}).encode())
                if code != 200:
                    self.note(kind, self.error_outcome(code, raw), raw.decode()[:200])
                elif stream:
                    text, error = sse_text(raw)
                    if error:
                        self.note(kind, "error event", raw.decode()[-300:])
                    else:
                        self.note(kind, "200" if text == base["text"] else "FAIL 200 other text", text)
                else:
                    text = json.loads(raw)["choices"][0]["text"]
                    self.note(kind, "200" if text == base["text"] else "FAIL 200 other text", text)
            elif kind == "hangup":
                self.hangup(rng, body)
            else:
                code, _, raw = post(self.url + rng.choice(["/generate", "/v1/completions", "/v1/chat/completions"]),
                                    rng.choice(BAD_BODIES))
                self.note(kind, "4xx" if 400 <= code < 500 else f"FAIL {code}", raw.decode(errors="replace")[:200])
        except (ConnectionError, http.client.HTTPException, urllib.error.URLError, TimeoutError, OSError) as e:
            self.note(kind, "connection lost", repr(e))
            time.sleep(0.5)  # the coordinator is restarting: a client backs off too

    def hangup(self, rng: random.Random, body: dict) -> None:
        host, port = self.url.removeprefix("http://").split(":")
        conn = http.client.HTTPConnection(host, int(port), timeout=TIMEOUT_S)
        stream = rng.random() < 0.5
        data = json.dumps({**body, "max_tokens": 200, "stream": stream}).encode()
        conn.request("POST", "/v1/completions", data, {"Content-Type": "application/json"})
        if stream:
            r = conn.getresponse()
            r.fp.readline()  # the first event's line, then the client goes away
        else:
            time.sleep(0.3)  # a whole reply the client stops waiting for
        conn.close()
        self.note("hangup", "closed")


def rss_bytes(pid: int) -> int | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def svg(samples: list[dict], kills: list[dict], t0: float, path: Path) -> None:
    """The RSS of every service over the run (MiB), one polyline each; kills as vertical lines."""
    W, H, L, B = 900, 420, 60, 40
    names = sorted({n for s in samples for n in s["rss"]})
    t_end = max(s["t"] for s in samples) - t0 or 1
    top = max(v for s in samples for v in s["rss"].values() if v) / 2**20 * 1.1
    x = lambda t: L + (t - t0) / t_end * (W - L - 10)  # noqa: E731
    y = lambda mib: H - B - mib / top * (H - B - 10)  # noqa: E731
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" font-family="sans-serif" font-size="11">',
           f'<rect width="{W}" height="{H}" fill="white"/>',
           f'<line x1="{L}" y1="{H - B}" x2="{W - 10}" y2="{H - B}" stroke="black"/>',
           f'<line x1="{L}" y1="10" x2="{L}" y2="{H - B}" stroke="black"/>',
           f'<text x="{W // 2}" y="{H - 8}">minutes</text>',
           f'<text x="5" y="20">RSS MiB</text>']
    for m in range(0, int(t_end // 60) + 1, max(1, int(t_end // 600))):
        out.append(f'<text x="{x(t0 + m * 60):.0f}" y="{H - B + 14}">{m}</text>')
    for v in range(0, int(top) + 1, max(1, int(top // 6) // 50 * 50 or 50)):
        out.append(f'<text x="20" y="{y(v):.0f}">{v}</text>')
    for k in kills:
        out.append(f'<line x1="{x(k["t"]):.1f}" y1="10" x2="{x(k["t"]):.1f}" y2="{H - B}" stroke="red" '
                   f'stroke-dasharray="3,3"/><text x="{x(k["t"]) + 2:.1f}" y="22" fill="red" font-size="9">'
                   f'{k["name"]}</text>')
    for i, n in enumerate(names):
        hue = i * 360 // max(1, len(names))
        pts = " ".join(f"{x(s['t']):.1f},{y(s['rss'][n] / 2**20):.1f}" for s in samples if s["rss"].get(n))
        out.append(f'<polyline fill="none" stroke="hsl({hue},70%,40%)" points="{pts}"><title>{n}</title></polyline>')
    out.append("</svg>")
    path.write_text("\n".join(out))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--minutes", type=float, default=20.0)
    p.add_argument("--model", default=None, help="registered model or path (default: the default model)")
    p.add_argument("--workers", type=int, default=3)
    p.add_argument("--run-dir", default=str(Path(tempfile.gettempdir()) / "knot-soak"))
    p.add_argument("--out", default=str(Path(__file__).resolve().parents[1] / "docs"))
    args = p.parse_args(argv)
    env = {**os.environ, "KNOT_PORT": str(servers.free_ports(1)[0]), "PEER_WAIT_S": "60"}
    env.pop("KNOT_KEY", None)
    cluster = launcher.Cluster(Path(args.run_dir))
    print(f"starting the cluster in {args.run_dir}", flush=True)
    running = {r.name: r for r in cluster.up(model=args.model, env=env)}
    url = running["coordinator"].url
    try:
        baseline = {}
        for prompt in PROMPTS:
            code, _, raw = post(url + "/generate", json.dumps({"prompt": prompt, "max_tokens": MAX_TOKENS,
                                                              "temperature": 0}).encode())
            assert code == 200, raw
            baseline[prompt] = json.loads(raw)
        soak = Soak(url, cluster, baseline)
        t0 = time.time()
        end = t0 + args.minutes * 60
        samples, kills = [], []

        def worker(seed: int) -> None:
            rng = random.Random(seed)
            while time.time() < end:
                soak.one(rng)

        threads = [threading.Thread(target=worker, args=(i,), daemon=True) for i in range(args.workers)]
        for t in threads:
            t.start()
        kill_at = {t0 + (i + 1) * args.minutes * 60 / (len(KILLS) + 1): name for i, name in enumerate(KILLS)}
        next_sample = t0
        while time.time() < end:
            now = time.time()
            if now >= next_sample:
                rows = cluster.status()
                samples.append({"t": now, "rss": {r["name"]: rss_bytes(r["pid"]) for r in rows if r["kind"] != "oneshot"}})
                next_sample = now + 10
                done = sum(soak.outcomes.values())
                print(f"{(now - t0) / 60:5.1f} min: {done} requests, {len(soak.failures)} failures", flush=True)
            for at, name in list(kill_at.items()):
                if now >= at:
                    row = next(r for r in cluster.status() if r["name"] == name)
                    os.kill(row["pid"], signal.SIGKILL)
                    kills.append({"t": now, "name": name, "pid": row["pid"]})
                    print(f"killed {name} (pid {row['pid']})", flush=True)
                    del kill_at[at]
            time.sleep(1)
        for t in threads:
            t.join(TIMEOUT_S + 10)
        hung = sum(t.is_alive() for t in threads)
        rows = cluster.status()
        result = {"minutes": args.minutes, "model": args.model, "workers": args.workers,
                  "outcomes": {f"{k} {o}": n for (k, o), n in sorted(soak.outcomes.items())},
                  "by_outcome": dict(Counter(o for (_, o), n in soak.outcomes.items() for _ in range(n))),
                  "failures": soak.failures, "hung_workers": hung, "kills": kills,
                  "restarts": {r["name"]: r["restarts"] for r in rows if r.get("restarts")},
                  "rss_first_last_mib": {n: [round(samples[0]["rss"].get(n, 0) / 2**20, 1),
                                             round(samples[-1]["rss"].get(n, 0) / 2**20, 1)]
                                         for n in samples[-1]["rss"]},
                  "samples": samples}
        out = Path(args.out)
        (out / "reliability-soak.json").write_text(json.dumps(result, indent=1))
        svg(samples, kills, t0, out / "reliability-rss.svg")
        total = sum(soak.outcomes.values())
        print(f"{total} requests in {args.minutes:g} min; outcomes:")
        for o, n in sorted(result["by_outcome"].items(), key=lambda kv: -kv[1]):
            print(f"  {o:24s} {n:6d}  {100 * n / total:5.1f} %")
        print(f"failures: {len(soak.failures)}; hung workers: {hung}; restarts: {result['restarts']}")
        return 0 if not soak.failures and not hung else 1
    finally:
        cluster.down()


if __name__ == "__main__":
    sys.exit(main())
