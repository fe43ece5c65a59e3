"""Decode speed of a real model on the Cloudflare deployment, run under Pyodide in Node.

Every Worker `knot deploy cloudflare` writes (with its 128 MB budgets; with 2 stations they run fluid,
streaming layers from the LayerWarden) runs in one Pyodide 0.27.7 process, over the workerd
doubles of tests/cloudflare/node; the same requests then run on the CPython in-process cluster
over the same budgets. Prints seconds per token and the hops of one decode step, both ways.
One Pyodide process runs every Worker in turn, so its time is the sum of the Workers' CPU per
token: on Cloudflare the eight shards' LM-head slices would overlap.

    .venv/bin/python benchmarks/pyodide_speed.py [--model qwen2.5-coder-0.5b] [--stations 6] [--tokens 3]

The default 6 stations keep the 0.5B's layers resident in 64 MiB each (with 2 they run fluid and
re-read most layers from R2 every token, which under Pyodide takes minutes per token).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from common import ops  # noqa: E402
from deploy import models, wrangler  # noqa: E402
from deploy.commands.deploy import model_shape  # noqa: E402
from tests.cloudflare.test_pyodide import SECRET, run_harness  # noqa: E402
from tests.inprocess import build_cluster  # noqa: E402

PROMPT = "def fibonacci(n):"


def per_token(summary: dict) -> float:
    t = summary["timings"]
    n = max(1, len(summary["tokens"]) - 1)
    return t["decode_ms"] / 1e3 / n


async def cpython(knot: Path, tokens: int, stations: int, tmp: Path) -> dict:
    ops.install(ops.Ops())  # the numpy path, as under Pyodide
    cluster = await build_cluster(knot, tmp, n_stations=stations, station_budget_bytes=wrangler.BUDGETS["station"])
    await cluster.generate(prompt=PROMPT, max_tokens=1)  # boot
    t0 = time.perf_counter()
    out = (await cluster.generate(prompt=PROMPT, max_tokens=tokens)).json()
    out["wall_s"] = time.perf_counter() - t0
    await cluster.drain()
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=models.DEFAULT_MODEL)
    ap.add_argument("--stations", type=int, default=6)
    ap.add_argument("--tokens", type=int, default=3)
    ap.add_argument("--timeout", type=float, default=3600, help="seconds the Pyodide run may take")
    args = ap.parse_args()
    knot = models.ensure_knot(args.model, progress=False)
    n_layers, vocab, _ = model_shape(args.model)
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        out = tmp / "deploy"
        wrangler.write(out, wrangler.plan(n_layers, vocab, "model.knot", args.stations, public=True), public=True)
        gen = {"worker": "knot-coordinator", "path": "/generate", "body": {"prompt": PROMPT, "max_tokens": args.tokens}}
        cfg = {"mounts": {"/deploy": str(out)}, "deploy": str(out), "deploy_mount": "/deploy", "bucket": "knots",
               "knot_key": "model.knot", "knot": str(knot), "secrets": {"KNOT_INTERNAL_SECRET": SECRET},
               "python_path": ["/deploy/knot-coordinator/src", "/deploy/knot-coordinator/python_modules", "/sdk"],
               "requests": [{**gen, "body": {"prompt": PROMPT, "max_tokens": 1}}, gen]}
        t0 = time.perf_counter()
        res = run_harness(cfg, tmp, args.timeout)
        harness_s = time.perf_counter() - t0
        boot, run = res["requests"]
        assert run["status"] == 200, run["text"][:500]
        py = json.loads(run["text"])
        cp = asyncio.run(cpython(knot, args.tokens, args.stations, tmp / "cpython"))
    print(f"model {args.model}: {n_layers} layers, {args.tokens} tokens after a {len(py['prompt_tokens'])}-token prompt; "
          f"{args.stations} stations of {wrangler.BUDGETS['station'] >> 20} MiB")
    print(f"pyodide: start {res['timings']['pyodide_start_s']} s, numpy {res['timings']['numpy_load_s']} s, "
          f"first request (boots every Worker) {boot['seconds']} s, wasm heap {res['wasm_heap_bytes'] >> 20} MiB, "
          f"harness {harness_s:.1f} s")
    print(f"{'':10s} {'s/token':>8s} {'ttft s':>8s}  hops of the run (mean ms)")
    for name, s in (("pyodide", py), ("cpython", cp)):
        hops = ", ".join(f"{k} {v['mean_ms']:.0f}" for k, v in s["timings"]["hops"].items())
        print(f"{name:10s} {per_token(s):8.2f} {s['timings']['time_to_first_token_ms'] / 1e3:8.2f}  {hops}")
    print(f"ratio pyodide/cpython per token: {per_token(py) / per_token(cp):.1f}x; "
          f"same tokens: {py['tokens'] == cp['tokens']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
