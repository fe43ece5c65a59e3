"""The layer loop: layers [layer_start, layer_end) as (layer, phase) steps, written once.

Every runner goes through run_layers(): a station (weights from its warden or R2, kept or evicted
by its memory policy), the single process (deploy/engine_local.py, resident weights), and so the
in-process test cluster, whose stations are the real handlers. Per step:

    w = weights.load(layer, phase)        # a mapping name -> QTensor, or an awaitable of one
    state = model.run_phase(layer, phase, state, w, seqs)
    weights.done(layer, phase, w)         # evict, keep or release; also when the phase failed

so at most one phase's weights are needed at a time (seed section 2, the fluid-memory invariant).
A batch of sequences runs as one: x holds their rows back to back, seqs[i] = (kv_i, positions_i).
"""
from __future__ import annotations

import inspect
from types import MappingProxyType
from typing import Awaitable, Callable, Protocol, Sequence

import numpy as np

from common.kvcache import KVCache
from common.models import Model, PhaseWeights, Sequences
from common.quant import QTensor
from common.sync import run_sync


class Weights(Protocol):
    def load(self, layer: int, phase: str) -> PhaseWeights | Awaitable[PhaseWeights]: ...

    def done(self, layer: int, phase: str, w: PhaseWeights) -> None: ...


def steps(model: Model, layer_start: int, layer_end: int) -> list[tuple[int, str]]:
    """The (layer, phase) sequence of layers [layer_start, layer_end)."""
    if not 0 <= layer_start <= layer_end <= model.cfg.n_layer:
        raise ValueError(f"layer range [{layer_start}, {layer_end}) outside [0, {model.cfg.n_layer})")
    return [(layer, phase) for layer in range(layer_start, layer_end) for phase in model.phases]


async def run_layers(model: Model, x: np.ndarray, layer_start: int, layer_end: int, seqs: Sequences,
                     weights: Weights, compute: Callable[..., Awaitable] | None = None,
                     between: Callable[[], Awaitable[None]] | None = None) -> np.ndarray:
    """x (N, dim) -> (N, dim) f32 after layers [layer_start, layer_end); appends to every KV cache in seqs.

    compute(fn, *args) runs each phase's fn(*args) when given (a station runs it off the event loop
    while its next phase loads); None: in place. between() is awaited between two phases, with
    no weights held (a station runs other frames there)."""
    state = np.ascontiguousarray(x, dtype=np.float32)
    order = steps(model, layer_start, layer_end)
    for layer, phase in order:
        w = weights.load(layer, phase)
        if inspect.isawaitable(w):
            w = await w
        try:
            if compute is None:
                state = model.run_phase(layer, phase, state, w, seqs)
            else:
                state = await compute(model.run_phase, layer, phase, state, w, seqs)
        finally:
            weights.done(layer, phase, w)
        del w  # the next phase loads with this one's weights already let go
        if between is not None and (layer, phase) != order[-1]:
            await between()
    return state


class _Functions:
    """Weights from plain functions: load_phase(layer, phase) -> mapping; release(names) after each phase."""

    def __init__(self, model: Model, load_phase: Callable[[int, str], PhaseWeights],
                 release: Callable[[list[str]], None] | None):
        self.model, self.load, self.release = model, load_phase, release

    def done(self, layer: int, phase: str, w: PhaseWeights) -> None:
        if self.release is not None:
            self.release(self.model.phase_tensors(layer, phase))


def forward_range(model: Model, x: np.ndarray, layer_start: int, layer_end: int,
                  load_phase: Callable[[int, str], PhaseWeights], kv: KVCache, positions: Sequence[int],
                  release: Callable[[list[str]], None] | None = None) -> np.ndarray:
    """One sequence through layers [layer_start, layer_end) with weights at hand: x (T, dim) -> (T, dim) f32.

    positions (T,) are the absolute positions of x's rows; kv is the sequence's cache."""
    seqs = [(kv, np.asarray(positions, dtype=np.int64))]
    return run_sync(run_layers(model, x, layer_start, layer_end, seqs, _Functions(model, load_phase, release)))


def phase_loader(model: Model, get: Callable[[str], QTensor | None]) -> Callable[[int, str], PhaseWeights]:
    """load_phase over weights that stay at hand (the single process's, a drafter's): each (layer,
    phase)'s read-only mapping is built once, from get(name) (None: absent, left out so that the
    phase raises MissingTensorError naming it). Why: building it afresh took a dict, a list of names
    and their lookups per phase, four phases a layer, in every forward."""
    built: dict[tuple[int, str], PhaseWeights] = {}

    def load_phase(layer: int, phase: str) -> PhaseWeights:
        w = built.get((layer, phase))
        if w is None:
            named = ((n, get(n)) for n in model.phase_tensors(layer, phase))
            w = built[layer, phase] = MappingProxyType({n: t for n, t in named if t is not None})
        return w

    return load_phase


def forward_tokens(model: Model, tokens: Sequence[int], kv: KVCache, start_pos: int,
                   load_phase: Callable[[int, str], PhaseWeights], tensor: Callable[[str], QTensor],
                   head: QTensor, all_logits: bool = False,
                   vocab_runs: Sequence[tuple[int, int]] | None = None) -> np.ndarray:
    """The whole model, weights at hand: tokens at positions [start_pos, start_pos + T) -> logits
    (T, vocab) f32 with all_logits, else (1, vocab) of the last. tensor(name) gives the embedding
    table and the output norm, head the LM head (output.weight, or the tied embedding).

    vocab_runs: the id ranges [a, b) the head scores (a draft model's: common.speculative.
    draft_vocab_runs); the other ids' logits are -inf, so nothing samples them. Each scored logit
    is the bits of the whole head's."""
    tokens = np.asarray(tokens, dtype=np.int64)
    emb = tensor(model.TOKEN_EMBD)
    # One slice covers the whole vocabulary here, so an id outside it is an error, not the
    # all-zero row a shard returns for another shard's token.
    bad = tokens[(tokens < 0) | (tokens >= emb.n_rows)]
    if bad.size:
        raise ValueError(f"token ids {bad[:5].tolist()} outside the vocabulary [0, {emb.n_rows})")
    positions = np.arange(start_pos, start_pos + tokens.shape[0], dtype=np.int64)
    x = model.embed(tokens, emb, 0, emb.n_rows)                          # (T, dim)
    h = forward_range(model, x, 0, model.cfg.n_layer, load_phase, kv, positions)
    if not all_logits:
        h = h[-1:]                                                       # (1, dim)
    h = model.final_norm(h, tensor(model.OUTPUT_NORM))
    if vocab_runs is None:
        return model.lm_head(h, head)                                    # (T|1, vocab)
    out = np.full((h.shape[0], head.n_rows), -np.inf, dtype=np.float32)  # (T|1, vocab)
    for a, b in vocab_runs:
        out[:, a:b] = model.lm_head(h, head.rows(a, b))                  # (T|1, b - a)
    return out
