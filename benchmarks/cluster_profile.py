"""Where a cluster decode step goes: per-hop times, CPU per process per token, the LM-head fan-out.

Starts the compose topology with the local launcher (real SeaweedFS, Valkey and one process per
service), then:

    hops     /generate of --tokens greedy tokens (speculation off: one row per hop), twice; prints
             the second run's decode tok/s and the coordinator's per-hop mean times (timings.hops),
             each station's own layer loop per forward and its warden bytes; a
             fluid station's bytes over its layer loop's time (GB/s) against np.copyto of a phase,
             and the share of that loop spent waiting for tensors
    cpu      one run of --tokens tokens; prints each process's CPU ms per token (user + system,
             every thread, from /proc/<pid>/task/*/stat) and their sum
    fanout   posts one (1, dim) hidden state to every shard's /logits at once, --reps times, and
             prints when the replies arrive (median over the reps, sorted)
    floor    the LM-head hop against its floor: a greedy /sample to every shard at once, as a decode
             step's, interleaved with the same posts to as many bare aiohttp processes, each holding
             its shard's slice of the head and doing nothing but its product (no signature, envelope,
             batcher or summary): when the replies arrive, each way (median over the reps, sorted),
             and the whole head's product in one process, as the single process computes it
    embed    /generate of --tokens greedy tokens for each of three prompts the cluster has not seen
             (code, code, prose), once each: decode tok/s, the embed hop's calls and mean ms (a call
             per step whose token the coordinator does not keep: new rows, from the shard's LRU,
             its warden's RAM or, cold, KV and R2); KNOT_WARM_WARDEN=off/on compares the warm-up
    prefill  one ~700-token prompt: prompt tokens over the time to first token
    rss      each service's peak RSS (VmHWM) so far
    long     one prompt of --long-tokens tokens (bench's repeated Python functions) as ids to
             /v1/completions, --compare-tokens greedy tokens: prefill tok/s, each service's peak RSS
             before and after, each station's accounted peak against its budget; then the single
             process (`knot generate`'s LocalEngine) on the same ids, and whether the text is equal
    huge     50 MB bodies to /v1/completions (3 in flight, one after another) while /v1/models,
             /readyz and /metrics are polled: their slowest answer, the statuses, the coordinator's
             RSS before and after
    direct   decode frames posted straight to station 0, --reps of them, alone and alternating with
             station 1: the call's time against the station's own layer loop
    station  no servers: station 0's handler in-process (embedded bindings, the same code), the
             mean time of a decode forward over its layers, so the hop's HTTP share shows

    python benchmarks/cluster_profile.py [--model NAME|PATH] [--budget-bytes N] [--tokens N]
        [--reps N] [--long-tokens N] [--compare-tokens N]
        [--only hops,cpu,embed,fanout,floor,direct,prefill,rss,long,huge,station]

Extra variables in the environment reach every service (the launcher passes them on), so the
same run can compare settings, e.g. KNOT_SPIN_US=0 or KNOT_ACCESS_LOG=all.
Benchmarks are not tests: nothing here asserts a speed.
"""
from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402

from common import ops, settings, wire  # noqa: E402
from common.models import model_for  # noqa: E402
import deploy.kernels  # noqa: E402
from deploy import launcher, models, servers  # noqa: E402
from deploy.commands.bench import (copy_gb_s, describe_fluid, fluid_rates, http_json, peak_rss_bytes,  # noqa: E402
                                   stations_stats)
from deploy.knotfile import open_model  # noqa: E402

PROMPT = "def fibonacci(n):"


def post(url: str, body: dict, timeout_s: float = 1800.0) -> dict:
    return http_json("POST", url, body, timeout_s=timeout_s)


_cluster = None  # the cluster, once it is up (main): it signs our calls to its internal services


def _signed(method: str, url: str, body: bytes = b"") -> dict[str, str]:
    return _cluster.signed(method, url, body) if _cluster is not None else {}


def get(url: str) -> dict:
    """An internal service's GET, signed with the cluster's secret as its peers' calls are."""
    return http_json("GET", url, timeout_s=60, headers=_signed("GET", url))


def cpu_seconds(pid: int) -> float:
    """User + system time of every thread of pid."""
    total = 0
    for t in os.listdir(f"/proc/{pid}/task"):
        fields = Path(f"/proc/{pid}/task/{t}/stat").read_text().rpartition(")")[2].split()
        total += int(fields[11]) + int(fields[12])  # utime, stime (fields 14, 15)
    return total / os.sysconf("SC_CLK_TCK")


