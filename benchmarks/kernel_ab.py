"""Two builds of the matmul kernels in one process, called in alternation: this tree's against another.

A kernel change is a few percent, and this machine's speed drifts by as much from one minute to the
next, so two builds timed in separate runs cannot be told apart. Here both extensions are loaded
side by side (A: the other tree's `deploy/kernels/_qmatmul*.so`, B: this tree's), and every round
times one pass of each over a model's weight products in model order, the order of the two swapped
each round. Before timing, each product's output is compared bit for bit: a change that keeps the
kernels' numbers prints "same bits"; a scratch variant with other numbers is timed all the same and
says how many products differ.

    git worktree add /tmp/a HEAD~1 && (cd /tmp/a && python setup.py build_ext --inplace)
    python setup.py build_ext --inplace
    OPENBLAS_NUM_THREADS=1 python benchmarks/kernel_ab.py --against /tmp/a [--model 0.5b|1.5b|PATH]
        [--rows 1,7,8] [--types Q4_K,Q6_K] [--rounds 16] [--threads 2] [--isa avx2]

Per row count it prints the median pass of A and of B in ms, B/A, and the same per ggml type.
Benchmarks are not tests: nothing here asserts a speed.
"""
from __future__ import annotations

import os

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import argparse  # noqa: E402
import importlib.util  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.bench_kernels import MODELS, decode_weights  # noqa: E402
from deploy import kernels  # noqa: E402
from deploy.knotfile import open_model  # noqa: E402


def load_build(tree: Path, tag: str):
    """The _qmatmul extension built in `tree`, imported under its own name beside this tree's."""
    found = sorted((tree / "deploy" / "kernels").glob("_qmatmul*.so"))
    if not found:
        raise SystemExit(f"{tree}: no deploy/kernels/_qmatmul*.so (run `python setup.py build_ext --inplace` there)")
    spec = importlib.util.spec_from_file_location(f"{tag}._qmatmul", found[0])
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def one_pass(ext, products, xs: dict[int, np.ndarray], ys: list[np.ndarray]) -> None:
    """Every product once: ys[i] (T, ne1) = xs[ne0] (T, ne0) @ W_i.T."""
    for (type_id, data, ne0, ne1), y in zip(products, ys):
        x = xs[ne0]
        ext.matmul(type_id, x, data, y, len(x), ne0, ne1)


def compare(a, b, products, T: int, rounds: int, rng) -> tuple[list[float], list[float], int]:
    """-> (A's pass times, B's pass times, products whose outputs differ in any bit)."""
    xs = {ne0: rng.standard_normal((T, ne0)).astype(np.float32) for ne0 in {p[2] for p in products}}
    runs = {tag: (ext, [(ext.TYPES[t], d, n0, n1) for t, d, n0, n1 in products],
                  [np.empty((T, n1), np.float32) for _, _, _, n1 in products]) for tag, ext in (("A", a), ("B", b))}
    for ext, prods, ys in runs.values():
        one_pass(ext, prods, xs, ys)
    differ = sum(not np.array_equal(p.view(np.uint32), q.view(np.uint32)) for p, q in zip(runs["A"][2], runs["B"][2]))
    times: dict[str, list[float]] = {"A": [], "B": []}
    for r in range(rounds):
        for tag in ("A", "B") if r % 2 == 0 else ("B", "A"):
            ext, prods, ys = runs[tag]
            t0 = time.perf_counter()
            one_pass(ext, prods, xs, ys)
            times[tag].append(time.perf_counter() - t0)
    return times["A"], times["B"], differ


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--against", required=True, type=Path, help="the other tree (A), its extension built")
    ap.add_argument("--model", default="0.5b", help="0.5b, 1.5b or a .gguf/.knot path (default 0.5b)")
    ap.add_argument("--rows", type=lambda v: [int(x) for x in v.split(",") if x], default=[1, 7, 8],
                    help="row counts per pass (default 1,7,8: decode, a verify trip, a prefill pass)")
    ap.add_argument("--types", type=lambda v: [x for x in v.split(",") if x], default=None,
                    help="only these ggml types' products (default: every type both builds have)")
    ap.add_argument("--rounds", type=int, default=16, help="passes of each build per row count (default 16)")
    ap.add_argument("--threads", type=int, default=None, help="kernel threads (default KNOT_THREADS or CPUs)")
    ap.add_argument("--isa", default=None, help="both builds' kernels of this ISA, e.g. avx2 on an AVX-512 CPU "
                                                "(default: the best this CPU runs)")
    args = ap.parse_args(argv)
    if not kernels.available():
        print(f"no kernels in this tree: {kernels.UNAVAILABLE_REASON}", file=sys.stderr)
        return 1
    a, b = load_build(args.against.resolve(), "kernel_ab_A"), kernels._qmatmul
    threads = args.threads or kernels.threads_from_env(os.environ)
    a.set_threads(threads)
    b.set_threads(threads)
    if args.isa:
        a.set_isa(args.isa)
        b.set_isa(args.isa)
    path = Path(MODELS.get(args.model, args.model)).expanduser()
    if not path.exists():
        print(f"{path} not found (knot fetch-model caches it)", file=sys.stderr)
        return 1
    model = open_model(path)
    types = set(args.types or (set(a.TYPES) & set(b.TYPES)))
    products = []
    for name in decode_weights(model):
        w = model.tensor(name)
        if w.ggml_type in types and w.ggml_type in a.TYPES and w.ggml_type in b.TYPES:
            data = np.ascontiguousarray(np.frombuffer(w.data, np.uint8))
            products.append((w.ggml_type, data, w.shape[0], w.shape[1]))
    if not products:
        print(f"no products of {sorted(types)} in {path.name}", file=sys.stderr)
        return 1
    pass_mb = sum(p[1].nbytes for p in products) / 1e6
    print(f"command: {' '.join(sys.argv)}")
    print(f"A: {args.against}; B: {Path(__file__).resolve().parents[1]}; {b.get_isa()} kernels, {threads} threads; "
          f"load average {' '.join(f'{v:.2f}' for v in os.getloadavg())}")
    kinds = ", ".join(sorted({p[0] for p in products}))
    print(f"{path.name}: {len(products)} products ({kinds}), {pass_mb:.1f} MB a pass")
    rng = np.random.default_rng(0)
    for T in args.rows:
        ta, tb, differ = compare(a, b, products, T, args.rounds, rng)
        ma, mb = float(np.median(ta)), float(np.median(tb))
        bits = "same bits" if not differ else f"{differ} of {len(products)} products differ in their bits"
        print(f"T={T}: A {ma * 1e3:.2f} ms, B {mb * 1e3:.2f} ms, B/A {mb / ma:.3f} ({bits}; medians of {args.rounds})")
        if len({p[0] for p in products}) > 1:
            for t in sorted({p[0] for p in products}):
                sub = [p for p in products if p[0] == t]
                sa, sb, _ = compare(a, b, sub, T, max(4, args.rounds // 2), rng)
                print(f"    {t}: A {np.median(sa) * 1e3:.2f} ms, B {np.median(sb) * 1e3:.2f} ms, "
                      f"B/A {np.median(sb) / np.median(sa):.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
