"""Typed calls to the drafter (services/drafter/handler.py), and the Drafter protocol over them."""
from __future__ import annotations

import asyncio
import json
import logging
import time
from typing import Any, Callable

import numpy as np

from common import wire
from common.runtime import BadGateway, Request
from common.sampling import softmax
from common.speculative import Draft, draft_key
from services.drafter.handler import SAMPLING_FIELDS
from services.peer import PEER_URL, call, get_json


log = logging.getLogger(__name__)

PRIME_CHUNK_TOKENS = 2048  # prompt tokens the drafter reads per /prime call


class DrafterClient:
    def __init__(self, binding: Any, timeout_s: float, max_context_tokens: int | None = None):
        self.binding, self.timeout_s = binding, timeout_s
        self.max_context_tokens = max_context_tokens  # the longest sequence it drafts for (its /stats)

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
        scores = envs[1].array if len(envs) > 1 else None
        if (scores is None) != sampling.greedy or (scores is not None and scores.shape[0] != len(tokens)):
            raise BadGateway(f"/draft: scores {None if scores is None else scores.shape} for {len(tokens)} ids "
                             f"of a {'greedy' if sampling.greedy else 'sampled'} request")
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


class RemoteDraftModel:
    """The Drafter and Primes protocols (common.speculative) over the drafter service.

    Drafts are cut to end at the longest sequence the drafter's KV budget holds (the client's
    max_context_tokens), and past it the trips draft nothing: what is generated does not depend on
    the drafts, and a /draft the drafter cannot hold would be its 413, failing the request."""

    def __init__(self, client: DrafterClient, observe: Callable[[str, float], None] | None = None):
        self.client = client
        self.observe = observe  # (hop name, s): the coordinator's hop histogram, as its Hops report there
        self.outgrown = False  # the sequence outgrew the drafter's limit (logged once)

    def prime(self, gen, prompt: list[int]) -> asyncio.Task:
        """The Primes protocol: the drafter reads the prompt while the stations do (a task, started now)."""
        return asyncio.ensure_future(self._prime(gen.request_id, list(prompt)))  # a copy: the caller's grows

    async def _prime(self, request_id: str, prompt: list[int]) -> None:
        # In calls of PRIME_CHUNK_TOKENS more each (the drafter keeps what it read): each call is
        # bounded in time, as a station's prefill chunk is, and other generations' drafts are
        # served between them. A call sends the whole prefix, whose head the drafter matches.
        for end in range(min(PRIME_CHUNK_TOKENS, len(prompt)), len(prompt) + PRIME_CHUNK_TOKENS, PRIME_CHUNK_TOKENS):
            await self.client.prime(request_id, prompt[:min(end, len(prompt))])

    async def propose(self, gen, context: list[int], k: int) -> Draft:
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
        tokens, scores = await self.client.draft(gen.request_id, context, k, gen.sampling, draft_key(gen))
        s = time.perf_counter() - t0  # the "draft" hop: in /generate's timings.hops beside the stations'
        gen.hop_ms.setdefault("draft", []).append(s * 1e3)
        if self.observe is not None:
            self.observe("draft", s)
        return Draft(tokens, None if scores is None else [softmax(z) for z in scores])
