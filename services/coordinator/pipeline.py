"""The coordinator's hops: shards (embed, LM head) and the station chain, with their timings.

Failures are a policy, never a silent guess (issue 13):
- A station or shard that cannot be reached, or answers that it is not ready (a 5xx other than
  500), is down. Requests wait for it to come back (a supervised restart) for up to PEER_WAIT_S,
  counted from when it went down and shared by every request, so once it has been down that long
  each request gets 503 with Retry-After at once. A request never waits past its deadline.
- A station or shard that hangs (a stopped process: its socket takes the call and nothing answers)
  is down too: a hop slower than PROBE_EVERY_S has the peer's /healthz asked every PROBE_EVERY_S,
  and a peer that answers neither the hop nor a probe for PEER_WAIT_S gets 503 naming it. A peer
  that is computing answers its probes, so a long hop is waited for, up to its own timeout.
- Past the request's deadline (REQUEST_TIMEOUT_S) the request gets 504, whatever the hop was
  doing: a peer still computing is not down.
- Replicas (ClusterLayout replicas, `knot cluster up --replicas R`): each station range and each
  shard slice may be served by several processes. A generation is pinned to the least loaded
  replica of each that is up (Call.picks), and keeps it for every later token: its KV caches
  live there. When a replica it uses is down while another of the same range is up, it moves
  there at once instead of waiting: a shard's call is made again, and a station's move is a
  SessionLost, so the engine replays every frame exactly on the new replica (cluster_engine.py)
  and the tokens equal a fault-free run's. A replica that is down is probed (GET /readyz) when
  replicas are chosen, and rejoins once it answers. With one replica, or once every replica of a
  range is down, the rules above hold: wait up to PEER_WAIT_S, then 503 naming the range.
- A shard still down after that fails the request with 503 naming the vocabulary range that is
  missing (shard_failure "fail", the default). The seed's allSettled merge (section 3) is an
  explicit opt-in, per cluster (SHARD_FAILURE) or per request (shard_failure "degrade"): a shard
  that fails is not waited for; its tokens embed as zeros and its logits are -inf, the rest stay
  exact, and the reply says which shards were missing.

Every hop names the knot version the request works on (X-Knot-Etag), and every reply must name
the same one: a hop computed from another version, or one that refused over the knot's integrity,
fails the whole request with IntegrityFailure (503, services/peer.py). That is never waited for nor
degraded around: a generation uses the bytes of one knot version or none.
"""
from __future__ import annotations

import asyncio
import contextvars
import hashlib
import logging
import math
import time
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable, TypeVar

import numpy as np

from common import wire
from common.prefix import PREFIX_BLOCK_TOKENS
from common.runtime import BadGateway, GatewayTimeout, HttpError, Request, ServiceUnavailable
from common.shard_sampling import RowSummary, SliceSummary, merge
from common.topology import ShardSpec
from services import tracing
from services.batcher import Batcher
from services.coordinator import subrequests
from services.embed_cache import SealedRows
from services.peer import PEER_URL, IntegrityFailure, PeerError
from services.shard.shard_client import ShardClient
from services.station.station_client import SessionLost, StationClient

log = logging.getLogger(__name__)

T = TypeVar("T")

PROBE_EVERY_S = 0.5  # a hop slower than this has its peer's /healthz asked, and again this often
AFFINITY_HEADER = "X-Session-Affinity"  # a client's hint: requests that share it share replicas (prompt caching)
MAX_AFFINITY_BYTES = 256
AFFINITY_SLACK = 1.25  # a replica takes an affine generation while its load stays under this times the mean
# the request's X-Session-Affinity, set by the handler for the generations it starts
session_affinity: contextvars.ContextVar[bytes | None] = contextvars.ContextVar("session_affinity", default=None)
MIN_SILENCE_S = 1.0  # a hop to a peer known to hang still has this long to show a sign of life
# A replica whose range has another one up is taken to hang after this long without an answer to its
# hop or its probes (PEER_WAIT_S when it has none): a lost node drops packets rather than refusing
# connections, and a computing replica answers its probes every PROBE_EVERY_S (tests/swarm).
FAILOVER_SILENCE_S = 2.0
STEP_LINGER_S = 0.005  # the longest a decode step waits for the generations that lag behind (Pipeline.steps)


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


class RequestTimeout(GatewayTimeout):
    """The request's deadline (REQUEST_TIMEOUT_S) passed."""


class PrefillAborted(Exception):
    """A prefill chunk stopped because an earlier one failed (that failure is the one raised)."""


class PeerUnavailable(ServiceUnavailable):
    """A station or shard the request needs stayed down: 503 with Retry-After."""


class ReplicaDown(Exception):
    """A replica failed as an outage while another replica of its range is up: move there."""

    def __init__(self, cause: BaseException):
        super().__init__(f"{type(cause).__name__}: {cause}")
        self.cause = cause


class PeerHung(Exception):
    """Neither a hop nor a probe of the peer's /healthz answered since `quiet_since` (time.monotonic())."""

    def __init__(self, message: str, quiet_since: float):
        super().__init__(message)
        self.quiet_since = quiet_since


@dataclass
class Call:
    """What one generation's hops share: the request id (its KV session on every station), the
    timings, the deadline, the shard-failure policy and the shards it was degraded around."""

    rid: str
    hops: Hops = field(default_factory=Hops)
    deadline: float = math.inf  # time.monotonic() by which the request must end
    shard_failure: str = "fail"  # or "degrade" (params.SHARD_FAILURE_POLICIES)
    degraded: list[Degradation] = field(default_factory=list)
    timeout_s: float = math.inf  # the whole deadline, for messages
    # ("station" | "shard", index) -> the replica the generation is pinned to (its KV caches live
    # on a station's): the generation's own dict, shared by its calls
    picks: dict = field(default_factory=dict)
    affinity: bytes | None = None  # what its replicas are chosen by (ReplicaSet.choose); None: load alone
    # its trace and its invocation's subrequests (services/tracing.py, subrequests.py), entered where
    # its calls run in a task of their own (a step batch's: _own)
    trace: Any = None
    counter: Any = None

    def timeout(self, hop_timeout_s: float, what: str) -> float:
        """A hop's timeout: its own, or what is left of the request's deadline; RequestTimeout when none is."""
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise RequestTimeout(f"request {self.rid}: its deadline of {self.timeout_s:g} s (REQUEST_TIMEOUT_S) "
                                 f"passed before {what}")
        return min(hop_timeout_s, left)


