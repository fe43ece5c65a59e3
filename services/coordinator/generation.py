"""One generation as an async generator of events, shared by every endpoint.

    gen = coordinator.prepare(request)          # tokenize, check the context length (400s here)
    async for ev in coordinator.events(gen, ctx):
        TokenEvent(id, text, logprobs)          # one per sampled token; text is what it released
        FinishEvent(reason, text)               # last: "stop" | "length", plus any held-back tail

Each generation has its own request id, which names its KV session on every station. However the
generator ends (finished, failed, or closed early because the client went away), its `finally`
hands POST /release/<id> to ctx.wait_until, so the stations' KV caches are freed.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from dataclasses import dataclass, field
from typing import AsyncIterator

import jinja2
import numpy as np

from common.generation import StopText
from common.kvcache import prefill_chunks
from common.qwen2 import Qwen2Config
from common.runtime import ServiceUnavailable
from common.sampling import Sampler
from common.tokenizer import Tokenizer, TokenizerError
from services.coordinator.admission import Admission
from services.coordinator.errors import InvalidParam
from services.coordinator.metrics import CoordinatorMetrics
from services.coordinator.params import GenerateRequest
from services.coordinator.pipeline import Degradation, Hops, Pipeline, SessionLost

log = logging.getLogger(__name__)

MAX_REPLAYS = 3


@dataclass(frozen=True)
class TokenLogprobs:
    logprob: float  # log-probability of the sampled token under the model (raw logits, before sampling)
    top: tuple[tuple[int, float], ...]  # the most likely tokens and their logprobs, best first


@dataclass(frozen=True)
class TokenEvent:
    id: int
    text: str  # the text this token released ("" while a stop string or a UTF-8 character is pending)
    logprobs: TokenLogprobs | None = None


@dataclass(frozen=True)
class FinishEvent:
    reason: str  # "stop" (end of generation token or stop string) | "length" (max_tokens)
    text: str  # the tail released at the end


@dataclass
class Generation:
    """One request's state, filled in while events() runs."""

    request: GenerateRequest
    rid: str
    prompt_ids: list[int]
    max_tokens: int
    hops: Hops
    out_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str = "length"
    degraded: list[Degradation] = field(default_factory=list)
    replays: int = 0
    t0: float = 0.0
    t_first: float = 0.0
    t_end: float = 0.0

    def usage(self) -> dict:
        return {"prompt_tokens": len(self.prompt_ids), "completion_tokens": len(self.out_ids),
                "total_tokens": len(self.prompt_ids) + len(self.out_ids)}

    def summary(self) -> dict:
        """POST /generate's reply."""
        n_decode = max(0, len(self.out_ids) - 1)
        decode_s = self.t_end - self.t_first
        return {
            "id": self.rid,
            "text": self.text,
            "tokens": self.out_ids,
            "prompt_tokens": self.prompt_ids,
            "finish_reason": self.finish_reason,
            "usage": self.usage(),
            "timings": {"time_to_first_token_ms": round((self.t_first - self.t0) * 1e3, 3),
                        "decode_ms": round(decode_s * 1e3, 3),
                        "decode_tok_s": round(n_decode / decode_s, 3) if n_decode and decode_s > 0 else None,
                        "hops": self.hops.summary()},
            "degraded_shards": [d.as_json() for d in self.degraded],
            "replays": self.replays,
        }


def token_logprobs(logits: np.ndarray, tid: int, top_n: int) -> TokenLogprobs:
    """logits (vocab,) float32, -inf where a shard is degraded -> log-softmax of tid and the top_n best."""
    m = float(logits.max())
    lse = m + float(np.log(np.exp(logits - m, dtype=np.float64).sum()))
    top: tuple[tuple[int, float], ...] = ()
    if top_n > 0:
        n = min(top_n, logits.shape[0])
        idx = np.argpartition(-logits, n - 1)[:n]
        idx = idx[np.argsort(-logits[idx], kind="stable")]
        top = tuple((int(i), float(logits[i]) - lse) for i in idx)
    return TokenLogprobs(float(logits[tid]) - lse, top)


