"""knot secrets: the cluster's generated secrets in .env (mode 600), for docker compose."""
from __future__ import annotations

import sys
from pathlib import Path

from deploy import cluster_secrets
from deploy.local.compose_reader import REPO_ROOT

NAME = "secrets"
HELP = ("write the cluster's generated secrets (the Redis password, the internal calls' key) to .env next to "
        "docker-compose.yml, mode 600, keeping any already there; docker compose reads it. The values are never printed")


def add_arguments(p) -> None:
    p.add_argument("--file", type=Path, default=REPO_ROOT / ".env", help="where (default: .env in the repository)")


def run(args) -> int:
    names = cluster_secrets.ensure(args.file)
    sys.stdout.write(f"{args.file}: {', '.join(names)} (mode 600)\n")
    return 0
