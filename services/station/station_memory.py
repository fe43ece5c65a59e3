"""A station's memory policy (seed section 2, fluid memory): what it holds, what it evicts, and the
accounting that keeps the total within MEMORY_BUDGET_BYTES.

    resident     the small tensors of its layers (norms, biases; output_norm on exit), for life
    kept         phase tensors kept between forwards while the budget has room
    KV caches    the sessions' (owned by the station, counted here through kv_bytes()); during a
                 forward, what they will hold once it has appended (reserve())
    frames       the forward's frames in and out
    activations  the phase's temporaries (model.activation_bytes(T, S), tiled attention included)
    the tile     matmul's dequantization tile

    loaded       the tensors loaded for the running phase, and for the next one while it is
                 prefetched: counted from before their load starts until evict_or_keep() lets them go

Per phase: acquire() takes the phase's tensors from resident, then kept, and makes room before
loading the rest; evict_or_keep() afterwards keeps what still fits beside everything else. Kept
tensors are the only thing a phase may evict; the station checks before a forward that the rest
fits (rows_per_pass), so make_room never runs out, and refuses with StationMemoryFull otherwise.
What a kept entry is comes from `keep` and `take` (the station seals its copies with the knot
version and crc32, services/station/tensors.py); an entry `take` refuses is a miss, loaded again.

Prefetch (fluid): when the plan has room for the two largest consecutive phases beside everything
else, ForwardWeights starts loading phase i+1 as soon as phase i has its tensors, and phase i's
compute runs off the event loop meanwhile (compute()), so the transfer overlaps it. A forward whose
activations or KV caches leave no room for two phases loads one at a time, as without prefetch.
"""
from __future__ import annotations

import asyncio
import contextlib
import functools
import time
from dataclasses import asdict, dataclass
from typing import Any, Awaitable, Callable, Iterator, Mapping, Protocol, Sequence

from common.kvcache import largest
from common.lru import ByteLRU
from common.matmul import DEFAULT_TILE_BYTES
from common.quant import QTensor
from common.runtime import PayloadTooLarge
from services.offload import off_loop


class StationMemoryFull(PayloadTooLarge):
    """413: a frame cannot run within MEMORY_BUDGET_BYTES, even alone and in passes of one row."""


PROFILES = ("worker", "resident")  # MEMORY_PROFILE's choices (common/settings.py)
# What a streamed byte costs a decode, for the estimate a fluid station prints: the rate of the 1.5B's
# fluid row of knot bench, over the socket (its records: benchmarks/results/).
FLUID_BYTES_PER_S = 1.0e9


@dataclass(frozen=True)
class MemoryPlan:
    """What a station's budget means for its layers, decided at boot from the knot's tensor table."""

    profile: str  # worker: the Worker's budget as configured; resident: sized so the layers stay
    budget_bytes: int
    layer_bytes: int  # the phase tensors of its layers (what the LayerWarden serves)
    fixed_bytes: int  # resident norms + a decode step's activations + the matmul tile
    kept_bytes: int  # about how much of layer_bytes stays between forwards
    streamed_bytes_per_token: int  # about what every decode step loads again
    prefetch: bool = False  # the next phase loads while one computes (room for two phases is set aside)
    held_phase_bytes: int = 0  # what the plan sets aside for loading: the largest phase, or pair of phases

    @property
    def fits(self) -> bool:
        return self.streamed_bytes_per_token == 0

    @property
    def resident_fraction(self) -> float:
        return 1.0 if self.layer_bytes == 0 else self.kept_bytes / self.layer_bytes

    def as_dict(self) -> dict:
        return {**asdict(self), "fits": self.fits, "resident_fraction": round(self.resident_fraction, 4)}


def plan_memory(profile: str, budget_bytes: int, layer_bytes: int, largest_phase_bytes: int, fixed_bytes: int,
                resident_max_bytes: int | None = None, largest_pair_bytes: int | None = None) -> MemoryPlan:
    """The station's budget under a profile and what it keeps of its layers at that budget.

    worker: budget_bytes as configured (a Worker's 128 MiB by default). resident: the layers plus
    budget_bytes for everything else (KV caches, activations), capped at resident_max_bytes (what
    the host can give). When the layers do not fit, the phase being streamed needs room beside the
    kept ones (make_room), so the largest phase comes off what can stay; with largest_pair_bytes
    (two consecutive phases at most; None: no prefetch) and room for it, the pair does instead,
    and the station prefetches."""
    if profile not in PROFILES:
        raise ValueError(f"memory profile {profile!r}: one of {', '.join(PROFILES)}")
    if profile == "resident":
        budget_bytes += layer_bytes
        if resident_max_bytes is not None:
            budget_bytes = min(budget_bytes, max(resident_max_bytes, 1))
    room = max(budget_bytes - fixed_bytes, 0)
    if layer_bytes <= room:
        return MemoryPlan(profile, budget_bytes, layer_bytes, fixed_bytes, layer_bytes, 0)
    prefetch = largest_pair_bytes is not None and largest_pair_bytes <= room
    held = largest_pair_bytes if prefetch else largest_phase_bytes
    kept = max(min(room - held, layer_bytes), 0)
    return MemoryPlan(profile, budget_bytes, layer_bytes, fixed_bytes, kept, layer_bytes - kept, prefetch, held)


