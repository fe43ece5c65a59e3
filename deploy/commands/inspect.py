"""knot inspect: header, digest, hparams, tensor table, the stale check and the checksums of a knot.

Exit status: 0, or 1 when --verify finds a tensor or blob whose bytes disagree with its crc32 or a chunk digest.
"""
from __future__ import annotations

import json
from collections import Counter

from common import knot
from deploy.knotfile import open_model

NAME = "inspect"
HELP = ("print a knot's header, digest, hparams, tensor table, payload offset, stale-check result and "
        "checksums (--verify: check every tensor's bytes)")


def add_arguments(p) -> None:
    p.add_argument("file", help="a .knot file")
    p.add_argument("--json", action="store_true", help="print the header metadata as JSON")
    p.add_argument("--tensors", type=int, default=None, metavar="N",
                   help="show only the first N tensors of the table (default: all)")
    p.add_argument("--verify", action="store_true",
                   help="read every tensor and blob and check its bytes against the header's crc32 and chunk digests")


def run(args) -> int:
    model = open_model(args.file)  # runs the stale guard: raises on a broken knot
    h = model.header
    if not isinstance(h, knot.KnotHeader):
        raise knot.NotAKnot(f"{args.file}: a GGUF, not a knot (encode it with `knot encode`)")
    if args.json:
        print(json.dumps(h.metadata, indent=2))
        return 0
    size = model.path.stat().st_size
    print(f"file            {model.path} ({size} bytes)")
    print(f"format          knot v{h.version}, metaLen {h.meta_len}, payloadOffset {h.payload_offset}")
    print(f"digest          {h.digest}  (SHA-256 of the header; KNOT_DIGEST pins it)")
    print(f"architecture    {h.architecture}  ({h.metadata.get('name', '')})")
    print(f"stale check     OK: {size} = payloadOffset {h.payload_offset} + payload {h.payload_nbytes}")
    bad = _checksums(model, h, args.verify)
    print("hparams")
    for k, v in h.hparams.items():
        print(f"  {k:22} {v}")
    for b in h.blobs.values():
        print(f"blob            {b.name}: {b.length} bytes at payload+{b.offset} ({b.encoding})")
    types = Counter(t.ggml_type for t in h.tensors.values())
    print(f"tensors         {len(h.tensors)} ({', '.join(f'{n} {t}' for t, n in types.most_common())})")
    rows = list(h.tensors.values())[: args.tensors]
    width = max(len(t.name) for t in rows) if rows else 10
    print(f"  {'name':{width}}  {'type':5}  {'shape':>16}  {'bytes':>11}  {'offset':>11}")
    for t in rows:
        print(f"  {t.name:{width}}  {t.ggml_type:5}  {'x'.join(map(str, t.shape)):>16}  {t.length:>11}  {t.offset:>11}")
    for line in bad:
        print(f"CORRUPT         {line}")
    return 1 if bad else 0


def _checksums(model, h: knot.KnotHeader, verify: bool) -> list[str]:
    """Print the checksum line; with verify, check every tensor and blob -> the mismatches."""
    entries = [*h.tensors.values(), *h.blobs.values()]
    present = (f"crc32 and SHA-256 of {h.chunk_bytes // 1024} KiB chunks on {len(entries)} tensors and blobs "
               f"({sum(len(e.chunks) for e in entries) // knot.CHUNK_DIGEST_BYTES} chunks)")
    if not verify:
        print(f"checksums       {present}; not verified (--verify reads every byte)")
        return []
    bad = []
    for e in entries:
        start, end = h.entry_range(e.name)
        try:
            h.verify(e.name, model.data[start:end])
        except knot.CorruptKnot as err:
            bad.append(str(err))
    verdict = "all valid" if not bad else f"{len(bad)} MISMATCHED"
    print(f"checksums       {present}; verified: {verdict}")
    return bad
