"""Sampling on the shards: each vocabulary slice sends a summary of its logits, not the logits.

A shard (services/shard) turns its slice of a row of logits into
    - its `top` best candidates: ids and (penalized) logits, in the order (-logit, id);
    - its max and log-sum-exp (float64; the log-sum-exp NaN, not computed, when the sampler needs
      none: greedy or unfiltered draws without logprobs, where it was half of a 0.5B slice's summary);
    - with DRAW, its best Gumbel-perturbed score argmax(z + g) over all its ids, and that id's logit
(summarize below; the penalties are applied shard-side, each shard knowing its own ids). The
coordinator merges the slices of a row (merge) and decides the token from the summaries alone
(decide), exactly as common.sampling.Sampler would from the whole row:
    - greedy: the first merged candidate (the argmax, lowest id on ties);
    - top_k (k <= top): the first k merged candidates;
    - top_p: the cumulative probabilities (the log-sum-exp gives the denominator) over the prefix
      of the merged list that is known to be the global order's prefix ("trusted");
    - min_p: the candidates above max + log(min_p), when no slice held back one that high;
    - temperature: the Gumbel-max draw over the kept candidates, the same noise per id as the
      whole row's draw; with no filter at all, the best of the slices' own draws.
When the summaries cannot decide a row (top_p or min_p reaching past what a slice sent, x / T
overflowing float32, or a mask leaving too little: RowSummary.masked), decide returns None and
the caller fetches the full slices. What the shards are asked for (sample_spec) and whether their
summaries serve a trip (decided) are decided here too; the coordinator's ClusterEngine only calls them.

Why the trusted prefix: a slice that sent its top t of n > t ids holds back ids that all come after
its last sent one in the (-logit, id) order. The merged list is therefore the global order up to
and including the earliest such "last sent" candidate among the truncated slices, and no further.

Exactness: the same float32 logits, the same elementwise x / T and the same noise per id as the
whole row, so the tokens are the full-logit sampler's; the one rounding difference is top_p's
denominator (a sum of per-slice sums), which can move the cut only when a cumulative probability
lies within ~1e-15 of top_p.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

import numpy as np

from common import wire
from common.sampling import (DRAW, Sampler, SamplingParams, TokenLogprobs, apply_penalties, gumbel, gumbel_argmax,
                             min_p, scale, top_indices, top_p)

if TYPE_CHECKING:
    from common.generation import Generation

# stats columns of a slice's summary, per row (float64)
MAX, LSE, BEST_ID, BEST_SCORE, BEST_LOGIT = range(5)
N_STATS = 5


def row_history(history: Sequence[int], n_rows: int, j: int) -> Sequence[int]:
    """history ends at the last row's input token; row j of n_rows sees it without the last n_rows - 1 - j."""
    cut = n_rows - 1 - j
    return history[:len(history) - cut] if cut else history


def summarize(x: np.ndarray, offset: int, top: int, params: SamplingParams, key: int, history: Sequence[int],
              position: int, draw: bool, lse: bool = True) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """x (T, n) float32 logits of ids [offset, offset + n) -> ids (T, t) int32, logits (T, t) float32,
    stats (T, N_STATS) float64 with t = min(top, n). Row j's input token is at position + j: its
    token is drawn at position + j + 1, its penalties see row_history(history, T, j). lse=False
    leaves the LSE column NaN and skips its float64 exp over the whole slice."""
    T, n = x.shape
    t = min(top, n)
    ids = np.empty((T, t), np.int32)
    vals = np.empty((T, t), np.float32)
    stats = np.full((T, N_STATS), -np.inf, np.float64)
    stats[:, BEST_ID] = -1
    for j in range(T):
        r = apply_penalties(x[j], row_history(history, T, j), params, offset)  # (n,) f32
        idx = top_indices(r, t)
        ids[j], vals[j] = idx + offset, r[idx]
        m = float(r.max())
        stats[j, MAX] = m
        stats[j, LSE] = m + float(np.log(np.exp(r - m, dtype=np.float64).sum())) if lse else np.nan
        if draw:
            z = scale(r, params.temperature)
            if z.dtype == np.float32:  # else x / T overflowed: the coordinator sees it and fetches the slices
                tid, score = gumbel_argmax(z, key, DRAW, position + j + 1, offset)
                stats[j, BEST_ID], stats[j, BEST_SCORE], stats[j, BEST_LOGIT] = tid, score, r[tid - offset]
    return ids, vals, stats


