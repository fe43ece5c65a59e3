"""The cluster as an engine: ClusterEngine runs the Engine protocol (common/generation.py) over the
pipeline of stations and shards (services/coordinator/pipeline.py), and ClusterGeneration is a
generation's record plus what the hops need, with the frames the stations applied for an exact
replay. The coordinator (services/coordinator/coordinator.py) runs the generation loop over it.
"""
from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from common import wire
from common.generation import Generation
from common.kvcache import prefill_chunks
from common.prefix import PREFIX_BLOCK_TOKENS, block_keys, resume_at, reusable_blocks
from common.runtime import ServiceUnavailable
from common.sampling import LogitsRow, Row, apply_masks, row_masks
from common.shard_sampling import decided, sample_spec
from common.speculative import TripCost
from services import tracing
from services.coordinator import subrequests
from services.coordinator.pipeline import Call, Hops, Pipeline
from services.station.station_client import SessionLost

log = logging.getLogger(__name__)

MAX_REPLAYS = 3


@dataclass(frozen=True, slots=True)
class Frame:
    """One trip through the stations, as it ran, so a replay can run it again exactly."""

    mode: str  # "prefill" | "decode"
    start: int  # the first position it wrote
    end: int  # one past its last position
    rewind: bool  # the stations dropped what they held from `start` on first (an earlier trip's drafts)
    tokens: tuple[int, ...] = ()  # a decode trip's, drafts included; () for a prefill chunk (the prompt's)


@dataclass(eq=False)
class ClusterGeneration(Generation):
    """A generation on the cluster: the record, plus what the hops need (deadline, shard-failure
    policy) and the frames the stations applied, in order, for an exact replay."""

    deadline: float = math.inf  # time.monotonic() by which the request must end
    timeout_s: float = math.inf  # the deadline's length, for messages
    shard_failure: str = "fail"  # pipeline.SHARD_FAILURE_POLICIES
    frames: list[Frame] = field(default_factory=list)  # every trip the stations applied, in order
    subrequests: subrequests.Counter | None = None  # its invocation's (services/coordinator/subrequests.py)
    asked_tokens: int = 0  # max_tokens as asked; max_tokens itself may be bounded by the subrequests left
    trace: tracing.Scope | None = None  # where its hops record their spans (services/tracing.py)
    cache_prompt: bool = True  # may start after the blocks of its prompt the stations keep (prompt caching)
    prompt_cache: str = ""  # what prompt caching did for its prompt: hit, miss, none or off (metrics)
    picks: dict = field(default_factory=dict)  # the replicas it is pinned to (pipeline.Call.picks)
    affinity: bytes | None = None  # what chooses its station replicas (pipeline.ReplicaSet.choose)


