"""One generation loop, shared by the single process and the cluster, and its record.

    gen = Generation(prompt_ids, max_tokens, sampling, stop, logprobs, request_id)
    async for ev in generate_events(engine, gen, tokenizer, clock, drafter, cost):
        TokenEvent(id, text, logprobs)   # one per sampled token; text is what it released
        FinishEvent(reason, text)        # last: "stop" | "length" (OpenAI's reasons), plus any held-back tail

The engine computes rows of logits (the Engine protocol below; common.sampling.Row):
deploy/engine_local.LocalEngine runs the whole model in this process,
services/coordinator/cluster_engine.ClusterEngine runs the pipeline of stations and shards.
Everything else is here, once: sampling (each row samples itself), speculative decoding (a drafter
proposes tokens, one engine trip verifies them all: common/speculative.py), the
end-of-generation token, stop strings with hold-back for streaming, max_tokens, the finish
reason and the record. The clock is passed in (common/ reads none).
"""
from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, AsyncIterator, Callable, Literal, Protocol, Sequence, runtime_checkable

import numpy as np

from common.sampling import Row, Sampler, SamplingParams, TokenLogprobs, as_row
from common.speculative import Draft, Drafter, DraftLength, Primes, SpeculationParams, TripCost, verify

if TYPE_CHECKING:
    from common.tokenizer import Tokenizer

# "stop": the model's end-of-generation token or a stop string; "length": max_tokens reached.
FinishReason = Literal["stop", "length"]


@dataclass
class Generation:
    """One generation: its request, then what the loop and the engine filled in. Two records are
    equal when the generations are (timings, hops and the request id are not compared)."""

    prompt_ids: list[int]
    max_tokens: int
    sampling: SamplingParams = field(default_factory=SamplingParams)
    stop: tuple[str, ...] = ()
    logprobs: int | None = None  # alternatives reported per token; None: no logprobs at all
    request_id: str = field(default="", compare=False)  # names the KV caches the engine keeps for it
    token_ids: list[int] = field(default_factory=list)  # generated, without the end-of-generation token
    text: str = ""  # the generated text, cut before a stop string
    finish_reason: FinishReason = "length"
    replays: int = 0  # the cluster: prompts replayed after a station lost the KV session
    degraded: list = field(default_factory=list)  # the cluster: shard failures merged (pipeline.Degradation)
    speculation: SpeculationParams = field(default_factory=SpeculationParams, compare=False)
    decode_steps: int = field(default=0, compare=False)  # tokens sampled after the first (an end-of-generation one too)
    trips: int = field(default=0, compare=False)  # engine calls after the prompt's (next_logits, verify_logits)
    drafted: int = field(default=0, compare=False)  # draft tokens verified
    accepted: int = field(default=0, compare=False)  # ... and accepted
    backed_off: int = field(default=0, compare=False)  # trips that drafted nothing after drafts that all failed
    drafter_error: str | None = field(default=None, compare=False)  # the drafter's fault; no drafts after it
    cached: int = field(default=0, compare=False)  # positions the engine's KV caches hold (rejected drafts too)
    cached_prompt_tokens: int = field(default=0, compare=False)  # prompt positions taken from a prompt cache
    t0: float = field(default=0.0, compare=False)  # clock (s) at the start,
    t_first: float = field(default=0.0, compare=False)  # once the prompt's logits were in,
    t_end: float = field(default=0.0, compare=False)  # and at the end
    hop_ms: dict[str, list[float]] = field(default_factory=dict, compare=False)  # the cluster: wall ms per hop
    shard_sampled: int = field(default=0, compare=False)  # the cluster: LM-head calls decided from the shards' summaries
    full_rows: int = field(default=0, compare=False)  # ... and those that fetched the full slices after all
    sampler_key: int = field(default=0, compare=False)  # the sampler's noise key (the shards draw with it too)
    # constrained decoding: the ids that may follow a sequence (prompt + generated), bool (vocab,);
    # None (the callable, or what it returns): any. The engines mask their rows with it.
    allowed: Callable[[Sequence[int]], np.ndarray | None] | None = field(default=None, compare=False)

    @property
    def prefill_s(self) -> float:
        return self.t_first - self.t0

    @property
    def decode_s(self) -> float:
        return self.t_end - self.t_first

    @property
    def prefill_tok_s(self) -> float:
        return len(self.prompt_ids) / self.prefill_s if self.prefill_s > 0 else float("inf")

    @property
    def decode_tok_s(self) -> float:
        # The first generated token comes from the prompt's logits; decode gave every later one.
        return self.decode_steps / self.decode_s if self.decode_s > 0 else float("inf")

    def speculation_summary(self) -> dict:
        """drafted / accepted tokens and tokens per engine trip after the prompt."""
        return {"source": self.speculation.source if self.speculation.on else "off", "trips": self.trips,
                "drafted": self.drafted, "accepted": self.accepted, "backed_off": self.backed_off,
                "acceptance": round(self.accepted / self.drafted, 4) if self.drafted else None,
                "tokens_per_trip": round(self.decode_steps / self.trips, 4) if self.trips else None,
                "drafter_error": self.drafter_error}

    def usage(self) -> dict:
        return {"prompt_tokens": len(self.prompt_ids), "completion_tokens": len(self.token_ids),
                "total_tokens": len(self.prompt_ids) + len(self.token_ids),
                "prompt_tokens_details": {"cached_tokens": self.cached_prompt_tokens}}


