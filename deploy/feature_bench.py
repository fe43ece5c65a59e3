"""What coding agents' features cost or save, measured on a running cluster over its OpenAI API
(issue 50, item 5): prompt caching's time to first token, and a JSON schema's decode rate.
`knot bench` runs both on the cluster it starts; benchmarks/prompt_cache.py and
benchmarks/constrained_decode.py run them on any running cluster and write records.

Every request is streamed and timed by the client; none asserts a speed (benchmarks are records).
"""
from __future__ import annotations

import json
import os
import statistics
import time
import urllib.request
from typing import Callable

# A coding context: one function per record, repeated with its index until the context is long enough
FILLER = '''def parse_record_{i}(line: str) -> dict:
    """Split one CSV line of the {i}th export into named fields, checking each."""
    parts = [p.strip() for p in line.split(",")]
    if len(parts) != 4:
        raise ValueError(f"record {i}: expected 4 fields, got {{len(parts)}}")
    name, kind, size, owner = parts
    return {{"name": name, "kind": kind, "size": int(size), "owner": owner or None}}

'''

SCHEMA_RATIO = "decode, JSON schema / none"  # the records' metric names (deploy/records.py rows)


def cache_ratio_metric(context_tokens: int) -> str:
    return f"ttft, re-sent {context_tokens}-token context, cached / cold"


def served_model(url: str) -> str:
    """The model id a running coordinator serves (GET /v1/models)."""
    with urllib.request.urlopen(url + "/v1/models", timeout=60) as r:
        return json.load(r)["data"][0]["id"]


SCHEMA_MESSAGES = [{"role": "user", "content": "List twenty programming languages and what each is good for."}]
SCHEMA = {"type": "object", "properties": {"languages": {"type": "array", "items": {
    "type": "object", "properties": {"name": {"type": "string"}, "good_for": {"type": "string"}},
    "required": ["name", "good_for"], "additionalProperties": False}}},
    "required": ["languages"], "additionalProperties": False}


def stream_chat(url: str, body: dict, timeout_s: float = 1800) -> dict:
    """One streamed chat completion -> {"ttft_s": to the first content chunk, "text", "usage",
    "decode_tok_s": (chunks - 1) over the time from the first content chunk to the last (None
    under two chunks)}."""
    req = urllib.request.Request(url + "/v1/chat/completions", json.dumps(
        {**body, "stream": True, "stream_options": {"include_usage": True}}).encode(),
        {"Content-Type": "application/json"})
    t0, times, text, usage = time.perf_counter(), [], [], {}
    with urllib.request.urlopen(req, timeout=timeout_s) as r:
        for line in r:
            if not line.startswith(b"data: {"):
                continue
            chunk = json.loads(line[6:])
            usage = chunk.get("usage") or usage
            for c in chunk.get("choices", []):
                if c["delta"].get("content"):
                    times.append(time.perf_counter())
                    text.append(c["delta"]["content"])
    if not times:
        raise RuntimeError(f"no content streamed for a prompt of {usage.get('prompt_tokens')} tokens")
    rate = (len(times) - 1) / (times[-1] - times[0]) if len(times) > 1 and times[-1] > times[0] else None
    return {"ttft_s": times[0] - t0, "text": "".join(text), "usage": usage, "decode_tok_s": rate}


def coding_context(url: str, n_tokens: int, nonce: str) -> list[dict]:
    """A system message naming the nonce and a user message of code: about n_tokens in all, from one
    calibration request of a few functions (its prompt tokens, counted by the server)."""
    def messages(k: int) -> list[dict]:
        code = "".join(FILLER.format(i=i) for i in range(k))
        return [{"role": "system", "content": f"Session {nonce}. You review Python code."},
                {"role": "user", "content": "Here is the module:\n\n" + code}]

    def tokens(k: int) -> int:
        return stream_chat(url, {"messages": messages(k), "max_tokens": 1, "temperature": 0,
                                 "cache_prompt": False})["usage"]["prompt_tokens"]

    t2, t6 = tokens(2), tokens(6)
    per = (t6 - t2) / 4
    return messages(max(1, round(2 + (n_tokens - t2) / per)))


