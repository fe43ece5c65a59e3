"""Layer station: runs layers [SPECIALIZATION_START_LAYER, SPECIALIZATION_END_LAYER) of the model.

    POST /forward            envelope (prefill | decode) -> envelope
                             entry/middle: (T, dim) hidden states out; exit/solo: the
                             output-normed hidden states of the last row of a prefill,
                             (1, dim), and of every row of a decode, (T, dim)
    POST /forward_many       several decode envelopes in one bundle (common/wire.py,
                             services/bundle.py): concurrent generations' steps, one forward
    POST /release/<rid>      drop a request's attention KV cache
    POST /prefix             16-byte block keys of a prompt (common/prefix.py), back to back ->
                             {"blocks": j}: the leading blocks its prompt cache holds
    GET  /stats              boot key, memory accounting, tensor sources, sessions

Env: KNOT_KEY, SPECIALIZATION_START_LAYER, SPECIALIZATION_END_LAYER, SPECIALIZATION_ROLE,
MEMORY_BUDGET_BYTES (default 128 MiB), MEMORY_PROFILE (worker | resident), RESIDENT_MAX_BYTES,
SESSION_TTL_S (default 600), MAX_BATCH (default 16), PREFETCH (on | off, default on), PREFIX_CACHE_BYTES;
bindings KNOT_BUCKET (R2) and LAYER_WARDEN (DO namespace, optional).

Speculative decoding: a decode frame may hold several rows (the last token and the drafts the
coordinator verifies in one trip). The next frame then says REWIND: its position may lie before
the session's end, and the positions from there on (the rejected drafts) are dropped first. Only
the positions of the last frame can be dropped: a rewind below its start, or past the session's
end, is refused as UnknownSession (the coordinator replays), so a stray frame never erases a prompt.

Prompt caching (services/station/prefix_store.py): a prefill frame that holds whole prompt blocks
(flag BLOCK) leaves a copy of their KV in the prompt cache, each under its block's key; a prefill
frame at position P > 0 whose session is missing, with the key of the tokens before it (flag
PREFIX), starts its session from the cached blocks of that prefix, or is refused as UnknownSession
when they are gone (the coordinator prefills from 0). POST /prefix tells the coordinator which leading blocks of
a prompt it holds. The cache is counted in the KV bytes and evicted before sessions;
PREFIX_CACHE_BYTES bounds it, and /stats "prefix_cache" says what it holds and did.

Batched decode: decode frames of different requests that arrive while a forward runs are
stacked into the next forward (services/batcher.py), so each weight is read once per step for
all of them; attention and the KV caches stay per session.

Fair scheduling (docs/api.md): a prefill frame of more than INTERLEAVE_ROWS rows pauses after
each phase of its layers while frames of at most that many rows wait (other generations' decode
steps, short prompts); they run there (services/batcher.py interject), so a decode step waits for
one phase of a long prompt's chunk, not the chunk. Each session's rows are computed as they would
be alone, so no token changes. An interjected frame whose KV caches and activations do not fit
the budget beside the paused one (its reservation and the activations it carries to its next
phase) waits for it to end instead.

Fluid memory (seed section 2): the layer loop (common/layers.py) loads, runs and evicts each
phase of each layer in turn. A phase's tensors stay only when the budget has room for them after
the activations and the KV caches (services/station/station_memory.py); with the default 128 MiB that
keeps a 0.5B's layers, while a 7B runs fluid. MEMORY_PROFILE=resident sizes the budget from the
knot instead, so the station's layers stay (plan_memory); /stats "memory" says what was decided.
A fluid station whose budget has room for two phases prefetches: phase i+1's tensors load from the
warden while phase i computes in a worker thread (services/station/station_memory.py, ForwardWeights).

The budget holds (docs/runtime.md, "Long prompts"): before a forward the station reserves what
its KV caches will hold afterwards and checks that the largest phase fits beside them. If it does
not, other sessions are evicted (least recently used first) until a pass of PASS_FLOOR_ROWS rows
fits; a prefill frame then runs in passes of as many rows as fit, a batch frame by frame. A frame
that cannot run even alone, one row at a time, is refused: 413 StationMemoryFull with the bytes.
/stats reports max_session_tokens, the longest sequence whose KV caches fit; the coordinator
refuses longer prompts before any work.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np

from common import wire
from common.knot import KnotHeader
from common.kvcache import KV_BLOCK_TOKENS, PREFILL_CHUNK_TOKENS, KVCache, largest
from common.layers import run_layers, steps
from common.matmul import DEFAULT_TILE_BYTES, tile_rows
from common.prefix import KEY_BYTES, PREFIX_BLOCK_TOKENS
from common.runtime import BadRequest, Conflict, Env, NotFound, Request, Response
from common.settings import ConfigError, default, read
from common.topology import TopologyError
from services.batcher import LATER, Batcher
from services.boot import BootCache
from services.bundle import serve_bundle
from services.knot_source import KNOT_ETAG_HEADER, KnotSource, read_pin, serving_version
from services.layer_warden.layer_warden_client import LayerWardenClient
from services.station.prefix_store import PrefixStore, block_bytes
from services.station.station_memory import (ForwardWeights, MemoryPlan, StationMemory, StationMemoryFull,
                                              describe_plan, plan_memory)
from services.station.tensors import PhaseLoader

log = logging.getLogger(__name__)

DEFAULT_BUDGET_BYTES = default("MEMORY_BUDGET_BYTES", "station")
DEFAULT_SESSION_TTL_S = default("SESSION_TTL_S", "station")
DEFAULT_MAX_BATCH = default("MAX_BATCH", "station")  # decode frames per batched forward
DEFAULT_INTERLEAVE_ROWS = default("INTERLEAVE_ROWS", "station")  # frames that run between a long prefill's phases
PASS_FLOOR_ROWS = 32  # idle sessions are evicted before a prefill runs in passes of fewer rows


class UnknownSession(Conflict):
    """409 with error "UnknownSession": the coordinator replays the prompt as a fresh prefill."""


@dataclass(frozen=True)
class StationSettings:
    knot_key: str
    layer_start: int
    layer_end: int
    role: str
    budget_bytes: int
    session_ttl_s: float
    max_batch: int = 16
    profile: str = "worker"
    resident_max_bytes: int | None = None
    prefetch: bool = True
    interleave_rows: int = DEFAULT_INTERLEAVE_ROWS
    prefix_cache_bytes: int | None = None  # None: from the plan (Station.prefix_capacity)

    @property
    def boot_key(self) -> str:
        # seed section 1: a change of any of these reboots the station
        return f"{self.knot_key}|{self.role}|{self.layer_start}-{self.layer_end}"

    @classmethod
    def from_env(cls, env: Env) -> "StationSettings":
        def get(name: str):
            return read(env, name, "station")

        s = cls(get("KNOT_KEY"), get("SPECIALIZATION_START_LAYER"), get("SPECIALIZATION_END_LAYER"),
                get("SPECIALIZATION_ROLE"), get("MEMORY_BUDGET_BYTES"), get("SESSION_TTL_S"), get("MAX_BATCH"),
                get("MEMORY_PROFILE"), get("RESIDENT_MAX_BYTES"), get("PREFETCH") == "on", get("INTERLEAVE_ROWS"),
                get("PREFIX_CACHE_BYTES"))
        if not 0 <= s.layer_start < s.layer_end:
            raise ConfigError(f"station layers [{s.layer_start}, {s.layer_end}) are empty or negative",
                              name="SPECIALIZATION_END_LAYER")
        return s


@dataclass
class Session:
    kv: KVCache
    length: int = 0
    floor: int = 0  # where the last frame began: a REWIND may drop positions back to here, no further
    last_used: float = 0.0


class Station:
    def __init__(self, settings: StationSettings, header: KnotHeader, loader: PhaseLoader, clock=time.monotonic):
        self.settings, self.header, self.loader, self.clock = settings, header, loader, clock
        self.model = loader.model
        self.cfg = self.model.cfg
        if settings.layer_end > self.cfg.n_layer:
            raise TopologyError(f"station layers [{settings.layer_start}, {settings.layer_end}) exceed the "
                                f"model's {self.cfg.n_layer} layers")
        self.emits_final = settings.role in ("exit", "solo")
        self.sessions: OrderedDict[str, Session] = OrderedDict()
        phase_bytes, tile_bytes = self._streamed_sizes()
        self.phase_bytes = max(phase_bytes, default=0)  # the largest phase's streamed tensors
        self.plan = self._plan(phase_bytes, tile_bytes)
        self.memory = StationMemory(self.plan.budget_bytes, self.model.activation_bytes, lambda: self.kv_bytes,
                                    keep=loader.sealed_copy, take=loader.unseal,  # kept copies sealed with the version
                                    tile_bytes=tile_bytes)
        self.memory.pair_bytes = self.plan.held_phase_bytes if self.plan.prefetch else 0
        self.memory.set_aside_bytes = self.plan.held_phase_bytes
        self.boots_at = self.clock()
        self.forwards = 0
        self.sessions_evicted = 0
        self.batched_rows = 0
        self.layers = range(settings.layer_start, settings.layer_end)
        self.split_frames = 0  # frames run in several passes to fit the budget
        self.prefetched_phases = 0  # phases whose load overlapped the previous phase's compute
        self.forward_s = 0.0  # time in the layer loop, and the part of it spent waiting for tensors
        self.load_wait_s = 0.0
        self.refused_frames = 0
        # One forward at a time (memory is accounted for one, plus one interjected between two
        # phases of a long prefill); decode frames that arrive while it runs are batched into the next.
        self.batcher = Batcher(self._run_batch, self._batchable, max_batch=settings.max_batch,
                               interjects=self._interjects)
        self.paused: list[tuple[wire.Envelope, Session]] = []  # a long prefill's frame, between two of its phases
        self.paused_bytes = 0  # the activations it holds meanwhile, at most (its phases' temporaries)
        capacity, self.prefix_why = self.prefix_capacity()
        self.prefix = PrefixStore(capacity)  # recent prompts' KV blocks (prompt caching)

    async def boot(self) -> None:
        """Load the role's resident set: the small tensors of our layers (norms, biases), output_norm on exit."""
        names = [n for l in range(self.settings.layer_start, self.settings.layer_end) for p in self.model.phases
                 for n in self.loader.names(l, p) if self.model.is_resident(n)]
        if self.emits_final:
            names.append(self.model.OUTPUT_NORM)
        self.memory.hold(await self.loader.load(names))

    def _streamed_sizes(self) -> tuple[list[int], int]:
        """From the knot's tensor table: the streamed bytes of each (layer, phase), and matmul's
        largest dequantization tile over those tensors (float32 rows of tile_rows at a time)."""
        s = self.settings
        streamed = [[n for n in self.loader.names(l, p) if not self.model.is_resident(n)]
                    for l in range(s.layer_start, s.layer_end) for p in self.model.phases]
        tile = max((4 * e.shape[0] * tile_rows(*e.shape)
                    for e in (self.header.tensors[n] for names in streamed for n in names) if len(e.shape) == 2),
                   default=DEFAULT_TILE_BYTES)
        return [sum(self.loader.nbytes(n) for n in names) for names in streamed], tile

    def _plan(self, phase_bytes: list[int], tile_bytes: int) -> MemoryPlan:
        """The budget under the profile, from the knot's tensor table (nothing is loaded for it):
        phase_bytes and tile_bytes as _streamed_sizes gives them."""
        s = self.settings
        resident = sum(self.loader.nbytes(n) for layer in range(s.layer_start, s.layer_end)
                       for p in self.model.phases for n in self.loader.names(layer, p) if self.model.is_resident(n))
        # a decode step, counted as the station's memory counts it (the same tile), with the least
        # KV cache a session holds: one block of positions in each of its layers. Why: without it
        # the plan could promise prefetch (memory.prefetch) that no forward with a session has
        # room for (prefetch_fits counts the KV caches).
        kv_block = KV_BLOCK_TOKENS * self.model.new_kv().token_bytes() * (s.layer_end - s.layer_start)
        fixed = resident + self.model.activation_bytes(1, 1) + tile_bytes + kv_block
        # prefetch holds a phase and the next one (in the forward's step order) at once
        pair = max((a + b for a, b in zip(phase_bytes, phase_bytes[1:])), default=None) if s.prefetch else None
        return plan_memory(s.profile, s.budget_bytes, sum(phase_bytes), max(phase_bytes, default=0), fixed,
                           s.resident_max_bytes, pair)

    @property
    def kv_bytes(self) -> int:
        """The sessions' KV caches and the prompt cache's blocks."""
        return sum(s.kv.nbytes for s in self.sessions.values()) + self.prefix.nbytes

    def prefix_capacity(self) -> tuple[int, str | None]:
        """The prompt cache's capacity in bytes, and why it holds no block when it cannot (None: it can).
        Unset PREFIX_CACHE_BYTES: half of what the plan leaves beside the layers it keeps, their
        loading and a decode step, so a fluid station, whose kept layers fill its budget, keeps no
        prompt rather than stream more of its layers."""
        p, setting = self.plan, self.settings.prefix_cache_bytes
        spare = max(p.budget_bytes - p.fixed_bytes - p.kept_bytes - p.held_phase_bytes, 0)
        capacity = spare // 2 if setting is None else min(setting, spare)
        block = block_bytes(self.model.new_kv(), len(self.layers))
        if capacity >= block:
            return capacity, None
        if setting == 0:
            return 0, "PREFIX_CACHE_BYTES=0"
        return 0, (f"the {p.profile} budget of {p.budget_bytes} bytes leaves {spare} beside the layers it keeps "
                   f"({p.kept_bytes}), their loading and a decode step; the prompt cache may take "
                   f"{'half of that' if setting is None else f'PREFIX_CACHE_BYTES={setting}'}, less than a block of "
                   f"{PREFIX_BLOCK_TOKENS} tokens ({block} bytes)")

    # -------------------------------------------------------- sessions

    def _expire(self) -> None:
        now = self.clock()
        paused = {env.request_id for env, _ in self.paused}
        for rid in [r for r, s in self.sessions.items()
                    if now - s.last_used > self.settings.session_ttl_s and r not in paused]:
            del self.sessions[rid]
            self.sessions_evicted += 1
            log.info("session %s expired after %.0f s idle", rid, self.settings.session_ttl_s)

    def _session(self, env: wire.Envelope) -> Session:
        s = self.sessions.get(env.request_id)
        if env.mode == "prefill" and env.position == 0:
            s = Session(self.model.new_kv())
            self.sessions[env.request_id] = s
        elif env.mode == "prefill" and env.prefix is not None and (s is None or s.length != env.position):
            s = self._resume(env)
        else:
            if s is None:
                raise UnknownSession(f"request {env.request_id}: no KV session on this station (expired, evicted "
                                     f"or the station restarted); replay the prompt from position 0")
            if env.rewind and s.floor <= env.position <= s.length:
                s.kv.truncate(env.position)  # the last frame's rejected drafts
                s.length = env.position
            elif env.rewind:
                raise UnknownSession(f"request {env.request_id}: a rewind to position {env.position}, but only the "
                                     f"last frame's positions [{s.floor}, {s.length}) can be dropped; replay the "
                                     f"prompt from position 0")
            elif s.length != env.position:
                raise UnknownSession(f"request {env.request_id}: the session holds {s.length} positions, the frame "
                                     f"starts at {env.position}; replay the prompt from position 0")
        self.sessions.move_to_end(env.request_id)
        s.last_used = self.clock()
        return s

    def _resume(self, env: wire.Envelope) -> Session:
        """A new session for a prefill frame at position > 0, from the prompt cache's blocks of the
        prefix env.prefix names; UnknownSession (the coordinator prefills from 0) when they are gone."""
        kv = self.model.new_kv()
        if env.position % PREFIX_BLOCK_TOKENS or not self.prefix.restore(env.prefix, env.position, kv, self.layers):
            raise UnknownSession(f"request {env.request_id}: the prompt cache no longer holds the {env.position} "
                                 f"positions before this frame; prefill the prompt from position 0")
        s = Session(kv, env.position, env.position)
        self.sessions[env.request_id] = s
        return s

    def _keep_blocks(self, runs: list[tuple[wire.Envelope, Session]]) -> None:
        """After a forward: keep the whole prompt blocks of each prefill frame (its BLOCK keys) in the
        prompt cache, within what the budget spares beside the kept layers, a decode step and the
        sessions (a forward evicts blocks again when it needs their room: _rows_per_pass)."""
        if self.paused:  # between two phases of a paused forward, whose reservation counted the store as it was
            return
        for env, sess in runs:
            if not env.blocks or env.mode != "prefill" or env.position % PREFIX_BLOCK_TOKENS \
                    or env.seq_len - env.position < len(env.blocks) * PREFIX_BLOCK_TOKENS \
                    or (env.position and env.prefix is None):
                continue
            parent = env.prefix if env.position else None
            for i, key in enumerate(env.blocks):  # first to last: each one's parent is kept before it
                room = self.plan.budget_bytes - self.plan.fixed_bytes - self.memory.kept.bytes_used - self.kv_bytes
                if not self.prefix.put(key, parent, env.position + i * PREFIX_BLOCK_TOKENS, sess.kv, self.layers, room):
                    break  # a block after one not kept could never be restored
                parent = key

    # -------------------------------------------------------- the budget

    def frame_bytes(self, N: int) -> int:
        """A forward's frames of N rows: the request body, the rows the layers run on, the reply."""
        return 3 * 4 * N * self.cfg.dim

    def _frames(self, N: int) -> int:
        """frame_bytes(N), plus a paused prefill's frames (what reserve() holds for it; 0 when none)
        and the activations it carries to its next phase."""
        return self.memory.frame_bytes + self.frame_bytes(N) + self.paused_bytes

    def kv_after(self, runs: list[tuple[wire.Envelope, Session]]) -> int:
        """Every session's KV bytes once the frames of `runs` have been appended (reallocations included).
        Between two phases of a paused prefill: its reservation (every session once it has run) plus
        what `runs` append."""
        if self.paused:
            return self.memory.kv_after_bytes + sum(sess.kv.nbytes_after(self.layers, env.array.shape[0]) -
                                                    sess.kv.nbytes for env, sess in runs)
        batch = {id(sess) for _, sess in runs}
        idle = sum(s.kv.nbytes for s in self.sessions.values() if id(s) not in batch) + self.prefix.nbytes
        return idle + sum(sess.kv.nbytes_after(self.layers, env.array.shape[0]) for env, sess in runs)

    def max_session_tokens(self) -> int:
        """The longest sequence (<= the context) whose KV caches fit, alone, beside the frame of a
        prefill chunk run in passes of one row."""
        kv, L = self.model.new_kv(), len(self.layers)
        return largest(lambda n: self.memory.bytes_beside(kv.nbytes_bound(n, L), self.frame_bytes(
            min(n, PREFILL_CHUNK_TOKENS)), 1, n) + self.phase_bytes <= self.plan.budget_bytes,
            self.cfg.context_length)

    def _rows_per_pass(self, runs: list[tuple[wire.Envelope, Session]]) -> int:
        """How many rows a pass through the layers may take (0: none fit), evicting idle sessions,
        least recently used first, while fewer than PASS_FLOOR_ROWS (or all the rows) fit."""
        N = sum(env.array.shape[0] for env, _ in runs)
        S = max(env.seq_len for env, _ in runs)
        keep = {env.request_id for env, _ in runs}
        while True:
            with self.memory.reserve(self.kv_after(runs), self._frames(N)):
                t = self.memory.rows_per_pass(N, S, self.phase_bytes)
            if t < N and self.prefix.evict_one():  # cached prompts yield to a whole pass, before live sessions
                continue
            idle = [r for r in self.sessions if r not in keep]
            if t >= min(N, PASS_FLOOR_ROWS) or not idle:
                return t
            del self.sessions[idle[0]]
            self.sessions_evicted += 1
            log.warning("session %s evicted: the KV caches leave no room for a forward of %d rows", idle[0], N)

    def _fit_sessions(self, keep: set[str]) -> None:
        """Evict least recently used sessions (never those in `keep`, nor a paused prefill's) while their
        KV caches overflow half the budget."""
        keep = keep | {env.request_id for env, _ in self.paused}
        # half the configured budget: in the resident profile that is what is left beside the layers.
        # The prompt cache is bounded apart (its capacity, and forwards evict it first).
        half = self.settings.budget_bytes // 2
        while self.kv_bytes - self.prefix.nbytes > half and len(self.sessions) > len(keep):
            rid = next(r for r in self.sessions if r not in keep)
            del self.sessions[rid]
            self.sessions_evicted += 1
            log.warning("session %s evicted: KV caches exceed half the %d-byte budget", rid, self.settings.budget_bytes)

    def release(self, rid: str) -> bool:
        return self.sessions.pop(rid, None) is not None

    # -------------------------------------------------------- forward

    async def forward(self, env: wire.Envelope, ctx) -> wire.Envelope:
        """One frame through our layers. Decode frames of concurrent requests are batched: they run
        as one forward whose weight products read each tensor once for all of them."""
        self._check_frame(env)
        return await self.batcher.submit((env, ctx))

    def _check_frame(self, env: wire.Envelope) -> None:
        if env.mode not in ("prefill", "decode"):
            raise BadRequest(f"envelope mode {env.mode!r}: a station runs prefill or decode")
        x = env.array
        if x.dtype != np.float32 or x.ndim != 2 or x.shape[1] != self.cfg.dim or x.shape[0] == 0:
            raise BadRequest(f"envelope array {x.dtype} {x.shape}, expected float32 (T>0, {self.cfg.dim})")
        if not np.isfinite(x).all():
            raise BadRequest(f"envelope for {env.request_id}: activations contain NaN or inf")
        if env.seq_len != env.position + x.shape[0]:
            raise BadRequest(f"envelope: seq_len {env.seq_len} != position {env.position} + {x.shape[0]} rows")

    @staticmethod
    def _batchable(item: tuple[wire.Envelope, object]) -> bool:
        return item[0].mode == "decode"

    def _interjects(self, item: tuple[wire.Envelope, object]) -> bool:
        """A frame short enough to run between two phases of a longer prefill frame."""
        return item[0].array.shape[0] <= self.settings.interleave_rows

    def _pauses(self, runs: list[tuple[wire.Envelope, Session]]) -> bool:
        """A forward that lets short frames run between its phases: one prefill frame longer than
        INTERLEAVE_ROWS, not itself interjected (0: none)."""
        if self.paused or len(runs) != 1 or self.settings.interleave_rows == 0:
            return False
        env = runs[0][0]
        return env.mode == "prefill" and env.array.shape[0] > self.settings.interleave_rows

    async def _run_batch(self, items: list[tuple[wire.Envelope, object]]) -> list:
        """The Batcher's callback: one forward over every frame that can still run; per-frame
        errors (unknown session) go to that frame's caller only."""
        outer_wait_until = self.loader.wait_until
        self.loader.wait_until = items[0][1].wait_until  # invalidations belong to a request's ctx
        try:
            return await self._run_items(items)
        finally:
            if self.paused:  # interjected: the paused forward's request again
                self.loader.wait_until = outer_wait_until

    async def _run_items(self, items: list[tuple[wire.Envelope, object]]) -> list:
        if not self.paused:
            self._expire()
        results: list = [None] * len(items)
        runs: list[tuple[int, wire.Envelope, Session]] = []
        for i, (env, _) in enumerate(items):
            if any(env.request_id == e.request_id for _, e, _ in runs) or \
                    any(env.request_id == e.request_id for e, _ in self.paused):
                results[i] = Conflict(f"request {env.request_id}: two frames of one session in flight")
                continue
            try:
                runs.append((i, env, self._session(env)))
            except UnknownSession as e:
                results[i] = e
        pairs = [(env, sess) for _, env, sess in runs]
        if self.paused and runs:  # interjected: in one pass beside the paused forward, else after it
            if not self._fit_beside_paused(pairs):
                for i, _, _ in runs:
                    results[i] = LATER  # nothing is evicted for an interjected frame
                return results
            t = sum(env.array.shape[0] for env, _ in pairs)
        else:  # a batch whose frames do not fit the budget together runs them one after another
            t = self._rows_per_pass(pairs) if len(runs) > 1 else None
        together = t is None or t == sum(env.array.shape[0] for _, env, _ in runs)
        for group in ([runs] if together else [[r] for r in runs]) if runs else []:
            try:
                outs = await self._forward([(env, sess) for _, env, sess in group], t if together else None)
            except Exception as e:  # noqa: BLE001 - every frame of the group failed with it
                for i, _, _ in group:
                    results[i] = e
            else:
                for (i, _, _), out in zip(group, outs):
                    results[i] = out
        return results

    async def _forward(self, runs: list[tuple[wire.Envelope, Session]], t: int | None = None) -> list[wire.Envelope]:
        """Frames of distinct sessions -> their output frames: one pass over the layers, or for a
        single frame that does not fit at once, passes of as many rows as fit (t: _rows_per_pass(runs),
        when the caller has it already). A long prefill frame lets short frames run between its
        phases (_pauses)."""
        t = self._rows_per_pass(runs) if t is None else t
        N = sum(env.array.shape[0] for env, _ in runs)
        S = max(env.seq_len for env, _ in runs)  # the longest attention span in the batch
        if t == 0 or (t < N and len(runs) > 1):
            self.refused_frames += 1
            env, sess = runs[0]
            raise StationMemoryFull(
                f"request {env.request_id}: {N} rows at position {env.position} do not fit the station's "
                f"budget of {self.plan.budget_bytes} bytes ({self.plan.profile} profile, MEMORY_BUDGET_BYTES="
                f"{self.settings.budget_bytes}) even one row at a time: the KV caches would "
                f"hold {self.kv_after(runs)} bytes, the largest phase {self.phase_bytes}, resident tensors "
                f"{self.memory.resident_bytes}. This station holds the KV cache of at most "
                f"{self.max_session_tokens()} tokens per sequence; raise MEMORY_BUDGET_BYTES "
                f"(STATION_MEMORY_BUDGET_BYTES in compose) or run more stations")
        xs = [env.array for env, _ in runs]
        h = np.concatenate(xs) if len(xs) > 1 else np.array(xs[0], dtype=np.float32)  # (N, dim), writable
        pauses = runs if self._pauses(runs) else None
        try:
            with self.memory.reserve(self.kv_after(runs), self._frames(N)):
                if t == N:
                    seqs = [(sess.kv, np.arange(env.position, env.seq_len, dtype=np.int64)) for env, sess in runs]
                    h = await self._run_layers(h, seqs, N, S, pauses)
                else:  # one frame, in passes of t rows, each through every layer
                    (env, sess), = runs
                    self.split_frames += 1
                    for r in range(0, N, t):
                        p0, p1 = env.position + r, env.position + min(r + t, N)
                        h[r:r + t] = await self._run_layers(h[r:r + t], [(sess.kv, np.arange(p0, p1, dtype=np.int64))],
                                                            p1 - p0, p1, pauses)
        except BaseException:
            # A half-applied forward leaves the KV caches inconsistent: forget those sessions.
            for env, _ in runs:
                self.sessions.pop(env.request_id, None)
            raise
        for env, sess in runs:
            sess.floor, sess.length = env.position, env.seq_len
        self._keep_blocks(runs)
        self._fit_sessions({env.request_id for env, _ in runs})
        self.forwards += 1
        self.batched_rows += N
        out, a = [], 0
        for env, _ in runs:
            b = a + env.array.shape[0]
            rows = h[a:b]
            if self.emits_final:
                # a prefill needs the last row's logits; a decode (speculative: several rows) every row's
                rows = rows if env.mode == "decode" else rows[-1:]
                rows = self.model.final_norm(rows, self.memory.resident[self.model.OUTPUT_NORM])  # (1 | T, dim)
            out.append(wire.Envelope(env.request_id, env.mode, env.position, env.seq_len, rows))
            a = b
        return out

    def _fit_beside_paused(self, runs: list[tuple[wire.Envelope, Session]]) -> bool:
        """Whether interjected frames run in one pass beside the paused prefill's reservation, with
        nothing kept and nothing evicted."""
        N = sum(env.array.shape[0] for env, _ in runs)
        S = max(env.seq_len for env, _ in runs)
        with self.memory.reserve(self.kv_after(runs), self._frames(N)):
            return self.memory.rows_per_pass(N, S, self.phase_bytes) == N

    async def _run_layers(self, h: np.ndarray, seqs, T: int, S: int,
                          pauses: list[tuple[wire.Envelope, Session]] | None = None) -> np.ndarray:
        """h (T, dim) through our layers for these sequences (within reserve()), prefetching when the
        plan does. pauses: the forward's runs, when short frames may run between its phases."""
        a, b = self.settings.layer_start, self.settings.layer_end
        t0 = time.perf_counter()
        async with ForwardWeights(self.memory, self.loader, T, S, steps(self.model, a, b), self.plan.prefetch) as weights:

            async def between() -> None:
                await asyncio.sleep(0)  # frames that arrived during the phase reach the queue
                if not self.batcher.interject_waiting():
                    return
                await weights.pause()  # no prefetched phase held while another forward runs
                self.paused, self.paused_bytes = pauses, self.memory.activation_bytes(T, S)
                try:
                    await self.batcher.interject()
                finally:
                    self.paused, self.paused_bytes = [], 0
                await asyncio.sleep(0)  # their callers send the replies before the next phase

            try:
                return await run_layers(self.model, h, a, b, seqs, weights,
                                        compute=weights.compute if weights.prefetching else None,
                                        between=between if pauses else None)
            finally:
                self.prefetched_phases += weights.prefetched
                self.forward_s += time.perf_counter() - t0
                self.load_wait_s += weights.wait_s

    def stats(self) -> dict:
        s = self.settings
        return {
            "boot_key": s.boot_key, "role": s.role, "layer_start": s.layer_start, "layer_end": s.layer_end,
            "budget_bytes": self.plan.budget_bytes, "memory": self.plan.as_dict(),
            "peak_accounted_bytes": self.memory.peak_accounted_bytes,
            "resident_bytes": self.memory.resident_bytes, "kept_bytes": self.memory.kept.bytes_used,
            "kept_tensors": len(self.memory.kept), "kept_copies": self.memory.kept_copies,
            "kept_copy_bytes": self.memory.kept_copy_bytes, "kept_evictions": self.memory.kept_evictions,
            "kv_bytes": self.kv_bytes, "sessions": len(self.sessions), "sessions_evicted": self.sessions_evicted,
            "prefix_cache": {**self.prefix.stats(), "holds": self.prefix_why is None, "why_not": self.prefix_why},
            "max_session_tokens": self.max_session_tokens(), "phase_bytes": self.phase_bytes,
            "split_frames": self.split_frames, "refused_frames": self.refused_frames,
            "prefetched_phases": self.prefetched_phases, "forward_s": round(self.forward_s, 6),
            "load_wait_s": round(self.load_wait_s, 6),
            "forwards": self.forwards, "batched_rows": self.batched_rows, **self.batcher.stats(),
            **self.loader.stats, **self.loader.warden_stats(), **self.loader.source.stats(),
        }


