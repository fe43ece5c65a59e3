"""Soak (issues 13 and 52): a bounded run of mixed load on a `knot cluster up` cluster, with faults
spread over it, that measures what docs/reliability.md reports. CI runs a short one
(tests/integration/test_soak_faults.py); this one is run by hand.

    python benchmarks/soak.py [--minutes 20] [--model qwen2.5-coder-0.5b] [--workers 3] [--out DIR]

Load, from --workers threads, each request one of:
    generate   POST /generate, temperature 0: its tokens must equal the baseline's
    long       the same with a long prompt (--long-tokens, default 300, 1000 and 2000 tokens of this
               repository's code): its prefill is split and interleaved with the others' decode steps
    complete   POST /v1/completions, temperature 0: its text must equal the baseline's
    stream     the same, streamed (SSE): the concatenated text must equal the baseline's
    hangup     a streamed request closed after its first event, or a whole one whose client gives up
    bad        an invalid body (NaN temperature, top_p 0, a lone surrogate, deep nesting, ...): a 4xx
Faults (FAULTS), one after another, spread over the run; each is lifted, then the run waits (bounded)
for the baseline tokens again:
    kill NAME      kill -9 of a shard, a station, each warden, Redis, SeaweedFS, the coordinator; the
                   launcher's supervisor restarts it
    stop-station   SIGSTOP of station-1 for longer than PEER_WAIT_S, then SIGCONT (503 meanwhile)
    stop-s3        SIGSTOP of SeaweedFS, then SIGCONT (the loaded version is served meanwhile)
    forge-kv       a KV row for each of the prompts' tokens written straight into Redis with its password:
                   another vector (the row's, times -8, if Redis held it), in the right layout, its
                   crc32 right, its MAC under another secret than the cluster's;
                   then kill -9 of the CobordismWarden and shards 0-3, so the rows are read from KV
    replace-knot   the knot replaced in the bucket under its key with LM-head rows overwritten (the
                   header untouched), until a request gets 503 IntegrityFailure and 10 s more;
                   then the original put back
    anonymous-put  an unsigned PUT of the knot's key: 403, and the object unchanged
    replay         a signed call captured for station-0 sent to station-1: 401 (and 200 at station-0)
Every 10 s it samples each service's RSS. Out (default docs/): reliability-soak.json (every count, the
requests each fault saw by outcome, every sample) and reliability-rss.svg (the RSS of every service
over the run, faults marked).

A request "ends well" with a 200 whose tokens equal the baseline, or a deliberate error: a 4xx for a
bad body, a 503/504 with a message while a fault lasts, or a connection that the coordinator's own kill
broke. A 200 with other tokens, a 500, or a hang (no answer within REQUEST_TIMEOUT_S + HANG_MARGIN_S)
is a failure; so is a fault whose check fails (an anonymous PUT not refused, a replay accepted, a
replaced knot never refused) or a cluster that does not give the baseline again within RECOVERY_S.
"""
from __future__ import annotations

import argparse
import http.client
import json
import os
import random
import re
import signal
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections import Counter
from pathlib import Path

import numpy as np
import redis

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common.integrity import CacheKey  # noqa: E402
from common.knot import parse_header, read_header_sync  # noqa: E402
from common.topology import BUCKET_NAME  # noqa: E402
from deploy import cluster_secrets, launcher, servers  # noqa: E402
from deploy.local.server_bindings import S3Settings, s3_client  # noqa: E402
from services.embed_cache import decode_row, encode_row, row_key  # noqa: E402

PROMPTS = ["def fibonacci(n):", "import os\n", "class Stack:\n    def push(self, x):", "# sort a list of dicts by key\n"]
LONG_SOURCES = ["common/knot.py", "common/layers.py", "services/coordinator/pipeline.py"]  # long prompts' text
MAX_TOKENS = 12
FAULTS = ("kill shard-3", "stop-station", "kill station-1", "forge-kv", "kill layer-warden", "anonymous-put",
          "stop-s3", "kill redis", "replace-knot", "kill cobordism-warden", "replay", "kill minio", "kill coordinator")
