"""RSS over knot reloads (issue 52 item 8): a `knot cluster up` cluster, the knot replaced in its
bucket N times, one request after each, every service's RSS after each reload. CI does not run it
(tests/integration/test_reload_memory.py checks the same on the tiny model).

    python benchmarks/reload_rss.py [--model qwen2.5-coder-0.5b] [--reloads 10] [--profile worker] [--out FILE]

Each new version is the model's knot uploaded again in parts of another size: the same bytes under a
new S3 etag, which every service loads as a new version.
After each request (retried while a hop answers 503 mid-reload) the script waits SETTLE_S for
background work (the warden's warm-up), then reads VmRSS of every process from /proc. It prints
one row per reload and, per service, the RSS after the first and after the last reload; --out
writes every sample as JSON.

    python benchmarks/reload_rss.py --plot BEFORE.json AFTER.json --svg docs/reliability-reload-rss.svg

draws two such runs (the first dashed) without starting anything.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from deploy import cluster_secrets, launcher, servers  # noqa: E402
from deploy.local.server_bindings import S3Settings, s3_client  # noqa: E402

PROMPT = "def fibonacci(n):"
MAX_TOKENS = 8
SETTLE_S = 5.0
BUCKET = "knots"


def rss_bytes(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def generate(url: str, attempts: int = 20) -> dict:
    """One /generate at temperature 0; a 503 (a hop mid-reload) is tried again."""
    body = json.dumps({"prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0}).encode()
    for _ in range(attempts):
        req = urllib.request.Request(url + "/generate", data=body, method="POST",
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=600) as r:
                return json.loads(r.read())
        except urllib.error.HTTPError as e:
            if e.code != 503:
                raise
            time.sleep(1.0)
    raise RuntimeError(f"no 200 from /generate in {attempts} attempts")


def reloads(url: str) -> dict[str, float]:
    """The reload counters of the coordinator's /metrics: its own, and each service's (per process)."""
    with urllib.request.urlopen(url + "/metrics", timeout=60) as r:
        text = r.read().decode()
    out = {}
    for line in text.splitlines():
        if line.startswith(("knot_version_reloads_total", "knot_service_version_reloads_total")):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def upload(s3, key: str, path: Path, i: int) -> str:
    """The same knot again, in parts of 16 MiB + i KiB -> its new etag. S3 names a multipart object's
    version after its parts, so every upload is a new version (etag) of the same bytes (digest): what
    the services reload, the pinned digest included."""
    part_bytes = (16 << 20) + (i << 10)
    up = s3.create_multipart_upload(Bucket=BUCKET, Key=key)["UploadId"]
    parts = []
    with open(path, "rb") as f:
        while chunk := f.read(part_bytes):
            n = len(parts) + 1
            etag = s3.upload_part(Bucket=BUCKET, Key=key, UploadId=up, PartNumber=n, Body=chunk)["ETag"]
            parts.append({"PartNumber": n, "ETag": etag})
    s3.complete_multipart_upload(Bucket=BUCKET, Key=key, UploadId=up, MultipartUpload={"Parts": parts})
    return s3.head_object(Bucket=BUCKET, Key=key)["ETag"]


def s3_for(cluster: launcher.Cluster, rows: dict[str, dict]) -> object:
    """A client of the cluster's bucket, with its one S3 identity (the cluster's secrets)."""
    secrets = cluster_secrets.read(cluster.run_dir / launcher.SECRETS_FILE)
    return s3_client(S3Settings(rows["minio"]["url"], secrets["MINIO_ROOT_USER"], secrets["MINIO_ROOT_PASSWORD"],
                                connect_timeout_s=5.0, read_timeout_s=300.0))


PLOTTED = {"station-0": "#1f77b4", "station-1": "#6baed6", "shard-0": "#d62728", "coordinator": "#2ca02c",
           "cobordism-warden": "#9467bd", "layer-warden": "#8c564b"}


def svg(runs: list[dict], labels: list[str], path: Path) -> None:
    """RSS (MiB) of some services after boot and after each reload, one polyline per service and run;
    every run but the last dashed."""
    W, H, L, B = 760, 380, 60, 40
    n = max(len(r["samples"]) for r in runs)
    top = max((v or 0) for r in runs for smp in r["samples"] for k, v in smp["rss"].items() if k in PLOTTED)
    top = (int(top / 2**20 / 200) + 1) * 200
    x = lambda i: L + i * (W - L - 150) / max(n - 1, 1)  # noqa: E731
    y = lambda mib: H - B - mib * (H - B - 10) / top  # noqa: E731
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" font-family="sans-serif" font-size="11">',
           f'<rect width="{W}" height="{H}" fill="white"/>',
           f'<line x1="{L}" y1="{H - B}" x2="{W - 150}" y2="{H - B}" stroke="black"/>',
           f'<line x1="{L}" y1="10" x2="{L}" y2="{H - B}" stroke="black"/>',
           f'<text x="{(W - 150) / 2}" y="{H - 8}">after boot, then after reload 1 ... {n - 1}</text>',
           '<text x="5" y="20">RSS MiB</text>']
    out += [f'<text x="{x(i) - 3:.1f}" y="{H - B + 14}">{i}</text>' for i in range(n)]
    out += [f'<text x="20" y="{y(v) + 4:.1f}">{v}</text>' for v in range(0, top + 1, 200)]
    legend = 30
    for k, (run, label) in enumerate(zip(runs, labels)):
        dash = '' if k == len(runs) - 1 else ' stroke-dasharray="5,4"'
        for name, color in PLOTTED.items():
            pts = " ".join(f"{x(i):.1f},{y(smp['rss'][name] / 2**20):.1f}" for i, smp in enumerate(run["samples"])
                           if smp["rss"].get(name))
            if pts:
                out.append(f'<polyline fill="none" stroke="{color}" stroke-width="1.5"{dash} points="{pts}"/>')
        out.append(f'<line x1="{W - 140}" y1="{legend}" x2="{W - 115}" y2="{legend}" stroke="black"{dash}/>'
                   f'<text x="{W - 110}" y="{legend + 4}">{label}</text>')
        legend += 16
    for name, color in PLOTTED.items():
        out.append(f'<text x="{W - 140}" y="{legend + 4}" fill="{color}">{name}</text>')
        legend += 14
    out.append("</svg>")
    path.write_text("\n".join(out) + "\n")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="registered model or path (default: the default model)")
    p.add_argument("--reloads", type=int, default=10)
    p.add_argument("--profile", default=None, help="worker (default) or resident")
    p.add_argument("--run-dir", default=str(Path(tempfile.gettempdir()) / "knot-reload-rss"))
    p.add_argument("--out", default=None, help="write every sample here (JSON)")
    p.add_argument("--plot", nargs="+", metavar="JSON", help="draw these runs' samples (--out files) instead")
    p.add_argument("--svg", default="reliability-reload-rss.svg", help="with --plot: where the drawing goes")
    args = p.parse_args(argv)
    if args.plot:
        runs = [json.loads(Path(f).read_text()) for f in args.plot]
        svg(runs, [Path(f).stem for f in args.plot], Path(args.svg))
        return 0
    env = {**os.environ, "KNOT_PORT": str(servers.free_ports(1)[0])}
    env.pop("KNOT_KEY", None)
    choice = launcher.choose_model(args.model, env)
    from deploy.models import ensure_knot

    path = Path(choice.source) if Path(choice.source).is_file() else ensure_knot(choice.source)
    cluster = launcher.Cluster(Path(args.run_dir))
    print(f"starting the cluster in {args.run_dir}", flush=True)
    running = {r.name: r for r in cluster.up(model=args.model, env=env, profile=args.profile)}
    url = running["coordinator"].url
    samples = []
    try:
        rows = {r["name"]: r for r in cluster.status()}
        s3 = s3_for(cluster, rows)
        base = generate(url)["tokens"]
        etags = {s3.head_object(Bucket=BUCKET, Key=choice.knot_key)["ETag"]}

        def sample(label: str) -> dict:
            time.sleep(SETTLE_S)
            rows = {r["name"]: r for r in cluster.status() if r["kind"] == "process"}
            got = {n: rss_bytes(r["pid"]) for n, r in rows.items()}
            samples.append({"t": time.time(), "after": label, "rss": got})
            return got

        first = sample("boot")
        print(f"{'after':>8} " + " ".join(f"{n[:12]:>12}" for n in first), flush=True)
        print(f"{'boot':>8} " + " ".join(f"{v / 2**20:12.1f}" for v in first.values()), flush=True)
        for i in range(1, args.reloads + 1):
            etag = upload(s3, choice.knot_key, path, i)
            if etag in etags:
                raise AssertionError(f"reload {i}: the upload kept an earlier etag, {etag}")
            etags.add(etag)
            got = generate(url)["tokens"]
            if got != base:
                raise AssertionError(f"reload {i}: tokens {got}, the first version's were {base}")
            now = sample(f"reload {i}")
            print(f"{f'reload {i}':>8} " + " ".join(f"{(now.get(n) or 0) / 2**20:12.1f}" for n in first), flush=True)
        counted = reloads(url)
        print("reloads counted: " + ", ".join(f"{k} {v:g}" for k, v in counted.items()))
        one, last = samples[1]["rss"], samples[-1]["rss"]
        print(f"\nRSS MiB after reload 1 -> after reload {args.reloads} (ratio):")
        for n in first:
            if one.get(n) and last.get(n):
                print(f"  {n:18s} {one[n] / 2**20:8.1f} -> {last[n] / 2**20:8.1f}  ({last[n] / one[n]:.3f})")
        if args.out:
            Path(args.out).write_text(json.dumps({"model": choice.source, "profile": args.profile or "worker",
                                                  "reloads": args.reloads, "counted": counted,
                                                  "samples": samples}, indent=1))
        return 0
    finally:
        cluster.down()


if __name__ == "__main__":
    raise SystemExit(main())
