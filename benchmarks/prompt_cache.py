"""What prompt caching saves (issue 50, item 5): time to first token of a long chat context re-sent
with a new last turn, cached against cold, on a running cluster (`knot cluster up`).

    python benchmarks/prompt_cache.py [--url http://127.0.0.1:8000] [--context-tokens 4000]
                                      [--rounds 3] [--json FILE]

Each round starts a new conversation (a nonce in its system message, so nothing of an earlier round
is shared): turn 1 sends the context and a question (it leaves the context's blocks on the
stations); turn 2 re-sends all of it with the answer and a new question, once with the cache
(`cache_prompt` true, the default) and once without (`cache_prompt: false`: the whole prompt
prefilled, as a cold cluster would), in alternating order. Time to first token is the client's,
from sending to the first streamed content; each pair's answers must be equal (greedy), or the run
stops (deploy/feature_bench.py). Prints the medians and their ratio (the goal: cached <= 0.1 of
cold). --json appends the figures as records (deploy/records.py).
"""
from __future__ import annotations

import argparse
import time
from pathlib import Path

from deploy import records
from deploy.feature_bench import cache_ratio_metric, prompt_cache, served_model
from deploy.machine import describe


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--url", default="http://127.0.0.1:8000")
    p.add_argument("--context-tokens", type=int, default=4000)
    p.add_argument("--max-tokens", type=int, default=24)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--json", type=Path, default=None, metavar="FILE", help="append the figures as records")
    args = p.parse_args()
    m = prompt_cache(args.url, args.context_tokens, args.rounds, args.max_tokens)
    machine = describe()
    print(f"{machine.get('cpu')} (family {machine.get('family')}, model {machine.get('model')})")
    print(f"time to first token, {m['prompt_tokens']} prompt tokens ({m['cached_tokens']:.0f} cached): cold "
          f"{m['cold_ttft_s']:.3f} s, cached {m['cached_ttft_s']:.3f} s (median of {args.rounds}); cached / cold "
          f"{m['ratio']:.3f} (goal <= 0.1); same answers")
    if args.json:
        cmd = f"python benchmarks/prompt_cache.py --context-tokens {args.context_tokens} --rounds {args.rounds}"
        records.append(args.json, [records.record(
            time.strftime("%Y-%m-%d", time.gmtime()), records.machine_of(machine), cmd,
            cache_ratio_metric(args.context_tokens), round(m["ratio"], 3), "x",
            f"{m['cached_ttft_s']:.3f} against {m['cold_ttft_s']:.3f} s, {m['prompt_tokens']} prompt tokens, "
            f"{m['cached_tokens']:.0f} cached, median of {args.rounds}", model=served_model(args.url))])


if __name__ == "__main__":
    main()