def not_for(reply: wire.Envelope, frame: wire.Envelope, mode: str) -> str | None:
    """What makes reply not the answer to frame (another request, mode or positions), or None.
    Why: stations and shards stack several requests' frames into one computation and split the
    rows back by request; a reply for other rows would be computed on as if it were ours."""
    if (reply.request_id, reply.mode, reply.position, reply.seq_len) == (frame.request_id, mode, frame.position,
                                                                          frame.seq_len):
        return None
    return (f"for {reply.request_id!r} {reply.mode} positions [{reply.position}, {reply.seq_len}), the frame was "
            f"{frame.request_id!r} {mode} positions [{frame.position}, {frame.seq_len})")


def misfit(reply: wire.Envelope, frame: wire.Envelope, mode: str, shape: tuple[int, ...]) -> str | None:
    """not_for, and then what makes reply's array not float32 of this shape, or None."""
    a = reply.array
    return not_for(reply, frame, mode) or (None if a.dtype == np.float32 and a.shape == shape else
                                           f"{a.dtype} shape {a.shape}, expected float32 shape {shape}")


def unavailable(e: BaseException) -> bool:
    """A failure that a restart cures: unreachable, timed out, or a peer that answered it is not ready
    (502/503/504). A peer's 500 or 4xx is a bug, not an outage: it fails the request as it is."""
    if isinstance(e, PeerError):
        return e.peer_status in (502, 503, 504)
    return isinstance(e, (ServiceUnavailable, TimeoutError, GatewayTimeout)) and not isinstance(e, RequestTimeout)


class PeerState:
    """One peer's availability as the coordinator last saw it, shared by every request."""

    def __init__(self, name: str):
        self.name = name
        self.down_since: float | None = None  # time.monotonic() of the first failure of this outage
        self.outages = 0
        self.on_down: set[Callable[[], None]] = set()  # called when it goes down (hops waiting on it: watched)

    def up(self) -> None:
        if self.down_since is not None:
            log.info("%s is back after %.1f s", self.name, time.monotonic() - self.down_since)
        self.down_since = None

    def down(self, now: float) -> float:
        """Mark it down (if it was up); returns since when."""
        if self.down_since is None:
            self.down_since = now
            self.outages += 1
            for f in list(self.on_down):
                f()
        return self.down_since


@dataclass(eq=False)
class Replica:
    """One process serving a station's layer range or a shard's vocabulary slice."""

    binding: str  # its binding's name: STATION_0, STATION_0_R1, ...
    client: Any  # StationClient | ShardClient
    state: PeerState
    load: int = 0  # generations pinned to it
    probe: asyncio.Task | None = None  # a GET /readyz of it while it is down
    check: asyncio.Task | None = None  # a GET /healthz of it after another replica was found hung (sweep)


class ReplicaSet:
    """The replicas of one station range or shard slice, replica 0 first."""

    def __init__(self, name: str, replicas: list[Replica]):
        if not replicas:
            raise ValueError(f"{name}: no replica")
        self.name, self.replicas = name, replicas

    def choose(self, exclude: Replica | None = None, affinity: bytes | None = None) -> Replica | None:
        """A replica that is up, other than exclude; None if none is. Without affinity the least
        loaded (ties: the lowest index). With it, the first in the affinity's rendezvous order
        (highest hash of affinity and binding) whose load is under AFFINITY_SLACK times the mean
        with this generation (consistent hashing with bounded loads, Mirrokni et al. 2018): requests
        of one affinity (a prompt's first block, a session) land on the replicas that keep their
        prompt blocks, and one hot prefix still spreads. Replicas that are down are probed
        meanwhile, so one that came back rejoins."""
        self.probe_down()
        up = [r for r in self.replicas if r is not exclude and r.state.down_since is None]
        if not up:
            return None
        least = min(up, key=lambda r: r.load)
        if affinity is None or len(up) == 1:
            return least
        cap = math.ceil(AFFINITY_SLACK * (sum(r.load for r in up) + 1) / len(up))
        order = sorted(up, key=lambda r: hashlib.blake2b(affinity + r.binding.encode(), digest_size=8).digest(),
                       reverse=True)
        return next((r for r in order if r.load < cap), least)

    def others_up(self, r: Replica) -> bool:
        return any(o is not r and o.state.down_since is None for o in self.replicas)

    def probe_down(self) -> None:
        """GET /readyz of each replica that is down (one probe at a time each): one that answers 200
        is up again (may_probe)."""
        if len(self.replicas) == 1 or not may_probe():
            return
        for r in self.replicas:
            if r.state.down_since is not None and (r.probe is None or r.probe.done()):
                r.probe = asyncio.get_running_loop().create_task(_probe_ready(r))


async def _own(call: Call, fn: Callable[[], Awaitable[T]]) -> T:
    """fn() as the call's generation: its trace and its invocation's subrequests current (a step
    batch runs it in the task of whichever generation started the batch)."""
    tracing.leave()
    tracing.enter(call.trace)
    subrequests.leave()
    subrequests.enter(call.counter)
    return await fn()


def _slice(spec: ShardSpec, envs: list[wire.Envelope], frame: wire.Envelope,
           sample: wire.SampleSpec) -> tuple[SliceSummary, str | None]:
    """A shard's /sample reply to frame -> its slice's summary, and what makes it wrong (None: nothing)."""
    sl = SliceSummary(spec.vocab_start, spec.vocab_end, *(e.array for e in envs))
    bad = next((b for e in envs if (b := not_for(e, frame, "sample")) is not None), None) or \
        sl.check(frame.array.shape[0], sample.lse)
    return sl, bad


def may_probe() -> bool:
    """Not under a subrequest limit (Cloudflare): there a probe would be a subrequest the generation's
    budget does not hold, and the platform bounds a hung Worker's call itself."""
    counter = subrequests.current()
    return counter is None or counter.limit is None


async def _answers(r: Replica, path: str, timeout_s: float) -> bool:
    """Whether the replica answers GET path within timeout_s (a 2xx, when path is /readyz; any reply
    for /healthz: the process runs)."""
    try:
        async with asyncio.timeout(timeout_s):
            resp = await r.client.binding.fetch(Request("GET", PEER_URL + path))
    except Exception:  # noqa: BLE001 - no answer
        return False
    return resp.ok or path == "/healthz"


async def _probe_alive(r: Replica) -> None:
    """A replica that is up and answers no GET /healthz within MIN_SILENCE_S: down."""
    if not await _answers(r, "/healthz", MIN_SILENCE_S) and r.state.down_since is None:
        log.warning("%s answers no GET /healthz within %.1f s; marked down", r.state.name, MIN_SILENCE_S)
        r.state.down(time.monotonic())


async def _probe_ready(r: Replica) -> None:
    """A replica that is down and answers GET /readyz: up again."""
    if await _answers(r, "/readyz", PROBE_EVERY_S * 4):
        r.state.up()
    else:
        await asyncio.sleep(PROBE_EVERY_S)  # the next probe of it no sooner

