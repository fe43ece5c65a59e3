"""What a fluid station pays to take one phase of weights out of its LayerWarden's shared blocks.

The LayerWarden keeps its frames in shared blocks (deploy/local/shm.py SharedBlocks); a station's
binding copies each block it is sent into one private buffer and checks the copy's crc32. Three
ways of doing that, interleaved, on a --mb MB block (a 7B's largest phase is ~56 MB):

    copy, then crc32    a fresh buffer, copied into (two threads), then one crc32 pass over it
                        (what the station did before the copy was checked as it went)
    checked copy        the same fresh buffer, each 256 KiB chunk's crc32 taken as it lands
    checked, spare      ReplyReader.assemble as the station runs it: the checked copy into the
                        buffer of the previous body, when nobody holds that any more

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

from common.integrity import crc32  # noqa: E402
from deploy.local.shm import ReplyReader, SharedBlocks, _copy, _copy_checked  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mb", type=float, default=56.0, help="the block's size in MB (default 56)")
    p.add_argument("--reps", type=int, default=15, help="timed runs of each (default 15)")
    args = p.parse_args(argv)
    n = int(args.mb * 1e6)
    base = "/dev/shm" if Path("/dev/shm").is_dir() else None
    with tempfile.TemporaryDirectory(dir=base) as d:
        blocks = SharedBlocks(d)
        block = blocks.keep(np.random.default_rng(0).bytes(n))
        name = blocks.region(block)[0]
        reader = ReplyReader(d)
        src = reader._map(name, n)[2]
        want = crc32(block)

        def before() -> int:
            out = np.empty(n, np.uint8)
            _copy(out, src, n)
            return crc32(out)

        def checked() -> int:
            return _copy_checked(np.empty(n, np.uint8), src, n)

        def spare() -> int:
            got: dict[int, tuple[int, int]] = {}
            reader.assemble(f"{name}:{n}", b"", got)  # dropped at once: its buffer is the next spare
            return got[0][1]

        ways = {"copy, then crc32": before, "checked copy": checked, "checked, spare": spare}
        times: dict[str, list[float]] = {k: [] for k in ways}
        for f in ways.values():
            assert f() == want, "every way must give the block's crc32"
        for _ in range(args.reps):
            for k, f in ways.items():
                t0 = time.perf_counter()
                f()
                times[k].append(time.perf_counter() - t0)
        first = statistics.median(times["copy, then crc32"])
        print(f"{n / 1e6:.0f} MB block, {args.reps} interleaved runs each (spare buffers reused: {reader.reused})")
        for k, ts in times.items():
            med = statistics.median(ts)
            print(f"  {k:18s} median {med * 1e3:6.1f} ms ({n / med / 1e9:5.2f} GB/s), best {min(ts) * 1e3:6.1f} ms;"
                  f" {first / med:4.2f}x the first")
        reader.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