def hops(running: dict, gen: str, tokens: int) -> None:
    before = stations_stats(_cluster, running)
    for i in range(2):
        b = post(gen, {"prompt": PROMPT, "max_tokens": tokens, "temperature": 0, "speculation": "off"})
    after = stations_stats(_cluster, running)
    print(f"hops: decode {b['timings']['decode_tok_s']:.3g} tok/s; mean ms per hop: "
          + ", ".join(f"{k} {v['mean_ms']:.2f}" for k, v in b["timings"]["hops"].items()))
    for name, s in after.items():
        forwards = s["forwards"] - before[name]["forwards"]
        print(f"  {name}: warden bytes per forward {(s['warden_bytes'] - before[name]['warden_bytes']) / forwards:,.0f}, "
              f"kept {s['kept_bytes']:,} B, accounted peak {s['peak_accounted_bytes']:,} B, "
              f"prefetch {s['memory']['prefetch']}; {(s['forward_s'] - before[name]['forward_s']) / forwards * 1e3:.2f} ms "
              f"per forward in its layer loop (the rest of the hop is HTTP, queueing and the envelope)")
    rates = fluid_rates(before, after)
    if any(r["bytes_per_forward"] for r in rates.values()):  # fluid: against the machine's copy speed
        copy = copy_gb_s(max(r["phase_bytes"] for r in rates.values()))
        for line in describe_fluid(rates, copy):
            print(f"  fluid {line}")


NEW_PROMPTS = ("class LRUCache:\n    def __init__(self, capacity):", "import json\n\ndef load_config(path):",
               "Write a short story about a lighthouse keeper.")


def embed(gen: str, tokens: int) -> None:
    for prompt in NEW_PROMPTS:
        b = post(gen, {"prompt": prompt, "max_tokens": tokens, "temperature": 0, "speculation": "off"})
        e = b["timings"]["hops"].get("embed", {"calls": 0, "mean_ms": 0.0})
        print(f"embed: {prompt[:24]!r}: decode {b['timings']['decode_tok_s']:.3g} tok/s; embed hop {e['calls']} calls "
              f"of {b['usage']['completion_tokens']} steps, mean {e['mean_ms']:.2f} ms")


def cpu(running: dict, gen: str, tokens: int) -> None:
    procs = {n: r.pid for n, r in running.items() if r.kind == "process" and servers.pid_alive(r.pid)}
    before = {n: cpu_seconds(p) for n, p in procs.items()}
    t0 = time.perf_counter()
    b = post(gen, {"prompt": PROMPT, "max_tokens": tokens, "temperature": 0, "speculation": "off"})
    wall = time.perf_counter() - t0
    n = b["usage"]["completion_tokens"]
    per = {k: (cpu_seconds(p) - before[k]) / n * 1e3 for k, p in procs.items()}
    print(f"cpu: {n} tokens, wall {wall / n * 1e3:.1f} ms per token, CPU {sum(per.values()):.1f} ms per token")
    for k in sorted(per):
        print(f"  {k:18s} {per[k]:6.2f} ms per token")


async def _direct(url: str, dim: int, reps: int, other: str | None = None) -> float:
    import aiohttp

    x = (np.random.default_rng(0).standard_normal((5, dim)) * 0.1).astype(np.float32)
    async with aiohttp.ClientSession() as s:
        async def forward(mode: str, pos: int, arr: np.ndarray, at: str = url) -> None:
            body = wire.encode_envelope(wire.Envelope("profile-direct", mode, pos, pos + len(arr), arr))
            headers = {"Content-Type": wire.ENVELOPE_CONTENT_TYPE, **_signed("POST", at + "/forward", body)}
            async with s.post(at + "/forward", data=body, headers=headers) as r:
                assert r.status == 200, (r.status, (await r.read())[:200])
                await r.read()

        for u in (url, other) if other else (url,):
            await forward("prefill", 0, x, u)
            for i in range(3):
                await forward("decode", 5 + i, x[:1], u)
        total = 0.0
        for i in range(reps):
            t0 = time.perf_counter()
            await forward("decode", 8 + i, x[:1])
            total += time.perf_counter() - t0
            if other:
                await forward("decode", 8 + i, x[:1], other)
        return total / reps