# ------------------------------------------------------------ the Worker

_booted: BootCache[Station] = BootCache()


async def station_for(env: Env, ctx, knot_etag: str | None = None) -> Station:
    """The station serving knot version knot_etag (a request's X-Knot-Etag; None: the loaded one)."""
    settings = StationSettings.from_env(env)

    async def boot(pin: str) -> Station:
        source = KnotSource(env.KNOT_BUCKET, settings.knot_key, pin)
        header, model = await source.header(), await source.model()
        ns = read(env, "LAYER_WARDEN", "station")
        warden = (None if ns is None else  # it must answer for our version
                  LayerWardenClient(ns, settings.knot_key, settings.layer_start, settings.layer_end, source.etag))
        st = Station(settings, header, PhaseLoader(model, header, source, warden, ctx.wait_until))
        await st.boot()
        log.info("station booted: %s, %d resident tensors (%d bytes), budget %d bytes", settings.boot_key,
                 len(st.memory.resident), st.memory.resident_bytes, st.plan.budget_bytes)
        log.info("%s", describe_plan("station", (settings.layer_start, settings.layer_end), st.plan))
        return st

    return await serving_version(_booted, settings.boot_key, boot, lambda st: st.loader.source, knot_etag,
                                 pin=read_pin(env, "station"))


