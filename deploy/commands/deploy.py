"""`knot deploy cloudflare --out DIR`: the Workers' directories and wrangler configs (deploy/wrangler.py),
their secrets (OUT/secrets.env, mode 600), and with --upload the knot into R2 (deploy/r2_upload.py)."""
from __future__ import annotations

import argparse
import os
import shlex
import sys
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
    p.add_argument("--replicas", type=int, default=1, help="Workers per station range and shard slice (default 1)")
    p.add_argument("--bucket", default="knots", help="the R2 bucket that holds the knot (default knots)")
    p.add_argument("--knot-key", default=None, help="the knot's key in the bucket (default: MODEL.knot)")
    p.add_argument("--kv-id", default=None, help="the EMBED_CACHE KV namespace id (default: a placeholder "
                                                 "the README says how to fill)")
    p.add_argument("--public", action="store_true",
                   help="the coordinator serves without an API key (default: it wants KNOT_API_KEY, a secret "
                        "generated into OUT/secrets.env, and refuses to be written without one)")
    p.add_argument("--plan", choices=("paid", "free"), default="paid",
                   help="the Workers plan, whose per-invocation subrequest limit bounds a generation (default paid)")
    p.add_argument("--upload", nargs="?", const="", default=None, metavar="FILE",
                   help="also upload the knot (FILE, default the model's, encoded if needed) into the bucket "
                        "through R2's S3 API: multipart, resumable, each part's MD5 checked; endpoint and keys "
                        "from R2_ENDPOINT_URL or CLOUDFLARE_ACCOUNT_ID, R2_ACCESS_KEY_ID, R2_SECRET_ACCESS_KEY")
    p.add_argument("--part-size-mib", type=int, default=None,
                   help="the upload's part size in MiB (default 64; at least 5)")


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


def command_line(args: argparse.Namespace, out: Path) -> str:
    """The `knot deploy cloudflare` that writes this deployment again, with --upload (the README's step 2)."""
    parts = ["knot", "deploy", "cloudflare", "--out", str(out)]
    for flag, value in (("--model", args.model), ("--stations", args.stations), ("--shards", args.shards),
                        ("--replicas", args.replicas if args.replicas != 1 else None),
                        ("--bucket", args.bucket), ("--knot-key", args.knot_key), ("--kv-id", args.kv_id),
                        ("--plan", args.plan), ("--part-size-mib", args.part_size_mib)):
        if value is not None:
            parts += [flag, str(value)]
    if args.public:
        parts.append("--public")
    parts.append("--upload" if not args.upload else f"--upload={args.upload}")
    return " ".join(shlex.quote(p) for p in parts)


def secrets(out: Path, public: bool) -> dict[str, str]:
    """OUT/secrets.env (mode 600): the Workers' secrets, generated once and kept (a user's own API key too)."""
    from deploy import cluster_secrets, wrangler

    path = out / wrangler.SECRETS_FILE
    values = cluster_secrets.read(path) if path.exists() else {}
    names = [wrangler.INTERNAL_SECRET] + ([] if public else [wrangler.API_KEY])
    missing = [n for n in names if not values.get(n)]
    if missing:
        values.update({n: cluster_secrets.generate() for n in missing})
        cluster_secrets.write(path, values)
    return values


def upload_target(bucket: str):
    """Where --upload goes, from the environment (common/settings.py, reader deploy)."""
    from common.settings import read
    from deploy import r2_upload

    env = os.environ
    endpoint = read(env, "R2_ENDPOINT_URL", "deploy")
    if endpoint is None:
        account = read(env, "CLOUDFLARE_ACCOUNT_ID", "deploy")
        if account is None:
            raise r2_upload.UploadError("--upload needs CLOUDFLARE_ACCOUNT_ID (or R2_ENDPOINT_URL)")
        endpoint = r2_upload.r2_endpoint(account)
    key_id, secret = read(env, "R2_ACCESS_KEY_ID", "deploy"), read(env, "R2_SECRET_ACCESS_KEY", "deploy")
    if not key_id or not secret:
        raise r2_upload.UploadError("--upload needs R2_ACCESS_KEY_ID and R2_SECRET_ACCESS_KEY (an R2 API token)")
    return r2_upload.Target(endpoint, key_id, secret, bucket)


