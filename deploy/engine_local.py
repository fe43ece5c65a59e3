"""Single-process runner: the whole model, weights resident, through the same layer loop
(common/layers.py) and generation loop (common/generation.py) as the cluster.

Used by `knot generate`, the llama.cpp oracle test and anything else that wants plain local
inference. Memory is not bounded here (that is the stations' job): the weights are mmap-backed.
With copy_weights (`knot generate`, `knot bench`), those the C kernels take are copied on first use
into one arena on huge pages, where their products run faster. The others, when they fit in
`cache_budget_bytes`, are dequantized to float32 once on first use, which makes decode several
times faster than re-dequantizing every step.
"""
from __future__ import annotations

import logging
import time
import uuid
from math import prod
from typing import Callable, Sequence

import numpy as np

from common.generation import Generation, generate_events
from common.kvcache import PREFILL_CHUNK_TOKENS, KVCache, prefill_chunks
from common.layers import forward_tokens, phase_loader
from common.models import PhaseWeights, model_for
from common.ops import Ops
from common.quant import Arena, QTensor
from common.sampling import LogitsRow, Row, SamplingParams, apply_masks, row_masks
from common.speculative import (DRAFT_HEAD_IDS, Drafter, DraftModel, PromptLookup, SpeculationParams, TripCost,
                                draft_vocab_runs, narrows_head)
from common.sync import iterate_sync
from common.tokenizer import Tokenizer, special_ids

log = logging.getLogger(__name__)

DEFAULT_CACHE_BUDGET_BYTES = 8 << 30


def _mem_available_bytes() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