class Coordinator:
    def __init__(self, settings, cfg: Qwen2Config, tokenizer: Tokenizer, pipeline: Pipeline, model_id: str):
        self.settings, self.cfg, self.tokenizer, self.pipeline = settings, cfg, tokenizer, pipeline
        self.model_id = model_id
        self.created = int(time.time())
        self.admission = Admission(settings.max_concurrent, settings.max_queued, settings.retry_after_s)
        self.metrics = CoordinatorMetrics(self.admission)

    # -------------------------------------------------------- admission

    async def admit(self) -> None:
        """Take a generation slot (waiting in the queue); 429 when the queue is full. Pair with release()."""
        t0 = time.perf_counter()
        await self.admission.acquire()
        self.metrics.queue_wait.observe(time.perf_counter() - t0)

    def release(self) -> None:
        self.admission.release()

    @contextlib.asynccontextmanager
    async def slot(self) -> AsyncIterator[None]:
        await self.admit()
        try:
            yield
        finally:
            self.release()

    # -------------------------------------------------------- before any work: the 400s

    def prepare(self, g: GenerateRequest) -> Generation:
        tok, ctx_len = self.tokenizer, self.cfg.context_length
        if g.prompt_ids is not None:
            prompt_ids, param = list(g.prompt_ids), "prompt"
            bad = [t for t in prompt_ids if not 0 <= t < self.cfg.vocab_size]
            if bad:
                raise InvalidParam(f"prompt token id {bad[0]} is outside the vocabulary [0, {self.cfg.vocab_size})",
                                   "prompt")
        elif g.messages is not None:
            param = "messages"
            try:
                prompt_ids = tok.encode_chat(g.messages)
            except (TokenizerError, jinja2.TemplateError) as e:
                raise InvalidParam(f"messages: the chat template refused them: {e}", "messages") from None
        else:
            prompt_ids, param = tok.encode(g.prompt or ""), "prompt"
        if not prompt_ids:
            raise InvalidParam("the prompt encodes to no tokens", param)
        n = len(prompt_ids)
        if n >= ctx_len:
            raise InvalidParam(f"the prompt is {n} tokens, and the context length is {ctx_len} tokens: no room "
                               f"for a completion; shorten the prompt", param, "context_length_exceeded")
        max_tokens = g.max_tokens if g.max_tokens is not None else ctx_len - n
        if n + max_tokens > ctx_len:
            raise InvalidParam(f"prompt of {n} tokens + max_tokens {max_tokens} exceeds the context length "
                               f"{ctx_len}; shorten the prompt or lower max_tokens", "max_tokens",
                               "context_length_exceeded")
        return Generation(g, uuid.uuid4().hex, prompt_ids, max_tokens, Hops(observe=self.metrics.observe_hop))

    # -------------------------------------------------------- the loop

    async def events(self, gen: Generation, ctx) -> AsyncIterator[TokenEvent | FinishEvent]:
        tok, g = self.tokenizer, gen.request
        sampler = Sampler(g.sampling)
        detok = tok.stream(skip_special=True)
        stop = StopText(g.stop)
        history = list(gen.prompt_ids)
        outcome = None
        gen.t0 = time.perf_counter()
        try:
            logits = await self._prefill(gen, history)
            gen.t_first = t_last = time.perf_counter()
            for i in range(gen.max_tokens):
                tid = sampler(logits, history)
                if tid in tok.eog_ids:
                    gen.finish_reason = "stop"
                    break
                lp = token_logprobs(logits, tid, g.logprobs) if g.logprobs is not None else None
                gen.out_ids.append(tid)
                history.append(tid)
                now = time.perf_counter()
                if i == 0:
                    self.metrics.ttft.observe(now - gen.t0)
                else:
                    self.metrics.itl.observe(now - t_last)
                t_last = now
                delta, stopped = stop.push(detok.push(tid))
                yield TokenEvent(tid, delta, lp)
                if stopped:
                    gen.finish_reason = "stop"
                    break
                if i + 1 == gen.max_tokens:
                    break
                logits = await self._next_logits(gen, tid, history)
            tail = "" if stop.stopped else stop.finish(detok.flush())
            gen.text, gen.t_end = stop.text, time.perf_counter()
            outcome = gen.finish_reason
            yield FinishEvent(gen.finish_reason, tail)
        except BaseException as e:
            if outcome is None:
                outcome = "cancelled" if isinstance(e, (GeneratorExit, asyncio.CancelledError)) else "error"
                log.info("request %s %s after %d tokens: %s", gen.rid, outcome, len(gen.out_ids),
                         type(e).__name__)
            raise
        finally:
            ctx.wait_until(self.pipeline.release(gen.rid))  # free the stations' KV caches, however we ended
            self._count(gen, outcome or "cancelled")

    def _count(self, gen: Generation, outcome: str) -> None:
        m = self.metrics
        m.generations.labels(outcome).inc()
        m.tokens.labels("prompt").inc(len(gen.prompt_ids))
        m.tokens.labels("completion").inc(len(gen.out_ids))
        if gen.replays:
            m.replays.inc(gen.replays)
        for d in gen.degraded:
            m.degradations.labels(str(d.shard), d.stage).inc()

    async def _next_logits(self, gen: Generation, tid: int, history: list[int]) -> np.ndarray:
        """Decode one token; when a station lost our session, replay everything so far as one prefill."""
        try:
            return await self._step(gen, tid, len(history) - 1)
        except SessionLost as e:
            gen.replays += 1
            if gen.replays > MAX_REPLAYS:
                raise ServiceUnavailable(f"request {gen.rid}: stations lost the session {gen.replays} times: {e}")
            log.warning("request %s: %s; replaying %d tokens", gen.rid, e, len(history))
            return await self._prefill(gen, history)

    async def _prefill(self, gen: Generation, ids: list[int]) -> np.ndarray:
        """The prompt in chunks (seed: floor(P/2)), pipelined through the stations."""
        rid, hops, degraded = gen.rid, gen.hops, gen.degraded
        chunks = prefill_chunks(len(ids))
        try:
            h = await self.pipeline.prefill(rid, ids, chunks, hops, degraded)
        except SessionLost:
            # A station restarted mid-prompt: our later chunks found no session. Once more from 0.
            h = await self.pipeline.prefill(rid, ids, chunks, hops, degraded)
        return await self.pipeline.logits(rid, h, len(ids) - 1, hops, degraded)

    async def _step(self, gen: Generation, tid: int, pos: int) -> np.ndarray:
        x = await self.pipeline.embed(gen.rid, [tid], pos, gen.hops, gen.degraded)
        h = await self.pipeline.stations_forward(gen.rid, "decode", pos, x, gen.hops)
        return await self.pipeline.logits(gen.rid, h, pos, gen.hops, gen.degraded)