def _named(bindings: Any, kind: str, index: int) -> list[tuple[str, Any]]:
    """A range's bindings: one binding, a list of them, or of (name, binding) -> [(name, binding)]."""
    items = bindings if isinstance(bindings, (list, tuple)) else [bindings]
    base = f"{kind.upper()}_{index}"
    return [b if isinstance(b, tuple) else (base if k == 0 else f"{base}_R{k}", b) for k, b in enumerate(items)]


class Pipeline:
    def __init__(self, stations: list, shards: list[tuple[ShardSpec, object]], dim: int, vocab_size: int,
                 shard_timeout_s: float, station_timeout_s: float, peer_wait_s: float = 15.0,
                 retry_after_s: int = 1, knot_etag: str | None = None, row_cache_bytes: int = 0,
                 step_batch: int = 0):
        """stations: per station, entry first, its service binding, or its replicas' (a list of
        bindings or of (binding name, binding)); shards: (spec, binding or replicas) sorted by
        vocab_start, tiling [0, vocab). Each binding is called through its typed client, which pins
        every hop to knot_etag (None: not checked). row_cache_bytes: embedding rows kept from the
        shards' replies (embed()); a pipeline serves one knot version, so its rows are that version's.
        step_batch: generations whose decode steps and LM-head calls are stepped together (STEP_BATCH;
        0 or 1: each makes its own calls)."""
        self.knot_etag = knot_etag
        self.rows = SealedRows(row_cache_bytes, "coordinator")
        self.station_sets = [ReplicaSet(f"station {i}", [
            Replica(name, StationClient(b, station_timeout_s, knot_etag),
                    PeerState(f"station {i}" + (f" replica {k}" if k else "")))
            for k, (name, b) in enumerate(_named(bs, "station", i))]) for i, bs in enumerate(stations)]
        self.shard_sets = [(spec, ReplicaSet(f"shard {spec.index}", [
            Replica(name, ShardClient(b, shard_timeout_s, knot_etag),
                    PeerState(f"shard {spec.index}" + (f" replica {k}" if k else "") +
                              f" (vocabulary [{spec.vocab_start}, {spec.vocab_end}))"))
            for k, (name, b) in enumerate(_named(bs, "shard", spec.index))])) for spec, bs in shards]
        self.dim, self.vocab_size = dim, vocab_size
        self.shard_timeout_s, self.station_timeout_s = shard_timeout_s, station_timeout_s
        self.peer_wait_s, self.retry_after_s = peer_wait_s, retry_after_s
        # Continuous batching (step(), _steps). A step waits up to STEP_LINGER_S for every generation
        # that is stepping (its first step taken, not yet released): those that lag behind by their
        # token's work (sampling, a stream's write) would otherwise fall into a batch of their own,
        # which reads every weight again (/metrics knot_step_batches_total: items per batch).
        self.stepping: set[str] = set()
        self.steps = Batcher(self._steps, max_batch=step_batch, quorum=lambda: len(self.stepping),
                             linger_s=STEP_LINGER_S) if step_batch > 1 else None
        self.bundled = {"station": 0, "shard": 0}  # calls that carried several generations
        self.unbundled = 0  # parts of those that failed and were made alone

    # Replica 0 of each range: the whole range where it has no other replica.
    @property
    def stations(self) -> list[StationClient]:
        return [rs.replicas[0].client for rs in self.station_sets]

    @property
    def shards(self) -> list[tuple[ShardSpec, ShardClient]]:
        return [(spec, rs.replicas[0].client) for spec, rs in self.shard_sets]

    @property
    def station_state(self) -> list[PeerState]:
        return [rs.replicas[0].state for rs in self.station_sets]

    @property
    def shard_state(self) -> list[PeerState]:
        return [rs.replicas[0].state for _, rs in self.shard_sets]

    def sets(self) -> list[ReplicaSet]:
        """Every station's and shard's replica set, stations in chain order first."""
        return [*self.station_sets, *(rs for _, rs in self.shard_sets)]

    def probe_down(self) -> None:
        """Probe every replica that is down (ReplicaSet.probe_down), so one that came back rejoins."""
        for rs in self.sets():
            rs.probe_down()

    def replicas(self) -> list[tuple[str, int, Replica]]:
        """Every replica as (kind, range index, replica): stations in chain order, then shards."""
        return [("station", i, r) for i, rs in enumerate(self.station_sets) for r in rs.replicas] + \
               [("shard", spec.index, r) for spec, rs in self.shard_sets for r in rs.replicas]

    # -------------------------------------------------------- replicas

    def pinned(self, call: Call, kind: str, k: int, rset: ReplicaSet) -> Replica:
        """The replica of range k the call's generation is pinned to; on its first hop there, the
        least loaded one that is up (replica 0 when none is: its hop then waits for it)."""
        r = call.picks.get((kind, k))
        if r is None:
            # a shard keeps nothing of a generation: load alone chooses
            r = rset.choose(affinity=call.affinity if kind == "station" else None) or rset.replicas[0]
            r.load += 1
            call.picks[(kind, k)] = r
        return r

    def sweep(self, hung: Replica) -> None:
        """A replica hung (a lost node drops packets): ask every other replica that is up for its
        /healthz at once, so those that went with it (the same node) are marked down together,
        rather than each found after its own FAILOVER_SILENCE_S when a generation reaches it
        (may_probe)."""
        if not may_probe():
            return
        for _, _, r in self.replicas():
            if r is not hung and r.state.down_since is None and (r.check is None or r.check.done()):
                r.check = asyncio.get_running_loop().create_task(_probe_alive(r))

    def _move(self, call: Call, kind: str, k: int, rset: ReplicaSet, r: Replica, e: object) -> Replica:
        """Pin the call's generation to another replica of range k than r, which failed."""
        new = rset.choose(exclude=r)
        if new is None:  # every other one went down meanwhile: r's hop waits for r again
            return r
        r.load -= 1
        new.load += 1
        call.picks[(kind, k)] = new
        log.warning("request %s: %s is down (%s); moving to %s", call.rid, r.state.name, e, new.state.name)
        return new

    def unpin(self, picks: dict) -> list[tuple[str, int, Replica]]:
        """A generation ended: its replicas' loads drop. -> what it was pinned to."""
        out = []
        for (kind, k), r in picks.items():
            r.load -= 1
            out.append((kind, k, r))
        picks.clear()
        return out

    async def on_replica(self, call: Call, kind: str, k: int, rset: ReplicaSet, hop_timeout_s: float, what: str,
                         attempt: Callable[[Any, float], Awaitable[T]], why: str = "", wait: bool = True,
                         fresh: bool = False) -> T:
        """attempt(client, timeout_s) on the call's replica of range k (until_up; without wait, once,
        as the shards' degrade policy wants). When that replica is down and another of the range is
        up, the call's generation moves there: a shard's call runs again on it; a station's raises
        SessionLost, since the new replica does not hold the generation's KV caches (the engine
        replays exactly), unless the frame is `fresh` (a prefill from position 0, which starts the
        session wherever it lands). A replica already known down is left before it is tried."""
        while True:
            r = self.pinned(call, kind, k, rset)
            others = (lambda: rset.others_up(r)) if len(rset.replicas) > 1 else None
            if others is not None and r.state.down_since is not None and others():
                new = self._move(call, kind, k, rset, r, "marked down")
                if kind == "station" and not fresh and new is not r:
                    raise SessionLost(f"{r.state.name} is down; the generation moves to {new.state.name}, which does "
                                      f"not hold its KV caches")
                continue
            try:
                if wait:
                    try:
                        return await self.until_up(r.state, call, hop_timeout_s, what,
                                                   lambda t: attempt(r.client, t), why, r.client, others)
                    except PeerUnavailable as e:
                        if others is None:
                            raise
                        raise PeerUnavailable(f"{rset.name}: none of its {len(rset.replicas)} replicas is up; {e}",
                                              headers=e.headers) from None
                try:
                    return await self.watched(r.state, r.client, lambda: attempt(
                        r.client, call.timeout(hop_timeout_s, what)), others)
                except Exception as e:  # noqa: BLE001 - outages move to another replica, the rest raise
                    if not (others is not None and (isinstance(e, PeerHung) or unavailable(e))):
                        raise
                    r.state.down(time.monotonic())
                    if not others():
                        raise
                    raise ReplicaDown(e) from None
            except ReplicaDown as e:
                if isinstance(e.cause, PeerHung):
                    self.sweep(r)
                new = self._move(call, kind, k, rset, r, e)
                if kind == "station" and not fresh and new is not r:
                    raise SessionLost(f"{r.state.name} is down ({e}); the generation moves to {new.state.name}, "
                                      f"which does not hold its KV caches") from None

    # -------------------------------------------------------- waiting for a peer that is down

    async def until_up(self, peer: PeerState, call: Call, hop_timeout_s: float, what: str,
                       attempt: Callable[[float], Awaitable[T]], why: str = "", client: Any = None,
                       others: Callable[[], bool] | None = None) -> T:
        """attempt(timeout_s) until it succeeds, while `peer` is down for less than peer_wait_s and the
        request's deadline holds; then PeerUnavailable (503, Retry-After), or RequestTimeout (504) once
        the deadline has passed. Only outages are retried (unavailable()); any other failure is raised
        at once. client: the peer's typed client, whose binding is probed while a hop is slow (watched).
        others: whether another replica of the peer's range is up; then an outage raises ReplicaDown
        at once instead of waiting."""
        delay = 0.05
        while True:
            try:
                out = await self.watched(peer, client, lambda: attempt(call.timeout(hop_timeout_s, what)), others)
            except Exception as e:  # noqa: BLE001 - sorted by unavailable(): outages wait, the rest raise
                hung = isinstance(e, PeerHung)
                if not (hung or unavailable(e)):
                    raise
                now = time.monotonic()
                if now >= call.deadline:  # the request's time is up, not necessarily the peer
                    raise RequestTimeout(f"request {call.rid}: its deadline of {call.timeout_s:g} s (REQUEST_TIMEOUT_S) "
                                         f"passed during {what}: {type(e).__name__}: {e}") from None
                since = peer.down(e.quiet_since if hung else now)
                if others is not None and others():
                    raise ReplicaDown(e) from None
                give_up = min(since + self.peer_wait_s, call.deadline)
                if now >= give_up or hung:  # a hung peer has had its PEER_WAIT_S (watched)
                    raise PeerUnavailable(
                        f"{peer.name} is down (for {now - since:.1f} s; PEER_WAIT_S={self.peer_wait_s:g}): "
                        f"{type(e).__name__}: {e}{why}",
                        headers={"Retry-After": str(self.retry_after_s)}) from None
                log.warning("request %s: %s is down (%s: %s); retrying in %.2f s", call.rid, peer.name,
                            type(e).__name__, e, delay)
                await asyncio.sleep(min(delay, give_up - now))  # the last attempt falls on give_up
                delay = min(2 * delay, 1.0)
            else:
                peer.up()
                return out

    async def watched(self, peer: PeerState, client: Any, attempt: Callable[[], Awaitable[T]],
                      others: Callable[[], bool] | None = None) -> T:
        """attempt() -> its result, or PeerHung once neither it nor a probe of the peer's /healthz has
        answered for peer_wait_s (FAILOVER_SILENCE_S when others() says another replica of its range
        is up; MIN_SILENCE_S at least), counted from the last sign of life: the hop's start, or when
        the peer was last seen if it is down already.

        Why: a stopped (SIGSTOP) or wedged process still accepts connections, so its calls neither
        fail nor end before their timeout (STATION_TIMEOUT_S: minutes); a computing one answers the
        probes (its forward runs between them), so a long forward is not taken for a hang. Only
        where may_probe()."""
        if client is None or (binding := getattr(client, "binding", None)) is None or not may_probe():
            return await attempt()
        loop = asyncio.get_running_loop()
        now = time.monotonic()
        quiet_since = now if peer.down_since is None else peer.down_since
        wait_s = min(self.peer_wait_s, FAILOVER_SILENCE_S) if others is not None and others() else self.peer_wait_s
        silence_s = max(quiet_since + wait_s - now, MIN_SILENCE_S)
        watch: asyncio.Task | None = None

        async def probe(hang: asyncio.Timeout) -> None:
            nonlocal quiet_since
            while True:
                try:
                    async with asyncio.timeout_at(hang.when()):
                        await binding.fetch(Request("GET", PEER_URL + "/healthz"))
                except Exception:  # noqa: BLE001 - no answer is no sign of life; the hop's silence runs on
                    pass
                else:  # any reply, even an error status: the process runs
                    quiet_since = time.monotonic()
                    hang.reschedule(max(hang.when(), loop.time() + wait_s))
                await asyncio.sleep(PROBE_EVERY_S)

        def start(hang: asyncio.Timeout) -> None:
            nonlocal watch
            watch = loop.create_task(probe(hang))

        def marked_down() -> None:  # another hop or a sweep found it down: no need to wait out the silence
            if others is not None and others():
                hang.reschedule(loop.time())

        try:
            async with asyncio.timeout(silence_s) as hang:
                timer = loop.call_later(min(PROBE_EVERY_S, silence_s / 2), start, hang)
                peer.on_down.add(marked_down)
                try:
                    return await attempt()
                finally:
                    peer.on_down.discard(marked_down)
                    timer.cancel()
                    if watch is not None:
                        watch.cancel()
                        await asyncio.gather(watch, return_exceptions=True)
        except TimeoutError:
            if not hang.expired():
                raise  # the hop's own timeout
            raise PeerHung(f"{peer.name} answers nothing, neither the call nor GET /healthz, for "
                           f"{time.monotonic() - quiet_since:.1f} s (a stopped or wedged process)",
                           quiet_since) from None

    async def _shards(self, owners: list[int], call: Call, stage: str,
                      attempt: Callable[[ShardClient, float], Awaitable[wire.Envelope]]) -> list:
        """One call per shard index in owners, at once -> a reply or, under "degrade", the exception."""
        def one(k: int) -> Awaitable[wire.Envelope]:
            spec, rset = self.shard_sets[k]
            what = f"shard {spec.index} {stage}"
            if call.shard_failure == "degrade":  # the seed's allSettled: no waiting, a failure is degraded around
                return self.on_replica(call, "shard", k, rset, self.shard_timeout_s, what, attempt, wait=False)
            missing = (f"; the tokens [{spec.vocab_start}, {spec.vocab_end}) cannot be embedded or scored without it, "
                       f"so the request fails rather than answer without them (shard_failure=degrade opts into that)")
            return self.on_replica(call, "shard", k, rset, self.shard_timeout_s, what, attempt, missing)

        results = await asyncio.gather(*(one(k) for k in owners), return_exceptions=True)
        for r in results:  # another knot version, or a refusal over its integrity: never degraded around
            if isinstance(r, IntegrityFailure):
                raise r
        failed = [r for r in results if isinstance(r, BaseException)]
        if failed and (call.shard_failure != "degrade" or any(isinstance(r, RequestTimeout) for r in failed)):
            down = [r for r in failed if isinstance(r, PeerUnavailable)]
            if len(down) > 1 and len(down) == len(failed):  # name every missing range
                raise PeerUnavailable("; ".join(str(r) for r in down), headers=down[0].headers)
            raise failed[0]
        return results

    # -------------------------------------------------------- the shards

    async def embed(self, call: Call, tokens: list[int], position: int) -> np.ndarray:
        """tokens (T,) -> (T, dim): sum of the partial embeddings of the shards that own a token.

        Rows already kept (self.rows) are not asked for; a decode step whose tokens are all kept
        makes no embed hop. A kept row is what the sum gave for its token: the owner's row plus the
        other shards' zeros, so the bits do not depend on where it came from."""
        out = np.zeros((len(tokens), self.dim), np.float32)  # (T, dim)
        fetch = []  # the rows still needed
        for i, t in enumerate(tokens):
            row = self.rows.checked(t, self.knot_etag or "") if self.rows.budget_bytes else None
            if row is None:
                fetch.append(i)
            else:
                out[i] = row
        if not fetch:
            return out
        ids = np.asarray([tokens[i] for i in fetch], dtype=np.int32)  # (F,) the rows still needed
        # position: the first row's, as the frame always carried (the shards only check T = seq_len - position)
        frame = wire.Envelope(call.rid, "embed", position + fetch[0], position + fetch[0] + len(ids), ids)
        owners = [k for k, (s, _) in enumerate(self.shard_sets) if ((ids >= s.vocab_start) & (ids < s.vocab_end)).any()]
        t0 = time.perf_counter()
        results = await self._shards(owners, call, "embed", lambda shard, t: shard.embed(frame, t))
        call.hops.add("embed", t0)
        got = np.zeros((len(ids), self.dim), np.float32)  # (F, dim)
        ok = np.zeros(len(ids), bool)  # the owner answered: the row is the token's
        for k, res in zip(owners, results):
            spec = self.shard_sets[k][0]
            if not isinstance(res, BaseException):
                if (bad := misfit(res, frame, "embed", got.shape)) is not None:
                    res = BadGateway(f"shard {spec.index} embed reply: {bad}")
                    self._refuse(res, call)
            if isinstance(res, BaseException):
                self._degrade(spec, "embed", res, call.degraded)
                continue  # its tokens stay zero: wrong, but local (seed section 3), and reported
            got += res.array  # μ: elementwise sum of disjoint partials
            ok |= (ids >= spec.vocab_start) & (ids < spec.vocab_end)
        out[fetch] = got
        if self.rows.budget_bytes:
            for j in np.flatnonzero(ok):  # never a degraded (zero) row; a copy, not a view of got
                self.rows.keep(int(ids[j]), got[j].copy(), self.knot_etag or "")
        return out

    @property
    def row_rejects(self) -> int:
        """Kept rows whose seal no longer held (asked of their shard again)."""
        return self.rows.rejects

    async def logits(self, call: Call, h: np.ndarray, position: int) -> np.ndarray:
        """h (T, dim) final normed hidden -> (T, vocab) logits, slices concatenated in vocab order."""
        frame = wire.Envelope(call.rid, "logits", position, position + h.shape[0], h)
        t0 = time.perf_counter()
        results = await self._shards(list(range(len(self.shard_sets))), call, "logits",
                                     lambda shard, t: shard.logits(frame, t))
        call.hops.add("logits", t0)
        out = np.full((h.shape[0], self.vocab_size), -np.inf, np.float32)  # (T, vocab)
        ok = 0
        for (spec, _), res in zip(self.shard_sets, results):
            want = (h.shape[0], spec.n_rows)
            if not isinstance(res, BaseException):
                bad = misfit(res, frame, "logits", want) or (None if np.isfinite(res.array).all() else
                                                             "non-finite logits")
                if bad is not None:
                    res = BadGateway(f"shard {spec.index} logits reply: {bad}")
                    self._refuse(res, call)
            if isinstance(res, BaseException):
                self._degrade(spec, "logits", res, call.degraded)  # its slice stays -inf: never sampled
                continue
            out[:, spec.vocab_start:spec.vocab_end] = res.array
            ok += 1
        if ok == 0:
            raise ServiceUnavailable("every shard failed at the LM head; no token can be sampled",
                                     headers={"Retry-After": str(self.retry_after_s)})
        return out

    async def sample(self, call: Call, h: np.ndarray, position: int, spec: wire.SampleSpec) -> list[RowSummary]:
        """h (T, dim) final normed hidden, the first row's input at position -> per row the merged
        summaries of the slices (common/shard_sampling.py), not their logits."""
        frame = wire.Envelope(call.rid, "logits", position, position + h.shape[0], h)
        t0 = time.perf_counter()
        results = await self._shards(list(range(len(self.shard_sets))), call, "logits",
                                     lambda shard, t: shard.sample(spec, frame, t))
        call.hops.add("logits", t0)  # the LM-head hop, whatever the shards send back
        slices = []
        for (spec_s, _), res in zip(self.shard_sets, results):
            if not isinstance(res, BaseException):
                sl, bad = _slice(spec_s, res, frame, spec)
                if bad is None:
                    slices.append(sl)
                    continue
                res = BadGateway(f"shard {spec_s.index} sample reply: {bad}")
                self._refuse(res, call)
            self._degrade(spec_s, "logits", res, call.degraded)  # its slice is left out: never sampled
        if not slices:
            raise ServiceUnavailable("every shard failed at the LM head; no token can be sampled",
                                     headers={"Retry-After": str(self.retry_after_s)})
        return merge(slices, self.vocab_size, position + 1)

    @staticmethod
    def _refuse(err: BadGateway, call: Call) -> None:
        """A reply of the wrong shape is a broken peer: degraded around only when the request opted in."""
        if call.shard_failure != "degrade":
            raise err

    # -------------------------------------------------------- the stations

    async def stations_forward(self, call: Call, mode: str, position: int, x: np.ndarray,
                               rewind: bool = False) -> np.ndarray:
        """x (T, dim) through every station in order -> the exit's final normed hidden: (1, dim) for a
        prefill, (T, dim) for a decode. rewind: the stations first drop their positions >= position.
        A generation's decode steps go through step()."""
        return await self._chain(call, mode, position, x, rewind)

    async def step(self, call: Call, tokens: list[int], position: int, rewind: bool,
                   spec: wire.SampleSpec | None) -> tuple[np.ndarray, list[RowSummary] | None]:
        """A decode step: tokens (T,) embedded and through every station -> the exit's rows (T, dim),
        and with spec the LM head's summaries of them (sample()). Concurrent generations' steps go
        together (STEP_BATCH: _steps)."""
        if self.steps is not None:
            self.stepping.add(call.rid)
            return await self.steps.submit((call, tokens, position, rewind, spec))
        return await self.step_alone(call, tokens, position, rewind, spec)

    async def _alone(self, call: Call, position: int, x: np.ndarray, rewind: bool, spec: wire.SampleSpec | None,
                     first: int = 0, again: bool = False) -> tuple[np.ndarray, list[RowSummary] | None]:
        """step(), one generation's calls, from station `first` on (_chain)."""
        h = await self._chain(call, "decode", position, x, rewind, first, again)
        return h, None if spec is None else await self.sample(call, h, position, spec)

    async def _chain(self, call: Call, mode: str, position: int, h: np.ndarray, rewind: bool = False,
                     first: int = 0, again: bool = False) -> np.ndarray:
        """stations_forward(), one generation's calls, from station `first` on. again: station `first`
        may have applied the frame already (its bundle failed), so it drops what it holds from
        position on first: the frame then runs once either way."""
        for i in range(first, len(self.station_sets)):
            h = await self._hop(i, call, mode, position, h, rewind or (again and i == first))
        return h

    # -------------------------------------------------------- continuous batching (STEP_BATCH)
    # The generations' decode steps that arrive while a step runs wait for it (services/batcher.py),
    # then cross each station, and their LM-head calls each shard, as one call per replica: a bundle
    # (services/bundle.py), which the station runs as one forward and the shard as one product. So
    # a weight is read once per step for every generation, and a hop's fixed cost is paid once.
    # A bundle that fails as a whole (its replica down, hung, another version) or a part that fails
    # (an unknown session, a malformed reply) leaves that generation to its own calls, from that hop
    # on, where every failure has its rule (on_replica, until_up, the replay): the tokens are the
    # same either way, since a station computes each session's rows as it would alone.

    async def _steps(self, steps: list[tuple[Call, list[int], int, bool, wire.SampleSpec | None]]) -> list:
        """The steps Batcher's run: step()'s arguments per generation -> step()'s result. The embedding
        and the LM head are part of the step: the generations come back together for the next one."""
        if len(steps) == 1:
            call, tokens, position, rewind, spec = steps[0]
            return [await _own(call, lambda: self.step_alone(call, tokens, position, rewind, spec))]
        await self._keep_rows(steps)
        xs = await asyncio.gather(*(_own(c, lambda c=c, t=t, p=p: self.embed(c, t, p)) for c, t, p, _, _ in steps),
                                  return_exceptions=True)
        out: list = [None] * len(steps)
        for j, x in enumerate(xs):
            if isinstance(x, BaseException):
                if not isinstance(x, Exception):
                    raise x
                out[j] = x
        hs = list(xs)  # generation j's rows so far
        alone: list[tuple[int, asyncio.Future]] = []
        live = [j for j in range(len(steps)) if out[j] is None]
        try:
            for i, rset in enumerate(self.station_sets):
                frames = {j: wire.Envelope(steps[j][0].rid, "decode", steps[j][2], steps[j][2] + hs[j].shape[0],
                                           hs[j], steps[j][3]) for j in live}
                got: dict[int, np.ndarray] = {}
                t0 = time.perf_counter()

                async def bundle(r: Replica, idx: list[int], i: int = i, rset: ReplicaSet = rset,
                                 frames: dict = frames, got: dict = got) -> None:
                    replies = await self._bundle(r, rset, "station", "/forward_many", [steps[j][0] for j in idx],
                                                 self.station_timeout_s, f"station {i} decode",
                                                 lambda client, t: client.forward_many([frames[j] for j in idx], t))
                    for j, rep in zip(idx, replies or ()):
                        if rep is not None and misfit(rep, frames[j], "decode", (hs[j].shape[0], self.dim)) is None:
                            got[j] = rep.array
                    self.unbundled += sum(j not in got for j in idx)

                groups = self._groups([steps[j][0] for j in live], "station", i, rset)
                await asyncio.gather(*(bundle(r, [live[q] for q in idx]) for r, idx in groups if len(idx) > 1))
                for j in live:
                    if j in got:
                        steps[j][0].hops.add(f"station_{i}", t0)
                        hs[j] = got[j]
                    else:  # its own calls from here on, beside the others
                        call, _, position, rewind, spec = steps[j]
                        alone.append((j, asyncio.ensure_future(_own(call, lambda call=call, position=position,
                                                                        rewind=rewind, spec=spec, j=j, i=i: self._alone(
                            call, position, hs[j], rewind, spec, first=i, again=True)))))
                live = [j for j in live if j in got]
            for j in live:
                out[j] = (hs[j], None)
            need = [j for j in live if steps[j][4] is not None]
            for j, res in zip(need, await self._samples([(steps[j][0], hs[j], steps[j][2], steps[j][4])
                                                         for j in need]) if need else ()):
                out[j] = res if isinstance(res, BaseException) else (hs[j], res)
            for j, task in alone:
                try:
                    out[j] = await task
                except Exception as e:  # noqa: BLE001 - that generation's failure, raised to it alone
                    out[j] = e
        finally:
            for _, task in alone:
                task.cancel()
        return out

    async def step_alone(self, call: Call, tokens: list[int], position: int, rewind: bool,
                         spec: wire.SampleSpec | None) -> tuple[np.ndarray, list[RowSummary] | None]:
        """step(), one generation's calls."""
        return await self._alone(call, position, await self.embed(call, tokens, position), rewind, spec)

    async def _keep_rows(self, steps: list[tuple[Call, list[int], int, bool, wire.SampleSpec | None]]) -> None:
        """The embedding rows of the steps' tokens that are not kept yet, in one fan-out for all of
        them, so each step's embed finds its rows kept (embed()). A failure here is left to those
        embeds, under each generation's own rules (waiting, degrade): nothing fetched here is used
        but through the kept rows, which hold only answered rows."""
        if not self.rows.budget_bytes:
            return
        etag = self.knot_etag or ""
        missing = list(dict.fromkeys(t for _, tokens, _, _, _ in steps for t in tokens
                                     if self.rows.checked(t, etag) is None))
        if not missing:
            return
        first = steps[0][0]
        fill = Call(first.rid, Hops(), min(c.deadline for c, *_ in steps), "degrade", [], first.timeout_s)
        tracing.leave()  # made for several generations: none's trace nor count (STEP_BATCH is 0 on Workers)
        subrequests.leave()
        try:
            await self.embed(fill, missing, 0)
        except Exception as e:  # noqa: BLE001 - each generation's embed asks again, with its own rules
            log.info("embedding %d rows for %d steps at once failed (%s: %s); each embeds its own",
                     len(missing), len(steps), type(e).__name__, e)
        finally:
            self.unpin(fill.picks)

    async def _samples(self, items: list[tuple[Call, np.ndarray, int, wire.SampleSpec]]) -> list:
        """sample()'s arguments per generation -> its rows' summaries, or its exception."""
        if len(items) == 1:
            try:
                return [await _own(items[0][0], lambda: self.sample(*items[0]))]
            except Exception as e:  # noqa: BLE001 - that generation's failure, raised to it alone
                return [e]
        frames = [wire.Envelope(call.rid, "logits", pos, pos + h.shape[0], h) for call, h, pos, _ in items]
        bodies = [wire.encode_sample_request(spec, f) for (_, _, _, spec), f in zip(items, frames)]  # each shard's
        slices: list[list[SliceSummary | None]] = [[None] * len(self.shard_sets) for _ in items]
        t0 = time.perf_counter()

        async def bundle(k: int, r: Replica, idx: list[int]) -> None:
            spec_s, rset = self.shard_sets[k]
            replies = await self._bundle(r, rset, "shard", "/sample_many", [items[j][0] for j in idx],
                                         self.shard_timeout_s, f"shard {spec_s.index} logits",
                                         lambda client, t: client.sample_many([bodies[j] for j in idx], t))
            for j, envs in zip(idx, replies or ()):
                if envs is not None:
                    sl, bad = _slice(spec_s, envs, frames[j], items[j][3])
                    slices[j][k] = sl if bad is None else None

        await asyncio.gather(*(bundle(k, r, idx) for k, (_, rset) in enumerate(self.shard_sets)
                               for r, idx in self._groups([c for c, _, _, _ in items], "shard", k, rset)))
        out: list = [None] * len(items)
        again = []
        for j, (call, h, pos, spec) in enumerate(items):
            if all(sl is not None for sl in slices[j]):
                call.hops.add("logits", t0)
                out[j] = merge(slices[j], self.vocab_size, pos + 1)
            else:  # every shard again, as its own calls: a failure there has its rule (fail, degrade)
                again.append(j)
        self.unbundled += len(again)
        redone = await asyncio.gather(*(_own(items[j][0], lambda j=j: self.sample(*items[j])) for j in again),
                                      return_exceptions=True)
        for j, res in zip(again, redone):
            if isinstance(res, BaseException) and not isinstance(res, Exception):
                raise res
            out[j] = res
        return out

    def step_stats(self) -> dict | None:
        """What continuous batching did: the steps' batches, the bundles sent by hop and the parts made
        alone after all; None when it is off (STEP_BATCH)."""
        if self.steps is None:
            return None
        return {"steps": self.steps.stats(), "bundles": dict(self.bundled),
                "made_alone": self.unbundled, "stepping": len(self.stepping)}

    def _groups(self, calls: list[Call], kind: str, k: int, rset: ReplicaSet) -> list[tuple[Replica, list[int]]]:
        """The calls by the replica of range k each is pinned to -> (replica, their indexes)."""
        groups: dict[int, tuple[Replica, list[int]]] = {}
        for j, call in enumerate(calls):
            r = self.pinned(call, kind, k, rset)
            groups.setdefault(id(r), (r, []))[1].append(j)
        return list(groups.values())

    async def _bundle(self, r: Replica, rset: ReplicaSet, kind: str, path: str, calls: list[Call],
                      hop_timeout_s: float, what: str, attempt: Callable[[Any, float], Awaitable[list]]) -> list | None:
        """attempt(client, timeout_s), one call on replica r for several generations -> its parts' results;
        None when it failed as a whole (each generation then makes its own call). An outage marks r
        down, so those calls move at once where another replica of the range is up."""
        if r.state.down_since is not None:
            return None
        try:
            timeout_s = max(c.timeout(hop_timeout_s, what) for c in calls)
        except RequestTimeout:  # one's deadline passed: each its own call, that one's a 504
            return None
        tracing.leave()  # the call is every generation's: each records its span and counts it below
        subrequests.leave()
        others = (lambda: rset.others_up(r)) if len(rset.replicas) > 1 else None
        t0 = time.perf_counter()
        try:
            out = await self.watched(r.state, r.client, lambda: attempt(r.client, timeout_s), others)
            status = "200"
        except Exception as e:  # noqa: BLE001 - the parts are made alone, where failures have their rules
            if isinstance(e, PeerHung) or unavailable(e):
                r.state.down(e.quiet_since if isinstance(e, PeerHung) else time.monotonic())
                if isinstance(e, PeerHung):
                    self.sweep(r)
            log.warning("%s of %d generations on %s failed (%s: %s); each makes its own call", path, len(calls),
                        r.state.name, type(e).__name__, e)
            out, status = None, tracing.outcome(e)
        else:
            r.state.up()
        t1 = time.perf_counter()
        for c in calls:
            if c.counter is not None:
                c.counter.add()
            tracing.shared_span(c.trace, path, r.binding, t0, t1, status)
        self.bundled[kind] += 1
        return out

    async def _hop(self, i: int, call: Call, mode: str, position: int, h: np.ndarray,
                   rewind: bool = False, keys: tuple[bytes | None, tuple[bytes, ...]] = (None, ())) -> np.ndarray:
        """h (T, dim) through station i -> its output rows, timed as hop station_i. A station that is
        down is waited for (until_up); once it is back it answers UnknownSession (SessionLost) and
        the caller replays, as it does when the generation moves to another replica (on_replica).
        keys: a prompt chunk's prefix and block keys (wire.Envelope)."""
        frame = wire.Envelope(call.rid, mode, position, position + h.shape[0], h, rewind, *keys)
        t0 = time.perf_counter()
        out = await self.on_replica(call, "station", i, self.station_sets[i], self.station_timeout_s,
                                    f"station {i} {mode} at {position}", lambda st, t: st.forward(frame, t),
                                    fresh=mode == "prefill" and position == 0)
        call.hops.add(f"station_{i}", t0)
        # Why: a station stacks several requests' decode frames and splits the rows back. A reply
        # that is not this frame's rows would be computed on as if it were: other tokens, a 200.
        # The exit station sends a prefill's last row only (its logits are all a prompt needs).
        rows = 1 if mode == "prefill" and i == len(self.station_sets) - 1 else h.shape[0]
        if (bad := misfit(out, frame, mode, (rows, self.dim))) is not None:
            raise BadGateway(f"station {i} {mode} reply: {bad}")
        return out.array

    async def prefill(self, call: Call, ids: list[int], chunks: list[tuple[int, int]],
                      keys: list[bytes] | None = None) -> np.ndarray:
        """A prompt's chunks [(a, b)] through the embedding and every station, pipelined (the
        seed's Wallington Rotation): chunk k+1 enters station 0 while chunk k runs on station 1.
        Each station still receives its chunks in order, as its KV cache needs. A chunk is
        embedded once the previous one has entered station 0, so at most about two chunks of
        activations are alive. -> the exit's (1, dim) for the last chunk.

        keys: the prompt's block keys (common.prefix.block_keys): each chunk then names the prefix
        before it and the whole blocks it holds, so the stations keep them (prompt caching); a first
        chunk after position 0 starts its sessions from the blocks they keep."""
        entered = [asyncio.Event() for _ in chunks]                        # station 0 began chunk k
        done = [[asyncio.Event() for _ in chunks] for _ in self.station_sets]  # [station][chunk] finished
        aborted = False

        async def after(ev: asyncio.Event) -> None:
            await ev.wait()
            if aborted:
                raise PrefillAborted("an earlier chunk failed")

        def chunk_keys(a: int, b: int) -> tuple[bytes | None, tuple[bytes, ...]]:
            if keys is None or a % PREFIX_BLOCK_TOKENS:
                return None, ()
            j = a // PREFIX_BLOCK_TOKENS  # keys[j + i] names the tokens up to its i-th whole block's end
            return keys[j], tuple(keys[j + 1:b // PREFIX_BLOCK_TOKENS + 1])

        async def run(k: int, a: int, b: int) -> np.ndarray:
            if k:
                await after(entered[k - 1])
            h = await self.embed(call, ids[a:b], a)                        # (T_k, dim)
            for i in range(len(self.station_sets)):
                if k:
                    await after(done[i][k - 1])  # station i has taken chunk k-1 in full
                if i == 0:
                    entered[k].set()
                h = await self._hop(i, call, "prefill", a, h, False, chunk_keys(a, b))
                done[i][k].set()
            return h

        tasks = [asyncio.ensure_future(run(k, a, b)) for k, (a, b) in enumerate(chunks)]
        try:
            return (await asyncio.gather(*tasks))[-1]
        except BaseException:
            # A failed chunk never sets its events: the later chunks would wait forever. Cancelling
            # them was not enough while Python 3.11's asyncio.wait_for dropped a cancellation that
            # arrived as its call completed (peer.call now stops there), and a chunk must never
            # wait for an event nobody will set: every event is set too, and a chunk that wakes to
            # `aborted` stops.
            aborted = True
            for ev in [*entered, *(e for row in done for e in row)]:
                ev.set()
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            raise

    async def cached_blocks(self, call: Call, keys: list[bytes], most: int) -> int:
        """How many leading blocks of a prompt (its block keys) every station's prompt cache holds, at
        most `most`: one call to each station at once. A station that does not answer holds none
        (the prompt then runs from 0, and its own hops wait for the station as ever)."""
        if most <= 0:
            return 0
        keys = keys[:most + 1]

        async def one(i: int) -> int:
            st = self.pinned(call, "station", i, self.station_sets[i]).client
            t0 = time.perf_counter()
            try:
                return await st.prefix(keys, call.timeout(self.station_timeout_s, f"station {i} prefix"))
            except Exception as e:  # noqa: BLE001 - a hint: without it the prompt runs from 0
                log.info("request %s: station %d did not say which blocks it holds (%s: %s)", call.rid, i,
                         type(e).__name__, e)
                return 0
            finally:
                call.hops.add("prefix", t0)

        return min(await asyncio.gather(*(one(i) for i in range(len(self.station_sets)))))

    async def release(self, rid: str, picks: dict | None = None) -> None:
        """Free the request's KV caches on the stations (best effort, after the response): on the
        replicas its generation was pinned to (picks: Call.picks, then emptied) that are up, or on
        replica 0 of each station without picks."""
        self.stepping.discard(rid)
        if picks is None:
            held = [(i, rs.replicas[0]) for i, rs in enumerate(self.station_sets)]
        else:
            held = [(i, r) for kind, i, r in self.unpin(picks) if kind == "station" and r.state.down_since is None]

        async def one(i: int, r: Replica) -> None:
            try:
                await r.client.release(rid)
            except (HttpError, TimeoutError) as e:
                log.warning("release %s on %s failed: %s", rid, r.state.name, e)

        await asyncio.gather(*(one(i, r) for i, r in held))

    @staticmethod
    def _degrade(spec: ShardSpec, stage: str, err: BaseException, degraded: list[Degradation]) -> None:
        msg = f"{type(err).__name__}: {err}" if str(err) else type(err).__name__
        log.warning("shard %d [%d, %d) degraded at %s: %s", spec.index, spec.vocab_start, spec.vocab_end, stage, msg)
        degraded.append(Degradation(spec.index, spec.vocab_start, spec.vocab_end, stage, msg))
