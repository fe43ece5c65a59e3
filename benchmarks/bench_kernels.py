"""Matmul kernels on the real Qwen2.5-Coder layer shapes: numpy path vs the C kernels.

For each distinct (ggml type, shape) of a model's decode-time weights it prints the time of one
matmul and the weight GB/s streamed, then an estimate of decode tok/s for the whole model: the
sum over every weight product of one token (all layers' q, k, v, o, gate, up, down and the LM
head). The estimate leaves out attention, norms and sampling, so it bounds the real decode.

    OPENBLAS_NUM_THREADS=1 python benchmarks/bench_kernels.py [--model 0.5b|1.5b|PATH ...]
        [--threads N] [--tokens T] [--no-numpy] [--reps R] [--generate N] [--rows 1,2,3,4,9]

--rows times one pass over all of a token's weight products with T rows (a speculative verify
trip's, or stacked decode steps'), as a ratio to one row.
--generate N also runs N tokens of real greedy decode through deploy.engine_local (attention,
norms and sampling included) with the kernels installed.

Benchmarks are not tests: nothing here asserts a speed.
"""
from __future__ import annotations

import os

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")  # OpenBLAS threading collapses on a loaded box

import argparse  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402

from common import settings  # noqa: E402
from common.matmul import matmul_tiled  # noqa: E402
from common.quant import QTensor  # noqa: E402
from deploy import kernels  # noqa: E402
from deploy.knotfile import open_model  # noqa: E402

CACHE = Path.home() / ".cache" / "knot"
MODELS = {"0.5b": CACHE / "qwen2.5-coder-0.5b-q4_k_m.gguf", "1.5b": CACHE / "qwen2.5-coder-1.5b-q4_k_m.gguf"}
LAYER_WEIGHTS = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")


def decode_weights(model) -> list[str]:
    """Names of the weights one decode token multiplies by: every layer's, then the LM head."""
    names = [n for n in model.header.tensors
             if n.startswith("blk.") and n.endswith(".weight") and n.split(".")[2] in LAYER_WEIGHTS]
    # There may be no output.weight: the head is then the tied token embedding.
    names.append("output.weight" if model.has_tensor("output.weight") else "token_embd.weight")
    return names


def time_it(fn, reps: int) -> float:
    """Median seconds of reps calls fn(i), i = 0.., after one warm-up call."""
    fn(0)
    ts = []
    for i in range(reps):
        t0 = time.perf_counter()
        fn(i)
        ts.append(time.perf_counter() - t0)
    return float(np.median(ts))