@dataclass(frozen=True)
class SliceSummary:
    """One shard's reply for T rows (checked by the caller against its slice)."""
    vocab_start: int
    vocab_end: int
    ids: np.ndarray    # (T, t) int32, global ids, each row in (-logit, id) order
    logits: np.ndarray  # (T, t) float32
    stats: np.ndarray  # (T, N_STATS) float64

    def check(self, n_rows: int, lse: bool = True) -> str | None:
        """What is wrong with a peer's reply, or None (lse=False: its log-sum-exps were not asked for)."""
        if self.ids.ndim != 2:
            return f"candidate ids of {self.ids.ndim} dimensions, expected 2"
        T, t = self.ids.shape
        if (self.logits.shape != (T, t) or self.stats.shape != (T, N_STATS) or T != n_rows
                or not 1 <= t <= self.vocab_end - self.vocab_start):
            return f"shapes {self.ids.shape} {self.logits.shape} {self.stats.shape} for {n_rows} rows"
        if ((self.ids < self.vocab_start) | (self.ids >= self.vocab_end)).any():
            return f"candidate ids outside the slice [{self.vocab_start}, {self.vocab_end})"
        if not (np.isfinite(self.logits).all() and np.isfinite(self.stats[:, [MAX, LSE] if lse else [MAX]]).all()):
            return "non-finite candidate logits, max or log-sum-exp"
        best = self.stats[:, BEST_ID]
        if ((best != -1) & ((best < self.vocab_start) | (best >= self.vocab_end) | (best != np.floor(best)))).any():
            return "a best id outside the slice"
        return None

    @property
    def truncated(self) -> bool:
        return self.ids.shape[1] < self.vocab_end - self.vocab_start


@dataclass
class RowSummary:
    """One row of logits as the merged summaries of the slices that answered (a sampling.Row)."""
    ids: np.ndarray     # (m,) int64, every candidate, in (-logit, id) order
    logits: np.ndarray  # (m,) float32
    trusted: int        # ids[:trusted] is the prefix of the whole row's (-logit, id) order
    floors: np.ndarray  # (s,) float32: the last sent logit of each truncated slice
    max: np.float32     # of the whole row; NaN where unknown (a mask left no trusted candidate)
    lse: float          # log-sum-exp of the whole row (float64); NaN where not asked for (SampleSpec.lse) or unknown
    best: tuple[int, float, float] | None  # (id, z + g, logit) of the slices' best draw; None: not drawn
    vocab_size: int
    position: int       # where this row's token goes
    token: int | None = None  # decided (decide), set by the engine
    complete: bool = False  # set by masked(): every allowed id is a candidate, nothing held back

    def sample(self, sampler: Sampler, history: Sequence[int], position: int) -> int:
        """The Sampler's call on this row (history is applied shard-side)."""
        assert position == self.position, f"row for position {self.position} sampled at {position}"
        if self.token is None:
            self.token = decide(self, sampler.params, sampler.key)
            assert self.token is not None, "a row the summaries cannot decide reached the sampler"
        return self.token

    def logit(self, tid: int) -> float:
        hit = np.flatnonzero(self.ids == tid)
        if hit.size:
            return float(self.logits[hit[0]])
        assert self.best is not None and self.best[0] == tid, f"token {tid} is not among the candidates"
        return self.best[2]

    def serves(self, top_n: int | None) -> bool:
        """Whether logprobs(_, top_n) can be given (None: none asked for)."""
        return top_n is None or (not np.isnan(self.lse) and (top_n <= self.trusted or self.complete))

    def logprobs(self, tid: int, top_n: int) -> TokenLogprobs:
        """(log-softmax of tid, the top_n best with theirs); the engine asked for enough (serves)."""
        assert self.serves(top_n), f"{top_n} logprobs from {self.trusted} trusted candidates, lse {self.lse}"
        top = tuple((int(i), float(v) - self.lse) for i, v in zip(self.ids[:top_n], self.logits[:top_n]))
        return TokenLogprobs(self.logit(tid) - self.lse, top)

    def masked(self, allowed: np.ndarray) -> RowSummary:
        """The summary of the masked row, from this one's candidates alone:
            - the candidates: those allowed, in the same order; the trusted prefix: the allowed ones
              of this one's (the masked row's order is the whole order without the masked ids);
            - the max: the first trusted allowed candidate's logit (unknown if there is none);
            - the slices' best draw: kept if its id is allowed (the best of all is the best of the
              allowed then), else unknown;
            - complete when every allowed id is a candidate: then nothing of nonzero probability is
              held back, so the log-sum-exp is the candidates' and a draw may run over them.
        The slices' log-sum-exps are of unmasked logits: unknown otherwise (no logprobs, no top_p
        without top_k). decide returns None where this is not enough: the full slices, masked."""
        assert allowed.shape == (self.vocab_size,) and allowed.dtype == bool, f"{allowed.shape=} {allowed.dtype=}"
        keep = allowed[self.ids]
        ids, x = self.ids[keep], self.logits[keep]
        complete = ids.size == int(np.count_nonzero(allowed))
        trusted = ids.size if complete else int(np.count_nonzero(keep[:self.trusted]))
        lse = np.nan
        if complete and ids.size:
            m = float(x[0])
            lse = m + float(np.log(np.exp(x - np.float32(m), dtype=np.float64).sum()))
        best = self.best if self.best is not None and allowed[self.best[0]] else None
        return RowSummary(ids, x, trusted, self.floors[:0] if complete else self.floors,
                          x[0] if trusted else np.float32(np.nan), lse, best, self.vocab_size, self.position,
                          complete=complete)