# Issue 52's, for the short soak in CI. stop-s3 last: after a failed version check requests skip the
# check for BUCKET_CHECK_BACKOFF_S, which would hold off replace-knot's refusal that long.
NEW_FAULTS = ("stop-station", "forge-kv", "replace-knot", "anonymous-put", "replay", "stop-s3")
BAD_BODIES = [b'{"prompt": "x", "temperature": NaN}', b'{"prompt": "x", "top_p": 0}', b'{"prompt": "x", "seed": -1}',
              b'{"prompt": "\\ud800"}', b"[" * 100_000 + b"]" * 100_000, b'{"prompt": "x", "max_tokens": -1}',
              b'{"prompt": 7}', b"{oops", b'{"prompt": "x", "temperature": 1e999}']
HANG_MARGIN_S = 60.0  # past REQUEST_TIMEOUT_S, a request with no answer hangs
RECOVERY_S = 300.0  # after a fault is lifted, the baseline tokens again within this
FAULT_CHECK_TIMEOUT_S = 120.0  # a replaced knot refused within this
FORGED_KEY = CacheKey("a-forgers-secret-which-is-not-the-clusters")
# The coordinator keeps no embedding rows and a booting shard has its warden read nothing ahead: after
# forge-kv's kills, the prompts' rows are read from the KV, where the forged ones are.
ROW_PATH_ENV = {"EMBED_ROW_CACHE_BYTES": "0", "KNOT_WARM_WARDEN": "off"}
# where the CobordismWarden's KV binding keeps its keys (its name, deploy/local/host_settings.py)
KV_PREFIX = "EMBED_CACHE:"


def post(url: str, body: bytes, timeout_s: float) -> tuple[int, dict, bytes]:
    req = urllib.request.Request(url, data=body, method="POST", headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as r:
            return r.status, dict(r.headers), r.read()
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), e.read()


def timed_out(e: BaseException) -> bool:
    """urllib's read timeout is a TimeoutError; its connect timeout a URLError that wraps one."""
    return isinstance(e, TimeoutError) or (isinstance(e, urllib.error.URLError) and isinstance(e.reason, TimeoutError))


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


