"""Decode through the containers (`docker compose up`) vs the same services as local processes
(`knot cluster up`), in one run on one machine: greedy tokens from the same prompt, the two
clusters asked in turn so both see the same background load.

    scripts/test-compose.sh leaves nothing up, so bring the stack up first (after `knot secrets`), e.g.
    KNOT_MODELS_DIR=~/.cache/knot COMPOSE_FILE=docker-compose.yml:deploy/docker/offline.yml:tests/compose/override.yml \
        docker compose up -d --wait
    .venv/bin/python benchmarks/compose_vs_local.py --compose-url http://127.0.0.1:8000 [--tokens 64] [--rounds 3]

Prints decode tok/s and time to first token, median over the rounds, for each (and each round's
decode, to see the spread on a loaded machine), and their ratio.
Benchmarks are not tests: nothing here asserts a speed.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from deploy.commands.bench import SHORT_PROMPT, http_json, start_cluster  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--compose-url", required=True, help="the compose coordinator, e.g. http://127.0.0.1:8000")
    ap.add_argument("--model", default="qwen2.5-coder-0.5b")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    ns = argparse.Namespace(run_dir=str(Path(tempfile.gettempdir()) / "knot-compose-vs-local"))
    cluster, running = start_cluster(args.model, ns, 128 << 20)  # the compose file's station budget
    urls = {"containers": args.compose_url, "processes": running["coordinator"].url}
    got: dict = {k: {"decode_tok_s": [], "ttft_ms": []} for k in urls}
    tokens: dict = {}
    try:
        for url in urls.values():  # warm-up: stations load their layers, shards their slices
            http_json("POST", url + "/generate", {"prompt": SHORT_PROMPT, "max_tokens": 4})
        for _ in range(args.rounds):
            for name, url in urls.items():
                body = http_json("POST", url + "/generate", {"prompt": SHORT_PROMPT, "max_tokens": args.tokens})
                got[name]["decode_tok_s"].append(body["timings"]["decode_tok_s"])
                got[name]["ttft_ms"].append(body["timings"]["time_to_first_token_ms"])
                tokens.setdefault(name, body["tokens"])
    finally:
        cluster.down()
    med = {n: {k: statistics.median(v) for k, v in g.items()} for n, g in got.items()}
    print(f"{args.tokens} greedy tokens, median of {args.rounds} rounds; same tokens: "
          f"{tokens['containers'] == tokens['processes']}")
    for name, m in med.items():
        rounds = " ".join(f"{v:.2f}" for v in got[name]["decode_tok_s"])
        print(f"  {name:10s}  decode {m['decode_tok_s']:6.2f} tok/s   first token {m['ttft_ms']:7.1f} ms"
              f"   (decode per round: {rounds})")
    print(f"  containers / processes decode: {med['containers']['decode_tok_s'] / med['processes']['decode_tok_s']:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
