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


def model_shape(model: str | None) -> tuple[int, int, str]:
    """(n_layers, vocab_size, default knot key) from a registered name or a model file's header."""
    from deploy import models

    name = model or models.DEFAULT_MODEL
    spec = models.MODELS.get(name)
    if spec is not None:
        return spec.block_count, spec.vocab_size, f"{spec.name}.knot"
    from common.qwen2 import Qwen2Config
    from deploy.knotfile import open_model

    path = Path(name)
    cfg = Qwen2Config.from_hparams(open_model(path).header.hparams)
    return cfg.n_layer, cfg.vocab_size, path.with_suffix(".knot").name


def run(args: argparse.Namespace) -> int:
    from deploy import wrangler

    n_layers, vocab_size, knot_key = model_shape(args.model)
    workers = wrangler.plan(n_layers, vocab_size, args.knot_key or knot_key, args.stations, args.shards,
                            args.bucket, args.kv_id or wrangler.KV_ID_PLACEHOLDER)
    out = Path(args.out)
    dirs = wrangler.write(out, workers)
    for d in dirs:
        print(d)
    print(f"{len(dirs)} Workers written; the deploy steps are in {out / 'README.md'}")
    return 0