class ClusterEngine:
    """The Engine protocol (common.generation) over the pipeline: the shards embed, the stations run
    the layers, the shards' LM-head slices give the logits. Per generation it keeps nothing but what
    the stations keep under gen.request_id; hops, degradations and replays go to the record.

    Exact replay: when a station lost the session (a restart), every frame the stations had applied
    runs again with the same boundaries, the prompt's chunks as prefill and then each decode trip
    with its tokens (drafts included) and rewinds, so the KV caches come back bit for bit and the
    tokens equal the fault-free run's (a replay that prefilled prompt + generated text in new chunks
    diverged at near-ties)."""

    def __init__(self, pipeline: Pipeline, observe_hop: Callable[[str, float], None] | None = None,
                 sample_top: int = 0):
        """sample_top: candidates per row each shard sends (SHARD_SAMPLE_TOP); 0: the shards send their
        full slices of logits and the coordinator samples from those."""
        self.pipeline, self.observe_hop, self.sample_top = pipeline, observe_hop, sample_top
        self.trip_cost = TripCost()  # its plain trips' time, shared by its generations (speculation's back-off)
        # Prompt caching: on when every station keeps blocks (the coordinator reads their /stats)
        self.prompt_caching = False

    def _call(self, gen: ClusterGeneration) -> Call:
        return Call(gen.request_id, Hops(gen.hop_ms, self.observe_hop), gen.deadline, gen.shard_failure,
                    gen.degraded, gen.timeout_s, gen.picks, gen.affinity, gen.trace, gen.subrequests)

    async def prompt_logits(self, gen: ClusterGeneration, ids: list[int]) -> Row:
        """The prompt in chunks of at most PREFILL_CHUNK_TOKENS (common.kvcache.prefill_chunks), pipelined
        through the stations. With prompt caching, the chunks start after the leading blocks every
        station keeps (common/prefix.py; one /prefix call to each); when a station no longer has
        them by the time the prompt reaches it, the prompt runs from position 0. Either way
        gen.frames records every chunk from 0: a replay computes the same KV caches without any
        cache."""
        chunks = prefill_chunks(len(ids))
        keys = block_keys(ids) if self.prompt_caching and gen.cache_prompt else None
        gen.prompt_cache = "off" if keys is None else "none"
        if gen.affinity is None and keys is not None and len(keys) > 1:
            gen.affinity = keys[1]  # its first block: prompts that share it find their blocks on the same replicas
        h = await self._cached_prefill(gen, ids, keys) if keys else None
        while h is None:
            try:
                h = await self.pipeline.prefill(self._call(gen), ids, chunks, keys)
            except SessionLost as e:  # a station restarted mid-prompt: our later chunks found no session
                self._replaying(gen, e, len(ids))
        gen.frames[:] = [Frame("prefill", a, b, False) for a, b in chunks]
        gen.cached = len(ids)
        row = (await self._rows(gen, h, len(ids) - 1, ids))[-1]
        self._bound(gen)
        return row

    async def _cached_prefill(self, gen: ClusterGeneration, ids: list[int], keys: list[bytes]) -> np.ndarray | None:
        """The prompt's chunks after the leading blocks every station keeps (common.prefix.resume_at)
        -> the exit's (1, dim); None when they keep none, or a station no longer held them when asked
        to resume (an eviction in between, a restart)."""
        j = resume_at(len(ids), await self.pipeline.cached_blocks(self._call(gen), keys, reusable_blocks(len(ids))))
        if j == 0:
            return None
        start = j * PREFIX_BLOCK_TOKENS
        try:
            h = await self.pipeline.prefill(self._call(gen), ids, prefill_chunks(len(ids), start=start), keys)
        except SessionLost as e:  # evicted since, or the station restarted
            gen.prompt_cache = "miss"
            log.info("request %s: the stations no longer hold its first %d prompt tokens (%s); prefilling from 0",
                     gen.request_id, start, e)
            return None
        gen.cached_prompt_tokens, gen.prompt_cache = start, "hit"
        return h

    async def next_logits(self, gen: ClusterGeneration, token: int, history: list[int]) -> Row:
        return (await self.verify_logits(gen, [token], history))[0]

    async def verify_logits(self, gen: ClusterGeneration, tokens: list[int], context: list[int]) -> list[Row]:
        """One trip for tokens (the last one and the drafts) -> their rows; the stations drop what they
        hold from their position on first (an earlier trip's rejected drafts). When a station lost our
        session, every frame the stations had applied runs again exactly (_replay), then this one."""
        pos = len(context) - len(tokens)
        frame = Frame("decode", pos, pos + len(tokens), gen.cached > pos, tuple(tokens))
        masks, spec = self._spec(gen, context, len(tokens))
        summaries = None  # the LM head's, when the step brought them
        try:
            h, summaries = await self.pipeline.step(self._call(gen), list(frame.tokens), frame.start, frame.rewind,
                                                    spec)
        except SessionLost as e:
            self._replaying(gen, e, pos)
            h = await self._replay(gen, context, [*gen.frames, frame])
        gen.frames.append(frame)
        gen.cached = pos + len(tokens)
        rows = await self._rows(gen, h, pos, context, (masks, spec), summaries)
        self._bound(gen)
        return rows

    def cost(self, gen: ClusterGeneration) -> subrequests.HopCost:
        """The most subrequests each of gen's hops costs the coordinator."""
        return subrequests.HopCost(len(self.pipeline.station_sets), len(self.pipeline.shard_sets),
                                   gen.speculation.source == "draft_model")

    def _bound(self, gen: ClusterGeneration) -> None:
        """After a trip: the tokens gen may still take within its invocation's subrequests."""
        subrequests.bound(gen, gen.subrequests, self.cost(gen), gen.speculation.max_draft if gen.speculation.on else 0)

    async def _forward(self, gen: ClusterGeneration, frame: Frame) -> np.ndarray:
        """One decode trip through the embedding and the stations -> the exit's rows (T, dim)."""
        call = self._call(gen)
        x = await self.pipeline.embed(call, list(frame.tokens), frame.start)  # (T, dim)
        return await self.pipeline.stations_forward(call, frame.mode, frame.start, x, frame.rewind)

    def _replaying(self, gen: ClusterGeneration, e: SessionLost, n_tokens: int) -> None:
        gen.replays += 1
        if gen.replays > MAX_REPLAYS:
            raise ServiceUnavailable(f"request {gen.request_id}: stations lost the session {gen.replays} times: {e}")
        log.warning("request %s: %s; replaying %d tokens", gen.request_id, e, n_tokens)

    async def _replay(self, gen: ClusterGeneration, context: list[int], frames: list[Frame]) -> np.ndarray:
        """Run `frames` again from position 0 -> the exit's rows after the last one: the prompt's
        chunks through the pipelined prefill as they first ran, then every decode trip (its drafts
        and rewinds included) alone, as it first ran."""
        while True:
            try:
                prefill = [(f.start, f.end) for f in frames if f.mode == "prefill"]
                h = await self.pipeline.prefill(self._call(gen), context, prefill)
                for f in frames:
                    if f.mode == "decode":
                        h = await self._forward(gen, f)
                return h
            except SessionLost as e:  # lost again during the replay: once more from position 0
                self._replaying(gen, e, len(context))

    def _spec(self, gen: ClusterGeneration, seq: list[int], n: int) -> tuple[list, wire.SampleSpec | None]:
        """The masks of n rows whose last input token ends seq, and what the shards are asked to
        summarize of them (None: the full slices)."""
        masks = row_masks(gen.allowed, seq, n)
        p = self.pipeline
        return masks, sample_spec(gen, seq, n, self.sample_top, p.vocab_size, len(p.shard_sets), masks)

    async def _rows(self, gen: ClusterGeneration, h: np.ndarray, pos: int, seq: list[int],
                    masks_spec: tuple | None = None, summaries: list | None = None) -> list[Row]:
        """h (T, dim), the first row's input token at pos, seq the sequence up to the last row's input
        token -> the rows the sampler takes, masked where gen is constrained: the shards' summaries
        when they decide every row's token (common/shard_sampling.py), else the full slices' logits.
        masks_spec: _spec's, when computed already; summaries: the shards', when the step brought them."""
        p, call = self.pipeline, self._call(gen)
        masks, spec = masks_spec or self._spec(gen, seq, h.shape[0])
        if spec is not None:
            rows = apply_masks(summaries if summaries is not None else await p.sample(call, h, pos, spec), masks)
            if decided(rows, gen):
                gen.shard_sampled += 1
                return rows
            gen.full_rows += 1  # top_p / min_p / a mask reached past what a slice sent: the full slices after all
        return apply_masks([LogitsRow(x) for x in await p.logits(call, h, pos)], masks)


@dataclass(frozen=True)
class StationCapacity:
    """What station `index` reports: the longest sequence whose KV caches fit its budget."""

    index: int
    max_session_tokens: int
    budget_bytes: int
