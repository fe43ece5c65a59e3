"""logits -> token id.

The chain is llama.cpp's default order (common/sampling.cpp, without the samplers we lack):
    logit bias -> penalties -> top_k -> top_p -> min_p -> temperature -> dist
so top_p and min_p see temperature-1 probabilities, as in llama.cpp. temperature == 0 is
greedy: bias and penalties, then argmax (lowest id on ties), and no random draw.

The draw is the Gumbel-max trick: the token is argmax(z + g) over the kept tokens, where z are
the logits after the chain (already divided by the temperature) and g is Gumbel noise, so
P(token) = softmax(z). The noise is counter-based: g(id) is a pure function of (seed, stream,
position, id) (SplitMix64, below), never a generator's running state. Hence
  - the same seed, logits, history and position give the same token, in any order of calls;
  - a vocabulary slice can draw its own best argmax(z + g) over its ids, and the best of the
    slices' bests is exactly the token the whole vocabulary would give (shard-side sampling);
  - speculative decoding (common/speculative.py) verifying a drafted token at a position
    compares it with the token this sampler gives there: the output is the same with or
    without drafts, and the decisions at different positions use independent noise.
(llama.cpp draws with mt19937 from a running state, so seeded draws differ from its.)

What the sampler takes is a Row: one position's next-token distribution as an engine returns it.
    LogitsRow        the whole row of logits (the single process; the cluster's full slices)
    RowSummary       the shards' summary of it (common/shard_sampling.py; the cluster)
Each samples (Sampler(params)(row, history, position) calls row.sample), gives logprobs, and
applies a mask: row.masked(allowed), allowed a bool (vocab,) of the ids that may come next
(constrained decoding), is the row whose logits are -inf outside it, so a masked id has
probability 0 and the rest keep the chain above. A summary that cannot say what the masked whole
row would (shard_sampling.decide) sends the engine to the full slices.
"""
from __future__ import annotations

import functools
import math
from collections import Counter
from dataclasses import dataclass
from typing import Callable, Protocol, Sequence