def direct(running: dict, dim: int, reps: int) -> None:
    """Decode frames posted straight to station-0 (no coordinator, no shard), first alone, then
    each followed by one to station-1: the call's time against station-0's own layer loop."""
    url = running["station-0"].url
    for other in (None, running["station-1"].url):
        before = stations_stats(_cluster, running)["station-0"]
        call_s = asyncio.run(_direct(url, dim, reps, other))
        after = stations_stats(_cluster, running)["station-0"]
        loop_s = (after["forward_s"] - before["forward_s"]) / (after["forwards"] - before["forwards"])
        print(f"direct{', alternating with station-1' if other else ''}: station-0's decode call over HTTP "
              f"{call_s * 1e3:.2f} ms (mean of {reps}), its layer loop {loop_s * 1e3:.2f} ms per forward "
              f"(the prefill included in that mean)")


async def _fanout(shards: list[str], dim: int, reps: int) -> np.ndarray:
    import aiohttp

    h = (np.random.default_rng(0).standard_normal((1, dim)) * 0.1).astype(np.float32)
    body = wire.encode_envelope(wire.Envelope("profile", "logits", 5, 6, h))
    headers = {"Content-Type": wire.ENVELOPE_CONTENT_TYPE}
    async with aiohttp.ClientSession() as s:
        async def one(url: str, t0: float) -> float:
            sig = _signed("POST", url + "/logits", body)  # a fresh nonce per call: a replay is refused
            async with s.post(url + "/logits", data=body, headers={**headers, **sig}) as r:
                await r.read()
                return time.perf_counter() - t0

        for u in shards:  # warm
            await one(u, time.perf_counter())
        rows = []
        for _ in range(reps):
            t0 = time.perf_counter()
            rows.append(sorted(await asyncio.gather(*(one(u, t0) for u in shards))))
    return np.median(np.array(rows), axis=0) * 1e3


def fanout(running: dict, dim: int, reps: int) -> None:
    shards = sorted((n for n in running if n.startswith("shard-")), key=lambda n: int(n.split("-")[1]))
    arrivals = asyncio.run(_fanout([running[n].url for n in shards], dim, reps))
    print(f"fanout: {len(shards)} shards' /logits replies arrive at (ms, median of {reps}): "
          + ", ".join(f"{a:.1f}" for a in arrivals))


def _bare_head(port: int, knot: str, head: str, rows: tuple[int, int], threads: int) -> None:
    """A bare aiohttp server (a spawned process) whose POST answers 300 bytes after the product of
    the hidden state in its first dim * 4 bytes with rows [a, b) of the head: a shard's work and
    HTTP, without the rest of the stack."""
    from aiohttp import web

    from common.quant import QTensor

    deploy.kernels.install(threads)  # the shards' ops: the C kernels where they built
    full = open_model(knot).tensor(head)  # GGUF shape (dim, n_vocab)
    dim, n = full.shape
    data = full.data.reshape(n, -1)[rows[0]:rows[1]].copy()  # (b - a, row bytes): a shard keeps its rows
    w = QTensor(f"{head}[{rows[0]}:{rows[1]}]", full.ggml_type, (dim, rows[1] - rows[0]), data.reshape(-1))

    async def sample(request: web.Request) -> web.Response:
        body = await request.read()
        x = np.frombuffer(body, np.float32, dim).reshape(1, dim)  # (1, dim)
        best = int(ops.installed().matmul(x, w).argmax())  # (1, b - a) -> the slice's greedy candidate
        return web.Response(body=best.to_bytes(4, "little") * 75, content_type="application/octet-stream")

    app = web.Application()
    app.router.add_post("/sample", sample)
    web.run_app(app, host="127.0.0.1", port=port, print=None, access_log=None)


async def _arrivals(targets: list[tuple[int, Callable[[], bytes]]], reps: int) -> np.ndarray:
    """POST to every (port, make the whole request) at once on kept-alive sockets, reps times (each
    request made before the clock starts) -> the replies' arrival times in ms (median over the
    reps, sorted)."""
    conns = [await asyncio.open_connection("127.0.0.1", port) for port, _ in targets]

    async def one(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, message: bytes, t0: float) -> float:
        writer.write(message)
        head = (await reader.readuntil(b"\r\n\r\n")).decode("latin-1").lower()
        if not head.startswith("http/1.1 200"):
            raise RuntimeError(f"floor: {head.splitlines()[0]}")
        await reader.readexactly(int(head.split("content-length:")[1].split("\r\n")[0]))
        return time.perf_counter() - t0

    rows = []
    for i in range(reps + 5):  # the first 5 warm up
        messages = [make() for _, make in targets]
        t0 = time.perf_counter()
        got = await asyncio.gather(*(one(r, w, m, t0) for (r, w), m in zip(conns, messages)))
        if i >= 5:
            rows.append(sorted(got))
    for _, w in conns:
        w.close()
    return np.median(np.array(rows), axis=0) * 1e3