class LocalEngine:
    def __init__(self, model, *, cache_f32: bool | None = None,
                 cache_budget_bytes: int = DEFAULT_CACHE_BUDGET_BYTES, kv_dtype=None,
                 draft: "LocalEngine | None" = None, draft_head_ids: int = DRAFT_HEAD_IDS,
                 copy_weights: bool = False, ops: Ops | None = None):
        """model: a deploy.knotfile.LocalModel. ops: what it computes with (None: the process's,
        common.ops.installed(): the C kernels once deploy.kernels.install() ran). cache_f32=None: cache when the float32 weights
        fit in cache_budget_bytes and in half the available memory. copy_weights: the
        quantized weights the kernels take are copied out of the file's map into one Arena (on
        huge pages) on first use (or by load_weights()), when they fit in half the available memory:
        decode runs faster, at the cost of the copy and of memory (`knot generate` and `knot bench`
        ask for it; a library user's default is the map, zero copy). draft: a smaller model of the
        same vocabulary that drafts for this one (speculation source "draft_model"), its head
        scoring the ids below draft_head_ids and the special tokens (as the drafter's DRAFT_HEAD_IDS;
        0: every id). An architecture the model registry does not know raises
        common.models.UnknownArchitecture."""
        self.model = model
        self.trip_cost = TripCost()  # its plain trips' time, shared by its generations (speculation's back-off)
        self.draft = None
        if draft is not None:
            if draft.cfg.vocab_size != model_for(model.header).cfg.vocab_size:
                raise ValueError(f"the draft model's vocabulary ({draft.cfg.vocab_size}) is not this model's")
            runs = None
            if narrows_head(draft.cfg.vocab_size, draft_head_ids):
                types = draft.model.tokenizer_data().get("token_types") or []  # not a whole Tokenizer
                runs = draft_vocab_runs(draft.cfg.vocab_size, draft_head_ids, special_ids(types))
            # the last row's logits: all it uses
            self.draft = DraftModel(lambda t, kv, p: draft.forward(t, kv, p, vocab_runs=runs), draft.new_kv)
        self.arch = model_for(model.header, ops)
        self.cfg = self.arch.cfg
        self.head_name = self.arch.head_tensor(model.has_tensor)
        self.kv_dtype = kv_dtype
        self._tokenizer: Tokenizer | None = None
        self._weights: dict[str, QTensor] = {}
        self._load_phase = phase_loader(self.arch, lambda n: self.weight(n) if self.model.has_tensor(n) else None)
        self._sessions: dict[str, KVCache] = {}  # request id -> its KV cache, while it generates
        f32_bytes = self.matmul_weights_f32_bytes()
        if cache_f32 is None:
            avail = _mem_available_bytes()
            cache_f32 = f32_bytes <= cache_budget_bytes and (avail is None or f32_bytes <= avail // 2)
        self.cache_f32 = cache_f32
        log.debug("float32 weight cache %s (%.2f GB)", "on" if cache_f32 else "off", f32_bytes / 1e9)
        # The file's map sits on 4 KiB pages: each decode product streams its weights from DRAM, and
        # a copy on huge pages runs the products faster (common.quant.Arena). Only the types a kernel
        # takes: the others go to the float32 cache, or are dequantized per product.
        self._arena = None
        if copy_weights:
            ents = self.model.header.tensors
            sizes = {n: ents[n].length for n in self._matmul_weight_names()
                     if n in ents and ents[n].ggml_type in self.arch.ops.quantized_types}
            avail = _mem_available_bytes()
            if avail is not None and sum(sizes.values()) > avail // 2:
                log.info("weights: %.0f MB are more than half the available memory (%.0f MB), so they are "
                         "not copied onto huge pages: decode computes from the model file's map",
                         sum(sizes.values()) / 1e6, avail / 1e6)
            elif sizes:
                self._arena = Arena(sizes)

    def load_weights(self) -> None:
        """Copy every weight the kernels take into the arena now, which the first forward would do
        otherwise (so that its prefill's time is its own); logs what it took."""
        if self._arena is None:
            return
        t0 = time.perf_counter()
        for name in self._arena.names:
            self.weight(name)
        log.info("weights: %.0f MB copied out of the model file's map onto huge pages in %.1f s, where decode "
                 "runs faster (knot generate --no-weight-cache skips it)",
                 self._arena.nbytes / 1e6, time.perf_counter() - t0)

    @classmethod
    def open(cls, path, **kw) -> "LocalEngine":
        """The engine of a .knot or .gguf file, on the C kernels where they are built (as the
        services and the CLI run), so its numbers are theirs bit for bit."""
        from deploy import kernels
        from deploy.knotfile import open_model
        kernels.ensure_installed()
        return cls(open_model(path), **kw)

    @property
    def tokenizer(self) -> Tokenizer:
        if self._tokenizer is None:
            self._tokenizer = Tokenizer(self.model.tokenizer_data())
        return self._tokenizer

    # ------------------------------------------------------------------ weights

    def _matmul_weight_names(self) -> list[str]:
        names = [n for l in range(self.cfg.n_layer) for n in self.arch.layer_tensors(l)
                 if not self.arch.is_resident(n)]
        return names + [self.head_name]

    def matmul_weights_f32_bytes(self) -> int:
        ents = self.model.header.tensors
        return sum(4 * prod(ents[n].shape) for n in self._matmul_weight_names() if n in ents)

    def weight(self, name: str) -> QTensor:
        """The tensor as stored (built once, a view of the mmap, or its copy in the arena), or its
        float32 copy when the cache is on and no quantized kernel serves its type (2-D weights only)."""
        w = self._weights.get(name)
        if w is not None:
            return w
        w = self.model.tensor(name)
        if (self.cache_f32 and len(w.shape) == 2 and w.ggml_type != "F32"
                and w.ggml_type not in self.arch.ops.quantized_types):
            a = np.ascontiguousarray(w.dequantize(), dtype=np.float32)   # (ne1, ne0)
            w = QTensor(name, "F32", w.shape, a.reshape(-1).view(np.uint8))
        elif self._arena is not None and (copied := self._arena.copy(name, w.data)) is not None:
            w = QTensor(name, w.ggml_type, w.shape, copied)
        self._weights[name] = w
        return w

    def load_phase(self, layer: int, phase: str) -> PhaseWeights:
        return self._load_phase(layer, phase)

    # ------------------------------------------------------------------ forward

    def new_kv(self) -> KVCache:
        return self.arch.new_kv(self.kv_dtype)

    def forward(self, tokens: Sequence[int], kv: KVCache, start_pos: int,
                all_logits: bool = False, vocab_runs: Sequence[tuple[int, int]] | None = None) -> np.ndarray:
        """One chunk at positions [start_pos, start_pos + T) -> logits (T or 1, vocab) f32; with
        vocab_runs only those ids' are scored, the others' are -inf (common.layers.forward_tokens)."""
        return forward_tokens(self.arch, tokens, kv, start_pos, self.load_phase, self.model.tensor,
                              self.weight(self.head_name), all_logits, vocab_runs)

    def prefill(self, tokens: Sequence[int], kv: KVCache, start_pos: int = 0,
                chunk_size: int = PREFILL_CHUNK_TOKENS, all_logits: bool = False) -> np.ndarray:
        """Chunked prefill, in the cluster's chunks (common/kvcache.py) -> logits (vocab,), or
        (P, vocab) with all_logits."""
        if len(tokens) == 0:
            raise ValueError("prefill of an empty prompt")
        outs = [self.forward(tokens[a:b], kv, start_pos + a, all_logits)
                for a, b in prefill_chunks(len(tokens), chunk_size)]
        return np.concatenate(outs, axis=0) if all_logits else outs[-1][0]

    def decode(self, token: int, kv: KVCache, pos: int) -> np.ndarray:
        """One token at position pos -> logits (vocab,)."""
        return self.forward([token], kv, pos)[0]

    # ------------------------------------------------------------------ generation

    async def prompt_logits(self, gen: Generation, ids: list[int]) -> Row:
        """The Engine protocol (common.generation): from position 0, so a fresh KV cache."""
        kv = self._sessions[gen.request_id] = self.new_kv()
        out = self.prefill(ids, kv)
        gen.cached = len(ids)
        return apply_masks([LogitsRow(out)], row_masks(gen.allowed, ids, 1))[0]

    async def next_logits(self, gen: Generation, token: int, history: list[int]) -> Row:
        return (await self.verify_logits(gen, [token], history))[0]

    async def verify_logits(self, gen: Generation, tokens: list[int], context: list[int]) -> list[Row]:
        """The Engine protocol: the rows after each of tokens, one forward."""
        kv = self._sessions[gen.request_id]
        pos = len(context) - len(tokens)
        if kv.n_positions() > pos:  # an earlier trip's rejected drafts
            kv.truncate(pos)
        out = self.forward(tokens, kv, pos, all_logits=True)  # (len(tokens), vocab)
        gen.cached = pos + len(tokens)
        return apply_masks([LogitsRow(x) for x in out], row_masks(gen.allowed, context, len(tokens)))

    def generate(self, prompt_ids: Sequence[int], params: SamplingParams = SamplingParams(),
                 max_tokens: int = 128, stop: Sequence[str] = (),
                 on_text: Callable[[str], None] | None = None,
                 speculation: SpeculationParams = SpeculationParams()) -> Generation:
        """Sample up to max_tokens after the prompt (fewer if the context ends first); stop at an
        end-of-generation token or when the text contains a stop string (the text is cut before
        it). on_text gets the text as it becomes final: incomplete UTF-8 and possible stop-string
        prefixes are held back. speculation: drafts verified k at a time (common/speculative.py).
        Runs common.generation's loop in place, without an event loop."""
        prompt_ids = [int(t) for t in prompt_ids]
        max_tokens = max(0, min(max_tokens, self.cfg.context_length - len(prompt_ids)))
        gen = Generation(prompt_ids, max_tokens, params, tuple(stop), request_id=uuid.uuid4().hex,
                         speculation=speculation)
        try:
            drafter = self.drafter(speculation)
            for ev in iterate_sync(generate_events(self, gen, self.tokenizer, time.perf_counter, drafter,
                                                   self.trip_cost)):
                if ev.text and on_text is not None:
                    on_text(ev.text)
        finally:
            self._sessions.pop(gen.request_id, None)
            if self.draft is not None:
                self.draft.release(gen.request_id)
        return gen

    def drafter(self, speculation: SpeculationParams) -> Drafter | None:
        """What drafts for a generation with these params (None: no speculation)."""
        if not speculation.on:
            return None
        if speculation.source == "prompt_lookup":
            return PromptLookup(speculation.ngram_max, speculation.ngram_min)
        if self.draft is None:
            raise ValueError("speculation source 'draft_model' needs a draft model: LocalEngine(draft=...)")
        return self.draft
