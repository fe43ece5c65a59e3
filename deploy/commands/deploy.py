"""`knot deploy cloudflare --out DIR`: the Workers' directories and wrangler configs (deploy/wrangler.py)."""
from __future__ import annotations

import argparse
from pathlib import Path

NAME = "deploy"
HELP = "write the deployment for a platform: `knot deploy cloudflare --out DIR` (Python Workers + wrangler)"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("platform", choices=["cloudflare"], help="where to deploy")
    p.add_argument("--out", required=True, help="directory to write (one sub-directory per Worker)")
    p.add_argument("--model", default=None,
                   help="a registered model name, or a .knot / .gguf file (its header gives the layers and "
                        "vocabulary); default: the default model")
    p.add_argument("--stations", type=int, default=2, help="layer stations (default 2)")
    p.add_argument("--shards", type=int, default=8, help="vocabulary shards (default 8)")
    p.add_argument("--bucket", default="knots", help="the R2 bucket that holds the knot (default knots)")
    p.add_argument("--knot-key", default=None, help="the knot's key in the bucket (default: MODEL.knot)")
    p.add_argument("--kv-id", default=None, help="the EMBED_CACHE KV namespace id (default: a placeholder "
                                                 "the README says how to fill)")


def _model_file(name: str) -> Path | None:
    """The model's file if it is here (a path, or a registered model already fetched)."""
    from deploy import models

    try:
        return models.model_path(name)
    except (models.ModelError, OSError):
        return None


def model_shape(model: str | None) -> tuple[int, int, str]:
    """(n_layers, vocab_size, default knot key) from a registered name or a model file's header."""
    from deploy import models

    name = model or models.DEFAULT_MODEL
    spec = models.MODELS.get(name)
    if spec is not None:
        return spec.block_count, spec.vocab_size, f"{spec.name}.knot"
    from common.models import model_for
    from deploy.knotfile import open_model

    path = Path(name)
    cfg = model_for(open_model(path).header).cfg
    return cfg.n_layer, cfg.vocab_size, path.with_suffix(".knot").name


def station_bytes(model: str | None, n_stations: int) -> list[int] | None:
    """Bytes of each station's layer tensors, when the model file is here to tell."""
    from common.topology import split_layers
    from deploy import models
    from deploy.knotfile import open_model

    path = _model_file(model or models.DEFAULT_MODEL)
    if path is None:
        return None
    header = open_model(path).header
    per_layer: dict[int, int] = {}
    for name, e in header.tensors.items():
        if name.startswith("blk."):
            per_layer[int(name.split(".")[1])] = per_layer.get(int(name.split(".")[1]), 0) + e.length
    return [sum(per_layer.get(i, 0) for i in range(s.layer_start, s.layer_end))
            for s in split_layers(len(per_layer), n_stations)]


def run(args: argparse.Namespace) -> int:
    from deploy import wrangler

    n_layers, vocab_size, knot_key = model_shape(args.model)
    workers = wrangler.plan(n_layers, vocab_size, args.knot_key or knot_key, args.stations, args.shards,
                            args.bucket, args.kv_id or wrangler.KV_ID_PLACEHOLDER)
    out = Path(args.out)
    dirs = wrangler.write(out, workers)
    for d in dirs:
        print(d)
    sizes = station_bytes(args.model, args.stations)
    if sizes is not None and max(sizes) > wrangler.BUDGETS["station"] * 3 // 4:
        print(f"note: a station holds up to {max(sizes) / 2**20:.0f} MiB of layers, more than fits its "
              f"{wrangler.BUDGETS['station'] >> 20} MiB budget beside its activations: the stations run fluid "
              f"(layers streamed from the LayerWarden and R2 every token); more --stations keep them resident "
              f"(docs/cloudflare.md, Limits)")
    print(f"{len(dirs)} Workers written; the deploy steps are in {out / 'README.md'}")
    return 0