def _listening(port: int, proc, timeout_s: float) -> None:
    """Until proc (a bare head's process) listens on port; RuntimeError if it dies or is slow."""
    deadline = time.monotonic() + timeout_s
    while servers.port_is_free(port):
        if not proc.is_alive() or time.monotonic() > deadline:
            raise RuntimeError(f"floor: the bare head process for port {port} "
                               f"{'exited' if not proc.is_alive() else f'is not listening after {timeout_s:g} s'}")
        time.sleep(0.2)


def _whole_head_ms(w, h: np.ndarray, reps: int) -> float:
    """The median ms of h (1, dim) @ the whole head w, as the single process computes it (the
    installed kernels, every thread): what the fan-out stands in for."""
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        ops.installed().matmul(h, w)  # (1, dim) -> (1, n_vocab)
        times.append((time.perf_counter() - t0) * 1e3)
    return float(np.median(times))


def floor(running: dict, knot: str, dim: int, reps: int) -> None:
    import multiprocessing

    shards = sorted((n for n in running if n.startswith("shard-")), key=lambda n: int(n.split("-")[1]))
    stats = {n: get(running[n].url + "/stats") for n in shards}
    head = stats[shards[0]]["head"]
    h = (np.random.default_rng(0).standard_normal((1, dim)) * 0.1).astype(np.float32)  # (1, dim)
    sample = wire.encode_sample_request(wire.SampleSpec(top=1, temperature=0.0, key=0, lse=False),
                                        wire.Envelope("profile-floor", "logits", 5, 6, h))

    def maker(port: int, body: bytes, content_type: str, signed: bool) -> tuple[int, Callable[[], bytes]]:
        url = f"http://127.0.0.1:{port}/sample"
        head = ["POST /sample HTTP/1.1", f"Host: 127.0.0.1:{port}", f"Content-Length: {len(body)}",
                f"Content-Type: {content_type}"]

        def make() -> bytes:  # signed afresh each time: a verifier refuses a nonce twice
            lines = head + [f"{k}: {v}" for k, v in (_signed("POST", url, body) if signed else {}).items()]
            return "\r\n".join(lines).encode() + b"\r\n\r\n" + body
        return port, make

    whole = open_model(knot).tensor(head)  # (dim, n_vocab)
    ports = servers.free_ports(len(shards))
    spawn = multiprocessing.get_context("spawn")
    threads = settings.read(os.environ, "KNOT_SHARD_THREADS", "compose")  # a shard's KNOT_THREADS, as the launcher sets it
    bare = [spawn.Process(target=_bare_head, daemon=True,
                          args=(port, str(knot), head, (stats[n]["vocab_start"], stats[n]["vocab_end"]), threads))
            for port, n in zip(ports, shards)]
    for p in bare:
        p.start()
    try:
        for port, p in zip(ports, bare):
            _listening(port, p, 120)
        real = [maker(running[n].port, sample, wire.ENVELOPE_CONTENT_TYPE, True) for n in shards]
        base = [maker(port, h.tobytes(), "application/octet-stream", False) for port in ports]
        for _ in range(2):  # interleaved: the machine's speed drifts
            got = asyncio.run(_arrivals(real, reps))
            print(f"floor: {len(shards)} shards' greedy /sample replies arrive at (ms, median of {reps}): "
                  + ", ".join(f"{a:.1f}" for a in got))
            got = asyncio.run(_arrivals(base, reps))
            print(f"       {len(shards)} bare aiohttp processes, the same products: "
                  + ", ".join(f"{a:.1f}" for a in got))
            print(f"       the whole head in this one process (the single process's product): "
                  f"{_whole_head_ms(whole, h, reps):.1f}")
    finally:
        for p in bare:
            p.terminate()
            p.join(5)


