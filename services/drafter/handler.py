"""Drafter: a small model of the same vocabulary (the 0.5B for the 1.5B) drafting tokens for
speculative decoding (common/speculative.py, DraftModel).

    POST /draft              JSON {"request_id", "context": [ids], "k", "sampling": {...}, "key"}
                             -> envelopes (mode draft): int32 drafted ids (k,), then, for a sampled
                             request, float32 (k, vocab): the scores each id was drawn from
    POST /prime              JSON {"request_id", "context": [ids]}: feed a prompt into the request's
                             KV cache ahead of its first /draft -> {"request_id", "fed": tokens fed}
                             Either is a 413 when the sequence's KV cache (context and drafts) cannot
                             fit the budget alone; to fit it, the least recently used sessions go.
    POST /release/<rid>      drop a request's KV cache
    GET  /stats

Env: KNOT_KEY (the draft model's .knot), DRAFT_HEAD_IDS (the ids its LM head scores: those below,
and the special tokens; common/speculative.py), MEMORY_BUDGET_BYTES (default 1 GiB: the whole
model, one forward's work and the sessions' KV caches; /stats max_context_tokens is the longest
sequence whose cache it holds, and the coordinator drafts with it only for sequences that fit);
binding KNOT_BUCKET.

Why a service of its own rather than a model inside the coordinator: the coordinator is a Worker
that must stay small and keep serving every request from one event loop, while a draft model holds
~400 MB and computes for ~20 ms per drafted token. Here its compute blocks nothing but drafting,
and it scales (or runs elsewhere) apart from the coordinator. The cost is one hop per trip: the k
tokens of a trip come from one call. The whole model is read from the bucket once at boot and
stays resident; sessions keep their KV caches between trips (a trip's rejected drafts are rewound
by the next call, which sends the context the drafts must follow).
"""
from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

import numpy as np

from common import wire
from common.knot import TOKENIZER_BLOB, decode_tokenizer_blob
from common.kvcache import PREFILL_CHUNK_TOKENS
from common.layers import forward_tokens, phase_loader
from common.quant import QTensor, huge_buffer
from common.runtime import BadRequest, Env, NotFound, Request, Response, ServiceUnavailable
from common.sampling import SamplingParams
from common.settings import read
from common.speculative import DRAFT_HEAD_IDS, MAX_DRAFT, DraftModel, draft_vocab_runs, narrows_head
from common.tokenizer import special_ids
from services.boot import BootCache
from services.knot_source import KnotSource
from services.offload import off_loop

log = logging.getLogger(__name__)

BOOT_READ_BYTES = 64 << 20  # one ranged read of the draft model's payload at boot
MIN_CONTEXT_TOKENS = 1024  # a drafter whose budget holds a shorter sequence's KV cache refuses to boot

SAMPLING_FIELDS = ("temperature", "top_k", "top_p", "min_p", "repetition_penalty", "presence_penalty",
                   "frequency_penalty", "penalty_last_n")


@dataclass(frozen=True)
class DrafterSettings:
    knot_key: str
    budget_bytes: int
    head_ids: int = DRAFT_HEAD_IDS

    @classmethod
    def from_env(cls, env: Env) -> "DrafterSettings":
        return cls(read(env, "KNOT_KEY", "drafter"), read(env, "MEMORY_BUDGET_BYTES", "drafter"),
                   read(env, "DRAFT_HEAD_IDS", "drafter"))