def expected_tok_s(streamed_bytes_per_token: int) -> float:
    """A rough decode ceiling from the bytes a token streams (inf when nothing streams)."""
    return float("inf") if streamed_bytes_per_token <= 0 else FLUID_BYTES_PER_S / streamed_bytes_per_token


def describe_plan(name: str, layers: tuple[int, int], plan: MemoryPlan) -> str:
    """The start-up line of one station: budget, fit, bytes per token, and what to expect otherwise."""
    mb = 1e6
    head = (f"{name} layers [{layers[0]}, {layers[1]}): profile {plan.profile}, budget {plan.budget_bytes / mb:.0f} MB, "
            f"layers {plan.layer_bytes / mb:.0f} MB")
    if plan.fits:
        return f"{head}: resident (nothing streamed per token)"
    line = (f"{head}: do not fit, {plan.resident_fraction:.0%} stay; streams ~{plan.streamed_bytes_per_token / mb:.0f} MB "
            f"per token from the LayerWarden{', the next phase while one computes' if plan.prefetch else ''}, "
            f"which alone holds decode under {expected_tok_s(plan.streamed_bytes_per_token):.1f} tok/s")
    if plan.profile == "worker":
        line += " (a Worker's budget; `knot cluster up --profile resident` or KNOT_PROFILE=resident keeps them)"
    else:
        line += " (resident, but capped by RESIDENT_MAX_BYTES: the host's memory)"
    return line


class TensorSource(Protocol):
    """Where the tensors come from (services/station/tensors.py: the warden, then R2)."""

    def names(self, layer: int, phase: str) -> list[str]: ...

    def nbytes(self, name: str) -> int: ...

    def load(self, names: list[str]) -> Awaitable[dict[str, QTensor]]: ...


def copy_of(t: QTensor) -> QTensor:
    """A kept copy: a tensor from a warden batch is a view that pins the whole batch buffer."""
    return QTensor(t.name, t.ggml_type, t.shape, t.data.copy())