@runtime_checkable
class Engine(Protocol):
    """What computes a generation's rows (common.sampling.Row): the whole logits (LogitsRow, the
    single process) or the shards' summaries of them (shard_sampling.RowSummary, the cluster),
    masked where gen.allowed says (constrained decoding). It may keep state per gen.request_id
    (KV caches)."""

    async def prompt_logits(self, gen: Generation, ids: list[int]) -> Row:
        """The row after ids, the whole sequence from position 0 (a prompt, or a replay)."""
        ...

    async def next_logits(self, gen: Generation, token: int, history: list[int]) -> Row:
        """The row after one more token: history ends with it, at position len(history) - 1."""
        ...

    async def verify_logits(self, gen: Generation, tokens: list[int], context: list[int]) -> Sequence[Row]:
        """The rows after each of tokens: context ends with them, the first at position
        len(context) - len(tokens). Positions the caches hold from there on (an earlier trip's
        rejected drafts) are dropped first; so does next_logits."""
        ...


@dataclass(frozen=True)
class TokenEvent:
    id: int
    text: str  # the text this token released ("" while a stop string or a UTF-8 character is pending)
    logprobs: TokenLogprobs | None = None


@dataclass(frozen=True)
class FinishEvent:
    reason: FinishReason
    text: str  # the tail released at the end


def token_logprobs(row: Row | np.ndarray, tid: int, top_n: int) -> TokenLogprobs:
    """A row (or logits (vocab,) float32, -inf where a shard is degraded) -> log-softmax of tid and the top_n best."""
    return as_row(row).logprobs(tid, top_n)


async def generate_events(engine: Engine, gen: Generation, tokenizer: "Tokenizer", clock: Callable[[], float],
                          drafter: Drafter | None = None,
                          cost: TripCost | None = None) -> AsyncIterator[TokenEvent | FinishEvent]:
    """Sample up to gen.max_tokens after the prompt; fills gen in as it goes. With a drafter (and
    gen.speculation on), each engine trip verifies the tokens it drafts (common/speculative.py).
    With a TripCost (the engine's own), the trips are timed by clock and
    drafting backs off where its tokens come slower than plain trips' (DraftLength)."""
    sampler = Sampler(gen.sampling)
    gen.sampler_key = sampler.key
    detok = tokenizer.stream(skip_special=True)
    stop = StopText(gen.stop)
    history = list(gen.prompt_ids)
    draft_len = DraftLength(gen.speculation.max_draft, cost=cost, blind=getattr(drafter, "blind", False)) \
        if drafter is not None and gen.speculation.on else None
    gen.t0 = clock()
    # A draft model reads the prompt while the target does (a service of its own: the drafter),
    # not in the first trip after it; the first proposal awaits it.
    primed = drafter.prime(gen, list(history)) if draft_len is not None and gen.max_tokens > 1 and \
        isinstance(drafter, Primes) else None
    try:
        row = await engine.prompt_logits(gen, history) if gen.max_tokens > 0 else None
        gen.t_first = clock()
        # The tokens the last engine call decided, each with the row it was sampled from.
        decided = [(sampler(row, history), row)] if gen.max_tokens > 0 else []
        while decided:
            for tid, row in decided:
                gen.decode_steps += 1 if gen.trips else 0
                if tid in tokenizer.eog_ids:
                    gen.finish_reason = "stop"
                    break
                lp = token_logprobs(row, tid, gen.logprobs) if gen.logprobs is not None else None
                gen.token_ids.append(tid)
                history.append(tid)
                delta, stopped = stop.push(detok.push(tid))
                yield TokenEvent(tid, delta, lp)
                if stopped or len(gen.token_ids) == gen.max_tokens:
                    break
            else:
                if primed is not None:
                    await primed  # one that raises fails the request (RemoteDraftModel's notes a drafter fault instead)
                    primed = None
                decided = await _trip(engine, gen, sampler, history, drafter, draft_len, cost, clock)
                continue
            break
    finally:
        if primed is not None:  # the generation ended before its first trip
            primed.cancel()
            if primed.done() and not primed.cancelled():
                primed.exception()  # retrieved: it no longer matters
    tail = "" if stop.stopped else stop.finish(detok.flush())
    if stop.stopped:  # a stop string, possibly completed by the detokenizer's flushed tail
        gen.finish_reason = "stop"
    gen.text, gen.t_end = stop.text, clock()
    yield FinishEvent(gen.finish_reason, tail)


