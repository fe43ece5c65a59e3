"""A ServiceRuntime served on a real socket by either of the local host's HTTP servers: the aiohttp
app (deploy/local/host.py build_app) or the lean server (deploy/local/lean_http.py). Tests that
run against both check that the lean server answers as the aiohttp app does."""
from __future__ import annotations

from typing import Awaitable, Callable

from deploy.local.host import ServiceRuntime, app_runner, build_app

SERVERS = ("aiohttp", "lean")


async def serve(rt: ServiceRuntime, server: str = "aiohttp") -> tuple[str, Callable[[], Awaitable[None]]]:
    """-> (base url, close) of rt served on 127.0.0.1 on a free port."""
    if server == "lean":
        from deploy.local.lean_http import LeanServer

        lean = LeanServer(rt, "127.0.0.1", 0)
        await lean.start()
        return f"http://127.0.0.1:{lean.port}", lean.close
    from aiohttp import web

    runner = app_runner(build_app(rt))
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    return f"http://127.0.0.1:{runner.addresses[0][1]}", runner.cleanup
