"""Speculative decoding: cheap drafts of the next tokens, verified k at a time by the model.

One trip through the model takes the last sampled token and k drafted ones as a small batch and
returns k + 1 rows of logits: after the last token, after each draft. The drafts are checked in
order against those rows; the first rejected one is replaced, and the trip ends there, so a trip
decides between 1 and k + 1 tokens for about the price of one (the weights are read once for
all rows). The engines then drop the rejected drafts' positions from their KV caches.

    draft = PromptLookup().propose(gen, context, k)  # or a draft model (a Drafter)
    rows = await engine.verify_logits(gen, [context[-1], *draft.tokens], context + draft.tokens)
    tokens, accepted = verify(sampler, rows, context, draft)

The rule (verify()), so that speculation never changes what is generated:
- a drafted token that is a point mass (prompt lookup; any greedy draft) is accepted iff it is
  the token the sampler draws at its position from its row; else that token replaces it. Greedy,
  that is the argmax. Sampled, the sampler's noise is keyed by position (common/sampling.py),
  so the output is token for token the one without speculation, for the same seed; and this is
  the standard rule for q = a point mass: accepted with probability p(d), else a draw from p
  without d. This needs a trip's k + 1 rows to be the bits of decoding them one at a time: the
  kernels are row-exact, and attention runs such short batches row by row
  (common/ops.py Ops.attention, EXACT_ROWS).
- a draft model's sampled token d ~ q is accepted with probability min(1, p(d) / q(d)), else
  replaced by a draw from max(0, p - q), normalized (Leviathan et al. 2023, "Fast Inference from
  Transformers via Speculative Decoding", algorithm 1; Chen et al. 2023): the output has the
  distribution p, though the tokens differ from an unspeculated run's.
If every draft is accepted, the last row gives one more token (the "bonus").
"""
from __future__ import annotations

import zlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Awaitable, Callable, Iterable, Protocol, Sequence, runtime_checkable

import numpy as np

from common.kvcache import KVCache, largest, prefill_chunks
from common.runtime import PayloadTooLarge
from common.sampling import DRAFT, Row, Sampler, SamplingParams, softmax

if TYPE_CHECKING:
    from common.generation import Generation

SOURCES = ("off", "prompt_lookup", "draft_model")
MAX_DRAFT = 32  # tokens one trip may verify besides the last one
# Prompt lookup's n-gram bounds. Why not 1 at the bottom: a lone repeated token (a bracket, a
# space) predicts little, and its failed drafts cost verify rows and start the back-off
# (DraftLength) that then skips the long matches after it (benchmarks/draft_replay.py).
NGRAM_MAX, NGRAM_MIN = 3, 2
# Tokens drafted per trip at most, by source, where neither SPEC_MAX_DRAFT nor the request says.
# Why fewer for the draft model: its drafts cost a forward each in series, and a verify trip's rows
# past the kernels' pass of 8 cost a whole pass more; prompt lookup's drafts cost only their verify
# rows, and an edit's long copies pay for 8 (knot bench; docs/performance.md, "Levers tried").
DEFAULT_MAX_DRAFT = {"prompt_lookup": 8, "draft_model": 6}


def default_max_draft(source: str) -> int:
    """The most tokens a trip drafts from `source` when nobody chose (DEFAULT_MAX_DRAFT; 8 otherwise)."""
    return DEFAULT_MAX_DRAFT.get(source, 8)


@dataclass(frozen=True)
class SpeculationParams:
    source: str = "off"      # one of SOURCES
    max_draft: int = 8       # tokens drafted per trip, at most
    ngram_max: int = NGRAM_MAX  # prompt lookup: the longest suffix of the text matched against it
    ngram_min: int = NGRAM_MIN  # ... and the shortest

    def __post_init__(self):
        if self.source not in SOURCES or not 0 <= self.max_draft <= MAX_DRAFT or not 1 <= self.ngram_min <= self.ngram_max:
            raise ValueError(f"invalid speculation params: {self}")

    @property
    def on(self) -> bool:
        return self.source != "off" and self.max_draft > 0


@dataclass(frozen=True)
class Draft:
    tokens: list[int]
    # The draft model's distributions the tokens were drawn from, (vocab,) float64 each; None:
    # point masses (prompt lookup, or a greedy draft model).
    q: list[np.ndarray] | None = None
    # Prompt lookup: how many tokens before the drafts the context matches where it copied them
    # from (0: not known). A long match is text being copied (DraftLength.bound).
    extent: int = 0