def prefill(gen: str) -> None:
    text = "".join(f"def function_{i}(values, scale={i}):\n    total = 0\n    for v in values:\n"
                   f"        total += v * scale\n    return total\n\n" for i in range(20))
    b = post(gen, {"prompt": text, "max_tokens": 1, "temperature": 0})
    n = b["usage"]["prompt_tokens"]
    print(f"prefill: {n} tokens, {n / b['timings']['time_to_first_token_ms'] * 1e3:.1f} tok/s")


def rss_mib(running: dict) -> dict[str, float]:
    return {n: peak_rss_bytes(r.pid) / 2**20 for n, r in running.items()
            if r.kind == "process" and servers.pid_alive(r.pid)}


def long_prompt(running: dict, knot: Path, n: int, tokens: int) -> None:
    from common.sampling import SamplingParams
    from deploy.commands.bench import long_prompt_ids
    from deploy.engine_local import LocalEngine

    engine = LocalEngine.open(knot)
    ids = long_prompt_ids(engine.tokenizer, n)
    before = rss_mib(running)
    t0 = time.perf_counter()
    # a 30k-token prefill takes over 30 min on a loaded 2-core machine
    b = post(running["coordinator"].url + "/v1/completions", {"prompt": ids, "max_tokens": tokens, "temperature": 0},
             timeout_s=4 * 3600)
    wall = time.perf_counter() - t0
    after = rss_mib(running)
    text = b["choices"][0]["text"]
    print(f"long: {b['usage']['prompt_tokens']} prompt tokens, {tokens} greedy tokens in {wall:.0f} s "
          f"({n / wall:.1f} prompt tok/s over the whole request, its decode steps included): {text!r}")
    print("long: peak RSS MiB before -> after: " + ", ".join(
        f"{k} {before.get(k, 0):.0f} -> {v:.0f}" for k, v in sorted(after.items())))
    for name, r in sorted(running.items()):
        if name.startswith("station"):
            s = get(r.url + "/stats")
            print(f"  {name}: accounted peak {s['peak_accounted_bytes']:,} B of {s['budget_bytes']:,}, "
                  f"max_session_tokens {s['max_session_tokens']}, split frames {s['split_frames']}")
    t0 = time.perf_counter()
    want = engine.generate(ids, SamplingParams(), max_tokens=tokens)
    print(f"long: the single process in {time.perf_counter() - t0:.0f} s: {want.text!r}; "
          f"equal: {want.text == text}")


