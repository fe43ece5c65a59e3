"""What one small internal call costs its caller: a coordinator's hop to a station or a shard.

A server process runs the local host (deploy/local/host.py build_app, signatures checked) around a
handler that answers a --request-bytes body with a --reply-bytes one, as a shard answers a decode
step's hidden state (896 floats for the 0.5B) with its slice's summary. This process makes --calls
signed calls in a row through each client the local bindings have, in alternating rounds, and
prints the caller's CPU and wall time per call (medians of the rounds) and their ratio:

    aiohttp      deploy/local/bindings.http_fetch (the service bindings' client before buffered_fetch)
    buffered     deploy/local/bindings.buffered_fetch on kept-alive Connections (HttpService now)

    python benchmarks/hop_client.py [--calls 2000] [--rounds 3]

The caller's CPU is what a coordinator spends between the hops of a token, ten calls of it per
decode step (two stations, eight shards). Nothing here asserts a speed.
"""
from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import os
import resource
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

SECRET = "b" * 43


def serve(port: int, reply_bytes: int) -> None:
    from aiohttp import web

    from common import signing
    from common.runtime import Env, Response
    from deploy.local import host
    from deploy.local.tasks import BackgroundTasks

    reply = os.urandom(reply_bytes)

    async def handler(request, env, ctx) -> Response:
        return Response.from_bytes(reply, "application/octet-stream")

    rt = host.ServiceRuntime("shard", handler, Env(), BackgroundTasks("bench"),
                             verifier=signing.Verifier(SECRET, "shard", booted_at=time.time()))
    web.run_app(host.build_app(rt), host="127.0.0.1", port=port, print=None, access_log=None)


def cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


async def measure(port: int, calls: int, rounds: int, request_bytes: int, reply_bytes: int) -> dict[str, list]:
    import aiohttp

    from common.runtime import Request
    from deploy.local.server_bindings import Connections, Signer, buffered_fetch, http_fetch

    signer, body = Signer(SECRET, "shard"), os.urandom(request_bytes)
    url = f"http://127.0.0.1:{port}/sample"
    conns = Connections()
    out: dict[str, list] = {"aiohttp": [], "buffered": []}
    async with aiohttp.ClientSession() as session:
        clients = {"aiohttp": lambda r: http_fetch(session, url, r, 30, signer=signer),
                   "buffered": lambda r: buffered_fetch(url, r, 30, signer=signer, connections=conns,
                                                        replay_stale=False)}
        for fetch in clients.values():  # connections made, code warm
            for _ in range(50):
                await fetch(Request("POST", url, body=body))
        for rnd in range(rounds):
            for name in (("aiohttp", "buffered") if rnd % 2 == 0 else ("buffered", "aiohttp")):
                fetch = clients[name]
                c0, t0 = cpu_s(), time.perf_counter()
                for _ in range(calls):
                    r = await fetch(Request("POST", url, body=body))
                    if r.status != 200 or len(r.body) != reply_bytes:
                        raise SystemExit(f"{name}: HTTP {r.status}, {len(r.body)} bytes: {bytes(r.body[:200])!r}")
                out[name].append(((cpu_s() - c0) / calls * 1e6, (time.perf_counter() - t0) / calls * 1e6))
    conns.close()
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--calls", type=int, default=2000, help="calls per client and round")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--request-bytes", type=int, default=3700, help="default: a 0.5B hidden state's frame")
    p.add_argument("--reply-bytes", type=int, default=1000, help="default: about a shard's summary")
    args = p.parse_args(argv)
    from deploy.servers import free_ports

    port = free_ports(1)[0]
    server = mp.Process(target=serve, args=(port, args.reply_bytes), daemon=True)
    server.start()
    try:
        time.sleep(2.0)
        res = asyncio.run(measure(port, args.calls, args.rounds, args.request_bytes, args.reply_bytes))
    finally:
        server.terminate()
        server.join()
    med = {k: (statistics.median(c for c, _ in v), statistics.median(w for _, w in v)) for k, v in res.items()}
    for name, (c, w) in med.items():
        print(f"{name:9s} caller CPU {c:6.1f} us/call, wall {w:6.1f} us/call "
              f"(rounds: {', '.join(f'{x:.0f}' for x, _ in res[name])} us CPU)")
    print(f"buffered / aiohttp: CPU {med['buffered'][0] / med['aiohttp'][0]:.2f}x, "
          f"wall {med['buffered'][1] / med['aiohttp'][1]:.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
