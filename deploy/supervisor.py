"""Supervision for `knot cluster up`: a crashed service is started again, with backoff, as compose's
`restart: unless-stopped` does for the containers.

`up` starts the supervisor last, once every service is ready, as a process of its own
(`python -m deploy.supervisor RUN_DIR`, in its own session, so it outlives `up`); `down` stops it
first, so nothing it stops comes back. Every POLL_S it reads cluster.json. A service whose process
has exited is started again with the same command, environment and port (from supervise.json,
mode 600, which names the secrets it needs; their values are read from secrets.env), after a
delay that doubles from BACKOFF_S to MAX_BACKOFF_S and is reset once the service has stayed up HEALTHY_S. cluster.json then records the
new pid, the restarts and when the last one was; `knot cluster status` shows them. Readiness comes
back by itself: the coordinator's calls find the restarted peer on the same address.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from deploy import cluster_secrets, servers

log = logging.getLogger("deploy.supervisor")

RECIPES_FILE = "supervise.json"  # how to start each service again; mode 600 (environments, without the secrets)
POLL_S = 0.5
BACKOFF_S = 0.5  # the first restart waits this long; each next one twice as long ...
MAX_BACKOFF_S = 30.0  # ... up to this
HEALTHY_S = 60.0  # up this long: the next crash is restarted after BACKOFF_S again


def write_recipes(run_dir: Path, recipes: dict[str, dict]) -> None:
    """name -> {"kind": "process", "argv", "env", "cwd", "log", "secrets": {variable: secret's name}} |
    {"kind": "seaweedfs"|"redis", "dir", "port", "log"}; no secret's value (they stay in secrets.env)."""
    cluster_secrets.write_private(run_dir / RECIPES_FILE, json.dumps(recipes).encode())


def start(recipe: dict, secrets: dict[str, str] | None = None) -> int:
    """Start one service again -> its pid (a store's start waits until it answers). secrets: the
    cluster's (secrets.env): for the variables the recipe names, Redis's password and the bucket's keys."""
    kind, secrets = recipe["kind"], secrets or {}
    if kind == "process":
        env = {**recipe["env"], **{var: secrets[name] for var, name in recipe.get("secrets", {}).items()}}
        return servers.spawn(recipe["argv"], Path(recipe["log"]), env=env, cwd=recipe["cwd"])
    if kind == "seaweedfs":
        return servers.start_seaweedfs(recipe["dir"], recipe["port"], recipe["log"],
                                       access_key=secrets["MINIO_ROOT_USER"],
                                       secret_key=secrets["MINIO_ROOT_PASSWORD"]).pid
    if kind == "redis":
        return servers.start_redis(recipe["dir"], recipe["port"], recipe["log"],
                                   password=secrets["KNOT_REDIS_PASSWORD"]).pid
    raise ValueError(f"unknown service kind {kind!r}")


def _secrets(run_dir: Path) -> dict[str, str]:
    path = run_dir / cluster_secrets.FILE_NAME
    return cluster_secrets.read(path) if path.exists() else {}


@dataclass
class Backoff:
    delay_s: float = BACKOFF_S
    due: float | None = None  # time.monotonic() of the next start, once the exit was seen
    started: float = 0.0  # time.monotonic() of the last start


def update_services(state_path: Path, changes: dict[str, dict]) -> None:
    """Apply {name: {field: value}} to cluster.json's services, atomically."""
    doc = json.loads(state_path.read_text())
    for s in doc["services"]:
        s.update(changes.get(s["name"], {}))
    tmp = state_path.with_suffix(".sup.tmp")
    tmp.write_text(json.dumps(doc, indent=2))
    os.replace(tmp, state_path)


def supervise(run_dir: Path, stop: list[bool]) -> None:
    from deploy.launcher import STATE_FILE

    state_path = run_dir / STATE_FILE
    recipes = json.loads((run_dir / RECIPES_FILE).read_text())
    backoff = {name: Backoff(started=time.monotonic()) for name in recipes}
    while not stop[0]:
        now = time.monotonic()
        try:
            services = json.loads(state_path.read_text())["services"]
        except (OSError, ValueError):  # `down` removed it: nothing left to supervise
            return
        changes: dict[str, dict] = {}
        for s in services:
            name, b = s["name"], backoff.get(s["name"])
            if b is None:
                continue
            if servers.pid_alive(s["pid"]):
                if now - b.started > HEALTHY_S:
                    b.delay_s = BACKOFF_S
                continue
            if b.due is None:
                b.due = now + b.delay_s
                log.warning("%s (pid %d) exited; restarting in %.1f s", name, s["pid"], b.delay_s)
            if now < b.due or stop[0]:
                continue
            try:
                pid = start(recipes[name], _secrets(run_dir))
            except Exception as e:  # noqa: BLE001 - a start that fails is retried after a longer delay
                log.error("%s: restart failed: %s", name, e)
                b.due, b.delay_s = now + b.delay_s, min(2 * b.delay_s, MAX_BACKOFF_S)
                continue
            b.due, b.started, b.delay_s = None, time.monotonic(), min(2 * b.delay_s, MAX_BACKOFF_S)
            changes[name] = {"pid": pid, "restarts": s.get("restarts", 0) + 1, "restarted_at": time.time()}
            log.warning("%s restarted (pid %d, restart %d)", name, pid, changes[name]["restarts"])
        if changes:
            update_services(state_path, changes)
        time.sleep(POLL_S)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m deploy.supervisor", description=__doc__.splitlines()[0])
    p.add_argument("run_dir", type=Path)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(levelname)s %(message)s")
    stop = [False]

    def on_signal(signum, frame) -> None:
        stop[0] = True

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    log.info("supervising %s", args.run_dir)
    supervise(args.run_dir, stop)
    log.info("stopped")
    return 0


if __name__ == "__main__":
    sys.exit(main())