def merge(slices: Sequence[SliceSummary], vocab_size: int, position: int) -> list[RowSummary]:
    """The slices that answered (at least one) -> one RowSummary per row; row j's token goes at position + j."""
    T = slices[0].ids.shape[0]
    out = []
    for j in range(T):
        ids = np.concatenate([s.ids[j].astype(np.int64) for s in slices])
        vals = np.concatenate([s.logits[j] for s in slices])
        order = np.lexsort((ids, -vals))  # (-logit, id)
        rank = np.empty_like(order)
        rank[order] = np.arange(order.size)
        trusted, end, floors = order.size, 0, []
        for s in slices:
            end += s.ids.shape[1]
            if s.truncated:
                trusted = min(trusted, int(rank[end - 1]) + 1)
                floors.append(s.logits[j, -1])
        maxes = np.array([s.stats[j, MAX] for s in slices])
        m = float(maxes.max())
        lse = m + float(np.log(np.exp(np.array([s.stats[j, LSE] for s in slices]) - m).sum()))
        best = None
        if all(s.stats[j, BEST_ID] >= 0 for s in slices):
            # the best score; on a tie the lowest id, as argmax over the whole row
            b = max(slices, key=lambda s: (s.stats[j, BEST_SCORE], -s.stats[j, BEST_ID]))
            best = (int(b.stats[j, BEST_ID]), float(b.stats[j, BEST_SCORE]), float(b.stats[j, BEST_LOGIT]))
        out.append(RowSummary(ids[order], vals[order], trusted, np.array(floors, np.float32), np.float32(m), lse,
                              best, vocab_size, position + j))
    return out


