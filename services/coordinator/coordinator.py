"""The coordinator's side of a generation: the 400s before any work, admission, the metrics, and the
reply of POST /generate; the cluster as an engine is services/coordinator/cluster_engine.py.

    gen = coordinator.prepare(request)            # tokenize, check the context length (400s here)
    async for ev in coordinator.events(gen, ctx):  # common.generation's loop over ClusterEngine
        TokenEvent(id, text, logprobs)             # one per sampled token; text is what it released
        FinishEvent(reason, text)                  # last: "stop" | "length", plus any held-back tail

Each generation has its own request id, which names its KV session on every station. However the
generator ends (finished, failed, or closed early because the client went away), its `finally`
hands POST /release/<id> to ctx.wait_until, so the stations' KV caches are freed.
"""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
import uuid
from typing import AsyncIterator

import jinja2

from common import constraints
from common.generation import FinishEvent, Generation, TokenEvent, generate_events
from common.models import ModelConfig
from common.runtime import HttpError
from common.sampling import SamplingParams
from common.speculative import Drafter, PromptLookup, SpeculationParams, default_max_draft
from common.tokenizer import Tokenizer, TokenizerError, TooManyTokens
from services import tracing
from services.coordinator import subrequests
from services.coordinator.admission import Admission
from services.coordinator.cluster_engine import ClusterEngine, ClusterGeneration, StationCapacity
from services.coordinator.errors import InvalidParam
from services.coordinator.metrics import CoordinatorMetrics
from services.coordinator.params import GenerateRequest
from services.coordinator.pipeline import Hops, Pipeline, RequestTimeout, session_affinity
from services.drafter.drafter_client import DrafterClient, RemoteDraftModel

log = logging.getLogger(__name__)

GRAMMAR_CACHE = 32  # compiled grammars kept (Coordinator.constraint)


def summary(gen: ClusterGeneration) -> dict:
    """POST /generate's reply."""
    decode_s = gen.decode_s
    return {
        "id": gen.request_id,
        "text": gen.text,
        "tokens": gen.token_ids,
        "prompt_tokens": gen.prompt_ids,
        "finish_reason": gen.finish_reason,
        "usage": gen.usage(),
        "timings": {"time_to_first_token_ms": round(gen.prefill_s * 1e3, 3),
                    "decode_ms": round(decode_s * 1e3, 3),
                    "decode_tok_s": round(gen.decode_tok_s, 3) if gen.decode_steps and decode_s > 0 else None,
                    "hops": Hops(gen.hop_ms).summary(),
                    "speculation": gen.speculation_summary(),
                    "shard_sampling": {"summaries": gen.shard_sampled, "full_slices": gen.full_rows}},
        "shard_failure": gen.shard_failure,
        "degraded_shards": [d.as_json() for d in gen.degraded],
        "replays": gen.replays,
        # why it ended before max_tokens, when it did: "subrequests" (the plan's per-invocation limit)
        "limited_by": subrequests.LIMITED_BY if subrequests.limited(gen) else None,
        "subrequests": gen.subrequests.as_json() if gen.subrequests is not None else None,
    }



SHARD_FAILURE_HEADER = "X-Knot-Shard-Failure"  # the policy a generation ran under
DEGRADED_HEADER = "X-Knot-Degraded-Shards"  # "3:56976-75968,..." when shards were degraded around


def policy_headers(*gens: ClusterGeneration) -> dict[str, str]:
    """What every generation reply says in its headers: the shard-failure policy and, once the
    generations (a request's choices) have ended, the shards they were degraded around (a stream's
    headers go out before)."""
    out = {SHARD_FAILURE_HEADER: gens[0].shard_failure}
    missing = dict.fromkeys(f"{d.shard}:{d.vocab_start}-{d.vocab_end}" for gen in gens for d in gen.degraded)
    if missing:
        out[DEGRADED_HEADER] = ",".join(missing)
    if any(subrequests.limited(gen) for gen in gens):
        out[subrequests.LIMITED_HEADER] = subrequests.LIMITED_BY
    return out