class Drafter(Protocol):
    def propose(self, gen: "Generation", context: list[int], k: int) -> Draft | Awaitable[Draft]:
        """Up to k tokens that may follow context (prompt + generated so far)."""
        ...


@runtime_checkable
class Primes(Protocol):
    """A drafter with state per generation (a draft model's KV cache) may also read the prompt
    ahead: the generation loop calls prime() when the prompt goes to the model, and awaits what it
    returns only before the first proposal (common/generation.py). prime() returns None when it
    read the prompt in place, else the read, already running: a future (an asyncio Task), which the
    loop cancels if the generation ends before its first trip."""

    def prime(self, gen: "Generation", prompt: list[int]) -> "PrimeFuture | None": ...


class PrimeFuture(Protocol):
    """What Primes.prime returns when it reads the prompt elsewhere (asyncio.Future's methods)."""

    def __await__(self): ...

    def cancel(self) -> bool: ...

    def done(self) -> bool: ...

    def cancelled(self) -> bool: ...

    def exception(self) -> BaseException | None: ...


class PromptLookup:
    """Drafts by copying: the longest recent n-gram of the text (ngram_max down to ngram_min tokens)
    that occurred before, and the tokens that followed its latest earlier occurrence. No model;
    code repeats itself (names, signatures, whole lines), so it often guesses right."""

    blind = True  # its drafts carry no confidence: DraftLength bounds them by the acceptance so far

    def __init__(self, ngram_max: int = NGRAM_MAX, ngram_min: int = NGRAM_MIN):
        self.ngram_max, self.ngram_min = ngram_max, ngram_min

    def propose(self, gen: "Generation | None", context: Sequence[int], k: int) -> Draft:
        tokens, extent = lookup_match(context, k, self.ngram_max, self.ngram_min)
        return Draft(tokens, extent=extent)


def lookup(context: Sequence[int], k: int, ngram_max: int = NGRAM_MAX, ngram_min: int = NGRAM_MIN) -> list[int]:
    """The k tokens after the latest earlier occurrence of the longest matching suffix of context."""
    return lookup_match(context, k, ngram_max, ngram_min)[0]


def lookup_match(context: Sequence[int], k: int, ngram_max: int = NGRAM_MAX, ngram_min: int = NGRAM_MIN,
                 extent_max: int = 16) -> tuple[list[int], int]:
    """lookup()'s tokens, and how many tokens of context end in a match of that occurrence (the
    n-gram and as many before it as agree, up to extent_max; 0 without tokens)."""
    L = len(context)
    if k <= 0 or L < ngram_min + 1:
        return [], 0
    h = np.asarray(context, dtype=np.int64)
    for n in range(min(ngram_max, L - 1), ngram_min - 1, -1):
        starts = L - n  # occurrences start at i < L - n, so at least one token follows them
        hit = np.ones(starts, dtype=bool)
        for j in range(n):  # h[i + j] == suffix[j] for every j
            hit &= h[j:starts + j] == h[L - n + j]
        idx = np.flatnonzero(hit)
        if idx.size:
            i = int(idx[-1])
            e = n  # back from the n-gram while the occurrence and the suffix agree
            while e < extent_max and i - (e - n) > 0 and h[i - (e - n) - 1] == h[L - e - 1]:
                e += 1
            return [int(t) for t in h[i + n:i + n + k]], e
    return [], 0


# A draft model stops a trip's drafts (after the first) once the chance it gives the whole chain,
# the product of each draft's top probability, falls below this. A draft is worth its forward and
# its verify row only if every draft before it is accepted too, which is what the product
# estimates. The rule reads only the draft model's own distribution, so the accept/reject rule
# (verify) still keeps the target's. Why the product, not each draft's own probability (Hugging
# Face's assistant_confidence_threshold, 0.4, which this used before): benchmarks/draft_replay.py
# replays the 1.5B's greedy tokens against the 0.5B's drafts from every position through a trip
# cost model; the product gained on code and on the held-out prompts under every cost tried.
DRAFT_CONFIDENCE = 0.4


