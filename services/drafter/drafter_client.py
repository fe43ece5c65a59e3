"""Typed calls to the drafter (services/drafter/handler.py), and the Drafter protocol over them."""
from __future__ import annotations

import asyncio
import json
import logging
import math
import time
from typing import Any, Callable

import numpy as np

from common import wire
from common.runtime import BadGateway, HttpError, Request
from common.sampling import softmax
from common.speculative import Draft, draft_key
from common.topology import TopologyError
from services.coordinator.pipeline import Hops
from services.drafter.handler import SAMPLING_FIELDS
from services.peer import PEER_URL, call, get_json


log = logging.getLogger(__name__)

PRIME_CHUNK_TOKENS = 1024  # prompt tokens the drafter reads per /prime call (each within DRAFTER_TIMEOUT_S)


class DrafterClient:
    def __init__(self, binding: Any, timeout_s: float, max_context_tokens: int | None = None, *, vocab_size: int):
        self.binding, self.timeout_s = binding, timeout_s  # DRAFTER_TIMEOUT_S
        self.max_context_tokens = max_context_tokens  # the longest sequence it drafts for (its /stats)
        self.vocab_size = vocab_size  # the served model's, which the drafter's must share (check())
        self.faulted_at = -math.inf  # time.monotonic() of its last fault (RemoteDraftModel)
        self.checked = False  # its /stats confirmed its vocabulary and gave max_context_tokens (check())

    def cooling(self) -> bool:
        """It failed a generation within the last timeout_s: `auto` leaves it out meanwhile, so a hung
        drafter costs one generation its timeout, not every generation (a dead one is restarted)."""
        return time.monotonic() - self.faulted_at < self.timeout_s

    async def draft(self, request_id: str, context: list[int], k: int, sampling, key: int
                    ) -> tuple[list[int], np.ndarray | None]:
        """Up to k ids after context, and for a sampled request the scores (k, vocab) each was drawn from."""
        body = {"request_id": request_id, "context": context, "k": k, "key": key,
                "sampling": {f: getattr(sampling, f) for f in SAMPLING_FIELDS}}
        resp = await call(self.binding, Request("POST", f"{PEER_URL}/draft", {"Content-Type": "application/json"},
                                                json.dumps(body).encode()), self.timeout_s)
        try:
            envs = wire.decode_envelopes(resp.body)
        except wire.WireError as e:
            raise BadGateway(f"/draft: malformed reply: {e}") from None
        tokens = envs[0].array
        if envs[0].mode != "draft" or tokens.dtype != np.int32 or tokens.ndim != 1 or len(tokens) > k:
            raise BadGateway(f"/draft: ids {tokens.dtype} {tokens.shape}, expected int32 (<= {k},)")
        # Why: the target checks each draft's choice, not its id. Under the sampled accept/reject
        # rule a negative id indexes numpy from the end (p[-5]), so it could be accepted and served.
        if len(tokens) and not (0 <= int(tokens.min()) and int(tokens.max()) < self.vocab_size):
            raise BadGateway(f"/draft: ids outside the vocabulary [0, {self.vocab_size}): "
                             f"{tokens[(tokens < 0) | (tokens >= self.vocab_size)][:4].tolist()}")
        scores = envs[1].array if len(envs) > 1 else None
        want = (len(tokens), self.vocab_size)
        if (scores is None) != sampling.greedy or (scores is not None and scores.shape != want):
            raise BadGateway(f"/draft: scores {None if scores is None else scores.shape} for {len(tokens)} ids "
                             f"of a {'greedy' if sampling.greedy else 'sampled'} request, expected "
                             f"{'none' if sampling.greedy else want}")
        if scores is not None:
            # -inf is a filtered token's score (probability 0); NaN or +inf would make the draft
            # distribution, and the residual drawn from on a rejection, NaN.
            if np.isnan(scores).any() or np.isposinf(scores).any():
                raise BadGateway("/draft: scores hold NaN or +inf")
            if not np.isfinite(scores).any(axis=-1).all():
                raise BadGateway("/draft: a row of scores has no finite score")
            # A draft its own scores rule out (-inf: q(d) = 0) would pass the accept rule u * q(d) < p(d)
            # whenever the target allows d at all: the output would lean towards what the drafter sent.
            if not np.isfinite(scores[np.arange(len(tokens)), tokens]).all():
                raise BadGateway("/draft: a drafted id has no probability under the scores it was drawn from")
        return tokens.tolist(), scores

    async def prime(self, request_id: str, context: list[int]) -> int:
        """Feed context into the request's KV cache on the drafter -> the tokens it fed."""
        body = json.dumps({"request_id": request_id, "context": context}).encode()
        resp = await call(self.binding, Request("POST", f"{PEER_URL}/prime", {"Content-Type": "application/json"},
                                                body), self.timeout_s)
        try:
            fed = resp.json()["fed"]
        except (ValueError, TypeError, KeyError):
            raise BadGateway(f"/prime: malformed reply {bytes(resp.body[:200])!r}") from None
        if not isinstance(fed, int) or isinstance(fed, bool) or not 0 <= fed <= len(context):
            raise BadGateway(f"/prime: fed {fed!r} of {len(context)} tokens")
        return fed

    async def release(self, request_id: str) -> bool:
        resp = await call(self.binding, Request("POST", f"{PEER_URL}/release/{request_id}"), self.timeout_s)
        return bool(resp.json().get("released"))

    async def stats(self, timeout_s: float | None = None) -> dict:
        return await get_json(self.binding, "/stats", self.timeout_s if timeout_s is None else timeout_s)

    async def check(self, timeout_s: float | None = None) -> None:
        """Ask /stats before the first draft: the drafter's model must share the served model's
        vocabulary (TopologyError), and the longest sequence its budget holds becomes
        max_context_tokens. HttpError or TimeoutError when it does not answer well."""
        stats = await self.stats(timeout_s)
        theirs, longest = stats.get("vocab_size"), stats.get("max_context_tokens")
        for name, v in (("vocab_size", theirs), ("max_context_tokens", longest)):
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise BadGateway(f"drafter /stats: {name} {v!r}, expected a positive integer")
        if theirs != self.vocab_size:
            raise TopologyError(f"the drafter's model has a vocabulary of {theirs} tokens, the served model "
                                f"{self.vocab_size}: a draft model must share the tokenizer")
        self.max_context_tokens, self.checked = longest, True