def upload(args: argparse.Namespace, out: Path, knot_key: str) -> int:
    from deploy import models, r2_upload

    path = Path(args.upload) if args.upload else models.ensure_knot(args.model or models.DEFAULT_MODEL)
    target = upload_target(args.bucket)
    part_bytes = (args.part_size_mib or r2_upload.DEFAULT_PART_BYTES // r2_upload.MiB) * r2_upload.MiB
    size = path.stat().st_size
    print(f"uploading {path} ({size / 2**20:.1f} MiB) to {target.bucket}/{knot_key} at {target.endpoint_url}, "
          f"parts of {part_bytes >> 20} MiB", flush=True)

    def progress(number: int, of: int) -> None:
        print(f"  part {number}/{of} sent", flush=True)

    done = r2_upload.upload(path, target, knot_key, out, part_bytes, progress)
    record = r2_upload.write_record(out, done)
    kept = f", {len(done.kept_parts)} already there" if done.kept_parts else ""
    print(f"uploaded {target.bucket}/{knot_key}: {done.size} bytes, {done.parts} parts ({len(done.sent_parts)} "
          f"sent{kept}), etag {done.etag}; recorded in {record}")
    return 0


def run(args: argparse.Namespace) -> int:
    from deploy import cluster_secrets, r2_upload, wrangler

    n_layers, vocab_size, knot_key = model_shape(args.model)
    knot_key = args.knot_key or knot_key
    limit = wrangler.PLAN_SUBREQUESTS[args.plan]
    workers = wrangler.plan(n_layers, vocab_size, knot_key, args.stations, args.shards,
                            args.bucket, args.kv_id or wrangler.KV_ID_PLACEHOLDER, public=args.public,
                            subrequest_limit=limit, replicas=args.replicas)
    out = Path(args.out)
    try:
        dirs = wrangler.write(out, workers, args.public, command_line(args, out))
        names = secrets(out, args.public)
    except (wrangler.DeployError, cluster_secrets.SecretsError) as e:
        print(f"knot deploy cloudflare: {e}", file=sys.stderr)
        return 2
    for d in dirs:
        print(d)
    sizes = station_bytes(args.model, args.stations)
    if sizes is not None and max(sizes) > wrangler.BUDGETS["station"] * 3 // 4:
        print(f"note: a station holds up to {max(sizes) / 2**20:.0f} MiB of layers, more than fits its "
              f"{wrangler.BUDGETS['station'] >> 20} MiB budget beside its activations: the stations run fluid "
              f"(layers streamed from the LayerWarden and R2 every token); more --stations keep them resident "
              f"(docs/cloudflare.md, Limits)")
    longest = wrangler.longest_generations(args.stations, args.shards)
    print(f"longest generation per invocation ({args.stations} stations, {args.shards} shards, a 16-token prompt, "
          f"no drafts): " + ", ".join(f"{plan} {wrangler.PLAN_SUBREQUESTS[plan]:,} subrequests -> {n:,} tokens"
                                      for plan, n in longest.items())
          + f"; the coordinator is set for {args.plan} (SUBREQUEST_LIMIT={limit})")
    print(f"secrets for `wrangler secret put` in {out / wrangler.SECRETS_FILE} (mode 600): {', '.join(sorted(names))}"
          + ("; the coordinator is public (no API key)" if args.public else ""))
    print(f"{len(dirs)} Workers written; the deploy steps are in {out / 'README.md'}")
    if args.upload is not None:
        try:
            return upload(args, out, knot_key)
        except (r2_upload.UploadError, OSError) as e:
            print(f"knot deploy cloudflare --upload: {e}", file=sys.stderr)
            return 1
    return 0
