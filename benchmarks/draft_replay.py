"""How a draft model's stop rule would pay, replayed without a cluster: the target's greedy tokens
on a set of prompts, the draft model's greedy drafts (and its top probability for each) from every
position of them, then a trip cost model run over each rule.

    python benchmarks/draft_replay.py [--target qwen2.5-coder-1.5b] [--draft qwen2.5-coder-0.5b]
        [--prompts bench|held] [--tokens 64] [--cost 54,14,15 ...] [--max-draft 6] [--cache FILE]

A trip verifies the drafts a rule kept and costs cost[0] (a plain trip) + cost[1] per verify row
beyond the first + cost[2] per draft forward (one per kept draft, and one more where the rule, not
--max-draft, ended the drafts: the forward that made the doubted guess). Greedy drafts are
accepted up to the first that differs from the target's token; the trip then gives that token, or
the bonus. Each rule prints its speed-up over plain decoding (the target's tokens at cost[0] each),
drafts accepted / made, and trips. `bench` is `knot bench`'s three prompts; `held` is eight
HumanEval-style prompts (tests/tokenizer_corpus.py) and five chats the bench does not use.

The rules: `each T` stops before the first draft (after the first) whose own top probability is
below T (Hugging Face's assistant_confidence_threshold); `product T` stops once the product of the
drafts' top probabilities falls below T (common/speculative.py, DRAFT_CONFIDENCE); `copying` adds
the greedy draft model's copies of the context (COPY_NGRAM). The drafts do not depend on the rule,
only where they stop, so one pass of the draft model serves every rule.
Nothing here asserts a speed.
"""
from __future__ import annotations

import argparse
import pickle
import sys
from pathlib import Path
from typing import Sequence

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402

from common.speculative import COPY_NGRAM, DRAFT_CONFIDENCE, lookup, top_probability  # noqa: E402

HELD_CHATS = ["What is the difference between a process and a thread? Answer in two paragraphs.",
              "Write a short email asking a colleague to review my pull request by Friday.",
              "How do I reverse a linked list in C? Show the code and explain it briefly.",
              "Summarize the rules of chess castling.",
              "Explain Python decorators to a beginner, with an example."]
RULES = [("each", t) for t in (0.4, 0.5, 0.6, 0.7)] + [("product", t) for t in (0.3, 0.4, 0.5)]

Chain = list[tuple[int, float]]  # the draft model's greedy drafts from one position: (id, top probability)


# ---------------------------------------------------------------------------- the replay (pure)

def kept(probs: Sequence[float], rule: str, threshold: float) -> int:
    """How many of a chain's drafts the rule keeps (the first always)."""
    product = 1.0
    for i, p in enumerate(probs):
        product *= p
        if i and (p if rule == "each" else product) < threshold:
            return i
    return len(probs)


def replay(prompt: Sequence[int], target: Sequence[int], chains: Sequence[Chain], rule: str, threshold: float,
           cost: tuple[float, float, float], max_draft: int, copy: bool = False) -> tuple[float, int, int, int]:
    """The target's tokens after prompt, chains[n] the drafts after its first n -> (ms, drafted,
    accepted, trips). copy: where the context's last COPY_NGRAM tokens occurred before, max_draft
    tokens followed them, and the model's first draft is the first of those, the trip drafts them
    (one forward); the drafter then catches up on the tokens it did not feed, at half a forward."""
    plain, row, draft = cost
    n = ms = drafted = accepted = trips = 0
    behind = False
    while n < len(target):
        chain = chains[n][:max_draft]
        copied = lookup(list(prompt) + list(target[:n]), max_draft, ngram_min=COPY_NGRAM) if copy else []
        if len(copied) == max_draft and chain and copied[0] == chain[0][0]:
            drafts, forwards = copied, 1
        else:
            k = kept([p for _, p in chain], rule, threshold)
            drafts, forwards = [t for t, _ in chain[:k]], k + (k < len(chain))
        a = 0
        while a < len(drafts) and n + a < len(target) and drafts[a] == target[n + a]:
            a += 1
        ms += plain + row * len(drafts) + draft * (forwards + 0.5 * behind)
        behind = drafts is copied and a > 0
        drafted, accepted, trips = drafted + len(drafts), accepted + a, trips + 1
        n += a + 1
    return ms, drafted, accepted, trips


# ---------------------------------------------------------------------------- the models

def prompt_set(name: str, tok) -> list[tuple[str, list[int]]]:
    from deploy.commands.bench import SPEC_PROMPTS
    from tests.tokenizer_corpus import humaneval_prompts

    def ids(body: dict) -> list[int]:
        return tok.encode(body["prompt"]) if "prompt" in body else tok.encode_chat(body["messages"])

    if name == "bench":
        return [(kind, ids(body)) for kind, body in SPEC_PROMPTS.items()]
    return [(f"code {i}", tok.encode(p)) for i, p in enumerate(humaneval_prompts()[:8])] + \
        [(f"chat {i}", ids({"messages": [{"role": "user", "content": c}]})) for i, c in enumerate(HELD_CHATS)]


