"""The coordinator's hops: shards (embed, LM head) and the station chain, with their timings.

Seed section 3 merge with allSettled semantics: a shard that fails or times out gives zeros
for its tokens at the embedding and -inf logits for its slice at the head; the rest stay exact,
and the failure is logged and reported.

Every hop names the knot version the request works on (X-Knot-Etag), and every reply must name
the same one: a hop computed from another version, or one that refused over the knot's integrity,
fails the whole request with IntegrityFailure (503, services/peer.py). That is never degraded
around: a generation uses the bytes of one knot version or none.
"""
from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from common import wire
from common.runtime import BadGateway, HttpError, ServiceUnavailable
from common.shard_sampling import RowSummary, SliceSummary, merge
from common.topology import ShardSpec
from services.peer import IntegrityFailure
from services.shard.client import ShardClient
from services.station.client import SessionLost, StationClient

log = logging.getLogger(__name__)


@dataclass
class Hops:
    """Per-hop wall time of one request: name -> list of ms; each hop also goes to `observe` (s)."""

    ms: dict[str, list[float]] = field(default_factory=dict)
    observe: Callable[[str, float], None] | None = None

    def add(self, name: str, t0: float) -> None:
        s = time.perf_counter() - t0
        self.ms.setdefault(name, []).append(s * 1e3)
        if self.observe is not None:
            self.observe(name, s)

    def summary(self) -> dict:
        return {k: {"calls": len(v), "total_ms": round(sum(v), 3), "mean_ms": round(sum(v) / len(v), 3)}
                for k, v in self.ms.items()}


@dataclass
class Degradation:
    shard: int
    vocab_start: int
    vocab_end: int
    stage: str  # embed / logits
    error: str

    def as_json(self) -> dict:
        return {"shard": self.shard, "vocab_start": self.vocab_start, "vocab_end": self.vocab_end,
                "stage": self.stage, "error": self.error}


def _raise_integrity(results: list) -> None:
    """A shard that answered from another knot version fails the request: it is not degraded around."""
    for res in results:
        if isinstance(res, IntegrityFailure):
            raise res