class Drafter:
    def __init__(self, settings: DrafterSettings, source: KnotSource):
        self.settings, self.source = settings, source
        self.tensors: dict[str, QTensor] = {}
        self.drafts = 0
        self.drafted = 0
        self.primes = 0
        self.primed_tokens = 0  # prompt tokens fed by /prime, ahead of the first draft
        # The model runs off the event loop, so /healthz, /stats and the other calls answer while a
        # prompt is read (2,048 tokens a call: seconds); one call at a time, because the sessions
        # and their caches are not for two threads at once.
        self._compute = asyncio.Lock()

    async def boot(self) -> None:
        """Every tensor of the draft model, resident: one ranged read of the payload."""
        header, self.model = await self.source.header(), await self.source.model()
        if header.payload_nbytes > self.settings.budget_bytes:
            raise ServiceUnavailable(f"draft model {self.settings.knot_key!r}: {header.payload_nbytes} bytes of "
                                     f"tensors exceed MEMORY_BUDGET_BYTES={self.settings.budget_bytes}")
        # (the KV caches' share is checked once the model is known, below)
        a = header.payload_offset
        # Filled in ranged reads, not kept as the one read's bytes: a numpy buffer of this size sits
        # on transparent huge pages, where the products run faster (common.quant.resident_copy), and
        # the boot's peak stays one read over the model rather than two copies of it.
        payload = huge_buffer(header.payload_nbytes)
        for start in range(0, header.payload_nbytes, BOOT_READ_BYTES):
            end = min(start + BOOT_READ_BYTES, header.payload_nbytes)
            payload[start:end] = np.frombuffer(await self.source.read(a + start, a + end), dtype=np.uint8)
        payload.flags.writeable = False  # as the read's bytes were: nothing may change weights in place
        for name, e in header.tensors.items():
            start, end = header.tensor_range(name)
            data = payload[start - a:end - a]
            # The bucket is not trusted: a flipped byte in the draft model would not change a served
            # token (the target checks every draft) but would make its drafts worthless in silence.
            self.source.verify(name, data)
            self.tensors[name] = QTensor(name, e.ggml_type, tuple(e.shape), data)
        head = self.tensors[self.model.head_tensor(lambda n: n in self.tensors)]

        load_phase = phase_loader(self.model, self.tensors.get)

        cfg = self.model.cfg
        specials = await self._special_ids(header) if narrows_head(cfg.vocab_size, self.settings.head_ids) else set()
        self.vocab_runs = draft_vocab_runs(cfg.vocab_size, self.settings.head_ids, specials)
        self.head_ids = cfg.vocab_size if self.vocab_runs is None else sum(b - a for a, b in self.vocab_runs)

        def forward(tokens: list[int], kv, pos: int) -> np.ndarray:  # -> (1, vocab): the last row only
            return forward_tokens(self.model, tokens, kv, pos, load_phase, self.tensors.__getitem__, head,
                                  vocab_runs=self.vocab_runs)

        # What the budget leaves for the sessions' KV caches, beside the tensors and one forward's
        # work: a prefill chunk's activations at the context's length, and the last row's scores
        # with the sampler's copies of them.
        n_layer = cfg.n_layer
        work = self.model.activation_bytes(PREFILL_CHUNK_TOKENS, cfg.context_length) + 8 * 4 * cfg.vocab_size
        kv_budget = self.settings.budget_bytes - header.payload_nbytes - work
        bound = self.model.new_kv().nbytes_bound
        self.draft_model = DraftModel(forward, self.model.new_kv, kv_budget_bytes=max(kv_budget, 0),
                                      kv_bound=lambda n: bound(n, n_layer), on_evict=self._evicted)
        self.max_context_tokens = min(self.draft_model.max_tokens(), cfg.context_length)
        need = min(MIN_CONTEXT_TOKENS, cfg.context_length)
        if self.max_context_tokens < need:
            raise ServiceUnavailable(
                f"draft model {self.settings.knot_key!r}: MEMORY_BUDGET_BYTES={self.settings.budget_bytes} leaves "
                f"{max(kv_budget, 0)} bytes for KV caches beside {header.payload_nbytes} bytes of tensors and "
                f"{work} of work, room for {self.max_context_tokens} tokens (at least {need} are needed)")

    async def _special_ids(self, header) -> set[int]:
        """The draft model's special tokens (control and user-defined: an end of text, code infill's
        markers), which its head scores whatever DRAFT_HEAD_IDS leaves out."""
        if TOKENIZER_BLOB not in header.blobs:
            log.warning("draft model %r has no tokenizer, so no special tokens are known: its head scores "
                        "only the ids below DRAFT_HEAD_IDS=%d", self.settings.knot_key, self.settings.head_ids)
            return set()
        blob = await self.source.read_tensor(TOKENIZER_BLOB)  # checked against the knot's crc32
        return special_ids(decode_tokenizer_blob(blob, header.blobs[TOKENIZER_BLOB].encoding).get("token_types") or [])

    def _evicted(self, request_id: str) -> None:
        log.warning("draft session %s dropped: the sessions' KV caches would exceed the %d bytes that "
                    "MEMORY_BUDGET_BYTES leaves them (it is fed again from its context if it drafts again)",
                    request_id, self.draft_model.kv_budget_bytes)

    async def draft(self, body: dict) -> list[wire.Envelope]:
        rid, context, k, sampling, key = _draft_request(body, self.model.cfg.vocab_size)
        async with self._compute:
            tokens, scores = await off_loop(self.draft_model.draft, rid, context, k, sampling, key)
        self.drafts += 1
        self.drafted += len(tokens)
        n = len(context)
        out = [wire.Envelope(rid, "draft", n, n + len(tokens), np.asarray(tokens, np.int32))]
        if scores is not None:
            out.append(wire.Envelope(rid, "draft", n, n + len(tokens), np.stack(scores).astype(np.float32)))
        return out

    async def prime(self, body: dict) -> dict:
        rid, context = _request_context(body, self.model.cfg.vocab_size)
        async with self._compute:
            fed = await off_loop(self.draft_model.prefill, rid, context)
        self.primes += 1
        self.primed_tokens += fed
        return {"request_id": rid, "fed": fed}

    def stats(self) -> dict:
        dm = self.draft_model
        return {"knot_key": self.settings.knot_key, "sessions": len(dm.sessions), "kv_bytes": dm.kv_bytes,
                "kv_budget_bytes": dm.kv_budget_bytes, "max_context_tokens": self.max_context_tokens,
                "sessions_evicted": dm.sessions_evicted,
                "drafts": self.drafts, "drafted_tokens": self.drafted, "forwards": self.draft_model.forwards,
                "copied_drafts": self.draft_model.copies,
                "primes": self.primes, "primed_tokens": self.primed_tokens,
                "vocab_size": self.model.cfg.vocab_size, "head_ids": self.head_ids, **self.source.stats()}


