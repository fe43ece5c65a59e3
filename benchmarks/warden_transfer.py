"""How fast a LayerWarden-sized reply crosses from one local service process to another.

A server process runs the local host (deploy/local/host.py build_app) around a handler that returns
a --mb MB body, as a LayerWarden returns a phase's tensor batch; this process fetches it --reps
times through the stations' binding code (deploy/local/bindings.http_fetch, aiohttp) and through a
bare socket (recv_into one buffer: the most an HTTP client could get), and prints GB/s (median)
next to np.copyto of the same bytes and a plain-socket transfer of them (the kernel's loopback).
The server writes the body whole (as before issue 15) or sliced (SLICED_BODY_BYTES):

    python benchmarks/warden_transfer.py [--mb 56] [--reps 12]

Run it with the stations' malloc settings (deploy/compose_writer.py KEEP_HEAP), as the cluster does:
MALLOC_MMAP_THRESHOLD_=1073741824 MALLOC_TRIM_THRESHOLD_=1073741824. Nothing here asserts a speed.
"""
from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import socket
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402


def serve(port: int, nbytes: int, sliced: bool) -> None:
    from aiohttp import web

    from common.runtime import Env, Response
    from deploy.local import host
    from deploy.local.tasks import BackgroundTasks

    if not sliced:
        host.SLICED_BODY_BYTES = 1 << 62  # every body written whole, as before
    body = np.random.default_rng(0).bytes(nbytes)

    async def handler(request, env, ctx) -> Response:
        return Response.from_bytes(body, "application/x-knot-tensor-batch")

    rt = host.ServiceRuntime("layer-warden", handler, Env(), BackgroundTasks("bench"))
    web.run_app(host.build_app(rt), host="127.0.0.1", port=port, print=None, access_log=None)


def serve_socket(port: int, nbytes: int) -> None:
    s = socket.create_server(("127.0.0.1", port))
    body = np.random.default_rng(0).bytes(nbytes)
    c, _ = s.accept()
    while c.recv(1):
        c.sendall(body)


def median_gb_s(nbytes: int, times: list[float]) -> float:
    return nbytes / sorted(times)[len(times) // 2] / 1e9


async def via_binding(port: int, reps: int) -> tuple[int, list[float]]:
    import aiohttp

    from common.runtime import Request
    from deploy.local.server_bindings import http_fetch

    times = []
    async with aiohttp.ClientSession() as session:
        for _ in range(reps):
            t0 = time.perf_counter()
            resp = await http_fetch(session, f"http://127.0.0.1:{port}/tensors", Request("GET", "/tensors"), 60)
            times.append(time.perf_counter() - t0)
    return len(resp.body), times


async def via_socket(port: int, reps: int) -> tuple[int, list[float]]:
    """HTTP/1.1 GET on a bare socket, the body received into one preallocated buffer."""
    loop, times = asyncio.get_running_loop(), []
    for _ in range(reps):
        t0 = time.perf_counter()
        sock = socket.socket()
        sock.setblocking(False)
        await loop.sock_connect(sock, ("127.0.0.1", port))
        await loop.sock_sendall(sock, b"GET /tensors HTTP/1.1\r\nHost: bench\r\nConnection: close\r\n\r\n")
        head = b""
        while b"\r\n\r\n" not in head:
            head += await loop.sock_recv(sock, 1 << 16)
        lines, _, rest = head.partition(b"\r\n\r\n")
        n = next(int(v) for k, _, v in (line.partition(b":") for line in lines.split(b"\r\n"))
                 if k.strip().lower() == b"content-length")
        buf = bytearray(n)
        view, pos = memoryview(buf), len(rest)
        buf[:pos] = rest
        while pos < n:
            got = await loop.sock_recv_into(sock, view[pos:])
            if not got:
                raise ConnectionError(f"closed after {pos} of {n} bytes")
            pos += got
        sock.close()
        times.append(time.perf_counter() - t0)
    return n, times


def plain_socket(port: int, nbytes: int, reps: int) -> list[float]:
    c = socket.create_connection(("127.0.0.1", port))
    buf = bytearray(nbytes)
    view, times = memoryview(buf), []
    for _ in range(reps):
        t0 = time.perf_counter()
        c.send(b"x")
        pos = 0
        while pos < nbytes:
            pos += c.recv_into(view[pos:])
        times.append(time.perf_counter() - t0)
    return times


def started(target, *args) -> mp.Process:
    p = mp.Process(target=target, args=args, daemon=True)
    p.start()
    time.sleep(2.0)
    return p


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mb", type=int, default=56, help="body size in MiB (default 56: a 7B's ffn_down phase)")
    p.add_argument("--reps", type=int, default=12)
    args = p.parse_args(argv)
    nbytes = args.mb << 20
    from deploy.servers import free_ports

    src = np.frombuffer(np.random.default_rng(1).bytes(nbytes), np.uint8)
    dst = np.empty_like(src)
    np.copyto(dst, src)
    times = []
    for _ in range(args.reps):
        t0 = time.perf_counter()
        np.copyto(dst, src)
        times.append(time.perf_counter() - t0)
    print(f"np.copyto of {args.mb} MiB: {median_gb_s(nbytes, times):.2f} GB/s")
    port = free_ports(1)[0]
    server = started(serve_socket, port, nbytes)
    print(f"plain socket (loopback TCP, blocking recv_into): {median_gb_s(nbytes, plain_socket(port, nbytes, args.reps)):.2f} GB/s")
    server.terminate()
    for sliced in (False, True):
        port = free_ports(1)[0]
        server = started(serve, port, nbytes, sliced)
        for name, fetch in (("aiohttp (the stations' binding)", via_binding), ("bare socket, one buffer", via_socket)):
            n, times = asyncio.run(fetch(port, args.reps))
            assert n == nbytes, (n, nbytes)
            print(f"host writes {'sliced' if sliced else 'whole '}, client {name}: {median_gb_s(nbytes, times):.2f} GB/s")
        server.terminate()
        server.join()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
