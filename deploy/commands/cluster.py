"""knot cluster up|down|status: the cluster layout's services as local processes (deploy/launcher.py)."""
from __future__ import annotations

import sys
from pathlib import Path

from deploy.launcher import Cluster, LauncherError

NAME = "cluster"
HELP = "run the cluster's services as local processes (SeaweedFS and Valkey/Redis included)"


def add_arguments(p) -> None:
    p.add_argument("--run-dir", type=Path, help="state, logs and server data (default .knot-run/ or $KNOT_RUN_DIR)")
    sub = p.add_subparsers(dest="cluster_action", metavar="ACTION")
    sub.required = True
    up = sub.add_parser("up", help="start every service; print the entry URL when all are ready")
    up.add_argument("--model", help="registered model name or .gguf/.knot path (default: $KNOT_MODEL, else "
                    "the default model)")
    add_layout_arguments(up)
    up.add_argument("--profile", choices=("worker", "resident"),
                    help="station memory: worker keeps Cloudflare's 128 MiB per station (layers that do not fit "
                    "stream from the LayerWarden every token), resident sizes each station to keep its layers "
                    "(default: $KNOT_PROFILE, else worker; one line per station says which applies)")
    up.add_argument("--base-port", type=int, help="ports base, base+1, ... (default: free ports; the "
                    "published service keeps its compose port)")
    reload = sub.add_parser("reload", help="serve another knot, or the one now in the bucket: down, then up with "
                            "the services pinned to the model's digest (init uploads it when the bucket holds "
                            "another)")
    reload.add_argument("--model", help="registered model name or .gguf/.knot path (default: $KNOT_MODEL, else "
                        "the default model)")
    add_layout_arguments(reload)
    reload.add_argument("--profile", choices=("worker", "resident"), help="as for up")
    reload.add_argument("--base-port", type=int, help="as for up")
    sub.add_parser("down", help="stop every service (server data and logs are kept)")
    sub.add_parser("status", help="show each service's pid, port and state")


def add_layout_arguments(p) -> None:
    p.add_argument("--stations", type=int, default=2, help="layer stations: 1 to the model's layers (default 2)")
    p.add_argument("--shards", type=int, default=8, help="vocabulary shards: 1 to its vocabulary (default 8)")
    p.add_argument("--replicas", type=int, default=1, help="processes per station range and per shard slice: the "
                   "coordinator spreads generations over them and moves one off a replica that fails (default 1)")
    p.add_argument("--draft-model", default=None, help="also a drafter serving this smaller model of the same "
                   "vocabulary (name or path), for the speculation source draft_model")


def _table(rows: list[dict]) -> str:
    lines = [f"{'service':<20} {'kind':<10} {'pid':>7} {'state':<9} {'restarts':>8} {'url':<28} log"]
    for r in rows:
        lines.append(f"{r['name']:<20} {r['kind']:<10} {r['pid']:>7} {r.get('state', ''):<9} "
                     f"{r.get('restarts', 0):>8} {r['url'] or '-':<28} {r['log']}")
    return "\n".join(lines)


def run(args) -> int:
    cluster = Cluster(args.run_dir)
    try:
        if args.cluster_action in ("up", "reload"):
            start = cluster.up if args.cluster_action == "up" else cluster.reload
            running = start(model=args.model, base_port=args.base_port, n_stations=args.stations,
                            n_shards=args.shards, profile=args.profile, draft_model=args.draft_model,
                            replicas=args.replicas)
            print(_table(cluster.status()), file=sys.stderr)
            for line in cluster.memory_lines(running):
                print(line, file=sys.stderr)
            entry = [r for r in running if r.published]
            for r in entry:
                print(r.url, flush=True)  # the coordinator's URL, on a line of its own
            return 0
        if args.cluster_action == "down":
            stopped = cluster.down()
            print(f"stopped: {', '.join(stopped) or 'nothing was running'}", file=sys.stderr)
            return 0
        rows = cluster.status()
        if not rows:
            print("no cluster recorded in " + str(cluster.state_path), file=sys.stderr)
            return 3
        print(_table(rows))
        return 0 if all(r["state"] in ("ready", "up", "done") for r in rows) else 3
    except LauncherError as e:
        print(f"knot cluster {args.cluster_action}: {e}", file=sys.stderr)
        return 1