class StationMemory:
    def __init__(self, budget_bytes: int, activation_bytes: Callable[[int, int], int],
                 kv_bytes: Callable[[], int], keep: Callable[[QTensor], Any] = copy_of,
                 take: Callable[[Any], QTensor | None] = lambda kept: kept,
                 tile_bytes: int = DEFAULT_TILE_BYTES):
        self.budget_bytes = budget_bytes
        self.tile_bytes = tile_bytes  # matmul's float32 tile, at most DEFAULT_TILE_BYTES
        # (T new rows, S positions attended) -> bytes; pure, and asked ~3 times per phase with the
        # same (T, S) through a forward, so remembered
        self.activation_bytes = functools.lru_cache(maxsize=16)(activation_bytes)
        self.kv_bytes = kv_bytes
        self.keep, self.take = keep, take  # tensor -> kept entry; kept entry -> tensor, or None: a miss
        self.resident: dict[str, QTensor] = {}
        self.resident_bytes = 0  # fixed after boot; summed once, not per phase
        self.kept: ByteLRU[str, Any] = ByteLRU(budget_bytes)
        self.loaded: dict[str, int] = {}  # name -> bytes: loaded for a running or prefetched phase, not yet let go
        self.loaded_bytes = 0
        self.pair_bytes = 0  # two consecutive phases' streamed tensors at most; 0: never prefetch (set at boot)
        self.set_aside_bytes = 0  # what streamed phases hold at once at most (MemoryPlan.held_phase_bytes, set at boot)
        self.peak_accounted_bytes = 0
        self.kv_after_bytes = 0  # set by reserve() for the running forward
        self.frame_bytes = 0
        self.kept_copies = self.kept_copy_bytes = 0  # tensors kept after a phase (each a copy), ever
        self.kept_evictions = 0  # kept tensors make_room dropped, ever

    def hold(self, resident: Mapping[str, QTensor]) -> None:
        """The resident set, held for the station's life."""
        self.resident = dict(resident)
        self.resident_bytes = sum(t.nbytes for t in self.resident.values())

    @contextlib.contextmanager
    def reserve(self, kv_after_bytes: int, frame_bytes: int) -> Iterator[None]:
        """For one forward: count the KV caches at what they will hold once it has appended (the
        largest reallocation included), and its frames, from its first phase on. Nested (a frame
        run between two phases of a paused one): the caller's figures include the paused forward's,
        which hold again afterwards."""
        outer = self.kv_after_bytes, self.frame_bytes
        self.kv_after_bytes, self.frame_bytes = kv_after_bytes, frame_bytes
        try:
            yield
        finally:
            self.kv_after_bytes, self.frame_bytes = outer

    def fixed_bytes(self, T: int, S: int) -> int:
        """Everything a phase needs besides its own tensors and the kept ones."""
        return self.bytes_beside(max(self.kv_bytes(), self.kv_after_bytes), self.frame_bytes, T, S)

    def bytes_beside(self, kv_bytes: int, frame_bytes: int, T: int, S: int) -> int:
        """What a phase of T rows over S positions holds besides tensors, with these KV caches and frames."""
        return self.resident_bytes + kv_bytes + frame_bytes + self.activation_bytes(T, S) + self.tile_bytes

    def prefetch_fits(self, T: int, S: int) -> bool:
        """Whether a forward of T rows over S positions has room for two phases' tensors at once
        (within reserve()), nothing kept."""
        return 0 < self.pair_bytes and self.fixed_bytes(T, S) + self.pair_bytes <= self.budget_bytes

    def rows_per_pass(self, N: int, S: int, phase_bytes: int) -> int:
        """The most rows (<= N) one pass through the layers may take so that every phase fits with
        phase_bytes of its own tensors loaded and nothing kept (within reserve()); 0: not even one."""
        return largest(lambda t: self.fixed_bytes(t, S) + phase_bytes <= self.budget_bytes, N)

    def account(self, T: int, S: int) -> int:
        """The bytes held now, by a phase of T rows over S positions: kept, loaded and fixed; tracks the peak."""
        total = self.kept.bytes_used + self.loaded_bytes + self.fixed_bytes(T, S)
        self.peak_accounted_bytes = max(self.peak_accounted_bytes, total)
        return total

    def make_room(self, need_bytes: int, T: int, S: int, protect: set[str]) -> None:
        """Before a phase runs: evict kept tensors, most recently used first (never the phase's own,
        nor the running phase's while the next is prefetched: `protect`), until the phase's new
        tensors (need_bytes) fit the budget beside its activations and the tensors already loaded.
        Runs even when nothing is loaded: a long prefill needs room that a decode step did not.

        Why most recently used: a station reads its layers in the same cyclic order every forward,
        and under a cyclic scan LRU evicts exactly the tensor needed next, so a budget one tensor
        short of the whole range would hit nothing. Evicting the newest keeps the first layers that
        fit and streams the rest: the fewest bytes from the warden per forward (Belady's choice)."""
        limit = self.budget_bytes - self.fixed_bytes(T, S) - self.loaded_bytes - need_bytes
        if self.kept.bytes_used <= limit:
            return
        for name in reversed(list(self.kept.keys())):  # most recently used first
            if self.kept.bytes_used <= limit:
                break
            if name not in protect:
                self.kept.pop(name)
                self.kept_evictions += 1
        if self.kept.bytes_used > max(limit, 0) or limit < 0:
            raise StationMemoryFull(
                f"a phase of {T} rows over {S} positions needs {need_bytes} bytes of tensors and "
                f"{self.fixed_bytes(T, S)} of KV caches, frames, activations and resident tensors, "
                f"{self.loaded_bytes} loaded and {self.kept.bytes_used} kept ones left: over the "
                f"{self.budget_bytes}-byte budget")

    async def acquire(self, names: list[str], T: int, S: int, source: TensorSource,
                      protect: Sequence[str] = ()) -> dict[str, QTensor]:
        """The phase's tensors: resident, then kept (a hit refreshes it), then loaded from source
        once make_room has made room for them (never evicting `protect`: the running phase's while
        this one is prefetched). What it loads counts as loaded until evict_or_keep() or release()."""
        w, need = self.claim(names, T, S, source, protect)
        return await self.fill(w, need, T, S, source)

    def at_hand(self, names: list[str], T: int, S: int) -> dict[str, QTensor] | None:
        """acquire() for a phase whose tensors are all resident or kept, with nothing to evict: the
        same tensors and the same accounting, without its coroutine and room-making. None where any
        is missing or room must be made (acquire() then does the work). Why: a resident station
        runs every phase this way, and acquire's generality was a measurable share of its decode
        forward (benchmarks/cluster_profile.py --only station)."""
        total = self.kept.bytes_used + self.loaded_bytes + self.fixed_bytes(T, S)
        if total > self.budget_bytes:  # make_room would evict: the general path
            return None
        w = {}
        for n in names:
            t = self.resident.get(n) or self._kept_tensor(n)
            if t is None:
                return None
            w[n] = t
        self.peak_accounted_bytes = max(self.peak_accounted_bytes, total)
        return w

    def _kept_tensor(self, name: str) -> QTensor | None:
        """The kept tensor (a hit refreshes it), or None: not kept, or its seal failed (take() counts
        that miss once; the entry is dropped, so the phase loads it again)."""
        kept = self.kept.get(name)
        t = None if kept is None else self.take(kept)
        if t is None and kept is not None:
            self.kept.pop(name)
        return t

    def held(self, w: Mapping[str, QTensor]) -> bool:
        """Every tensor of a finished phase is resident or kept and none counts as loaded:
        evict_or_keep() would change nothing."""
        return all((n in self.resident or n in self.kept) and n not in self.loaded for n in w)

    def claim(self, names: list[str], T: int, S: int, source: TensorSource,
              protect: Sequence[str] = ()) -> tuple[dict[str, QTensor], dict[str, int]]:
        """acquire()'s first half, at once: the tensors at hand, and room made and counted for the
        rest (name -> bytes), so a phase that ends before they arrive (prefetch) sees them."""
        w = {n: self.resident[n] for n in names if n in self.resident}
        for n in names:
            if n not in w:
                t = self._kept_tensor(n)
                if t is not None:
                    w[n] = t
        need = {n: source.nbytes(n) for n in names if n not in w}
        self.make_room(sum(need.values()), T, S, protect=set(names) | set(protect))
        self.loaded.update(need)
        self.loaded_bytes += sum(need.values())
        return w, need

    async def fill(self, w: dict[str, QTensor], need: dict[str, int], T: int, S: int,
                   source: TensorSource) -> dict[str, QTensor]:
        """acquire()'s second half: load what claim() counted; on failure it is no longer counted."""
        try:
            if need:
                w.update(await source.load(list(need)))
        except BaseException:
            self.release(need)
            raise
        self.account(T, S)
        return w

    def release(self, names) -> None:
        """Let go of loaded tensors (a phase's, once it ran or was abandoned): no longer counted."""
        for n in names:
            self.loaded_bytes -= self.loaded.pop(n, 0)

    def evict_or_keep(self, w: Mapping[str, QTensor], T: int, S: int, ahead_bytes: int = 0) -> None:
        """After a phase: let go of its loaded tensors, keeping those that fit beside everything
        else: the tensors loaded meanwhile (a prefetched phase) and ahead_bytes, what the next load
        will need (were it kept, that load's make_room would evict it first), and never into the
        room set aside for streaming (set_aside_bytes, the largest phase or pair of phases).

        Why the set-aside too: phases differ in size, and a tensor kept beside a small pair is
        evicted unused by the next large one. A 7B station kept and evicted ~250 MB per forward
        that way (a copy each, ~12% of its time), keeping 42 MB."""
        self.release(w)
        room = self.budget_bytes - self.fixed_bytes(T, S) - max(self.loaded_bytes + ahead_bytes, self.set_aside_bytes)
        for name, t in w.items():
            if name in self.resident or name in self.kept:
                continue
            if t.nbytes <= room - self.kept.bytes_used:
                self.kept.put(name, self.keep(t), t.nbytes)
                self.kept_copies += 1
                self.kept_copy_bytes += t.nbytes