def prompt_cache(url: str, context_tokens: int = 4000, rounds: int = 3, max_tokens: int = 24,
                 progress: Callable[[str], None] = print) -> dict:
    """Time to first token of a coding context re-sent with its answer and a new question, cached
    against cache_prompt false, alternating, each round a new conversation (a nonce). The answers
    of a pair must be equal (greedy), else RuntimeError."""
    base = {"max_tokens": max_tokens, "temperature": 0, "speculation": "off"}
    cold, cached, cached_tokens, prompt_tokens = [], [], [], 0
    for r in range(rounds):
        turn1 = coding_context(url, context_tokens, os.urandom(6).hex()) + [
            {"role": "user", "content": "Which function would you test first, and why?"}]
        answer = stream_chat(url, {**base, "messages": turn1})["text"]  # leaves the context's blocks
        turn2 = turn1 + [{"role": "assistant", "content": answer},
                         {"role": "user", "content": "Write a unit test for parse_record_3."}]
        runs = [("cold", {"cache_prompt": False}), ("cached", {})]
        out = {name: stream_chat(url, {**base, "messages": turn2, **extra})
               for name, extra in (runs if r % 2 == 0 else runs[::-1])}
        if out["cold"]["text"] != out["cached"]["text"]:
            raise RuntimeError(f"round {r}: the cached answer differs from the cold one:\n"
                               f"{out['cached']['text']!r}\n{out['cold']['text']!r}")
        cold.append(out["cold"]["ttft_s"])
        cached.append(out["cached"]["ttft_s"])
        cached_tokens.append(out["cached"]["usage"]["prompt_tokens_details"]["cached_tokens"])
        prompt_tokens = out["cached"]["usage"]["prompt_tokens"]
        progress(f"  round {r}: {prompt_tokens} prompt tokens, {cached_tokens[-1]} cached; first token "
                 f"{cached[-1]:.3f} s cached, {cold[-1]:.3f} s cold; same answers")
    a, b = statistics.median(cold), statistics.median(cached)
    return {"cold_ttft_s": a, "cached_ttft_s": b, "ratio": b / a, "prompt_tokens": prompt_tokens,
            "cached_tokens": statistics.median(cached_tokens), "rounds": rounds, "context_tokens": context_tokens}


def json_schema_decode(url: str, max_tokens: int = 64, rounds: int = 5) -> dict:
    """Decode tok/s of a streamed chat with response_format json_schema against without, alternating
    (greedy, speculation off; prefill left out), and the first token's time with a schema not
    compiled yet (its compile included)."""
    base = {"messages": SCHEMA_MESSAGES, "max_tokens": max_tokens, "temperature": 0, "speculation": "off"}
    schema = {"type": "json_schema", "json_schema": {"name": "languages", "schema": SCHEMA}}
    fresh = {"type": "json_schema", "json_schema": {"name": "fresh", "schema": {**SCHEMA,
                                                                               "title": os.urandom(6).hex()}}}
    first_s = stream_chat(url, {**base, "response_format": fresh, "max_tokens": 2})["ttft_s"]
    stream_chat(url, base)  # warm both paths
    plain, constrained = [], []
    for i in range(rounds):
        order = [(plain, base), (constrained, {**base, "response_format": schema})]
        for out, body in order if i % 2 == 0 else order[::-1]:
            rate = stream_chat(url, body)["decode_tok_s"]
            if rate is None:
                raise RuntimeError(f"fewer than two content chunks: {body}")
            out.append(rate)
    a, b = statistics.median(plain), statistics.median(constrained)
    return {"plain_tok_s": a, "schema_tok_s": b, "ratio": b / a, "first_schema_ttft_s": first_s, "rounds": rounds}
