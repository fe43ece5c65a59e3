"""knot encode: GGUF -> .knot, tensor bytes copied verbatim."""
from __future__ import annotations

from pathlib import Path

from deploy import models
from deploy.encoder import encode

NAME = "encode"
HELP = "encode a GGUF (or a registered model name) into a .knot container"


def add_arguments(p) -> None:
    p.add_argument("model", help="a .gguf path or a registered model name (fetched if needed)")
    p.add_argument("out", help="output .knot path")
    p.add_argument("--no-progress", action="store_true", help="no progress bar even on a terminal")


def run(args) -> int:
    src = Path(args.model)
    if not src.is_file():
        src = models.fetch(args.model)
    header = encode(src, args.out, progress=False if args.no_progress else None)
    print(f"{args.out}: {len(header.tensors)} tensors, payloadOffset {header.payload_offset}, "
          f"{header.expected_file_size} bytes")
    print(f"digest {header.digest} (KNOT_DIGEST pins the cluster to it)")
    return 0