def decide(row: RowSummary, p: SamplingParams, key: int) -> int | None:
    """The token common.sampling.Sampler takes from the whole row, or None when the summaries cannot say."""
    if p.logit_bias:  # the slices' summaries are of unbiased logits: a biased id may be missing from them
        return None
    if p.greedy:
        return int(row.ids[0]) if row.trusted else None
    n = None  # kept: the first n merged candidates; None: the whole row
    if 0 < p.top_k < row.vocab_size:
        if p.top_k > row.trusted and not row.complete:
            return None
        n = min(p.top_k, row.trusted)
    if p.top_p < 1.0:
        if n is not None:
            n = int(np.flatnonzero(np.isfinite(top_p(row.logits[:n], p.top_p))).size)
        else:
            if np.isnan(row.lse):  # a masked row's, unless complete (RowSummary.masked)
                return None
            # probabilities of the whole row: exp(x - max) / sum, the sum from the slices' log-sum-exps
            prob = np.exp(row.logits[:row.trusted].astype(np.float64) - np.float64(row.max) - (row.lse - row.max))
            n = int(np.searchsorted(np.cumsum(prob), p.top_p)) + 1
            if n > row.trusted:
                return None
    if p.min_p > 0.0:
        if n is None:
            if not row.trusted:  # a masked row's max is unknown
                return None
            thr = row.max + np.log(p.min_p)  # min_p's threshold: the whole row's max + log(min_p)
            if (row.floors >= thr).any():
                return None  # a slice may hold back a token that high
            n = row.trusted
        kept = np.isfinite(min_p(row.logits[:n], p.min_p))
    elif n is None:
        if row.best is not None:
            return row.best[0]  # every token may be drawn: the best of the slices' own draws
        if not row.complete or not row.trusted:
            return None
        n = row.trusted  # a masked row whose every allowed id is a candidate: the draw over them
        kept = np.ones(n, bool)
    else:
        kept = np.ones(n, bool)
    ids, x = row.ids[:n][kept], row.logits[:n][kept]
    by_id = np.argsort(ids, kind="stable")  # argmax takes the first of equal scores: the lowest id, as the row
    ids, x = ids[by_id], x[by_id]
    z = scale(x, p.temperature)
    v = z.astype(np.float64) + gumbel(key, DRAW, row.position, ids)
    return int(ids[int(np.argmax(v))])


def sample_spec(gen: Generation, seq: Sequence[int], n_rows: int, sample_top: int, vocab_size: int,
                n_slices: int, masks: Sequence[np.ndarray | None] = ()) -> wire.SampleSpec | None:
    """What the shards (n_slices of them) send of each of n_rows rows (seq: the sequence up to the
    last row's input token), or None where the sampler needs the full slices: a sampled draft
    model's accept/reject rule (the whole distribution), logprobs of raw logits under penalties (the
    shards send penalized ones), more candidates than a shard may send, a logit bias (the
    coordinator applies it, so the wire to the shards stays as it is). sample_top: SHARD_SAMPLE_TOP
    (0: never summaries).

    masks: the rows' (Generation.allowed; None: unmasked). A masked row is summarized from the
    candidates alone (RowSummary.masked), so even greedy asks for sample_top of them (the best may
    be masked), and the slices' log-sum-exps, of unmasked logits, are not asked for. Logprobs and
    top_p without top_k need a complete masked summary: None when a mask allows more ids than the
    slices send candidates, which no summary of it can hold."""
    p = gen.sampling
    if sample_top == 0 or (gen.speculation.source == "draft_model" and not p.greedy) or p.logit_bias:
        return None
    if gen.logprobs is not None and p.penalized:
        return None
    masked = [m for m in masks if m is not None]
    # Greedy decides from each slice's best candidate alone; more are for logprobs, filters and masks.
    top = max(1, gen.logprobs or 0) if p.greedy and not masked else max(sample_top, p.top_k, gen.logprobs or 0)
    if top > wire.MAX_SAMPLE_TOP:
        return None
    top_k_cut = 0 < p.top_k < vocab_size
    needs_lse = gen.logprobs is not None or (not p.greedy and p.top_p < 1.0 and not top_k_cut)
    if needs_lse and masked and max(int(np.count_nonzero(m)) for m in masked) > top * n_slices:
        return None
    history: Sequence[int] = []
    if p.penalized:  # row j's window: the last penalty_last_n tokens up to its input
        history = seq if p.penalty_last_n < 0 else seq[-(p.penalty_last_n + n_rows - 1):]
    no_filter = not top_k_cut and p.top_p >= 1.0 and p.min_p <= 0.0
    # the log-sum-exps serve top_p's cut and logprobs only
    lse = (gen.logprobs is not None or (not p.greedy and p.top_p < 1.0)) and len(masked) < n_rows
    return wire.SampleSpec(top, p.temperature, gen.sampler_key, not p.greedy and no_filter,
                           p.repetition_penalty, p.frequency_penalty, p.presence_penalty,
                           p.penalty_last_n, tuple(history), lse)


def decided(rows: Sequence[RowSummary], gen: Generation) -> bool:
    """Decide every row's token (RowSummary.token) -> whether the summaries serve them all: each
    decided, and its logprobs known where asked for; False: fetch the full slices."""
    for r in rows:
        r.token = decide(r, gen.sampling, gen.sampler_key)
    return all(r.token is not None and r.serves(gen.logprobs) for r in rows)
