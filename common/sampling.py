"""logits -> token id.

The chain is llama.cpp's default order (common/sampling.cpp, without the samplers we lack):
    penalties -> top_k -> top_p -> min_p -> temperature -> dist
so top_p and min_p see temperature-1 probabilities, as in llama.cpp. temperature == 0 is
greedy: penalties, then argmax (lowest id on ties), and no random draw.
The draw uses numpy's Generator seeded from SamplingParams.seed: the same seed, logits and
history give the same tokens. (llama.cpp uses mt19937, so seeded draws differ from its.)
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Sequence

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

    def __post_init__(self):
        if self.temperature < 0 or not 0 < self.top_p or self.min_p < 0 or self.repetition_penalty <= 0:
            raise ValueError(f"invalid sampling params: {self}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def apply_penalties(logits: np.ndarray, history: Sequence[int], p: SamplingParams) -> np.ndarray:
    """Repetition, frequency and presence penalties over the last p.penalty_last_n tokens."""
    # ref: llama-sampling.cpp llama_sampler_penalties_apply
    if p.penalty_last_n == 0 or (p.repetition_penalty == 1.0 and p.presence_penalty == 0.0
                                 and p.frequency_penalty == 0.0):
        return logits
    window = history if p.penalty_last_n < 0 else history[-p.penalty_last_n:]
    if not len(window):
        return logits
    out = logits.copy()
    for tok, count in Counter(int(t) for t in window).items():
        x = out[tok]
        # Dividing a negative logit would raise its probability: multiply those instead.
        x = x * p.repetition_penalty if x <= 0 else x / p.repetition_penalty
        out[tok] = x - count * p.frequency_penalty - p.presence_penalty
    return out


def top_k(logits: np.ndarray, k: int) -> np.ndarray:
    if k <= 0 or k >= logits.shape[0]:
        return logits
    keep = np.argpartition(-logits, k - 1)[:k]
    out = np.full_like(logits, -np.inf)
    out[keep] = logits[keep]
    return out


def _probs(logits: np.ndarray) -> np.ndarray:
    e = np.exp((logits - logits.max()).astype(np.float64))
    return e / e.sum()


def top_p(logits: np.ndarray, p: float) -> np.ndarray:
    """Keep the smallest set of highest tokens whose probability reaches p (at least one)."""
    if p >= 1.0:
        return logits
    order = np.argsort(-logits, kind="stable")
    cum = np.cumsum(_probs(logits)[order])
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


class Sampler:
    """Stateful only in its random generator: one per generated sequence."""

    def __init__(self, params: SamplingParams):
        self.params = params
        self.rng = np.random.default_rng(params.seed)

    def __call__(self, logits: np.ndarray, history: Sequence[int] = ()) -> int:
        """logits (vocab,) f32, history = prompt + generated ids so far -> next id."""
        p = self.params
        x = apply_penalties(np.asarray(logits, dtype=np.float32), history, p)
        if p.greedy:
            return int(np.argmax(x))
        x = min_p(top_p(top_k(x, p.top_k), p.top_p), p.min_p)
        t32 = np.float32(p.temperature)
        with np.errstate(over="ignore", divide="ignore", invalid="ignore"):
            z = x / t32
            if t32 == 0 or np.isposinf(z).any():
                # A temperature so small that x / T overflows float32 (inf - inf is NaN in the softmax):
                # scale the gaps to the best logit instead, in float64 (-> one-hot on the best ties).
                z = (x.astype(np.float64) - x.max()) / p.temperature
        probs = _probs(z)
        return int(self.rng.choice(probs.shape[0], p=probs))