def huge_requests(running: dict) -> None:
    import json
    import urllib.error
    import urllib.request
    from concurrent.futures import ThreadPoolExecutor

    url = running["coordinator"].url
    pid = running["coordinator"].pid

    def rss() -> float:
        return int(Path(f"/proc/{pid}/statm").read_text().split()[1]) * 4096 / 2**20

    def send(body: bytes) -> int:
        req = urllib.request.Request(url + "/v1/completions", data=body, method="POST",
                                     headers={"content-type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=300) as r:
                return r.status
        except urllib.error.HTTPError as e:
            return e.code
        except (ConnectionError, urllib.error.URLError) as e:  # the server may close a refused upload
            return getattr(e, "code", 0) or -1

    huge = json.dumps({"prompt": "x" * (50 << 20), "max_tokens": 1}).encode()
    before, slowest, polls = rss(), {}, 0
    with ThreadPoolExecutor(3) as pool:
        t0 = time.perf_counter()
        sent = [pool.submit(send, huge) for _ in range(3)]
        while not all(f.done() for f in sent):
            for path in ("/v1/models", "/readyz", "/metrics"):
                t = time.perf_counter()
                http_json("GET", url + path, timeout_s=300) if path != "/metrics" else \
                    urllib.request.urlopen(url + path, timeout=300).read()
                slowest[path] = max(slowest.get(path, 0.0), time.perf_counter() - t)
                polls += 1
        wall = time.perf_counter() - t0
    print(f"huge: 3 x {len(huge) / 1e6:.0f} MB bodies, statuses {[f.result() for f in sent]}, done in {wall:.2f} s; "
          f"{polls} polls meanwhile, slowest ms: " + ", ".join(f"{k} {v * 1e3:.1f}" for k, v in slowest.items())
          + f"; coordinator RSS {before:.0f} -> {rss():.0f} MiB")


def station_inprocess(knot: Path, budget_bytes: int, steps: int) -> None:
    import tempfile

    from common.runtime import Request
    from tests.inprocess import build_cluster

    async def run() -> float:
        with tempfile.TemporaryDirectory() as tmp:
            c = await build_cluster(knot, Path(tmp), station_budget_bytes=budget_bytes)
            await c.generate(prompt=PROMPT, max_tokens=2)  # boots, fills the kept tensors
            st, dim = c.stations[0], model_for(open_model(knot).header).cfg.dim
            x = (np.random.default_rng(0).standard_normal((5, dim)) * 0.1).astype(np.float32)

            async def forward(mode: str, pos: int, arr: np.ndarray) -> None:
                body = wire.encode_envelope(wire.Envelope("profile", mode, pos, pos + len(arr), arr))
                r = await st.fetch(Request("POST", "https://station/forward", {}, body))
                assert r.status == 200, r.body[:200]

            await forward("prefill", 0, x)
            for i in range(3):
                await forward("decode", 5 + i, x[:1])
            t0 = time.perf_counter()
            for i in range(steps):
                await forward("decode", 8 + i, x[:1])
            dt = (time.perf_counter() - t0) / steps
            await c.drain()
            return dt

    from common.layers import forward_range
    from deploy.engine_local import LocalEngine

    station_s = asyncio.run(run())
    engine = LocalEngine.open(knot)  # the single process, over the same layers [0, n_layer // 2)
    kv, half = engine.new_kv(), engine.cfg.n_layer // 2
    x = (np.random.default_rng(0).standard_normal((1, engine.cfg.dim)) * 0.1).astype(np.float32)
    for i in range(3 + steps):
        if i == 3:
            t0 = time.perf_counter()
        forward_range(engine.arch, x, 0, half, engine.load_phase, kv, [i])
    engine_s = (time.perf_counter() - t0) / steps
    print(f"station: station 0's decode forward in-process {station_s * 1e3:.2f} ms; the single process "
          f"over the same {half} layers {engine_s * 1e3:.2f} ms (means of {steps})")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="qwen2.5-coder-0.5b")
    p.add_argument("--budget-bytes", type=int, default=128 << 20, help="stations' budget (default 128 MiB)")
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--reps", type=int, default=40, help="fan-outs timed (default 40)")
    p.add_argument("--long-tokens", type=int, default=30000, help="the long part's prompt tokens (default 30000)")
    p.add_argument("--compare-tokens", type=int, default=8, help="the long part's greedy tokens (default 8)")
    p.add_argument("--only", default="hops,cpu,fanout,prefill,rss,station",
                   help="parts, in order (long and huge run only when named)")
    p.add_argument("--run-dir", default=str(Path(tempfile.gettempdir()) / "knot-profile"))
    args = p.parse_args(argv)
    parts = [x.strip() for x in args.only.split(",") if x.strip()]
    deploy.kernels.install()  # the in-process station computes here, as `knot serve` would
    knot = models.ensure_knot(args.model)
    dim = model_for(open_model(knot).header).cfg.dim
    if "station" in parts:
        parts.remove("station")
        station_inprocess(knot, args.budget_bytes, args.tokens)
    if not parts:
        return 0
    env = {**os.environ, "KNOT_PORT": str(servers.free_ports(1)[0]),
           "STATION_MEMORY_BUDGET_BYTES": str(args.budget_bytes)}
    env.pop("KNOT_KEY", None)
    cluster = launcher.Cluster(Path(args.run_dir))
    running = {r.name: r for r in cluster.up(model=args.model, env=env)}
    global _cluster
    _cluster = cluster
    try:
        gen = running["coordinator"].url + "/generate"
        post(gen, {"prompt": PROMPT, "max_tokens": 4, "temperature": 0})  # boots and warms every service
        for part in parts:
            if part == "hops":
                hops(running, gen, args.tokens)
            elif part == "cpu":
                cpu(running, gen, args.tokens)
            elif part == "embed":
                embed(gen, args.tokens)
            elif part == "fanout":
                fanout(running, dim, args.reps)
            elif part == "floor":
                floor(running, knot, dim, args.reps)
            elif part == "direct":
                direct(running, dim, args.reps)
            elif part == "prefill":
                prefill(gen)
            elif part == "rss":
                print("rss: peak MiB " + ", ".join(f"{n} {v:.0f}" for n, v in rss_mib(running).items()))
            elif part == "long":
                long_prompt(running, knot, args.long_tokens, args.compare_tokens)
            elif part == "huge":
                huge_requests(running)
            else:
                print(f"unknown part {part!r}", file=sys.stderr)
    finally:
        cluster.down()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
