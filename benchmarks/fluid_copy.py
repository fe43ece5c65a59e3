"""What a fluid station pays to take one phase of weights out of its LayerWarden's shared blocks.

The LayerWarden keeps its frames in sealed shared blocks (deploy/local/shm.py SharedBlocks). Four
ways of taking one, interleaved, on a --mb MB block (a 7B's largest phase is ~56 MB):

    copy, then crc32     a fresh buffer, copied into (two threads), then one crc32 pass over it
                         (the station before e814c50)
    checked copy, spare  copied into a used buffer, each 256 KiB chunk's crc32 taken as it lands,
                         on two threads (e814c50 to this change)
    sealed, first sight  ReplyReader.assemble on a block it has not seen: the seals checked, the
                         block mapped read-only and its crc32 taken; no copy
    sealed, held         ReplyReader.assemble on a block it holds: a descriptor opened and
                         compared, nothing read (what every forward after the first pays)

    python benchmarks/fluid_copy.py [--mb 56] [--reps 15]

Prints each one's median and best, in ms and GB/s, and the ratios to the first. A VM's stolen time
shows as a wide gap between median and best; compare runs by their medians, interleaved as here.
Nothing here asserts a speed.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402

from common.integrity import crc32, crc32_combine  # noqa: E402
from deploy.local.shm import ReplyReader, SharedBlocks, _copy, _helper  # noqa: E402

CHUNK = 256 << 10


def _copy_run(dst: np.ndarray, src: np.ndarray) -> int:
    crc = 0
    for a in range(0, dst.nbytes, CHUNK):
        np.copyto(dst[a:a + CHUNK], src[a:a + CHUNK])
        crc = crc32(dst[a:a + CHUNK], crc)
    return crc


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mb", type=float, default=56.0, help="the block's size in MB (default 56)")
    p.add_argument("--reps", type=int, default=15, help="timed runs of each (default 15)")
    args = p.parse_args(argv)
    n = int(args.mb * 1e6)
    base = "/dev/shm" if Path("/dev/shm").is_dir() else None
    with tempfile.TemporaryDirectory(dir=base) as d:
        blocks = SharedBlocks()
        block = blocks.keep(np.random.default_rng(0).bytes(n))
        name = blocks.region(block)[0]
        src = np.frombuffer(block, np.uint8)
        want = crc32(block)
        used = np.ones(n, np.uint8)
        held = ReplyReader(d)

        def before() -> int:
            out = np.empty(n, np.uint8)
            _copy(out, src, n)
            return crc32(out)

        def checked() -> int:
            half = n // 2
            other = _helper.submit(_copy_run, used[half:], src[half:])
            first = _copy_run(used[:half], src[:half])
            return crc32_combine(first, other.result(), n - half)

        def assemble(reader: ReplyReader) -> int:
            got: dict[int, tuple[int, int]] = {}
            reader.assemble(f"{name}:{n}", b"", got)
            return got[0][1]

        def first_sight() -> int:
            reader = ReplyReader(d)
            try:
                return assemble(reader)
            finally:
                reader.close()

        ways = {"copy, then crc32": before, "checked copy, spare": checked, "sealed, first sight": first_sight,
                "sealed, held": lambda: assemble(held)}
        times: dict[str, list[float]] = {k: [] for k in ways}
        for f in ways.values():
            assert f() == want, "every way must give the block's crc32"
        for _ in range(args.reps):
            for k, f in ways.items():
                t0 = time.perf_counter()
                f()
                times[k].append(time.perf_counter() - t0)
        first = statistics.median(times["copy, then crc32"])
        print(f"{n / 1e6:.0f} MB block, {args.reps} interleaved runs each (held: {held.stats()['checked_blocks']} "
              f"check, {held.stats()['held_hits']} hits)")
        for k, ts in times.items():
            med = statistics.median(ts)
            print(f"  {k:19s} median {med * 1e3:6.1f} ms ({n / med / 1e9:5.2f} GB/s), best {min(ts) * 1e3:6.1f} ms;"
                  f" {first / med:4.2f}x the first")
        held.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