def long_prompts(url: str, n_tokens: list[int], timeout_s: float) -> list[str]:
    """Prompts of about n tokens each: the first n tokens of this repository's code, detokenized."""
    root = Path(__file__).resolve().parents[1]
    text = "\n".join((root / p).read_text(encoding="utf-8") for p in LONG_SOURCES)[:8 * max(n_tokens)]
    while (code := (got := post(url + "/tokenize", json.dumps({"prompt": text}).encode(), timeout_s))[0]) == 400:
        text = text[:len(text) // 2]  # more than the model's context
    assert code == 200, got
    raw = got[2]
    ids = json.loads(raw)["tokens"]
    out = []
    for n in n_tokens:
        code, _, raw = post(url + "/detokenize", json.dumps({"tokens": ids[:n]}).encode(), timeout_s)
        assert code == 200, raw
        out.append(json.loads(raw)["prompt"])
    return out


class Soak:
    """The load: what each request saw, and when."""

    def __init__(self, url: str, baseline: dict, long: list[str], hang_s: float):
        self.url, self.baseline, self.long, self.hang_s = url, baseline, long, hang_s
        self.outcomes: Counter = Counter()  # (kind, outcome) -> n
        self.requests: list[tuple[float, float, str, str]] = []  # (start, end, outcome, kind)
        self.failures: list[dict] = []
        self.lock = threading.Lock()

    def note(self, t0: float, kind: str, outcome: str, detail: str = "") -> None:
        with self.lock:
            self.outcomes[(kind, outcome)] += 1
            self.requests.append((t0, time.time(), outcome, kind))
            if outcome.startswith("FAIL"):
                self.failures.append({"t": time.time(), "took_s": round(time.time() - t0, 1), "kind": kind,
                                      "outcome": outcome, "detail": detail[:300]})

    def error_outcome(self, code: int, raw: bytes) -> str:
        if code in (503, 504, 429) or (code == 502 and raw):
            return f"{code}"  # deliberate: a peer restarting or stopped, the deadline, the queue, integrity
        return f"FAIL {code}"

    def one(self, rng: random.Random) -> None:
        kind = rng.choices(["generate", "long", "complete", "stream", "hangup", "bad"], [3, 1, 2, 2, 1, 1])[0]
        prompt = rng.choice(self.long if kind == "long" and self.long else PROMPTS)
        base = self.baseline[prompt]
        body = {"prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0}
        t0 = time.time()
        try:
            if kind in ("generate", "long"):
                code, _, raw = post(self.url + "/generate", json.dumps(body).encode(), self.hang_s)
                if code == 200:
                    ok = json.loads(raw)["tokens"] == base["tokens"]
                    self.note(t0, kind, "200" if ok else "FAIL 200 other tokens", raw.decode()[:200])
                else:
                    self.note(t0, kind, self.error_outcome(code, raw), raw.decode()[:200])
            elif kind in ("complete", "stream"):
                stream = kind == "stream"
                code, _, raw = post(self.url + "/v1/completions", json.dumps({**body, "stream": stream}).encode(),
                                    self.hang_s)
                if code != 200:
                    self.note(t0, kind, self.error_outcome(code, raw), raw.decode()[:200])
                elif stream:
                    text, error = sse_text(raw)
                    if error:
                        self.note(t0, kind, "error event", raw.decode()[-300:])
                    else:
                        self.note(t0, kind, "200" if text == base["text"] else "FAIL 200 other text", text)
                else:
                    text = json.loads(raw)["choices"][0]["text"]
                    self.note(t0, kind, "200" if text == base["text"] else "FAIL 200 other text", text)
            elif kind == "hangup":
                self.hangup(rng, body)
                self.note(t0, "hangup", "closed")
            else:
                code, _, raw = post(self.url + rng.choice(["/generate", "/v1/completions", "/v1/chat/completions"]),
                                    rng.choice(BAD_BODIES), self.hang_s)
                self.note(t0, kind, "4xx" if 400 <= code < 500 else f"FAIL {code}", raw.decode(errors="replace")[:200])
        except (ConnectionError, http.client.HTTPException, urllib.error.URLError, TimeoutError, OSError) as e:
            if timed_out(e):
                self.note(t0, kind, "FAIL hang", f"no answer in {self.hang_s:g} s: {e!r}")
            else:
                self.note(t0, kind, "connection lost", repr(e))
                time.sleep(0.5)  # the coordinator is restarting: a client backs off too

    def hangup(self, rng: random.Random, body: dict) -> None:
        host, port = self.url.removeprefix("http://").split(":")
        conn = http.client.HTTPConnection(host, int(port), timeout=self.hang_s)
        stream = rng.random() < 0.5
        data = json.dumps({**body, "max_tokens": 200, "stream": stream}).encode()
        conn.request("POST", "/v1/completions", data, {"Content-Type": "application/json"})
        if stream:
            r = conn.getresponse()
            r.fp.readline()  # the first event's line, then the client goes away
        else:
            time.sleep(0.3)  # a whole reply the client stops waiting for
        conn.close()

    def seen(self, t_start: float, t_end: float) -> dict[str, int]:
        """Requests whose span overlaps [t_start, t_end], by outcome."""
        with self.lock:
            return dict(Counter(o for a, b, o, _ in self.requests if a <= t_end and b >= t_start))

    def baseline_again(self, timeout_s: float) -> bool:
        """Poll (bounded) until the first prompt gives its baseline tokens with 200."""
        prompt = PROMPTS[0]
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                code, _, raw = post(self.url + "/generate", json.dumps({"prompt": prompt, "max_tokens": MAX_TOKENS,
                                                                       "temperature": 0}).encode(), self.hang_s)
                if code == 200:
                    if json.loads(raw)["tokens"] == self.baseline[prompt]["tokens"]:
                        return True
                    self.note(time.time(), "recovery probe", "FAIL 200 other tokens", raw.decode()[:200])
            except (OSError, http.client.HTTPException):
                pass
            time.sleep(0.5)
        return False


class Faults:
    """Each fault injected and lifted by one method, bounded; it returns what it saw, with "fail"
    set when its own check failed."""

    def __init__(self, cluster: launcher.Cluster, soak: Soak, knot_path: Path, knot_key: str,
                 peer_wait_s: float, s3_stop_s: float, hold_s: float):
        self.cluster, self.soak, self.knot_path, self.knot_key = cluster, soak, knot_path, knot_key
        self.peer_wait_s, self.s3_stop_s, self.hold_s = peer_wait_s, s3_stop_s, hold_s
        rows = self.rows()
        secrets = cluster_secrets.read(cluster.run_dir / launcher.SECRETS_FILE)
        self.s3_url = rows["minio"]["url"]
        self.s3 = s3_client(S3Settings(self.s3_url, secrets["MINIO_ROOT_USER"], secrets["MINIO_ROOT_PASSWORD"],
                                       connect_timeout_s=5.0, read_timeout_s=120.0))
        self.redis_password = secrets["KNOT_REDIS_PASSWORD"]
        self.key = CacheKey(secrets["KNOT_INTERNAL_SECRET"])
        self.prompt_rows: set[int] = set()  # the prompts' token ids (forge-kv forges their rows)

    def rows(self) -> dict[str, dict]:
        return {r["name"]: r for r in self.cluster.status()}

    def run(self, fault: str) -> dict:
        if fault.startswith("kill "):
            return self.kill(fault.split()[1])
        return getattr(self, fault.replace("-", "_"))()

    def kill(self, *names: str) -> dict:
        rows = self.rows()
        for name in names:
            os.kill(rows[name]["pid"], signal.SIGKILL)
        return {"killed": {name: rows[name]["pid"] for name in names}}

    def stopped(self, name: str, hold_s: float) -> dict:
        pid = self.rows()[name]["pid"]
        os.kill(pid, signal.SIGSTOP)
        try:
            time.sleep(hold_s)  # the fault's length: the load meets it meanwhile
        finally:
            os.kill(pid, signal.SIGCONT)
        return {"stopped": name, "pid": pid, "held_s": hold_s}

    def stop_station(self) -> dict:
        return self.stopped("station-1", self.peer_wait_s + max(3.0, self.peer_wait_s / 2))

    def stop_s3(self) -> dict:
        return self.stopped("minio", self.s3_stop_s)

    def etag(self) -> str:
        return self.s3.head_object(Bucket=BUCKET_NAME, Key=self.knot_key)["ETag"].strip('"')

    def redis(self) -> redis.Redis:
        return redis.Redis.from_url(self.rows()["redis"]["url"], password=self.redis_password, socket_timeout=10.0)

    def forge_kv(self) -> dict:
        etag = self.etag()
        namespace = f"{self.knot_key}@{etag}"
        hidden = self.header().tensors["token_embd.weight"].shape[0]
        rng = np.random.default_rng(52)
        r = self.redis()
        present = 0
        try:
            for row in sorted(self.prompt_rows):
                kv_key = row_key(namespace, row)
                value = r.get(KV_PREFIX + kv_key)
                genuine = None if value is None else decode_row(self.key, kv_key, value, etag, row, hidden)
                if isinstance(genuine, np.ndarray):
                    present += 1
                    vec = -8 * genuine
                else:  # a row the cluster has not written to KV (yet): one it could read next
                    vec = rng.standard_normal(hidden).astype(np.float32)
                r.set(KV_PREFIX + kv_key, encode_row(FORGED_KEY, kv_key, etag, row, vec), ex=3600)
        finally:
            r.close()
        before = metric(self.soak.url, "knot_cache_rejects_total", tier="kv")
        out = {"forged_rows": len(self.prompt_rows), "of_rows_in_kv": present, "kv_rejects_before": before}
        out.update(self.kill("cobordism-warden", "shard-0", "shard-1", "shard-2", "shard-3"))  # their rows: from KV
        return out

    def header(self):
        with open(self.knot_path, "rb") as f:
            def read_range(a: int, b: int) -> bytes:
                f.seek(a)
                return f.read(b - a)

            return read_header_sync(read_range)

    def replace_knot(self) -> dict:
        original = self.knot_path.read_bytes()
        h = parse_header(original)
        tensor = "output.weight" if "output.weight" in h.tensors else "token_embd.weight"  # the LM head
        vocab = h.tensors[tensor].shape[1]
        n = min(1000, vocab // 8)
        first = vocab // 2
        data = bytearray(original)
        for row in range(first, first + n):  # each row gets the bytes of the row n further on
            a, b = h.row_range(tensor, row, row + 1)
            c, d = h.row_range(tensor, row + n, row + n + 1)
            data[a:b] = data[c:d]
        assert data[:h.payload_offset] == original[:h.payload_offset]  # the header (and so the pin) untouched
        out = {"tensor": tensor, "rows": [first, first + n]}
        t0 = time.monotonic()
        self.s3.put_object(Bucket=BUCKET_NAME, Key=self.knot_key, Body=bytes(data))
        del data
        out["put_s"] = round(time.monotonic() - t0, 1)
        refused = None
        try:
            deadline = time.monotonic() + FAULT_CHECK_TIMEOUT_S
            while time.monotonic() < deadline:
                code, _, raw = post(self.soak.url + "/generate", json.dumps(
                    {"prompt": PROMPTS[0], "max_tokens": MAX_TOKENS, "temperature": 0}).encode(), self.soak.hang_s)
                if code == 503 and json.loads(raw).get("error") == "IntegrityFailure":
                    refused = json.loads(raw)["message"]
                    break
                time.sleep(0.5)
            out["refused_after_s"] = round(time.monotonic() - t0, 1) if refused else None
            out["message"] = (refused or "")[:300]
            if refused:
                time.sleep(self.hold_s)  # the load meets the refused knot meanwhile
            else:
                out["fail"] = f"no 503 IntegrityFailure within {FAULT_CHECK_TIMEOUT_S:g} s of the replacement"
        finally:
            self.s3.put_object(Bucket=BUCKET_NAME, Key=self.knot_key, Body=original)
        return out

    def anonymous_put(self) -> dict:
        before = self.s3.head_object(Bucket=BUCKET_NAME, Key=self.knot_key)
        req = urllib.request.Request(f"{self.s3_url}/{BUCKET_NAME}/{self.knot_key}", data=b"evil", method="PUT")
        try:
            with urllib.request.urlopen(req, timeout=30.0) as r:
                status = r.status
        except urllib.error.HTTPError as e:
            status = e.code
        after = self.s3.head_object(Bucket=BUCKET_NAME, Key=self.knot_key)
        unchanged = (before["ETag"], before["ContentLength"]) == (after["ETag"], after["ContentLength"])
        out = {"status": status, "object_unchanged": unchanged}
        if status != 403 or not unchanged:
            out["fail"] = f"an anonymous PUT got {status}; the object {'un' if unchanged else ''}changed"
        return out

    def replay(self) -> dict:
        rows = self.rows()
        to, sibling = rows["station-0"]["url"] + "/stats", rows["station-1"]["url"] + "/stats"
        captured = self.cluster.signed("GET", to)
        out = {"sibling_status": get_status(sibling, captured), "own_status": get_status(to, captured)}
        if out["sibling_status"] != 401:
            out["fail"] = f"station-1 answered {out['sibling_status']} to a call signed for station-0"
        return out


def get_status(url: str, headers: dict) -> int:
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=30.0) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code


def metric(url: str, name: str, **labels) -> float | None:
    """The sum of a counter over the series that carry these labels; None when /metrics does not answer."""
    try:
        with urllib.request.urlopen(url + "/metrics", timeout=30.0) as r:
            text = r.read().decode()
    except OSError:
        return None
    total = 0.0
    for line in text.splitlines():
        m = re.match(rf"^{name}(\{{[^}}]*\}})? (\S+)$", line)
        if m and all(f'{k}="{v}"' in (m.group(1) or "") for k, v in labels.items()):
            total += float(m.group(2))
    return total


def rss_bytes(pid: int) -> int | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def svg(samples: list[dict], marks: list[dict], t0: float, path: Path) -> None:
    """The RSS of every service over the run (MiB), one polyline each; faults as vertical lines."""
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
    for i, k in enumerate(marks):
        out.append(f'<line x1="{x(k["t"]):.1f}" y1="10" x2="{x(k["t"]):.1f}" y2="{H - B}" stroke="red" '
                   f'stroke-dasharray="3,3"/><text x="{x(k["t"]) + 2:.1f}" y="{22 + 10 * (i % 2)}" fill="red" '
                   f'font-size="9">{k["name"]}</text>')
    for i, n in enumerate(names):
        hue = i * 360 // max(1, len(names))
        pts = " ".join(f"{x(s['t']):.1f},{y(s['rss'][n] / 2**20):.1f}" for s in samples if s["rss"].get(n))
        out.append(f'<polyline fill="none" stroke="hsl({hue},70%,40%)" points="{pts}"><title>{n}</title></polyline>')
    out.append("</svg>")
    path.write_text("\n".join(out))


def run(cluster: launcher.Cluster, knot_path: Path, knot_key: str, minutes: float, workers: int = 3,
        faults: tuple[str, ...] = FAULTS, long_tokens: tuple[int, ...] = (300, 1000, 2000), peer_wait_s: float = 10.0,
        request_timeout_s: float = 120.0, s3_stop_s: float = 15.0, hold_s: float = 10.0,
        log=print) -> dict:
    """Load and faults on a cluster that is up; -> the record (failures: [] when nothing went wrong)."""
    url = next(r for r in cluster.status() if r["name"] == "coordinator")["url"]
    hang_s = request_timeout_s + HANG_MARGIN_S
    long = long_prompts(url, list(long_tokens), hang_s)
    baseline, prompt_rows = {}, set()
    for prompt in PROMPTS + long:
        code, _, raw = post(url + "/generate", json.dumps({"prompt": prompt, "max_tokens": MAX_TOKENS,
                                                          "temperature": 0}).encode(), hang_s)
        assert code == 200, raw
        baseline[prompt] = json.loads(raw)
        code, _, raw = post(url + "/tokenize", json.dumps({"prompt": prompt}).encode(), hang_s)
        assert code == 200, raw
        prompt_rows.update(json.loads(raw)["tokens"])
    soak = Soak(url, baseline, long, hang_s)
    injector = Faults(cluster, soak, knot_path, knot_key, peer_wait_s, s3_stop_s, hold_s)
    injector.prompt_rows = prompt_rows
    t0 = time.time()
    end = t0 + minutes * 60
    done = threading.Event()  # set when the load is to stop: past the end, and every fault over
    samples, events = [], []

    def worker(seed: int) -> None:
        rng = random.Random(seed)
        while not done.is_set():
            soak.one(rng)

    def sampler() -> None:
        while not done.is_set():
            now = time.time()
            samples.append({"t": now, "rss": {r["name"]: rss_bytes(r["pid"]) for r in cluster.status()
                                              if r["kind"] != "oneshot"}})
            log(f"{(now - t0) / 60:5.1f} min: {sum(soak.outcomes.values())} requests, "
                f"{len(soak.failures)} failures")
            done.wait(10.0)

    threads = [threading.Thread(target=worker, args=(i,), daemon=True) for i in range(workers)]
    threads.append(threading.Thread(target=sampler, daemon=True))
    for t in threads:
        t.start()
    try:
        for i, fault in enumerate(faults):
            at = t0 + (i + 1) * minutes * 60 / (len(faults) + 1)
            time.sleep(max(0.0, at - time.time()))  # the schedule: spread over the run
            start = time.time()
            log(f"fault: {fault}")
            seen = injector.run(fault)
            lifted = time.time()
            recovered = soak.baseline_again(RECOVERY_S)
            event = {"name": fault, "t": start, "lifted_s": round(lifted - start, 1),
                     "recovered_s": round(time.time() - lifted, 1) if recovered else None, **seen}
            if fault == "forge-kv":
                event["kv_rejects_after"] = metric(url, "knot_cache_rejects_total", tier="kv")
            if not recovered:
                event["fail"] = f"no baseline tokens within {RECOVERY_S:g} s of the fault's end"
            if "fail" in event:
                soak.note(start, f"fault {fault}", f"FAIL {event['fail']}")
            events.append(event)
            log(f"  {fault}: lifted after {event['lifted_s']} s, baseline again after {event['recovered_s']} s"
                + (f"; FAILED: {event['fail']}" if "fail" in event else ""))
        time.sleep(max(0.0, end - time.time()))
    finally:
        done.set()
        for t in threads:
            t.join(hang_s + 10)
    for event in events:  # what the requests under way between the fault and the baseline again saw
        event["requests"] = soak.seen(event["t"], event["t"] + event["lifted_s"] + (event["recovered_s"] or RECOVERY_S))
    rows = cluster.status()
    return {"minutes": round((time.time() - t0) / 60, 2), "workers": workers, "peer_wait_s": peer_wait_s,
            "request_timeout_s": request_timeout_s, "hang_s": hang_s,
            "long_prompt_tokens": [len(json.loads(post(url + "/tokenize", json.dumps({"prompt": p}).encode(),
                                                       hang_s)[2])["tokens"]) for p in long],
            "outcomes": {f"{k} {o}": n for (k, o), n in sorted(soak.outcomes.items())},
            "by_outcome": dict(Counter(o for (_, o), n in soak.outcomes.items() for _ in range(n))),
            "longest_request_s": round(max((b - a for a, b, _, _ in soak.requests), default=0.0), 1),
            "longest_requests": [{"at_min": round((a - t0) / 60, 2), "took_s": round(b - a, 1), "kind": k, "outcome": o}
                                 for a, b, o, k in sorted(soak.requests, key=lambda r: r[0] - r[1])[:5]],
            "failures": soak.failures, "hung_workers": sum(t.is_alive() for t in threads), "faults": events,
            "restarts": {r["name"]: r["restarts"] for r in rows if r.get("restarts")},
            "rss_first_last_mib": {n: [round((samples[0]["rss"].get(n) or 0) / 2**20, 1),
                                       round((samples[-1]["rss"].get(n) or 0) / 2**20, 1)]
                                   for n in samples[-1]["rss"]},
            "samples": samples}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--minutes", type=float, default=20.0)
    p.add_argument("--model", default=None, help="registered model or path (default: the default model)")
    p.add_argument("--workers", type=int, default=3)
    p.add_argument("--long-tokens", default="300,1000,2000", help="the long prompts' lengths, in tokens")
    p.add_argument("--peer-wait-s", type=float, default=10.0, help="the cluster's PEER_WAIT_S")
    p.add_argument("--request-timeout-s", type=float, default=120.0, help="the cluster's REQUEST_TIMEOUT_S")
    p.add_argument("--machine", default="", help="recorded in the JSON: the CPU, cores, what else ran")
    p.add_argument("--run-dir", default=str(Path(tempfile.gettempdir()) / "knot-soak"))
    p.add_argument("--out", default=str(Path(__file__).resolve().parents[1] / "docs"))
    args = p.parse_args(argv)
    env = {**os.environ, "KNOT_PORT": str(servers.free_ports(1)[0]), "PEER_WAIT_S": str(args.peer_wait_s),
           "REQUEST_TIMEOUT_S": str(args.request_timeout_s), **ROW_PATH_ENV}
    env.pop("KNOT_KEY", None)
    cluster = launcher.Cluster(Path(args.run_dir))
    print(f"starting the cluster in {args.run_dir}", flush=True)
    cluster.up(model=args.model, env=env)
    choice = launcher.choose_model(args.model, env)
    from deploy import models

    try:
        result = run(cluster, models.ensure_knot(choice.source), choice.knot_key, args.minutes, args.workers,
                     long_tokens=tuple(int(n) for n in args.long_tokens.split(",")), peer_wait_s=args.peer_wait_s,
                     request_timeout_s=args.request_timeout_s, log=lambda m: print(m, flush=True))
    finally:
        cluster.down()
    result = {"model": args.model or choice.source, "machine": args.machine, **result}
    out = Path(args.out)
    (out / "reliability-soak.json").write_text(json.dumps(result, indent=1))
    svg(result["samples"], result["faults"], result["samples"][0]["t"], out / "reliability-rss.svg")
    total = sum(result["by_outcome"].values())
    print(f"{total} requests in {result['minutes']:g} min; outcomes:")
    for o, n in sorted(result["by_outcome"].items(), key=lambda kv: -kv[1]):
        print(f"  {o:40s} {n:6d}  {100 * n / total:5.1f} %")
    for e in result["faults"]:
        print(f"  {e['name']:22s} {e['requests']}")
    print(f"failures: {len(result['failures'])}; hung workers: {result['hung_workers']}; "
          f"longest request: {result['longest_request_s']} s; restarts: {result['restarts']}")
    return 0 if not result["failures"] and not result["hung_workers"] else 1


if __name__ == "__main__":
    sys.exit(main())