class ForwardWeights:
    """The layer loop's weights (common.layers.Weights) for one forward of T rows attending to S
    positions; use it as `async with`, which drops a prefetched phase the forward did not reach.

    `steps`, the forward's (layer, phase) order, tells what loads next. A finished phase is kept
    only if it fits beside the next load too (ahead_bytes): a copy that phase's make_room would
    evict at once (the newest goes first) is a copy of tens of MB for nothing, once per phase.
    With `prefetch` and room for two phases (prefetch_fits), a phase's load starts the next
    phase's when that one needs loading, and compute() runs the phase off the event loop while it
    does, so the transfer overlaps the compute."""

    def __init__(self, memory: StationMemory, source: TensorSource, T: int, S: int,
                 steps: Sequence[tuple[int, str]] = (), prefetch: bool = False):
        self.memory, self.source, self.T, self.S = memory, source, T, S
        steps = list(steps)
        # the next forward starts where this one did, so the step after the last is the first
        self.after = dict(zip(steps, steps[1:] + steps[:1]))
        self.following = dict(zip(steps, steps[1:])) if prefetch and memory.prefetch_fits(T, S) else {}
        self.next: tuple[tuple[int, str], list[str], asyncio.Task] | None = None  # the step being prefetched
        self.prefetched = 0  # phases whose load overlapped the previous phase
        self.wait_s = 0.0  # time the layer loop waited for tensors (what prefetch did not hide)

    @property
    def prefetching(self) -> bool:
        return bool(self.following)

    async def __aenter__(self) -> "ForwardWeights":
        return self

    async def __aexit__(self, *exc) -> None:
        await self._drop_next()

    async def load(self, layer: int, phase: str) -> dict[str, QTensor]:
        t0 = time.perf_counter()
        try:
            return await self._load(layer, phase)
        finally:
            self.wait_s += time.perf_counter() - t0

    async def _load(self, layer: int, phase: str) -> dict[str, QTensor]:
        names = self.source.names(layer, phase)
        if self.next is not None and self.next[0] == (layer, phase):
            w = await self.next[2]
            self.next = None
            self.prefetched += 1
        else:
            w = self.memory.at_hand(names, self.T, self.S) if self.next is None else None
            if w is None:
                await self._drop_next()
                w = await self.memory.acquire(names, self.T, self.S, self.source)
        step = self.following.get((layer, phase))
        if step is not None:
            upcoming = self.source.names(*step)
            if self._to_load(upcoming):
                got, need = self.memory.claim(upcoming, self.T, self.S, self.source, protect=names)
                self.next = (step, upcoming, asyncio.ensure_future(
                    self.memory.fill(got, need, self.T, self.S, self.source)))
        return w

    def done(self, layer: int, phase: str, w: Mapping[str, QTensor]) -> None:
        if self.memory.held(w):  # nothing to let go of nor to keep (a resident station's every phase)
            return
        self.memory.evict_or_keep(w, self.T, self.S, self._ahead((layer, phase)))

    def _ahead(self, step: tuple[int, str]) -> int:
        """The bytes claimed before another phase is let go, once `step` is done: the next load's
        (its phase unless already loading, and the prefetch it starts). After the last step, the
        next forward's first: the layers are read in the same order every time."""
        j = self.after.get(step)
        if j is None:
            return 0
        if self.next is not None and self.next[0] == j:  # loading already, and counted
            if j in self.following:
                claims = [self.following[j]]
            else:  # j ends the forward; the next one starts over
                j = self.after[j]
                claims = [j, *([self.following[j]] if j in self.following else [])]
        else:
            claims = [j, *([self.following[j]] if j in self.following else [])]
        return sum(self._to_load(self.source.names(*c)) for c in claims)

    def _to_load(self, names: list[str]) -> int:
        """The bytes of names that neither stay (resident) nor are kept now: what loading them takes."""
        m = self.memory
        return sum(self.source.nbytes(n) for n in names if n not in m.resident and n not in m.kept)

    async def compute(self, fn: Callable[..., Any], *args: Any) -> Any:
        """fn(*args): in a worker thread while the next phase loads, so the event loop moves its
        bytes meanwhile (the kernels release the GIL); in place otherwise (no thread hop)."""
        if self.next is not None and not self.next[2].done():
            # One turn of the loop first, so the load has sent its request before the compute
            # starts: where off_loop runs inline (Pyodide has no threads) it is then in flight.
            await asyncio.sleep(0)
            return await off_loop(fn, *args)
        return fn(*args)

    async def pause(self) -> None:
        """Before another forward runs between two of this one's phases: let go of the phase being
        prefetched (it is loaded again when this forward goes on), so only that forward loads."""
        await self._drop_next()

    async def _drop_next(self) -> None:
        """Cancel a prefetch the forward will not use, and let go of whatever it loaded."""
        if self.next is None:
            return
        _, names, task = self.next
        self.next = None
        task.cancel()
        try:
            await asyncio.wait([task])  # raises only if this forward itself is cancelled meanwhile
        finally:
            if task.done() and not task.cancelled():
                task.exception()  # retrieved: an abandoned load's error concerns no one
            self.memory.release(names)