async def _trip(engine: Engine, gen: Generation, sampler: Sampler, history: list[int], drafter: Drafter | None,
                draft_len: DraftLength | None, cost: TripCost | None = None,
                clock: Callable[[], float] | None = None) -> list[tuple[int, Row]]:
    """One engine call after the prompt's: the last token, and the drafts if there are any -> the
    tokens it decides, each with its row. With a cost, the clock times the trip: a plain trip's
    time goes into cost, a drafting trip's (its drafting included) to draft_len."""
    # A trip decides up to k + 1 tokens: draft no more than max_tokens leaves room for.
    k = 0 if draft_len is None else min(draft_len.next(), gen.max_tokens - len(gen.token_ids) - 1)
    if draft_len is not None:
        gen.backed_off = draft_len.skipped
    now = clock if cost is not None else (lambda: 0.0)
    t0 = now()
    draft = Draft([])
    if k > 0:
        draft = drafter.propose(gen, history, k)
        if inspect.isawaitable(draft):
            draft = await draft
        draft = draft_len.bound(draft)
    gen.trips += 1
    if not draft.tokens:
        t0 = now()  # a plain trip: the engine's call alone, whatever a failed lookup took
        row = await engine.next_logits(gen, history[-1], history)
        if cost is not None:
            cost.observe_plain(now() - t0)
        return [(sampler(row, history), row)]
    t_verify = now()
    rows = await engine.verify_logits(gen, [history[-1], *draft.tokens], history + draft.tokens)
    seconds = None
    if cost is not None:
        t_end = now()
        seconds = t_end - t0
        cost.observe_verify(len(draft.tokens), t_end - t_verify)
    tokens, accepted = verify(sampler, rows, history, draft)
    gen.drafted += len(draft.tokens)
    gen.accepted += accepted
    draft_len.update(len(draft.tokens), accepted, seconds)
    return list(zip(tokens, rows))


def _prefix_function(s: str) -> list[int]:
    """KMP's table: pi[i] = length of the longest proper prefix of s[:i + 1] that is also its suffix."""
    pi = [0] * len(s)
    k = 0
    for i in range(1, len(s)):
        while k and s[i] != s[k]:
            k = pi[k - 1]
        if s[i] == s[k]:
            k += 1
        pi[i] = k
    return pi


class StopText:
    """Accumulates generated text; releases only what is final.

    Text that could still become the start of a stop string is held back, so a stream never
    shows a stop string (or half of one). push() returns (released text, stopped).

    Each stop string keeps a KMP state: how much of it the text's tail already spells. Why: a
    search of the whole tail on every token cost the coordinator's one event loop up to 91 ms a
    token with a thousand 1,000-character stop strings. Each character now costs each stop
    string O(1) amortized, however long it is.
    """

    def __init__(self, stop: Sequence[str] = ()):
        self.stop = [s for s in stop if s]
        self._pi = [_prefix_function(s) for s in self.stop]
        self._state = [0] * len(self.stop)  # the longest prefix of stop[i] that the text ends with
        self.text = ""
        self.emitted = 0
        self.stopped = False

    def push(self, delta: str) -> tuple[str, bool]:
        assert not self.stopped, "push after a stop string"
        if self._take(delta):
            return self._release(len(self.text)), True
        return self._release(len(self.text) - max(self._state, default=0)), False

    def finish(self, tail: str = "") -> str:
        """The end: release everything held back (plus a detokenizer's flushed tail)."""
        if not self.stopped and tail:
            self._take(tail)
        return self._release(len(self.text))

    def _take(self, delta: str) -> bool:
        """Append delta; where a stop string now occurs, cut the text before the earliest one."""
        base = len(self.text)
        self.text += delta
        cut = None
        for i, (s, pi) in enumerate(zip(self.stop, self._pi)):
            k = self._state[i]
            for j, c in enumerate(delta):
                while k and c != s[k]:
                    k = pi[k - 1]
                if c == s[k]:
                    k += 1
                if k == len(s):  # stop string i ends at delta[j]: its first occurrence
                    start = base + j + 1 - len(s)
                    cut = start if cut is None else min(cut, start)
                    break
            self._state[i] = k
        if cut is not None:
            self.text = self.text[:cut]
            self.stopped = True
        return self.stopped

    def _release(self, upto: int) -> str:
        out = self.text[self.emitted:upto] if upto > self.emitted else ""
        self.emitted = max(self.emitted, upto)
        return out