# A greedy draft model copies: where the context's last 3 tokens occurred before, a trip's worth of
# tokens followed them, and its own first draft is the first of those, the trip drafts them without
# more forwards. Edits and refactors copy long runs of the prompt, which prompt lookup finds for
# nothing while the draft model spends a forward a token; the draft model's agreement keeps the
# copies to where they are likely (a lookup alone drafts the 1.5B's code edit 59% right).
# benchmarks/draft_replay.py ("copying") measures it: edits gain, code and chat do not move; matches
# of 2 tokens copied too often.
COPY_NGRAM = 3


def top_probability(z: np.ndarray) -> float:
    """The probability of the likeliest token of softmax(z), z (vocab,) scores (-inf: excluded)."""
    m = float(np.max(z))
    # exp in float32 (numpy's SIMD loop), summed in float64: less than half the time of exp in
    # float64, once a drafted token; the stop needs no more precision
    return 1.0 / float(np.exp(z - m).sum(dtype=np.float64))


# A draft model's LM head scores only the ids below this, and the special tokens (an end of text, a
# chat turn's end, code infill's markers); it never drafts the others, so a token among them costs
# the trip where the target emits it one rejected draft, and changes no output. Why: the head is
# the draft model's biggest product. The 0.5B's is 145 MB of Q8_0 beside 246 MB of layers, and
# Qwen2's ids from 100,000 up (a third of its rows) are CJK and other scripts' words, 0.01% of the
# tokens of this repository's Python and 0.02% of its docs; scoring only the rest nearly halves
# the head's product (docs/lab/2026-12-04-draft-model-head-over-usable-ids.md).
DRAFT_HEAD_IDS = 100_000


def narrows_head(vocab_size: int, below: int) -> bool:
    """Whether DRAFT_HEAD_IDS=below leaves ids out of the head (0, or the whole vocabulary: none);
    where it does not, the caller need not read the special ids at all."""
    return 0 < below < vocab_size


def draft_vocab_runs(vocab_size: int, below: int, special_ids: Iterable[int]) -> list[tuple[int, int]] | None:
    """The id ranges [a, b) a draft model's head scores: [0, below) and the special ids at or above
    it, in runs of consecutive ids (Qwen2's 22 specials are one run) -> sorted, disjoint runs, or
    None (the whole head) where below does not narrow it (narrows_head)."""
    if not narrows_head(vocab_size, below):
        return None
    runs = [[0, below]]
    for i in sorted({int(i) for i in special_ids if below <= int(i) < vocab_size}):
        if i == runs[-1][1]:
            runs[-1][1] = i + 1
        else:
            runs.append([i, i + 1])
    return [(a, b) for a, b in runs]


