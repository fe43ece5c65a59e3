"""How near a decode is to this machine's memory speed: the bytes a token reads, the read
bandwidth of one and two threads, and llama.cpp's decode set against both.

A decode step reads every weight of the model once (the LM head included; the token embedding's
rows are gathered, not streamed, unless the head is tied to it). On a machine where weights do
not fit in cache, bytes per token / read bandwidth bounds any decode from below, ours or
llama.cpp's, one process or a cluster: a cluster reads the same bytes and adds its hops.

    python benchmarks/memory_ceiling.py [--model qwen2.5-coder-0.5b] [--mb 512] [--reps 7]
        [--tokens 48] [--rounds 3] [--no-llama]

Prints the bytes per decode token by ggml type, the read bandwidth (best of --reps passes of a
--mb MiB buffer, numpy reductions on 1 and 2 threads: numpy releases the GIL in them), the
decode that bandwidth allows, and llama.cpp's decode tok/s (--rounds runs of --tokens greedy
tokens, interleaved with the bandwidth) as GB/s and as a share of the two-thread bandwidth.
Nothing here asserts a speed.
"""
from __future__ import annotations

import argparse
import collections
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402

EMBEDDING, HEAD = "token_embd.weight", "output.weight"


def decode_bytes(tensors: list[tuple[str, str, int]]) -> dict[str, int]:
    """(name, ggml type, bytes) of a GGUF's tensors -> bytes one decode token reads, by type.

    Every tensor but the token embedding, whose rows are gathered; with no output.weight the head
    is the embedding (tied), read whole."""
    names = {n for n, _, _ in tensors}
    out: dict[str, int] = collections.Counter()
    for name, ggml_type, n in tensors:
        if name != EMBEDDING or HEAD not in names:
            out[ggml_type] += n
    return dict(out)


def read_bandwidth(buf: np.ndarray, threads: int, reps: int, pool: ThreadPoolExecutor) -> float:
    """Best bytes per second of `reps` passes over buf (uint64) split across `threads` reductions."""
    parts = np.array_split(buf, threads)
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        list(pool.map(np.bitwise_or.reduce, parts))
        best = min(best, time.perf_counter() - t0)
    return buf.nbytes / best


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="a name `knot fetch-model` knows, or a .gguf path (default: the default model)")
    p.add_argument("--mb", type=int, default=512, help="the bandwidth buffer, MiB (default 512: well past the caches)")
    p.add_argument("--reps", type=int, default=7, help="passes per bandwidth figure, best kept (default 7)")
    p.add_argument("--tokens", type=int, default=48, help="llama.cpp's greedy tokens per run (default 48)")
    p.add_argument("--rounds", type=int, default=3, help="rounds of bandwidth and llama.cpp, interleaved (default 3)")
    p.add_argument("--threads", type=int, default=2, help="llama.cpp's threads (default 2)")
    p.add_argument("--no-llama", action="store_true", help="bandwidth and bytes only")
    args = p.parse_args()

    from deploy import models
    from deploy.gguf_import import read_gguf

    gguf = models.fetch(args.model or models.DEFAULT_MODEL)
    if gguf.suffix != ".gguf":
        sys.exit(f"{gguf} is not a GGUF: the tensor table comes from one")
    by_type = decode_bytes([(t.name, t.ggml_type, t.length) for t in read_gguf(gguf).tensors])
    per_token = sum(by_type.values())

    llama = None
    if not args.no_llama:
        try:
            from deploy.commands.bench import SHORT_PROMPT, LlamaDecode
            from deploy.engine_local import LocalEngine

            tok = LocalEngine.open(models.ensure_knot(str(gguf))).tokenizer
            ids = ([tok.bos_id] if tok.add_bos and tok.bos_id is not None else []) + tok.encode(SHORT_PROMPT)
            llama = LlamaDecode(gguf, args.threads, args.tokens, ids, len(ids) + args.tokens + 16)
            llama()  # warm: pages in the weights
        except ImportError as e:
            print(f"llama.cpp skipped: {e}", file=sys.stderr)

    buf = np.ones((args.mb << 20) // 8, dtype=np.uint64)  # written: every page is backed
    bw1, bw2, ll = [], [], []
    with ThreadPoolExecutor(2) as pool:
        for r in range(args.rounds):
            bw1.append(read_bandwidth(buf, 1, args.reps, pool))
            bw2.append(read_bandwidth(buf, 2, args.reps, pool))
            if llama is not None:
                ll.append(llama())
            print(f"round {r + 1}: read 1 thread {bw1[-1] / 1e9:.1f} GB/s, 2 threads {bw2[-1] / 1e9:.1f} GB/s"
                  + (f"; llama.cpp decode {ll[-1]:.2f} tok/s" if ll else ""), file=sys.stderr)

    b2 = statistics.median(bw2)
    print(f"## {gguf.name}: {per_token / 1e6:.1f} MB read per decode token "
          f"({', '.join(f'{t} {n / 1e6:.1f}' for t, n in sorted(by_type.items(), key=lambda kv: -kv[1]))})")
    print(f"read bandwidth ({args.mb} MiB, medians of {args.rounds} rounds, each the best of {args.reps}): "
          f"1 thread {statistics.median(bw1) / 1e9:.1f} GB/s, 2 threads {b2 / 1e9:.1f} GB/s")
    print(f"decode that 2 threads' bandwidth allows: {b2 / per_token:.1f} tok/s ({per_token / b2 * 1e3:.1f} ms per token)")
    if ll:
        m = statistics.median(ll)
        print(f"llama.cpp decode ({args.threads} threads, {args.tokens} tokens, median of {len(ll)}: "
              f"{', '.join(f'{x:.2f}' for x in ll)}): {m:.2f} tok/s = {m * per_token / 1e9:.1f} GB/s, "
              f"{m * per_token / b2:.2f}x of the 2-thread read bandwidth")


if __name__ == "__main__":
    main()