def _request_context(body, vocab_size: int) -> tuple[str, list[int]]:
    if not isinstance(body, dict):
        raise BadRequest("the body must be a JSON object")
    rid, context = body.get("request_id"), body.get("context")
    if not isinstance(rid, str) or not rid:
        raise BadRequest("request_id must be a non-empty string")
    if not isinstance(context, list) or not context or not all(
            isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab_size for t in context):
        raise BadRequest(f"context must be a non-empty list of token ids in [0, {vocab_size})")
    return rid, context


def _draft_request(body, vocab_size: int) -> tuple[str, list[int], int, SamplingParams, int]:
    rid, context = _request_context(body, vocab_size)
    k, key = body.get("k"), body.get("key")
    if not isinstance(k, int) or isinstance(k, bool) or not 1 <= k <= MAX_DRAFT:
        raise BadRequest(f"k must be an integer in [1, {MAX_DRAFT}], got {k!r}")
    if not isinstance(key, int) or isinstance(key, bool) or not 0 <= key < 1 << 64:
        raise BadRequest(f"key must be an integer in [0, 2**64), got {key!r}")
    raw = body.get("sampling") or {}
    if not isinstance(raw, dict) or set(raw) - set(SAMPLING_FIELDS):
        raise BadRequest(f"sampling must be an object with fields among {', '.join(SAMPLING_FIELDS)}")
    try:
        sampling = SamplingParams(**raw)
    except (TypeError, ValueError) as e:
        raise BadRequest(f"sampling: {e}") from None
    return rid, context, k, sampling, key


_booted: BootCache[Drafter] = BootCache()


async def drafter_for(env: Env) -> Drafter:
    settings = DrafterSettings.from_env(env)

    async def boot() -> Drafter:
        d = Drafter(settings, KnotSource(env.KNOT_BUCKET, settings.knot_key))
        await d.boot()
        log.info("drafter booted: %s, %d tensors, its head scoring %d of %d ids", settings.knot_key,
                 len(d.tensors), d.head_ids, d.model.cfg.vocab_size)
        return d

    return await _booted.get(f"{settings.knot_key}|{settings.budget_bytes}|{settings.head_ids}", boot)


async def ready(env: Env) -> None:
    DrafterSettings.from_env(env)


async def fetch(request: Request, env: Env, ctx) -> Response:
    d = await drafter_for(env)
    path = request.path
    if path == "/draft" and request.method == "POST":
        return Response.from_bytes(wire.encode_envelopes(await d.draft(request.json())), wire.ENVELOPE_CONTENT_TYPE)
    if path == "/prime" and request.method == "POST":
        return Response.from_json(await d.prime(request.json()))
    if path.startswith("/release/") and request.method == "POST":
        rid = path[len("/release/"):]
        async with d._compute:  # not while a call changes the sessions in its thread
            released = rid in d.draft_model.sessions
            d.draft_model.release(rid)
        return Response.from_json({"request_id": rid, "released": released})
    if path == "/stats" and request.method == "GET":
        return Response.from_json({**d.stats(), "boots": _booted.boots})
    raise NotFound(f"{request.method} {path}: the drafter serves POST /draft, POST /prime, POST /release/<id>, "
                   "GET /stats")