class DraftModel:
    """Drafts with a small model of the same vocabulary (the 0.5B for the 1.5B), k forwards of one
    token each. It keeps a KV cache per generation: each proposal keeps what its cache shares with
    the context (rewinding the drafts the target rejected), feeds the rest, then drafts. prefill()
    feeds a prompt ahead of the first proposal, which then feeds only the first sampled token.

    forward(tokens, kv, start_pos) -> logits (1 or T, vocab) whose last row follows the last token:
    only that row is used, so a forward need not compute the LM head for the others (for a 150-token
    prompt the 0.5B's head over every row took 0.8 s of 2.2). Greedy requests draft the argmax
    (point masses), or copy the context where it agrees (COPY_NGRAM); sampled ones draw from the
    sampler's distribution with the DRAFT noise stream and report it (Draft.q), which the
    accept/reject rule needs. Drafts stop where the chain's probability falls below confidence
    (DRAFT_CONFIDENCE).

    kv_budget_bytes, with kv_bound(n) (the most an n-token sequence's cache may hold, growth
    included: KVCache.nbytes_bound), bounds the sessions' caches together: before a session grows,
    the least recently used others are dropped until it fits beside them (a dropped generation is
    fed again from its context if it drafts again), and a sequence too long to fit alone is a 413.
    Without them only max_sessions bounds the caches."""

    def __init__(self, forward: Callable[[list[int], KVCache, int], np.ndarray], new_kv: Callable[[], KVCache],
                 max_sessions: int = 64, confidence: float = DRAFT_CONFIDENCE,
                 kv_budget_bytes: int | None = None, kv_bound: Callable[[int], int] | None = None,
                 on_evict: Callable[[str], None] = lambda request_id: None, copy_ngram: int | None = COPY_NGRAM):
        if (kv_budget_bytes is None) != (kv_bound is None):
            raise ValueError("kv_budget_bytes and kv_bound go together")
        self.forward, self.new_kv, self.max_sessions = forward, new_kv, max_sessions
        self.confidence = confidence  # stop drafting where the chain's probability falls below this
        self.copy_ngram = copy_ngram  # greedy: copy after a match this long that the first draft agrees with
        self.copies = 0  # trips whose drafts were copied from the context (COPY_NGRAM)
        self.kv_budget_bytes, self.kv_bound, self.on_evict = kv_budget_bytes, kv_bound, on_evict
        self.sessions: dict[str, tuple[KVCache, list[int]]] = {}  # request id -> (cache, tokens it holds)
        self.forwards = 0
        self.sessions_evicted = 0  # dropped for the KV budget (not for max_sessions)

    @property
    def kv_bytes(self) -> int:
        # list() copies the values at once: /stats may read this while a draft runs in a thread
        return sum(kv.nbytes for kv, _ in list(self.sessions.values()))

    def max_tokens(self) -> int | None:
        """The longest sequence whose cache fits the KV budget alone (None: no budget)."""
        if self.kv_bound is None:
            return None
        fits = lambda n: self.kv_bound(n) <= self.kv_budget_bytes  # noqa: E731
        hi = 1
        while fits(hi):  # an n that does not fit, to search below
            hi *= 2
        return largest(fits, hi)

    def _session(self, request_id: str, n_tokens: int) -> tuple[KVCache, list[int]]:
        """The request's cache and the tokens it holds (a new one if none), once there is room for
        it to hold n_tokens."""
        kv, held = self.sessions.pop(request_id, None) or (self.new_kv(), [])
        if self.kv_bound is not None:
            # a cache rewound from a longer sequence keeps its capacity
            need = max(kv.nbytes, self.kv_bound(n_tokens))
            if need > self.kv_budget_bytes:
                raise PayloadTooLarge(
                    f"a sequence of {n_tokens} tokens needs up to {need} bytes of the draft model's KV cache, "
                    f"over its budget of {self.kv_budget_bytes} (at most {self.max_tokens()} tokens): "
                    f"raise the drafter's MEMORY_BUDGET_BYTES")
            held_bytes = self.kv_bytes
            while self.sessions and held_bytes + need > self.kv_budget_bytes:
                evicted = next(iter(self.sessions))  # the least recently used
                held_bytes -= self.sessions.pop(evicted)[0].nbytes
                self.sessions_evicted += 1
                self.on_evict(evicted)
        self.sessions[request_id] = (kv, held)  # most recent last
        while len(self.sessions) > self.max_sessions:
            del self.sessions[next(iter(self.sessions))]
        return kv, held

    def _feed(self, kv: KVCache, held: list[int], context: Sequence[int], keep_one: bool
              ) -> tuple[np.ndarray | None, int]:
        """Rewind kv to what it shares with context, then feed the rest in prefill chunks -> the last
        row's logits (vocab,) (None if nothing was fed) and the tokens fed. keep_one: feed at least
        the last token, whose logits the caller needs."""
        n = 0  # the common prefix
        while n < min(len(held), len(context) - keep_one) and held[n] == context[n]:
            n += 1
        kv.truncate(n)
        logits = None
        for a, b in prefill_chunks(len(context) - n):
            logits = self.forward(list(context[n + a:n + b]), kv, n + a)[-1]
            self.forwards += 1
        return logits, len(context) - n

    def prefill(self, request_id: str, context: Sequence[int]) -> int:
        """Feed context into the request's cache ahead of its first draft -> the tokens fed."""
        kv, held = self._session(request_id, len(context))
        _, fed = self._feed(kv, held, context, keep_one=False)
        self.sessions[request_id] = (kv, list(context))
        return fed

    def prime(self, gen: "Generation", prompt: list[int]) -> None:
        """The Primes protocol, in process."""
        self.prefill(gen.request_id, prompt)

    def draft(self, request_id: str, context: Sequence[int], k: int, sampling: SamplingParams,
              key: int) -> tuple[list[int], list[np.ndarray] | None]:
        """Up to k tokens after context, and for a sampled request the scores (vocab,) each was drawn
        from (softmax(scores) is its distribution)."""
        if k <= 0 or not context:
            return [], None
        kv, held = self._session(request_id, len(context) + k - 1)  # the last draft is not fed
        logits, _ = self._feed(kv, held, context, keep_one=True)
        fed = len(context)
        sampler = Sampler(sampling)
        sampler.key = key
        hist, tokens, scores = list(context), [], []
        copy = lookup(context, k, ngram_min=self.copy_ngram) if sampling.greedy and self.copy_ngram else []
        chain = 1.0  # the draft model's chance that every draft so far is right (DRAFT_CONFIDENCE)
        for i in range(k):
            z = sampler.scores(logits, hist)
            chain *= top_probability(z)
            if i and chain < self.confidence:
                break  # a chain the draft model itself doubts: not worth a verify row, nor more drafts
            if sampling.greedy:
                t = int(np.argmax(z))
                # only a copy as long as the trip's drafts: the latest match of a short cycle ("x y x
                # y") has one or two tokens after it, where the model would draft k
                if not i and len(copy) == k and copy[0] == t:
                    self.copies += 1
                    tokens = copy  # the context's own continuation, which the model's first draft starts
                    break
            else:
                t = sampler.draw(z, len(hist), DRAFT)
                scores.append(z)
            tokens.append(t)
            hist.append(t)
            if i + 1 < k:
                logits = self.forward([t], kv, len(hist) - 1)[-1]
                self.forwards += 1
                fed = len(hist)
        self.sessions[request_id] = (kv, hist[:fed])  # a draft after the last one fed was not
        return tokens, (scores if scores else None)

    def propose(self, gen: "Generation", context: list[int], k: int) -> Draft:
        """The Drafter protocol, in process (the single process)."""
        tokens, scores = self.draft(gen.request_id, context, k, gen.sampling, draft_key(gen))
        return Draft(tokens, None if scores is None else [softmax(z) for z in scores])

    def release(self, request_id: str) -> None:
        self.sessions.pop(request_id, None)


