"""What a JSON schema costs decode (issue 50, item 5): streamed chat completions against a running
cluster (`knot cluster up`), with response_format json_schema against without, alternating.

    python benchmarks/constrained_decode.py [--url http://127.0.0.1:8000] [--max-tokens 64]
                                            [--rounds 5] [--json FILE]

Each request is streamed, greedy, speculation off; its decode rate is (chunks - 1) / (last chunk -
first chunk), so prefill is left out (deploy/feature_bench.py). Prints each side's median and their
ratio (the goal: >= 0.9), and the time of a first request with a new schema (llguidance compiles
it; later ones are cached). --json appends the figures as records (deploy/records.py).
"""
from __future__ import annotations

import argparse
import time
from pathlib import Path

from deploy import records
from deploy.feature_bench import SCHEMA_RATIO, json_schema_decode, served_model
from deploy.machine import describe


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--url", default="http://127.0.0.1:8000")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--json", type=Path, default=None, metavar="FILE", help="append the figures as records")
    args = p.parse_args()
    m = json_schema_decode(args.url, args.max_tokens, args.rounds)
    a, b, first_s = m["plain_tok_s"], m["schema_tok_s"], m["first_schema_ttft_s"]
    machine = describe()
    print(f"{machine.get('cpu')} (family {machine.get('family')}, model {machine.get('model')})")
    print(f"decode, no schema:   {a:6.2f} tok/s (median of {args.rounds})")
    print(f"decode, JSON schema: {b:6.2f} tok/s  ratio {b / a:.3f} (goal >= 0.9)")
    print(f"first request with a new schema: {first_s:.2f} s to its first token (its compile included; the first "
          f"grammar after the coordinator's boot also builds llguidance's tokenizer)")
    if args.json:
        cmd = "python benchmarks/constrained_decode.py " + f"--max-tokens {args.max_tokens} --rounds {args.rounds}"
        day = time.strftime("%Y-%m-%d", time.gmtime())
        m = records.machine_of(machine)
        records.append(args.json, [
            records.record(day, m, cmd, SCHEMA_RATIO, round(b / a, 3), "x", f"{b:.2f} against {a:.2f} tok/s",
                           model=served_model(args.url)),
            records.record(day, m, cmd, "first token with a new schema", round(first_s, 2), "s", "compile included",
                           model=served_model(args.url))])


if __name__ == "__main__":
    main()