def record(target_name: str, draft_name: str, prompts: str, tokens: int, max_draft: int) -> dict[str, tuple]:
    """kind -> (the prompt's ids, the target's greedy tokens, the draft model's chain from each
    position)."""
    from common.sampling import SamplingParams
    from common.speculative import DRAFT_HEAD_IDS, draft_vocab_runs
    from deploy import models
    from deploy.engine_local import LocalEngine

    tgt = LocalEngine.open(models.model_path(target_name))
    outs = []
    for kind, ids in prompt_set(prompts, tgt.tokenizer):
        outs.append((kind, ids, tgt.generate(ids, SamplingParams(), max_tokens=tokens).token_ids))
        print(f"{kind}: the target's {len(outs[-1][2])} tokens", file=sys.stderr, flush=True)
    del tgt
    dr = LocalEngine.open(models.model_path(draft_name))
    runs = draft_vocab_runs(dr.cfg.vocab_size, DRAFT_HEAD_IDS, dr.tokenizer.special_ids)  # as the drafter's
    data = {}
    for kind, ids, out in outs:
        kv, chains = dr.new_kv(), []
        dr.forward(ids[:-1], kv, 0, vocab_runs=runs)
        for n in range(len(out)):
            ctx = ids + out[:n]
            kv.truncate(len(ctx) - 1)
            logits, chain = dr.forward([ctx[-1]], kv, len(ctx) - 1, vocab_runs=runs)[-1], []
            for i in range(max_draft):
                t = int(np.argmax(logits))
                chain.append((t, top_probability(logits)))  # as DraftModel's stop rule reads it
                if i + 1 < max_draft:
                    logits = dr.forward([t], kv, len(ctx) + i, vocab_runs=runs)[-1]
            chains.append(chain)
        data[kind] = (ids, out, chains)
        print(f"{kind}: the draft model's chains", file=sys.stderr, flush=True)
    return data


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="qwen2.5-coder-1.5b")
    ap.add_argument("--draft", default="qwen2.5-coder-0.5b")
    ap.add_argument("--prompts", choices=("bench", "held"), default="held")
    ap.add_argument("--tokens", type=int, default=64, help="the target's greedy tokens per prompt (default 64)")
    ap.add_argument("--max-draft", type=int, default=6, help="drafts per trip at most (default 6, the draft model's)")
    ap.add_argument("--cost", action="append", default=None,
                    help="PLAIN,ROW,DRAFT in ms (repeatable; default 54,14,15, the 1.5B cluster's)")
    ap.add_argument("--cache", help="keep the recorded tokens and chains in this file, and reuse them")
    args = ap.parse_args(argv)
    if args.cache and Path(args.cache).exists():
        data = pickle.loads(Path(args.cache).read_bytes())
    else:
        data = record(args.target, args.draft, args.prompts, args.tokens, args.max_draft)
        if args.cache:
            Path(args.cache).write_bytes(pickle.dumps(data))
    for text in args.cost or ["54,14,15"]:
        cost = tuple(float(x) for x in text.split(","))
        if len(cost) != 3:
            ap.error(f"--cost {text!r}: expected PLAIN,ROW,DRAFT")
        groups = sorted({kind.split()[0] for kind in data})  # code, chat
        each = len(data) <= 4  # a column per prompt too, where they fit
        print(f"\ncost {text}: speed-up over plain decoding" + (" (accepted/drafted, trips)" if each else ""))
        heads = (list(data) if each else []) + [f"all {g}" for g in groups]
        print("| rule | " + " | ".join(heads) + " |")
        print("|---" * (len(heads) + 1) + "|")
        for rule, thr, copy in [(r, t, False) for r, t in RULES] + [("product", DRAFT_CONFIDENCE, True)]:
            cells, totals = [], {g: [0.0, 0.0] for g in groups}  # group -> [plain ms, ms]
            for kind, (ids, out, chains) in data.items():
                ms, drafted, accepted, trips = replay(ids, out, chains, rule, thr, cost, args.max_draft, copy)
                if each:
                    cells.append(f"{cost[0] * len(out) / ms:.2f} ({accepted}/{drafted}, {trips})")
                t = totals[kind.split()[0]]
                t[0], t[1] = t[0] + cost[0] * len(out), t[1] + ms
            cells += [f"{a / b:.3f}" for a, b in totals.values()]
            print(f"| {rule} {thr}{', copying' if copy else ''} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