def draft_key(gen: "Generation") -> int:
    """The key of a draft model's noise: the seed (its DRAFT stream is independent of the target's
    streams), or for an unseeded request one of its own, from the request id."""
    return gen.sampling.seed if gen.sampling.seed is not None else zlib.crc32(gen.request_id.encode())


# After the second draft in a row of which nothing was accepted, the next trip drafts nothing,
# after the third the next 2, then 4, ... (at most MAX_COOLDOWN); any accepted token ends the
# back-off. One failure alone does not back off: where drafts mostly hit (a code edit, 87%), a
# skipped trip is a trip of ~7 tokens lost. Why: every drafted row costs its share of
# each hop of a trip, and on a fresh completion prompt lookup finds little to copy: its drafts
# cost more than they saved (knot bench's code prompt). What is generated never depends on the
# drafts, only the trips taken.
MAX_COOLDOWN = 16

# A blind source's (prompt lookup's) drafts carry no confidence of their own, so the generation's
# recent acceptance stands in for it: (accepted + ACCEPT_PRIOR[0]) / (decided + sum(ACCEPT_PRIOR)),
# each past drafting trip's count weighted by ACCEPT_DECAY per later one, so that a code edit's
# answer that starts copying the prompt after a few failed drafts is believed within a few trips.
# The prior, 3 of 4, lets a first draft run 3 tokens at ROW_SHARE_PRIOR.
ACCEPT_PRIOR = (3.0, 1.0)
ACCEPT_DECAY = 0.75
# ... except a draft whose context matched this many tokens where it was copied from (Draft.extent):
# that is text being copied (an edit's answer repeating the prompt), whose drafts run long; bounded
# by acceptance, an edit's copies took more trips (docs/lab/2026-12-07-prompt-lookup-bound.md).
COPY_EXTENT = 8
# What one more verified row adds to a trip, as a share of a plain trip, until the engine's own
# drafting trips measured it (TripCost.row_s): what a multi-row verify costs on the compute-bound
# machines (benchmarks/bench_kernels.py --rows).
ROW_SHARE_PRIOR = 0.25


