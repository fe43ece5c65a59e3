"""Single-process Qwen2 runner: the whole model, weights resident, through the same phase code.

Used by `knot generate`, the llama.cpp oracle test and anything else that wants plain local
inference. Memory is not bounded here (that is the stations' job): the weights are mmap-backed
and, when they fit in `cache_budget_bytes`, dequantized to float32 once on first use, which
makes decode several times faster than re-dequantizing every step.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from math import prod
from typing import Callable, Sequence

import numpy as np

from common import qwen2
from common.generation import StopText
from common.kvcache import KVCache, prefill_chunks
from common.matmul import get_kernel
from common.quant import QTensor
from common.sampling import Sampler, SamplingParams
from common.tokenizer import Tokenizer

log = logging.getLogger(__name__)

DEFAULT_CACHE_BUDGET_BYTES = 8 << 30


@dataclass
class Generation:
    prompt_ids: list[int]
    token_ids: list[int]            # generated, without the end-of-generation token
    text: str                       # decoded generated text, cut before a stop string
    finish_reason: str              # "eos" | "stop" | "length"
    prefill_s: float = 0.0
    decode_s: float = 0.0
    timings: dict = field(default_factory=dict)

    @property
    def prefill_tok_s(self) -> float:
        return len(self.prompt_ids) / self.prefill_s if self.prefill_s > 0 else float("inf")

    @property
    def decode_tok_s(self) -> float:
        # The first generated token comes from the prefill logits; decode ran once per later token.
        n = max(0, self.timings.get("decode_steps", 0))
        return n / self.decode_s if self.decode_s > 0 else float("inf")


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
                 cache_budget_bytes: int = DEFAULT_CACHE_BUDGET_BYTES, kv_dtype=np.float32):
        """model: a deploy.knotfile.LocalModel. cache_f32=None: cache when the float32 weights
        fit in cache_budget_bytes and in half the available memory."""
        if model.header.architecture != "qwen2":
            raise ValueError(f"architecture {model.header.architecture!r}: only qwen2 is supported")
        self.model = model
        self.cfg = qwen2.Qwen2Config.from_hparams(model.header.hparams)
        self.head_name = qwen2.head_tensor_name(model.has_tensor)
        self.kv_dtype = kv_dtype
        self._tokenizer: Tokenizer | None = None
        self._weights: dict[str, QTensor] = {}
        f32_bytes = self.matmul_weights_f32_bytes()
        if cache_f32 is None:
            avail = _mem_available_bytes()
            cache_f32 = f32_bytes <= cache_budget_bytes and (avail is None or f32_bytes <= avail // 2)
        self.cache_f32 = cache_f32
        log.debug("float32 weight cache %s (%.2f GB)", "on" if cache_f32 else "off", f32_bytes / 1e9)

    @classmethod
    def open(cls, path, **kw) -> "LocalEngine":
        from deploy.knotfile import open_model
        return cls(open_model(path), **kw)

    @property
    def tokenizer(self) -> Tokenizer:
        if self._tokenizer is None:
            self._tokenizer = Tokenizer(self.model.tokenizer_data())
        return self._tokenizer

    # ------------------------------------------------------------------ weights

    def _matmul_weight_names(self) -> list[str]:
        names = [n for l in range(self.cfg.n_layer) for ph in qwen2.PHASES
                 for n in qwen2.phase_tensors(l, ph) if n.endswith(".weight") and "norm" not in n]
        return names + [self.head_name]

    def matmul_weights_f32_bytes(self) -> int:
        ents = self.model.header.tensors
        return sum(4 * prod(ents[n].shape) for n in self._matmul_weight_names() if n in ents)

    def weight(self, name: str) -> QTensor:
        """The tensor as stored (built once, a view of the mmap), or its float32 copy when the cache
        is on and no quantized kernel serves its type (2-D weights only)."""
        w = self._weights.get(name)
        if w is not None:
            return w
        w = self.model.tensor(name)
        if self.cache_f32 and len(w.shape) == 2 and w.ggml_type != "F32" and get_kernel(w.ggml_type) is None:
            a = np.ascontiguousarray(w.dequantize(), dtype=np.float32)   # (ne1, ne0)
            w = QTensor(name, "F32", w.shape, a.reshape(-1).view(np.uint8))
        self._weights[name] = w
        return w

    def load_phase(self, layer: int, phase: str) -> dict[str, QTensor]:
        # Absent tensors are left out so that the phase raises MissingTensorError naming them.
        return {n: self.weight(n) for n in qwen2.phase_tensors(layer, phase) if self.model.has_tensor(n)}

    # ------------------------------------------------------------------ forward

    def new_kv(self) -> KVCache:
        return KVCache(self.cfg.n_kv_head, self.cfg.head_dim, dtype=self.kv_dtype)

    def forward(self, tokens: Sequence[int], kv: KVCache, start_pos: int,
                all_logits: bool = False) -> np.ndarray:
        """One chunk at positions [start_pos, start_pos + T) -> logits (T or 1, vocab) f32."""
        cfg = self.cfg
        tokens = np.asarray(tokens, dtype=np.int64)
        T = tokens.shape[0]
        positions = np.arange(start_pos, start_pos + T, dtype=np.int64)
        emb = self.model.tensor(qwen2.TOKEN_EMBD)
        # One slice covers the whole vocabulary here, so an id outside it is an error, not the
        # all-zero row a shard returns for another shard's token.
        bad = tokens[(tokens < 0) | (tokens >= emb.n_rows)]
        if bad.size:
            raise ValueError(f"token ids {bad[:5].tolist()} outside the vocabulary [0, {emb.n_rows})")
        x = qwen2.embed(tokens, emb, 0, emb.n_rows)                   # (T, dim)
        h = qwen2.forward_range(cfg, x, 0, cfg.n_layer, self.load_phase, kv, positions)
        if not all_logits:
            h = h[-1:]                                                # (1, dim)
        h = qwen2.output_norm(cfg, h, self.model.tensor(qwen2.OUTPUT_NORM))
        return qwen2.lm_head(h, self.weight(self.head_name))          # (T|1, vocab)

    def prefill(self, tokens: Sequence[int], kv: KVCache, start_pos: int = 0,
                chunk_size: int | None = None, all_logits: bool = False) -> np.ndarray:
        """Chunked prefill (default chunk floor(P/2), as the seed says) -> logits (vocab,),
        or (P, vocab) with all_logits."""
        if len(tokens) == 0:
            raise ValueError("prefill of an empty prompt")
        outs = [self.forward(tokens[a:b], kv, start_pos + a, all_logits)
                for a, b in prefill_chunks(len(tokens), chunk_size)]
        return np.concatenate(outs, axis=0) if all_logits else outs[-1][0]

    def decode(self, token: int, kv: KVCache, pos: int) -> np.ndarray:
        """One token at position pos -> logits (vocab,)."""
        return self.forward([token], kv, pos)[0]

    # ------------------------------------------------------------------ generation

    def generate(self, prompt_ids: Sequence[int], params: SamplingParams = SamplingParams(),
                 max_tokens: int = 128, stop: Sequence[str] = (),
                 on_text: Callable[[str], None] | None = None,
                 chunk_size: int | None = None) -> Generation:
        """Sample up to max_tokens after the prompt; stop at an end-of-generation token or when
        the text contains a stop string (the text is cut before it). on_text gets the text as
        it becomes final: incomplete UTF-8 and possible stop-string prefixes are held back."""
        tok = self.tokenizer
        prompt_ids = [int(t) for t in prompt_ids]
        max_tokens = max(0, min(max_tokens, self.cfg.context_length - len(prompt_ids)))
        sampler = Sampler(params)
        kv = self.new_kv()
        history = list(prompt_ids)
        out_ids: list[int] = []
        detok = tok.stream(skip_special=True)
        stop_text = StopText(stop)
        finish = "length"

        def emit(s: str) -> None:
            if s and on_text is not None:
                on_text(s)

        t0 = time.perf_counter()
        logits = self.prefill(prompt_ids, kv, chunk_size=chunk_size) if max_tokens else None
        t1 = time.perf_counter()
        steps = 0
        for i in range(max_tokens):
            tid = sampler(logits, history)
            if tid in tok.eog_ids:
                finish = "eos"
                break
            out_ids.append(tid)
            history.append(tid)
            released, stopped = stop_text.push(detok.push(tid))
            emit(released)
            if stopped:
                finish = "stop"
                break
            if i + 1 < max_tokens:
                logits = self.decode(tid, kv, len(history) - 1)
                steps += 1
        emit(stop_text.finish(detok.flush()))
        if stop_text.stopped:
            finish = "stop"
        t2 = time.perf_counter()
        return Generation(prompt_ids, out_ids, stop_text.text, finish, prefill_s=t1 - t0, decode_s=t2 - t1,
                          timings={"prefill_s": t1 - t0, "decode_s": t2 - t1, "decode_steps": steps})
