"""knot compose: docker-compose.yml for a model and counts of stations and shards, on stdout;
with --swarm, the stack file for a Docker Swarm (deploy/stack_writer.py)."""
from __future__ import annotations

import sys

from deploy import compose_writer, stack_writer
from deploy.commands.cluster import add_layout_arguments
from deploy.launcher import choose_model, layout_for

NAME = "compose"
HELP = "print docker-compose.yml for a model, N stations and M shards (knot compose > docker-compose.yml)"


def add_arguments(p) -> None:
    p.add_argument("--model", help="registered model name or .gguf/.knot path (default: the default model)")
    add_layout_arguments(p)
    p.add_argument("--swarm", action="store_true", help="the stack file for `docker stack deploy` on a Swarm of "
                   "several nodes instead (secrets as Swarm secrets, an overlay network, replicas placed by node "
                   "label): knot compose --swarm --replicas 2 > docker-stack.yml")


def command_args(model: str | None, n_stations: int, n_shards: int, draft_model: str | None = None,
                 replicas: int = 1) -> str:
    """The options that differ from the defaults, as the file's header repeats them."""
    parts = [f"--model {model}"] if model else []
    parts += [f"--stations {n_stations}"] if n_stations != 2 else []
    parts += [f"--shards {n_shards}"] if n_shards != 8 else []
    parts += [f"--draft-model {draft_model}"] if draft_model else []
    parts += [f"--replicas {replicas}"] if replicas != 1 else []
    return "".join(" " + p for p in parts)


def run(args) -> int:
    choice = choose_model(args.model, {})  # the file is the same whatever this shell's KNOT_MODEL says
    draft = choose_model(args.draft_model, {}) if args.draft_model else None
    layout = layout_for(choice, args.stations, args.shards, draft, args.replicas)
    writer = stack_writer if args.swarm else compose_writer
    sys.stdout.write(writer.render_text(layout, choice.source, command_args(
        args.model, args.stations, args.shards, args.draft_model, args.replicas)))
    return 0