class TripCost:
    """What a plain trip (one row, nothing drafted) through one engine takes, as its trips measure
    it: what a drafting trip's tokens are weighed against (DraftLength). Shared by the engine's
    generations (an engine keeps one: LocalEngine.trip_cost, ClusterEngine.trip_cost): it describes
    the machine and the model, not a request.

    Why: what a drafted row costs depends on the machine. Where the kernels are memory-bound (AVX-512
    VNNI), 8 rows cost little more than 1, and drafts pay from low acceptance on. Where they are
    compute-bound (AVX2 without VNNI), 8 rows cost about 7 times 1, and the same drafts lose time
    (benchmarks/bench_kernels.py --rows; knot bench). Acceptance alone cannot tell these apart; the
    clock can."""

    WEIGHT = 0.25  # of the newest plain trip in the running mean

    def __init__(self):
        self.plain_s: float | None = None  # seconds of a plain trip, a running mean; None: none yet
        self.row_s: float | None = None    # what each drafted row adds to a trip's engine call, a running mean

    def observe_plain(self, seconds: float) -> None:
        self.plain_s = seconds if self.plain_s is None else self.plain_s + self.WEIGHT * (seconds - self.plain_s)

    def observe_verify(self, drafted: int, seconds: float) -> None:
        """An engine call that verified 1 + drafted rows took seconds (its drafting not included)."""
        if drafted <= 0 or self.plain_s is None:
            return
        per_row = max(0.0, seconds - self.plain_s) / drafted
        self.row_s = per_row if self.row_s is None else self.row_s + self.WEIGHT * (per_row - self.row_s)

    def row_share(self) -> float:
        """What a drafted row adds to a trip, as a share of a plain trip (ROW_SHARE_PRIOR until measured)."""
        if self.row_s is None or not self.plain_s:
            return ROW_SHARE_PRIOR
        return self.row_s / self.plain_s


