"""knot serve: one service from the environment (the container's command), or, with --embedded,
the whole cluster layout in one process with embedded bindings."""
from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import sys
from pathlib import Path

from common import settings as table
from deploy import cluster_secrets, servers
from deploy.commands.cluster import add_layout_arguments
from deploy.launcher import choose_model, default_run_dir, layout_for, plan
from deploy.local import init, logs, malloc_trim
from deploy.local.host import build_app, serve_apps, serve_one
from deploy.local.host_settings import HostSettings, parse_binding
from deploy.local.embedded_cluster import EmbeddedCluster

NAME = "serve"
HELP = "serve one service configured by KNOT_SERVICE etc. (docs/configuration.md), or --embedded"

log = logging.getLogger(__name__)


def add_arguments(p) -> None:
    p.add_argument("--embedded", action="store_true",
                   help="every service of the layout in this process, with a directory bucket and in-process KV")
    p.add_argument("--model", help="with --embedded: model name or .gguf/.knot path (default: the default model)")
    add_layout_arguments(p)
    p.add_argument("--base-port", type=int, help="with --embedded: ports base, base+1, ... (default: free ports)")
    p.add_argument("--run-dir", type=Path, help="with --embedded: where the bucket directory lives")


def run(args) -> int:
    if not args.embedded:
        settings = HostSettings.from_env(os.environ)
        logs.configure(settings.name, settings.log_format, logging.DEBUG if args.verbose else logging.INFO)
        malloc_trim.trim_after_full_collections(os.environ)  # a knot reload's memory goes back to the system
        asyncio.run(serve_one(settings))
        return 0
    logs.configure("embedded", table.read(os.environ, "KNOT_LOG_FORMAT", "launcher"),
                   logging.DEBUG if args.verbose else logging.INFO)
    malloc_trim.trim_after_full_collections(os.environ)
    return asyncio.run(_embedded(args))


async def _embedded(args) -> int:
    env = dict(os.environ)
    choice = choose_model(args.model, env)
    if args.model:
        env["KNOT_MODEL"] = choice.source
    if not table.read(env, "KNOT_REDIS_PASSWORD", "launcher"):  # the KV is in memory here: a throwaway one will do
        env["KNOT_REDIS_PASSWORD"] = cluster_secrets.generate()
    draft = choose_model(args.draft_model, {}) if args.draft_model else None
    if draft is not None:
        env["KNOT_DRAFT_MODEL"] = draft.source
    specs = plan(layout_for(choice, args.stations, args.shards, draft, args.replicas), env)
    run_dir = Path(args.run_dir or default_run_dir()) / "embedded"
    cluster = EmbeddedCluster(specs, run_dir)
    for s in specs:  # the init service, in-process: the bucket is a directory here
        if s.oneshot and s.command[-1] == "deploy.local.init":
            bucket = parse_binding("KNOT_BUCKET", table.read(s.environment, "KNOT_BUCKET", "init")).target
            msg = await asyncio.to_thread(init.run, {**s.environment,
                                                      "KNOT_BUCKET": f"dir:{cluster.bucket_dir(bucket)}"})
            log.info(msg)
    ports = servers.free_ports(len(cluster.specs)) if args.base_port is None else \
        [args.base_port + i for i in range(len(cluster.specs))]
    async with contextlib.AsyncExitStack() as stack:
        runtimes = cluster.open(stack)
        apps = [(build_app(runtimes[s.name]), "127.0.0.1", port) for s, port in zip(cluster.specs, ports)]

        def ready() -> None:
            for s, port in zip(cluster.specs, ports):
                log.info("%s: http://127.0.0.1:%d", s.name, port)
            for s, port in zip(cluster.specs, ports):
                if s.published_port is not None:
                    print(f"http://127.0.0.1:{port}", flush=True)
            print("knot serve --embedded: ready (Ctrl-C stops)", file=sys.stderr, flush=True)

        await serve_apps(apps, on_ready=ready)
    return 0