class RemoteDraftModel:
    """The Drafter and Primes protocols (common.speculative) over the drafter service.

    Drafts are cut to end at the longest sequence the drafter's KV budget holds (the client's
    max_context_tokens), and past it the trips draft nothing: what is generated does not depend on
    the drafts, and a /draft the drafter cannot hold would be its 413.

    A drafter fault (unreachable, timed out, an error or a malformed reply) does not fail the
    request either: that generation drafts no more, and says so (timings.speculation.drafter_error,
    a warning, knot_spec_drafter_faults_total). Its tokens are the same: greedy, every token is the
    target's argmax; sampled, each is drawn from the target's distribution with or without a draft.
    A drafter the coordinator could not check at its boot is checked (DrafterClient.check) by the
    first generation that drafts with it; until it passes, nothing is sent to it but /stats."""

    def __init__(self, client: DrafterClient, observe: Callable[[str, float], None] | None = None):
        self.client = client
        self.observe = observe  # (hop name, s): the coordinator's hop histogram, as its Hops report there
        self.outgrown = False  # the sequence outgrew the drafter's limit (logged once)

    def prime(self, gen, prompt: list[int]) -> asyncio.Task:
        """The Primes protocol: the drafter reads the prompt while the stations do (a task, started now)."""
        return asyncio.ensure_future(self._prime(gen, list(prompt)))  # a copy: the caller's grows

    async def _prime(self, gen, prompt: list[int]) -> None:
        # In calls of PRIME_CHUNK_TOKENS more each (the drafter keeps what it read): each call is
        # bounded in time, as a station's prefill chunk is, and other generations' drafts are
        # served between them. A call sends the whole prefix, whose head the drafter matches.
        if not await self._checked(gen):
            return
        try:
            for end in range(min(PRIME_CHUNK_TOKENS, len(prompt)), len(prompt) + PRIME_CHUNK_TOKENS,
                             PRIME_CHUNK_TOKENS):
                await self.client.prime(gen.request_id, prompt[:min(end, len(prompt))])
        except (HttpError, TimeoutError) as e:
            self._fault(gen, "/prime", e)

    async def _checked(self, gen) -> bool:
        if gen.drafter_error is not None:
            return False
        if not self.client.checked:
            try:
                await self.client.check()
            except (HttpError, TimeoutError, TopologyError) as e:
                self._fault(gen, "/stats", e)
                return False
        return True

    def _fault(self, gen, what: str, e: BaseException) -> None:
        self.client.faulted_at = time.monotonic()
        gen.drafter_error = f"{what}: {type(e).__name__}: {e}"
        log.warning("request %s: the drafter failed (%s); the generation goes on without drafts, with the "
                    "same tokens", gen.request_id, gen.drafter_error)

    async def propose(self, gen, context: list[int], k: int) -> Draft:
        if not await self._checked(gen):
            return Draft([], None)
        limit = self.client.max_context_tokens
        if limit is not None:
            k = min(k, limit - len(context) + 1)  # the drafter's cache holds context + k - 1
            if k <= 0:
                if not self.outgrown:
                    self.outgrown = True
                    log.info("request %s: %d tokens outgrow the drafter's %d; no more drafts", gen.request_id,
                             len(context), limit)
                return Draft([], None)
        t0 = time.perf_counter()
        try:
            tokens, scores = await self.client.draft(gen.request_id, context, k, gen.sampling, draft_key(gen))
        except (HttpError, TimeoutError) as e:
            self._fault(gen, "/draft", e)
            return Draft([], None)
        Hops(gen.hop_ms, self.observe).add("draft", t0)  # in /generate's timings.hops beside the stations'
        return Draft(tokens, None if scores is None else [softmax(z) for z in scores])