async def ready(env: Env) -> None:
    """Fail the start with a clear message when the configuration is wrong."""
    StationSettings.from_env(env)
    read_pin(env, "station")


async def fetch(request: Request, env: Env, ctx) -> Response:
    st = await station_for(env, ctx, request.headers.get(KNOT_ETAG_HEADER))
    resp = await _route(request, st, ctx)
    resp.headers[KNOT_ETAG_HEADER] = st.loader.source.etag  # the version this reply was computed from
    return resp


async def _route(request: Request, st: Station, ctx) -> Response:
    path = request.path
    if path == "/forward" and request.method == "POST":
        try:
            frame = wire.decode_envelope(request.body)
        except wire.WireError as e:
            raise BadRequest(f"malformed envelope: {e}") from None
        out = await st.forward(frame, ctx)
        return Response.from_bytes(wire.encode_envelope(out), wire.ENVELOPE_CONTENT_TYPE)
    if path == "/forward_many" and request.method == "POST":  # concurrent generations' decode frames

        async def one(body: memoryview) -> bytes:
            try:
                frame = wire.decode_envelope(body)
            except wire.WireError as e:
                raise BadRequest(f"malformed envelope: {e}") from None
            if frame.mode != "decode":
                raise BadRequest(f"envelope mode {frame.mode!r}: /forward_many runs decode frames")
            return wire.encode_envelope(await st.forward(frame, ctx))

        return await serve_bundle(request.body, one)
    if path == "/prefix" and request.method == "POST":
        keys = request.body
        if len(keys) % KEY_BYTES or len(keys) // KEY_BYTES > st.cfg.context_length // PREFIX_BLOCK_TOKENS + 1:
            raise BadRequest(f"POST /prefix: {len(keys)} bytes, expected whole {KEY_BYTES}-byte block keys, at most "
                             f"{st.cfg.context_length // PREFIX_BLOCK_TOKENS + 1} (the context's blocks and the root)")
        keys = [bytes(keys[i:i + KEY_BYTES]) for i in range(0, len(keys), KEY_BYTES)]
        return Response.from_json({"blocks": st.prefix.held(keys) if st.prefix_why is None else 0})
    if path.startswith("/release/") and request.method == "POST":
        rid = path[len("/release/"):]
        return Response.from_json({"request_id": rid, "released": st.release(rid)})
    if path == "/stats" and request.method == "GET":
        return Response.from_json({**st.stats(), "boots": _booted.boots, "knot_reloads": _booted.reloads,
                                   "instance": _booted.instance})
    raise NotFound(f"{request.method} {path}: the station serves POST /forward, POST /forward_many, POST /prefix, "
                   f"POST /release/<id>, GET /stats")