import numpy as np


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0          # 0 = greedy
    top_k: int = 0                    # <= 0: off
    top_p: float = 1.0                # >= 1: off
    min_p: float = 0.0                # <= 0: off
    repetition_penalty: float = 1.0   # 1: off; logit / p if > 0 else logit * p
    presence_penalty: float = 0.0     # subtracted once from each token seen in the window
    frequency_penalty: float = 0.0    # subtracted per occurrence in the window
    penalty_last_n: int = 64          # window of history the penalties look at; 0: off, -1: all
    seed: int | None = None           # None: fresh entropy each Sampler
    logit_bias: tuple[tuple[int, float], ...] = ()  # (id, added to its logit), ids ascending; first in the chain

    def __post_init__(self):
        if self.temperature < 0 or not 0 < self.top_p or self.min_p < 0 or self.repetition_penalty <= 0:
            raise ValueError(f"invalid sampling params: {self}")
        ids = [i for i, _ in self.logit_bias]
        if ids != sorted(set(ids)) or any(i < 0 or not math.isfinite(b) for i, b in self.logit_bias):
            raise ValueError(f"invalid logit_bias (ascending distinct ids >= 0, finite biases): {self.logit_bias}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @functools.cached_property
    def bias_arrays(self) -> tuple[np.ndarray, np.ndarray]:
        """logit_bias as (ids intp, biases float32), built once per params, not once per token."""
        return (np.array([i for i, _ in self.logit_bias], np.intp),
                np.array([b for _, b in self.logit_bias], np.float32))

    @property
    def penalized(self) -> bool:
        return self.penalty_last_n != 0 and (self.repetition_penalty != 1.0 or self.presence_penalty != 0.0
                                             or self.frequency_penalty != 0.0)


def penalty_window(history: Sequence[int], p: SamplingParams) -> Counter:
    """token -> occurrences in the last p.penalty_last_n tokens of history (empty when penalties are off)."""
    if not p.penalized:
        return Counter()
    window = history if p.penalty_last_n < 0 else history[-p.penalty_last_n:]
    return Counter(int(t) for t in window)


def apply_logit_bias(logits: np.ndarray, p: SamplingParams) -> np.ndarray:
    """(vocab,) logits + p.logit_bias, on a copy (the same array when there is none)."""
    # ref: llama-sampling.cpp llama_sampler_logit_bias_apply (added, before every other sampler)
    if not p.logit_bias:
        return logits
    out = logits.copy()
    ids, biases = p.bias_arrays
    out[ids] += biases
    return out


def apply_penalties(logits: np.ndarray, history: Sequence[int], p: SamplingParams,
                    offset: int = 0) -> np.ndarray:
    """Repetition, frequency and presence penalties over the last p.penalty_last_n tokens.
    logits may be a vocabulary slice starting at id `offset`: ids outside it are skipped."""
    # ref: llama-sampling.cpp llama_sampler_penalties_apply
    counts = penalty_window(history, p)
    if not counts:
        return logits
    out = logits.copy()
    for tok, count in counts.items():
        i = tok - offset
        if not 0 <= i < out.shape[0]:
            continue
        x = out[i]
        # Dividing a negative logit would raise its probability: multiply those instead.
        x = x * p.repetition_penalty if x <= 0 else x / p.repetition_penalty
        out[i] = x - count * p.frequency_penalty - p.presence_penalty
    return out


def top_indices(x: np.ndarray, k: int) -> np.ndarray:
    """(n,) -> the indices of the k highest, in the order (-x, index): on a tie the lowest index first,
    so a slice's top k are the whole row's wherever they overlap (common/shard_sampling.py)."""
    n = x.shape[0]
    if k >= n:
        return np.argsort(-x, kind="stable")
    if k == 1:  # greedy's one candidate: argmax takes the lowest index of equal maxima (~25x argpartition)
        return np.array([np.argmax(x)], dtype=np.intp)
    kth = x[np.argpartition(-x, k - 1)[k - 1]]  # the k-th highest value
    above = np.flatnonzero(x > kth)  # fewer than k
    sel = np.concatenate([above, np.flatnonzero(x == kth)[:k - above.size]])  # ascending index within each
    return sel[np.argsort(-x[sel], kind="stable")] if sel.size > 1 else sel


def top_k(logits: np.ndarray, k: int) -> np.ndarray:
    if k <= 0 or k >= logits.shape[0]:
        return logits
    keep = top_indices(logits, k)  # ties at the k-th value: the lowest ids
    out = np.full_like(logits, -np.inf)
    out[keep] = logits[keep]
    return out


def softmax(logits: np.ndarray) -> np.ndarray:
    """(n,) scores, -inf = never -> (n,) float64 probabilities."""
    e = np.exp((logits - logits.max()).astype(np.float64))
    return e / e.sum()


def top_p(logits: np.ndarray, p: float) -> np.ndarray:
    """Keep the smallest set of highest tokens whose probability reaches p (at least one)."""
    if p >= 1.0:
        return logits
    order = np.argsort(-logits, kind="stable")
    cum = np.cumsum(softmax(logits)[order])
    n_keep = int(np.searchsorted(cum, p)) + 1   # first index where cum >= p, inclusive
    out = np.full_like(logits, -np.inf)
    keep = order[:n_keep]
    out[keep] = logits[keep]
    return out


def min_p(logits: np.ndarray, p: float) -> np.ndarray:
    """Keep tokens whose probability is at least p times the top one's."""
    # ref: llama_sampler_min_p_apply compares logits: logit >= max_logit + log(p).
    if p <= 0.0:
        return logits
    return np.where(logits >= logits.max() + np.log(p), logits, -np.inf)


def scale(x: np.ndarray, temperature: float) -> np.ndarray:
    """The kept logits divided by the temperature: float32, or float64 gaps to the best logit
    when x / T overflows float32 (inf - inf is NaN in a softmax), up or, for every kept logit
    (all negative, as a mask may leave them), down."""
    with np.errstate(over="ignore", divide="ignore", invalid="ignore"):
        t32 = np.float32(temperature)  # inf past float32's range: z is then 0, as x / T is (uniform)
        z = x / t32
        if t32 == 0 or (np.isinf(z.max()) and x.max() > -np.inf):
            z = (x.astype(np.float64) - x.max()) / temperature
    return z


# ---------------------------------------------------------------- counter-based noise
# One stream per kind of decision, so no two decisions at a position share their noise.
DRAW, ACCEPT, DRAFT = 0, 1, 2

# ref: SplitMix64 (Steele, Lea, Flood 2014; Vigna's splitmix64.c): state += GAMMA, then mix.
_MASK = (1 << 64) - 1
_GAMMA = 0x9E3779B97F4A7C15


def _mix64(z):
    """SplitMix64's output function, on a Python int or a uint64 array (wrapping arithmetic)."""
    if isinstance(z, int):
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK
        return z ^ (z >> 31)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def _stream_state(key: int, stream: int, position: int) -> int:
    return _mix64((_mix64((_mix64(key & _MASK) + stream * _GAMMA) & _MASK) + position * _GAMMA) & _MASK)


def uniform(key: int, stream: int, position: int, ids: np.ndarray) -> np.ndarray:
    """(n,) float64 in (0, 1), one per id: the ids-th outputs of a SplitMix64 seeded by (key, stream, position)."""
    s = np.uint64(_stream_state(key, stream, position))
    with np.errstate(over="ignore"):
        x = _mix64(s + (np.asarray(ids, dtype=np.uint64) + np.uint64(1)) * np.uint64(_GAMMA))
    return ((x >> np.uint64(11)).astype(np.float64) + 0.5) * 2.0 ** -53  # 53 bits, never 0 or 1


def gumbel(key: int, stream: int, position: int, ids: np.ndarray) -> np.ndarray:
    """(n,) float64 standard Gumbel noise, one per id."""
    return -np.log(-np.log(uniform(key, stream, position, ids)))


def gumbel_argmax(z: np.ndarray, key: int, stream: int, position: int, offset: int = 0) -> tuple[int, float]:
    """(id, z + g) of the best perturbed score over the finite entries of z; z may be a slice of
    the vocabulary starting at id `offset`. (-1, -inf) when nothing is kept."""
    kept = np.flatnonzero(np.isfinite(z))
    if kept.size == 0:
        return -1, float("-inf")
    v = z[kept].astype(np.float64) + gumbel(key, stream, position, kept + offset)
    i = int(np.argmax(v))
    return int(kept[i]) + offset, float(v[i])


@dataclass(frozen=True)
class TokenLogprobs:
    logprob: float  # log-probability of the sampled token under the model (raw logits, before sampling)
    top: tuple[tuple[int, float], ...]  # the most likely tokens and their logprobs, best first


class Row(Protocol):
    """One position's next-token distribution, as an engine returns it (module docstring)."""

    def sample(self, sampler: Sampler, history: Sequence[int], position: int) -> int:
        """The token the sampler takes here; history = the sequence up to this row's input token."""
        ...

    def logprobs(self, tid: int, top_n: int) -> TokenLogprobs:
        """log-softmax of tid and of the top_n best ids (raw logits: no bias, penalties or filters)."""
        ...

    def masked(self, allowed: np.ndarray) -> Row:
        """This row with the logits of the ids outside allowed (bool (vocab,)) at -inf."""
        ...


def mask_from_bitset(words: np.ndarray, vocab_size: int) -> np.ndarray:
    """A bitset of allowed ids (uint32 words, id i at bit i % 32 of word i // 32, as llguidance's
    token masks) -> bool (vocab_size,)."""
    bits = np.unpackbits(np.asarray(words, "<u4").view(np.uint8), bitorder="little")
    if bits.size < vocab_size:
        raise ValueError(f"a bitset of {bits.size} bits for a vocabulary of {vocab_size}")
    return bits[:vocab_size].astype(bool)


def row_masks(allowed: Callable[[Sequence[int]], np.ndarray | None] | None, seq: Sequence[int],
              n_rows: int) -> list[np.ndarray | None]:
    """allowed(sequence) -> bool (vocab,) | None (Generation.allowed; None: no constraint), for
    the n_rows rows whose input tokens end seq: row j's sequence is seq without its last
    n_rows - 1 - j tokens (a trip's drafts)."""
    if allowed is None:
        return [None] * n_rows
    return [allowed(seq[:len(seq) - (n_rows - 1 - j)]) for j in range(n_rows)]


def apply_masks(rows: Sequence[Row], masks: Sequence[np.ndarray | None]) -> list[Row]:
    return [r if m is None else r.masked(m) for r, m in zip(rows, masks)]


@dataclass(frozen=True, eq=False)
class LogitsRow:
    """The whole row: logits (vocab,) float32, -inf where a degraded shard or a mask left an id out."""
    logits: np.ndarray

    def sample(self, sampler: Sampler, history: Sequence[int], position: int) -> int:
        z = sampler.scores(self.logits, history)
        if not sampler.params.greedy:
            return sampler.draw(z, position)
        tid = int(np.argmax(z))  # the lowest id of equal maxima
        if z[tid] == -np.inf:
            raise ValueError("no token is kept: every logit is -inf")
        return tid

    def probs(self, sampler: Sampler, history: Sequence[int] = ()) -> np.ndarray:
        """(vocab,) float64: the distribution a token is drawn from (one-hot on the argmax when greedy)."""
        z = sampler.scores(self.logits, history)
        if sampler.params.greedy:
            out = np.zeros(z.shape[0], np.float64)
            out[int(np.argmax(z))] = 1.0
            return out
        return softmax(z)

    def logprobs(self, tid: int, top_n: int) -> TokenLogprobs:
        x = self.logits
        m = float(x.max())
        lse = m + float(np.log(np.exp(x - m, dtype=np.float64).sum()))
        top: tuple[tuple[int, float], ...] = ()
        if top_n > 0:
            idx = top_indices(x, min(top_n, x.shape[0]))  # on a tie the lowest id first, as the summaries
            idx = idx[x[idx] > -np.inf]  # an id of probability 0 (masked, degraded) is never among the best
            top = tuple((int(i), float(x[i]) - lse) for i in idx)
        return TokenLogprobs(float(x[tid]) - lse, top)

    def masked(self, allowed: np.ndarray) -> LogitsRow:
        assert allowed.shape == self.logits.shape and allowed.dtype == bool, f"{allowed.shape=} {allowed.dtype=}"
        return LogitsRow(np.where(allowed, self.logits, np.float32(-np.inf)))


def as_row(x: Row | np.ndarray) -> Row:
    """An array of logits (vocab,) is a LogitsRow; a Row is itself."""
    return LogitsRow(x) if isinstance(x, np.ndarray) else x


class Sampler:
    """Stateless but for its key: one per generated sequence."""

    def __init__(self, params: SamplingParams):
        self.params = params
        self.key = params.seed if params.seed is not None else int(np.random.default_rng().integers(1 << 63))

    def scores(self, logits: np.ndarray, history: Sequence[int] = ()) -> np.ndarray:
        """logits (vocab,) -> what the draw sees: the chain above, -inf outside the kept set, divided by T.
        Greedy: the penalized logits."""
        p = self.params
        x = apply_penalties(apply_logit_bias(np.asarray(logits, dtype=np.float32), p), history, p)
        if p.greedy:
            return x
        return scale(min_p(top_p(top_k(x, p.top_k), p.top_p), p.min_p), p.temperature)

    def probs(self, row: LogitsRow | np.ndarray, history: Sequence[int] = ()) -> np.ndarray:
        """(vocab,) float64: the distribution a token is drawn from (one-hot on the argmax when greedy)."""
        return as_row(row).probs(self, history)

    def draw(self, z: np.ndarray, position: int, stream: int = DRAW) -> int:
        """The Gumbel-max draw from softmax(z) at a position (z: scores, -inf = never)."""
        tid, _ = gumbel_argmax(z, self.key, stream, position)
        if tid < 0:
            raise ValueError("no token is kept: every score is -inf")
        return tid

    def uniform(self, position: int, stream: int = ACCEPT) -> float:
        return float(uniform(self.key, stream, position, np.zeros(1, np.int64))[0])

    def __call__(self, row: Row | np.ndarray, history: Sequence[int] = (), position: int | None = None) -> int:
        """A row (or logits (vocab,) f32), history = prompt + generated ids so far -> the next id, the
        token at `position` (default len(history)) of the sequence."""
        return as_row(row).sample(self, history, len(history) if position is None else position)