class DraftLength:
    """How many tokens to draft next: more after a trip that accepted them all, fewer after a
    rejection (the heuristic of Hugging Face's assisted generation: +2 / -1; half after a draft of
    which nothing was accepted), and none for a while after such drafts in a row (MAX_COOLDOWN).

    With a TripCost, also none for a while after drafting trips that gave their tokens slower than
    plain trips do (a trip's seconds, drafting included, over the tokens it decided), where the
    drafting trips so far do too: a running mean of that figure (TripCost.WEIGHT for the newest).
    After the first such trip in a row the next trip drafts nothing, after the second the next 2,
    then 4, ... (at most MAX_COOLDOWN); a trip that paid ends it. The plain trips meanwhile keep the
    TripCost current. Until the TripCost has seen a plain trip, the coming trip is one (a probe).

    Why the mean as well: one trip whose drafts went wrong early is slow however well drafting
    pays; judged alone, it cost the next trip its drafts, and the same tokens took a different
    number of trips from run to run as the clock fell either side of the line. Why not the mean
    alone: it remembers the slow trips before a code edit's answer starts copying the prompt, and
    kept prompt lookup backing off through the copy (knot bench's code edit prompt).

    A blind source's drafts (no confidence of their own: prompt lookup) with a TripCost are cut to
    what pays in expectation (bound, gainful): the length of the most tokens per trip second, with
    each draft accepted at the generation's recent rate and each row at what the engine's rows
    cost, unless they copy a long match (COPY_EXTENT). Why: on a fresh completion the first
    lookups mostly fail, and the back-off's whole drafts, each row paid in the verify, left prompt
    lookup below speculation off where rows are costly (docs/lab/2026-12-07-prompt-lookup-bound.md,
    `knot bench`'s prompt lookup rows); where rows are cheap, or the drafts keep being
    accepted, the bound allows the whole length."""

    def __init__(self, max_draft: int, start: int | None = None, cost: TripCost | None = None,
                 blind: bool = False):
        self.max_draft = max_draft
        self.k = max_draft if start is None else min(start, max_draft)
        self.cost = cost
        self.blind = blind
        self.hits = 0.0    # drafts accepted, decayed by ACCEPT_DECAY a drafting trip (blind sources)
        self.misses = 0.0  # drafts rejected (at most one a trip), decayed alike
        self.failures = 0  # drafts in a row of which nothing was accepted
        self.slow = 0      # drafting trips in a row slower per token than a plain trip, the mean below too
        self.drafting_s: float | None = None  # drafting trips' seconds per decided token, a running mean
        self.cooldown = 0  # trips left that draft nothing
        self.skipped = 0   # trips that drafted nothing because of the back-off

    def next(self) -> int:
        """The draft length of the coming trip: 0 while backing off (that trip is counted) and for
        the probe of a TripCost that has seen no plain trip yet."""
        if self.cooldown > 0:
            self.cooldown -= 1
            self.skipped += 1
            return 0
        if self.cost is not None and self.cost.plain_s is None:
            return 0
        return self.k

    def bound(self, draft: Draft) -> Draft:
        """A blind source's draft cut to its gainful length, unless it copies a match of
        COPY_EXTENT tokens or more; any other draft as it is."""
        if not self.blind or self.cost is None or draft.extent >= COPY_EXTENT or len(draft.tokens) <= 1:
            return draft
        n = self.gainful()
        return draft if n >= len(draft.tokens) else Draft(draft.tokens[:n], extent=draft.extent)

    def acceptance(self) -> float:
        """A blind source's expected chance that a draft is accepted (ACCEPT_PRIOR, ACCEPT_DECAY)."""
        a, b = ACCEPT_PRIOR
        return (self.hits + a) / (self.hits + self.misses + a + b)

    def gainful(self) -> int:
        """The length up to k with the most expected tokens per trip second, at least 1: a trip of
        j drafts decides sum(p**i, i <= j) tokens in expectation and costs 1 + j * row share of a
        plain trip. At least 1, so that drafting resumes where acceptance comes back; whether to
        draft at all is the back-off's."""
        p, r = self.acceptance(), self.cost.row_share()
        best, best_j, tokens, chain = 0.0, 1, 1.0, 1.0
        for j in range(1, self.k + 1):
            chain *= p
            tokens += chain
            if tokens / (1.0 + j * r) > best:
                best, best_j = tokens / (1.0 + j * r), j
        return best_j

    def update(self, drafted: int, accepted: int, seconds: float | None = None) -> None:
        """After a trip that drafted `drafted` tokens and accepted `accepted` of them, in `seconds`
        (drafting included; None: not timed)."""
        if drafted == 0:
            return
        self.hits = ACCEPT_DECAY * self.hits + accepted
        self.misses = ACCEPT_DECAY * self.misses + (accepted < drafted)
        if accepted == drafted:
            self.k = min(self.max_draft, self.k + 2)
        else:  # a draft that failed whole halves the next one: its rows were paid for nothing
            self.k = max(1, self.k - 1 if accepted else self.k // 2)
        if accepted:
            self.failures = 0
        else:
            self.failures += 1
            self.cooldown = min(1 << (self.failures - 2), MAX_COOLDOWN) if self.failures > 1 else 0
        if self.cost is None or seconds is None or self.cost.plain_s is None:
            return
        per_token = seconds / (accepted + 1)
        m = self.drafting_s
        self.drafting_s = per_token if m is None else m + TripCost.WEIGHT * (per_token - m)
        if per_token > self.cost.plain_s and self.drafting_s > self.cost.plain_s:  # slower than plain trips
            self.slow += 1
            self.cooldown = max(self.cooldown, min(1 << (self.slow - 1), MAX_COOLDOWN))
        else:
            self.slow = 0


def verify(sampler: Sampler, rows: Sequence[Row] | np.ndarray, context: list[int], draft: Draft) -> tuple[list[int], int]:
    """rows: the k + 1 rows (common.sampling.Row; or logits (k + 1, vocab)) after context[-1] and
    after each of the k drafted tokens, masked where the generation is constrained (so a draft
    outside the mask is rejected: it has probability 0); a sampled draft model's are LogitsRows
    (its rule needs the whole distribution; shard_sampling.sample_spec asks for the full slices)
    -> (the tokens this trip decides: the accepted drafts, then the replacement or the bonus;
    how many drafts were accepted)."""
    k = len(draft.tokens)
    assert len(rows) == k + 1, f"{len(rows)} rows for {k} drafts"
    out: list[int] = []
    for j, d in enumerate(draft.tokens):
        hist = context + out
        pos = len(hist)
        if draft.q is None or sampler.params.greedy:
            t = sampler(rows[j], hist, pos)
            if t != d:
                return out + [t], j
        else:
            p, q = sampler.probs(rows[j], hist), draft.q[j]
            if not sampler.uniform(pos) * q[d] < p[d]:  # accepted with probability min(1, p(d) / q(d))
                r = np.maximum(p - q, 0.0)  # the residual
                if not r.any():  # p == q up to rounding, so p(d) < q(d) only by rounding: p is the residual
                    r = p
                with np.errstate(divide="ignore"):
                    return out + [sampler.draw(np.log(r), pos)], j
        out.append(d)
    return out + [sampler(rows[k], context + out, len(context) + k)], k