class Pipeline:
    def __init__(self, stations: list, shards: list[tuple[ShardSpec, object]], dim: int, vocab_size: int,
                 shard_timeout_s: float, station_timeout_s: float, station_retry_s: float = 60.0,
                 knot_etag: str | None = None):
        """stations: service bindings, entry first; shards: (spec, binding) sorted by vocab_start,
        tiling [0, vocab). Each binding is called through its typed client, which pins every hop to
        knot_etag (None: not checked)."""
        self.knot_etag = knot_etag
        self.stations = [StationClient(b, station_timeout_s, knot_etag) for b in stations]
        self.shards = [(spec, ShardClient(b, shard_timeout_s, knot_etag)) for spec, b in shards]
        self.dim, self.vocab_size = dim, vocab_size
        self.station_retry_s = station_retry_s

    async def embed(self, rid: str, tokens: list[int], position: int, hops: Hops,
                    degraded: list[Degradation]) -> np.ndarray:
        """tokens (T,) -> (T, dim): sum of the partial embeddings of the shards that own a token."""
        ids = np.asarray(tokens, dtype=np.int32)
        frame = wire.Envelope(rid, "embed", position, position + len(tokens), ids)
        owners = [(s, c) for s, c in self.shards if ((ids >= s.vocab_start) & (ids < s.vocab_end)).any()]
        t0 = time.perf_counter()
        results = await asyncio.gather(*(shard.embed(frame) for _, shard in owners), return_exceptions=True)
        hops.add("embed", t0)
        _raise_integrity(results)
        out = np.zeros((len(tokens), self.dim), np.float32)  # (T, dim)
        for (spec, _), res in zip(owners, results):
            if isinstance(res, BaseException):
                self._degrade(spec, "embed", res, degraded)
                continue  # its tokens stay zero: wrong, but local (seed section 3)
            if res.array.shape != out.shape:
                self._degrade(spec, "embed", BadGateway(f"shape {res.array.shape}, expected {out.shape}"), degraded)
                continue
            out += res.array  # μ: elementwise sum of disjoint partials
        return out

    async def logits(self, rid: str, h: np.ndarray, position: int, hops: Hops,
                     degraded: list[Degradation]) -> np.ndarray:
        """h (T, dim) final normed hidden -> (T, vocab) logits, slices concatenated in vocab order."""
        frame = wire.Envelope(rid, "logits", position, position + h.shape[0], h)
        t0 = time.perf_counter()
        results = await asyncio.gather(*(shard.logits(frame) for _, shard in self.shards), return_exceptions=True)
        hops.add("logits", t0)
        _raise_integrity(results)
        out = np.full((h.shape[0], self.vocab_size), -np.inf, np.float32)  # (T, vocab)
        ok = 0
        for (spec, _), res in zip(self.shards, results):
            want = (h.shape[0], spec.n_rows)
            if not isinstance(res, BaseException) and res.array.shape != want:
                res = BadGateway(f"logits shape {res.array.shape}, expected {want}")
            if isinstance(res, BaseException):
                self._degrade(spec, "logits", res, degraded)  # its slice stays -inf: never sampled
                continue
            out[:, spec.vocab_start:spec.vocab_end] = res.array
            ok += 1
        if ok == 0:
            raise ServiceUnavailable("every shard failed at the LM head; no token can be sampled")
        return out

    async def sample(self, rid: str, h: np.ndarray, position: int, spec: wire.SampleSpec, hops: Hops,
                     degraded: list[Degradation]) -> list[RowSummary]:
        """h (T, dim) final normed hidden, the first row's input at position -> per row the merged
        summaries of the slices (common/shard_sampling.py), not their logits."""
        frame = wire.Envelope(rid, "logits", position, position + h.shape[0], h)
        t0 = time.perf_counter()
        results = await asyncio.gather(*(shard.sample(spec, frame) for _, shard in self.shards),
                                       return_exceptions=True)
        hops.add("logits", t0)  # the LM-head hop, whatever the shards send back
        _raise_integrity(results)
        slices = []
        for (spec_s, _), res in zip(self.shards, results):
            if not isinstance(res, BaseException):
                sl = SliceSummary(spec_s.vocab_start, spec_s.vocab_end, *(e.array for e in res))
                bad = sl.check(h.shape[0])
                if bad is None:
                    slices.append(sl)
                    continue
                res = BadGateway(f"sample reply: {bad}")
            self._degrade(spec_s, "logits", res, degraded)  # its slice is left out: never sampled
        if not slices:
            raise ServiceUnavailable("every shard failed at the LM head; no token can be sampled")
        return merge(slices, self.vocab_size, position + 1)

    async def stations_forward(self, rid: str, mode: str, position: int, x: np.ndarray, hops: Hops,
                               rewind: bool = False) -> np.ndarray:
        """x (T, dim) through every station in order -> the exit's final normed hidden: (1, dim) for a
        prefill, (T, dim) for a decode. rewind: the stations first drop their positions >= position."""
        h = x
        for i, st in enumerate(self.stations):
            h = await self._hop(i, st, rid, mode, position, h, hops, rewind)
        return h

    async def _hop(self, i: int, st, rid: str, mode: str, position: int, h: np.ndarray, hops: Hops,
                   rewind: bool = False) -> np.ndarray:
        """h (T, dim) through station i -> its output rows, timed as hop station_i."""
        t0 = time.perf_counter()
        out = await self._forward_one(i, st, wire.Envelope(rid, mode, position, position + h.shape[0], h, rewind))
        hops.add(f"station_{i}", t0)
        return out.array

    async def prefill(self, rid: str, ids: list[int], chunks: list[tuple[int, int]], hops: Hops,
                      degraded: list[Degradation]) -> np.ndarray:
        """A prompt's chunks [(a, b)] through the embedding and every station, pipelined (the
        seed's Wallington Rotation): chunk k+1 enters station 0 while chunk k runs on station 1.
        Each station still receives its chunks in order, as its KV cache needs. A chunk is
        embedded once the previous one has entered station 0, so at most about two chunks of
        activations are alive. -> the exit's (1, dim) for the last chunk."""
        entered = [asyncio.Event() for _ in chunks]                        # station 0 began chunk k
        done = [[asyncio.Event() for _ in chunks] for _ in self.stations]  # [station][chunk] finished

        async def run(k: int, a: int, b: int) -> np.ndarray:
            if k:
                await entered[k - 1].wait()
            h = await self.embed(rid, ids[a:b], a, hops, degraded)        # (T_k, dim)
            for i, st in enumerate(self.stations):
                if k:
                    await done[i][k - 1].wait()  # station i has taken chunk k-1 in full
                if i == 0:
                    entered[k].set()
                h = await self._hop(i, st, rid, "prefill", a, h, hops)
                done[i][k].set()
            return h

        tasks = [asyncio.ensure_future(run(k, a, b)) for k, (a, b) in enumerate(chunks)]
        try:
            return (await asyncio.gather(*tasks))[-1]
        except BaseException:
            # A failed chunk never sets its events: the later chunks would wait forever.
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            raise

    async def _forward_one(self, i: int, st: StationClient, frame: wire.Envelope) -> wire.Envelope:
        """One station hop. A station that cannot be reached (restarting) is retried with backoff
        for up to station_retry_s; once it is back it answers UnknownSession and we replay."""
        deadline = time.monotonic() + self.station_retry_s
        delay = 0.1
        while True:
            try:
                return await st.forward(frame)
            except ServiceUnavailable as e:
                if time.monotonic() + delay > deadline:
                    raise ServiceUnavailable(f"station {i} unreachable for {self.station_retry_s:.0f} s: {e}") from None
                log.warning("station %d unreachable (%s); retrying in %.1f s", i, e, delay)
                await asyncio.sleep(delay)
                delay = min(2 * delay, 2.0)

    async def release(self, rid: str) -> None:
        """Free the request's KV caches on every station (best effort, after the response)."""
        async def one(i: int, st: StationClient) -> None:
            try:
                await st.release(rid)
            except (HttpError, TimeoutError) as e:
                log.warning("release %s on station %d failed: %s", rid, i, e)

        await asyncio.gather(*(one(i, st) for i, st in enumerate(self.stations)))

    @staticmethod
    def _degrade(spec: ShardSpec, stage: str, err: BaseException, degraded: list[Degradation]) -> None:
        msg = f"{type(err).__name__}: {err}" if str(err) else type(err).__name__
        log.warning("shard %d [%d, %d) degraded at %s: %s", spec.index, spec.vocab_start, spec.vocab_end, stage, msg)
        degraded.append(Degradation(spec.index, spec.vocab_start, spec.vocab_end, stage, msg))
