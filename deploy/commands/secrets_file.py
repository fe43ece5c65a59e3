"""knot secrets: the cluster's generated secrets in .env (mode 600), for docker compose; with --swarm,
also each of them (and an API key for the coordinator) as a Swarm secret, knot_<name>."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from deploy import cluster_secrets
from deploy.local.compose_reader import REPO_ROOT

NAME = "secrets"
HELP = ("write the cluster's generated secrets (the Redis password, the internal calls' key) to .env next to "
        "docker-compose.yml, mode 600, keeping any already there; docker compose reads it. The values are never printed")


def add_arguments(p) -> None:
    p.add_argument("--file", type=Path, default=REPO_ROOT / ".env", help="where (default: .env in the repository)")
    p.add_argument("--swarm", action="store_true", help="also create them as Swarm secrets knot_<name> (on a manager "
                   "node; those that exist are kept), with KNOT_API_KEY, for `knot compose --swarm`'s stack")


def run(args) -> int:
    from deploy.stack_writer import SWARM_SECRETS, secret_name

    names = cluster_secrets.ensure(args.file)
    if args.swarm and "KNOT_API_KEY" not in cluster_secrets.read(args.file):  # the Swarm coordinator wants one
        cluster_secrets.write(args.file, {**cluster_secrets.read(args.file), "KNOT_API_KEY": cluster_secrets.generate()})
    sys.stdout.write(f"{args.file}: {', '.join(cluster_secrets.read(args.file))} (mode 600)\n")
    if not args.swarm:
        return 0
    values = cluster_secrets.read(args.file)
    for name in SWARM_SECRETS:
        secret = secret_name(name)
        if subprocess.run(["docker", "secret", "inspect", secret], capture_output=True).returncode == 0:
            sys.stdout.write(f"{secret}: kept (a Swarm secret cannot change while a service uses it)\n")
            continue
        made = subprocess.run(["docker", "secret", "create", secret, "-"], input=values[name].encode(),
                              capture_output=True)
        if made.returncode != 0:
            sys.stderr.write(f"docker secret create {secret}: {made.stderr.decode().strip()}\n")
            return 1
        sys.stdout.write(f"{secret}: created\n")
    return 0
