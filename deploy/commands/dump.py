"""knot dump: one tensor (or a row range of it) dequantized to float32 .npy."""
from __future__ import annotations

import numpy as np

from common import knot
from deploy.knotfile import open_model

NAME = "dump"
HELP = "write a tensor dequantized to float32 (.npy, GGUF row order: rows of ne0)"


def _rows(text: str) -> tuple[int, int]:
    try:
        a, b = text.split(":")
        return int(a), int(b)
    except ValueError:
        raise ValueError(f"--rows {text!r}: expected A:B with integers, B exclusive") from None


def add_arguments(p) -> None:
    p.add_argument("file", help="a .knot (or .gguf) file")
    p.add_argument("tensor", help="tensor name, e.g. blk.0.attn_q.weight")
    p.add_argument("--rows", type=str, default=None, metavar="A:B", help="only rows [A, B) (reads only their bytes)")
    p.add_argument("-o", "--out", required=True, help="output .npy path")


def run(args) -> int:
    model = open_model(args.file)
    t = model.tensor(args.tensor)
    if args.rows is not None:
        a, b = _rows(args.rows)
        if not 0 <= a < b <= t.n_rows:
            raise knot.KnotError(f"rows {a}:{b} out of range for {args.tensor} with {t.n_rows} rows")
        t = t.rows(a, b)
    arr = t.dequantize()
    np.save(args.out, arr)
    print(f"{args.out}: {args.tensor} {t.ggml_type} -> float32 {arr.shape}")
    return 0