def bench_model(path: Path, args) -> None:
    model = open_model(path)
    names = decode_weights(model)
    # group the weights by (type, shape); a group's calls cycle over its tensors (the layers),
    # so the weights stream from memory as in decode instead of sitting in the caches
    groups: dict[tuple, list[QTensor]] = {}
    for n in names:
        w = model.tensor(n)
        groups.setdefault((w.ggml_type, tuple(w.shape)), []).append(w)
    for ws in groups.values():  # fault every page of the mmap in once: decode pays that on token 1 only
        for w in ws:
            int(np.asarray(w.data)[::4096].sum())
    head = model.tensor(names[-1])
    head_key = (head.ggml_type, tuple(head.shape))
    rng = np.random.default_rng(0)
    xs = {ne0: rng.standard_normal((1, ne0)).astype(np.float32) for ne0 in {k[1][0] for k in groups}}
    xps = {ne0: rng.standard_normal((args.tokens, ne0)).astype(np.float32) for ne0 in xs}
    total_mb = sum(w.nbytes for ws in groups.values() for w in ws) / 1e6
    print(f"\n## {path.name}: {len(names)} weight products per token, {total_mb:.1f} MB of weights per token")
    hdr = f"{'type':5} {'ne0 x ne1':>15} {'uses':>4} {'MB':>7} |"
    hdr += f" {'numpy ms':>9} {'GB/s':>6} |" if args.numpy else ""
    hdr += f" {'kernel ms':>9} {'GB/s':>6} {'speedup':>7} |"
    hdr += f" T={args.tokens}: {'kernel ms':>9} {'tok/s':>7}" if args.tokens > 1 else ""
    print(hdr)
    total_np = total_k = total_kp = 0.0
    for (qtype, shape), ws in sorted(groups.items(), key=lambda kv: -sum(w.nbytes for w in kv[1])):
        x, xp, nbytes = xs[shape[0]], xps[shape[0]], ws[0].nbytes
        line = f"{qtype:5} {shape[0]:>6} x {shape[1]:<6} {len(ws):>4} {nbytes / 1e6:7.2f} |"
        t_np = 0.0
        if args.numpy:
            t_np = time_it(lambda i: matmul_tiled(x, ws[i % len(ws)]), max(1, args.reps // 10))
            total_np += t_np * len(ws)
            line += f" {t_np * 1e3:9.3f} {nbytes / t_np / 1e9:6.2f} |"
        if qtype in kernels.supported_types():
            k = kernels.make_kernel(qtype)
            t_k = time_it(lambda i: k(x, ws[i % len(ws)]), args.reps)
            line += f" {t_k * 1e3:9.3f} {nbytes / t_k / 1e9:6.2f} {t_np / t_k if t_np else float('nan'):7.1f} |"
            if args.tokens > 1 and (qtype, shape) == head_key:
                # a prefill computes the logits of its last position only: one token's head
                total_kp += t_k
                line += f" {'(head: T=1)':>17}"
            elif args.tokens > 1:
                t_kp = time_it(lambda i: k(xp, ws[i % len(ws)]), max(1, args.reps // 20))
                total_kp += t_kp * len(ws)
                line += f" {t_kp * 1e3:9.2f} {args.tokens / t_kp:7.1f}"
        else:
            t_k = t_np or time_it(lambda i: matmul_tiled(x, ws[i % len(ws)]), 1)
            line += f" {'(no kernel: numpy)':>25} |"
        total_k += t_k * len(ws)
        print(line)
    # one real pass: every weight product of a token, in model order
    ordered = [model.tensor(n) for n in names]
    mm = {qt: kernels.make_kernel(qt) for qt in kernels.supported_types()}

    def one_token(_):
        for w in ordered:
            kern = mm.get(w.ggml_type)
            kern(xs[w.shape[0]], w) if kern else matmul_tiled(xs[w.shape[0]], w)

    t_pass = time_it(one_token, max(3, args.reps // 10))
    print(f"decode, weight products only (sum of the rows above), tok/s:"
          + (f" numpy {1 / total_np:.2f} |" if args.numpy else "")
          + f" kernels {1 / total_k:.2f}"
          + (f" | prefill of {args.tokens} tokens (layers at T={args.tokens}, head at T=1): "
             f"kernels {args.tokens / total_kp:.1f} tok/s" if total_kp else ""))
    print(f"decode, one pass over all {len(ordered)} weight products in model order: "
          f"{t_pass * 1e3:.2f} ms = {1 / t_pass:.2f} tok/s, {total_mb / 1e3 / t_pass:.1f} GB/s")
    if args.rows:
        # a speculative verify trip (or a few sessions' stacked decode steps): every weight product
        # of the model with T rows, against T = 1; what T rows cost in decode steps
        line = []
        for T in args.rows:
            xr = {ne0: rng.standard_normal((T, ne0)).astype(np.float32) for ne0 in xs}

            def rows_pass(_, xr=xr):
                for w in ordered:
                    kern = mm.get(w.ggml_type)
                    kern(xr[w.shape[0]], w) if kern else matmul_tiled(xr[w.shape[0]], w)

            t_rows = time_it(rows_pass, max(3, args.reps // 10))
            line.append(f"T={T} {t_rows * 1e3:.1f} ms ({t_rows / t_pass:.2f}x)")
        print("rows per pass, all weight products, against one row: " + ", ".join(line))


def bench_generate(path: Path, n_tokens: int) -> None:
    """Whole-model greedy decode through deploy.engine_local with the kernels (weights stay quantized)."""
    from common.sampling import SamplingParams
    from deploy.engine_local import LocalEngine

    # a float32 copy would bypass the kernels; the arena is what knot generate computes from
    engine = LocalEngine.open(path, cache_f32=False, copy_weights=True)
    ids = engine.tokenizer.encode("def quicksort(arr):\n    ")
    engine.generate(ids, SamplingParams(), max_tokens=4)  # warm-up: mmap page faults, the pool
    g = engine.generate(ids, SamplingParams(), max_tokens=n_tokens)
    print(f"generate (LocalEngine, greedy, {len(ids)}-token prompt, {len(g.token_ids)} tokens): "
          f"decode {g.decode_tok_s:.2f} tok/s")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", action="append", help="0.5b, 1.5b or a .gguf/.knot path (repeatable)")
    ap.add_argument("--threads", type=int, default=None, help="kernel threads (default KNOT_THREADS or CPUs)")
    ap.add_argument("--tokens", type=int, default=64, help="also time a T-token (prefill) product; 1 to skip")
    ap.add_argument("--reps", type=int, default=50, help="timed calls per kernel (numpy: reps / 10)")
    ap.add_argument("--no-numpy", dest="numpy", action="store_false", help="skip the (slow) numpy path")
    ap.add_argument("--generate", type=int, default=0, metavar="N",
                    help="also time a real greedy decode of N tokens through LocalEngine")
    ap.add_argument("--rows", type=lambda v: [int(x) for x in v.split(",") if x], default=[],
                    help="row counts to time over all weight products, e.g. 2,3,4,9 (ratios to T=1)")
    args = ap.parse_args(argv)
    if not kernels.available():
        print(f"no kernels: {kernels.UNAVAILABLE_REASON}", file=sys.stderr)
        return 1
    kernels.install(args.threads)
    print(f"command: {' '.join(sys.argv)}")
    print(f"kernels: {kernels.describe()}; "
          f"OPENBLAS_NUM_THREADS={settings.read(os.environ, 'OPENBLAS_NUM_THREADS', 'bench')}; "
          f"load average {' '.join(f'{v:.2f}' for v in os.getloadavg())}")
    for m in args.model or list(MODELS):
        path = Path(MODELS.get(m, m)).expanduser()
        if not path.exists():
            print(f"\n## {m}: {path} not found (knot fetch-model caches it), skipped")
            continue
        bench_model(path, args)
        if args.generate:
            bench_generate(path, args.generate)
    return 0


if __name__ == "__main__":
    sys.exit(main())