class Coordinator:
    def __init__(self, settings, cfg: ModelConfig, tokenizer: Tokenizer, pipeline: Pipeline, model_id: str,
                 drafter: DrafterClient | None = None, capacity: list[StationCapacity] = (), knot_digest: str = ""):
        self.settings, self.cfg, self.tokenizer, self.pipeline = settings, cfg, tokenizer, pipeline
        self.model_id = model_id
        self.knot_digest = knot_digest  # SHA-256 of the served knot's header (common/knot.py)
        self.drafter_client = drafter
        # The longest sequence this cluster runs: the model's context, or less where a station's
        # memory budget cannot hold that many tokens' KV caches (prompt and completion together).
        self.capacity = min(capacity, key=lambda c: c.max_session_tokens, default=None)
        self.context_tokens = cfg.context_length
        if self.capacity is not None and self.capacity.max_session_tokens < cfg.context_length:
            self.context_tokens = self.capacity.max_session_tokens
        self.created = int(time.time())
        self.admission = Admission(settings.max_concurrent, settings.max_queued, settings.retry_after_s)
        self.metrics = CoordinatorMetrics(self.admission)
        self.engine = ClusterEngine(pipeline, self.metrics.observe_hop, settings.sample_top)
        self.station_memory: list[dict | None] = []  # each station's /stats "memory", last known
        self.station_prefix: list[dict | None] = []  # ... and "prefix_cache"
        self.in_flight: dict[str, ClusterGeneration] = {}  # by request id, while events() runs them
        self._grammars: dict[tuple, object] = {}  # compiled grammars (constraint()), least recent first

    def note_station_stats(self, stats: list[dict | None]) -> None:
        """Keep the stations' memory plans (at boot, and at each /metrics scrape for those that answered)."""
        old = self.station_memory + [None] * (len(stats) - len(self.station_memory))
        self.station_memory = [old[i] if s is None else s.get("memory") for i, s in enumerate(stats)]
        old = self.station_prefix + [None] * (len(stats) - len(self.station_prefix))
        self.station_prefix = [old[i] if s is None else s.get("prefix_cache") for i, s in enumerate(stats)]
        # prompt caching needs every station to keep blocks: a prompt resumed at one and not another
        # would be refused by it and run cold every time
        self.engine.prompt_caching = bool(self.station_prefix) and all(p and p.get("holds")
                                                                       for p in self.station_prefix)

    # -------------------------------------------------------- admission

    async def admit(self, gen: ClusterGeneration, n: int = 1) -> None:
        """Take the slots of a request's n generations (waiting in the queue, not past the deadline);
        429 when the queue is full, 504 when the deadline passes in it. Pair with release(n)."""
        t0 = time.perf_counter()
        try:
            async with asyncio.timeout(max(0.0, gen.deadline - time.monotonic())):
                await self.admission.acquire(n)
        except TimeoutError:
            raise RequestTimeout(f"request {gen.request_id}: its deadline of {gen.timeout_s:g} s (REQUEST_TIMEOUT_S) "
                                 f"passed while it waited for a slot") from None
        self.metrics.queue_wait.observe(time.perf_counter() - t0)

    def release(self, n: int = 1) -> None:
        self.admission.release(n)

    @contextlib.asynccontextmanager
    async def slot(self, gen: ClusterGeneration, n: int = 1) -> AsyncIterator[None]:
        await self.admit(gen, n)
        try:
            yield
        finally:
            self.release(n)

    # -------------------------------------------------------- before any work: the 400s

    def prepare(self, g: GenerateRequest) -> ClusterGeneration:
        """The request -> its generation, or a 400 before any work; its deadline starts here. CPU-bound
        (tokenizing), so the handlers run it off the event loop; it never tokenizes more than the
        context holds."""
        ctx_len = self.context_tokens
        outside = [t for t, _ in g.sampling.logit_bias if t >= self.cfg.vocab_size]
        if outside:
            raise InvalidParam(f"logit_bias: token id {outside[0]} is outside the vocabulary "
                               f"[0, {self.cfg.vocab_size})", "logit_bias")
        prompt_ids, _ = self.encode(g)
        n = len(prompt_ids)
        max_tokens = g.max_tokens if g.max_tokens is not None else ctx_len - n
        if n + max_tokens > ctx_len:
            raise InvalidParam(f"prompt of {n} tokens + max_tokens {max_tokens} exceeds {self._context_note()}; "
                               f"shorten the prompt or lower max_tokens", "max_tokens", "context_length_exceeded")
        timeout_s = self.settings.request_timeout_s
        compiled = self.constraint(g)
        return ClusterGeneration(prompt_ids, max_tokens, g.sampling, g.stop, g.logprobs, request_id=uuid.uuid4().hex,
                                 speculation=self.speculation(g, n), deadline=time.monotonic() + timeout_s,
                                 timeout_s=timeout_s, shard_failure=g.shard_failure or self.settings.shard_failure,
                                 cache_prompt=g.cache_prompt, affinity=session_affinity.get(),
                                 subrequests=subrequests.current(), trace=tracing.current(),
                                 allowed=compiled.start(n).allowed if compiled is not None else None)

    def constraint(self, g: GenerateRequest):
        """The request's grammar compiled for this model (common/constraints.py), or None; a 400
        naming its field where the host has no compiler or the grammar does not compile. The
        compiled grammars of recent requests are kept (agents send the same schema every turn)."""
        if g.grammar is None:
            return None
        compiler = constraints.compiler()
        if compiler is None:
            raise InvalidParam(f"{g.grammar_param}: constrained decoding is not available on this host (no grammar "
                               f"engine: llguidance does not run under Pyodide, so not on Cloudflare Workers)",
                               g.grammar_param)
        key = (g.grammar, compiler.name)
        compiled = self._grammars.get(key)
        if compiled is None:
            try:
                compiled = compiler.compile(g.grammar, self.tokenizer, self.cfg.vocab_size)
            except constraints.ConstraintError as e:
                raise InvalidParam(f"{g.grammar_param}: the grammar does not compile: {str(e)[:500]}",
                                   g.grammar_param) from None
            self._grammars[key] = compiled
            while len(self._grammars) > GRAMMAR_CACHE:
                self._grammars.pop(next(iter(self._grammars)))
        else:
            self._grammars[key] = self._grammars.pop(key)  # most recent last
        return compiled

    def prepare_choices(self, g: GenerateRequest, n: int) -> list[ClusterGeneration]:
        """prepare(g), and n - 1 more generations like it (the OpenAI endpoints' n): the same prompt
        ids and deadline, each its own request id (KV sessions). With a seed s, choice i samples
        with seed s + i (mod 2**64), so the choices differ and each is reproducible; without one,
        each draws its own."""
        if n > self.admission.max_active:
            raise InvalidParam(f"n={n}: the choices run side by side, each a generation, and this coordinator runs "
                               f"at most {self.admission.max_active} (MAX_CONCURRENT_REQUESTS)", "n")
        first = self.prepare(g)
        seed = g.sampling.seed

        def sampling(i: int) -> SamplingParams:
            return g.sampling if seed is None else dataclasses.replace(g.sampling, seed=(seed + i) % 2 ** 64)

        compiled = self.constraint(g)
        return [first] + [
            ClusterGeneration(list(first.prompt_ids), first.max_tokens, sampling(i), g.stop, g.logprobs,
                              request_id=uuid.uuid4().hex, speculation=first.speculation, deadline=first.deadline,
                              timeout_s=first.timeout_s, shard_failure=first.shard_failure,
                              cache_prompt=first.cache_prompt, affinity=first.affinity,
                              subrequests=first.subrequests,
                              allowed=compiled.start(len(first.prompt_ids)).allowed if compiled is not None else None)
            for i in range(1, n)]

    def encode(self, g: GenerateRequest, add_generation_prompt: bool = True) -> tuple[list[int], str]:
        """The request's prompt -> (its ids, the field they came from), or a 400: ids outside the
        vocabulary, a chat template's refusal, no tokens, or more than the context holds (found
        without tokenizing more than that). CPU-bound: off the event loop."""
        tok, ctx_len = self.tokenizer, self.context_tokens
        if g.prompt_ids is not None:
            prompt_ids, param = list(g.prompt_ids), "prompt"
            bad = [t for t in prompt_ids if not 0 <= t < self.cfg.vocab_size]
            if bad:
                raise InvalidParam(f"prompt token id {bad[0]} is outside the vocabulary [0, {self.cfg.vocab_size})",
                                   "prompt")
        else:
            param = "prompt" if g.messages is None else "messages"
            texts = [g.prompt or "", g.suffix or ""] if g.messages is None else [m.get("content") for m in g.messages]
            n_chars = sum(len(t) for t in texts if isinstance(t, str))
            # No token stands for more than max_token_bytes bytes, and a character is at least one.
            least = -(-n_chars // tok.max_token_bytes)
            if least >= ctx_len:
                raise self._too_long(f"the prompt is {n_chars} characters, so at least {least} tokens (no token of "
                                     f"this model is longer than {tok.max_token_bytes} bytes)", param)
            try:
                if g.messages is not None:
                    prompt_ids = tok.encode_chat(g.messages, add_generation_prompt, max_tokens=ctx_len - 1,
                                                 tools=g.tools.rendered if g.tools else None)
                elif g.suffix is not None:
                    prompt_ids = tok.encode_fim(g.prompt or "", g.suffix, max_tokens=ctx_len - 1)
                else:
                    prompt_ids = tok.encode_bounded(g.prompt or "", ctx_len - 1)
            except TooManyTokens as e:
                raise self._too_long(f"the prompt is more than {e.max_tokens} tokens", param) from None
            except (TokenizerError, jinja2.TemplateError) as e:
                if g.suffix is not None:  # the model has no fill-in-the-middle tokens
                    raise InvalidParam(f"suffix: {e}", "suffix") from None
                raise InvalidParam(f"messages: the chat template refused them: {e}", "messages") from None
        if not prompt_ids:
            raise InvalidParam("the prompt encodes to no tokens", param)
        if len(prompt_ids) >= ctx_len:
            raise self._too_long(f"the prompt is {len(prompt_ids)} tokens", param)
        return prompt_ids, param

    def speculation(self, g: GenerateRequest, n_prompt: int) -> SpeculationParams:
        """The request's speculation, or the server's (SPECULATION, SPEC_MAX_DRAFT): "auto" is, for
        greedy requests (whose output speculation does not change), the draft model where the
        cluster has a drafter whose KV budget holds the prompt (drafts stop where the sequence
        outgrows it: RemoteDraftModel) and that has not failed a generation within
        DRAFTER_TIMEOUT_S, else prompt lookup; off for sampled ones. Why the draft model first: it
        decodes code faster than prompt lookup and edits as fast (knot bench --draft-model)."""
        source = g.speculation.source if g.speculation.source != "auto" else self.settings.speculation
        d = self.drafter_client
        # the prompt, and a token more (None: a drafter that states no limit)
        holds = d is not None and (d.max_context_tokens is None or n_prompt < d.max_context_tokens)
        if source == "auto":  # not a drafter that failed a generation just now (DrafterClient.cooling)
            source = "off" if not g.sampling.greedy else "draft_model" if holds and not d.cooling() else \
                "prompt_lookup"
        if source == "draft_model" and d is None:
            raise InvalidParam("speculation source 'draft_model': this coordinator has no draft model (DRAFTER)",
                               "speculation")
        if source == "draft_model" and not holds:
            raise InvalidParam(f"speculation source 'draft_model': the prompt is {n_prompt} tokens, and the drafter's "
                               f"MEMORY_BUDGET_BYTES holds the KV cache of {d.max_context_tokens}, no room to draft after "
                               f"it (use prompt_lookup, or raise the drafter's budget)", "speculation")
        max_draft = g.speculation.max_draft or self.settings.max_draft or default_max_draft(source)
        return SpeculationParams(source, max_draft)

    def drafter(self, gen: Generation) -> Drafter | None:
        sp = gen.speculation
        if not sp.on:
            return None
        if sp.source == "draft_model":
            return RemoteDraftModel(self.drafter_client, self.metrics.observe_hop)
        return PromptLookup(sp.ngram_max, sp.ngram_min)

    def _context_note(self) -> str:
        if self.context_tokens == self.cfg.context_length:
            return f"the context length {self.context_tokens}"
        c = self.capacity
        return (f"the {self.context_tokens} tokens whose KV cache station {c.index}'s MEMORY_BUDGET_BYTES={c.budget_bytes} "
                f"holds (the model's context length is {self.cfg.context_length}; raise "
                f"STATION_MEMORY_BUDGET_BYTES or run more stations)")

    def _too_long(self, what: str, param: str) -> InvalidParam:
        return InvalidParam(f"{what}, and a sequence holds at most {self._context_note()}: no room for a "
                            f"completion; shorten the prompt", param, "context_length_exceeded")

    # -------------------------------------------------------- the loop

    async def events(self, gen: ClusterGeneration, ctx) -> AsyncIterator[TokenEvent | FinishEvent]:
        """common.generation's loop over the cluster, with the metrics and the KV release around it."""
        outcome = None
        t_last = 0.0
        counter, cost = gen.subrequests, self.engine.cost(gen)
        subrequests.enter(counter)  # and after every yield: a stream's reader may resume us from another task
        tracing.enter(gen.trace)
        subrequests.reserve(gen, counter, cost)
        self.in_flight[gen.request_id] = gen
        try:
            async with contextlib.aclosing(generate_events(self.engine, gen, self.tokenizer, time.perf_counter,
                                                           self.drafter(gen), self.engine.trip_cost)) as events:
                async for ev in events:
                    if isinstance(ev, TokenEvent):
                        now = time.perf_counter()
                        if len(gen.token_ids) == 1:
                            self.metrics.ttft.observe(now - gen.t0)
                        else:
                            self.metrics.itl.observe(now - t_last)
                        t_last = now
                    else:
                        outcome = gen.finish_reason
                    yield ev
                    subrequests.enter(counter)
                    tracing.enter(gen.trace)
        except BaseException as e:
            if outcome is None:
                outcome = "cancelled" if isinstance(e, (GeneratorExit, asyncio.CancelledError)) else "error"
                log.info("request %s %s after %d tokens: %s", gen.request_id, outcome, len(gen.token_ids),
                         type(e).__name__)
            raise
        finally:
            subrequests.enter(counter)
            tracing.enter(gen.trace)
            subrequests.finish(counter, cost)
            self.in_flight.pop(gen.request_id, None)
            # free the stations' KV caches (on the replicas it was pinned to), however we ended
            ctx.wait_until(self.pipeline.release(gen.request_id, gen.picks))
            if gen.speculation.source == "draft_model" and self.drafter_client.checked:  # (else it holds nothing)
                ctx.wait_until(self._release_draft(gen.request_id))
            self._count(gen, outcome or "cancelled")

    async def _release_draft(self, rid: str) -> None:
        try:
            await self.drafter_client.release(rid)
        except (HttpError, TimeoutError) as e:
            log.warning("release %s on the drafter failed: %s", rid, e)

    def _count(self, gen: Generation, outcome: str) -> None:
        m = self.metrics
        m.generations.labels(outcome).inc()
        m.tokens.labels("prompt").inc(len(gen.prompt_ids))
        m.tokens.labels("completion").inc(len(gen.token_ids))
        m.tokens.labels("prompt_cached").inc(gen.cached_prompt_tokens)
        if getattr(gen, "prompt_cache", ""):
            m.prompt_cache.labels(gen.prompt_cache).inc()
        if gen.replays:
            m.replays.inc(gen.replays)
        m.observe_speculation(gen)
        for d in gen.degraded:
            m.degradations.labels(str(d.shard), d.stage).inc()
