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
                 retry_after_s: int = 1, knot_etag: str | None = None, row_cache_bytes: int = 0):
        """stations: per station, entry first, its service binding, or its replicas' (a list of
        bindings or of (binding name, binding)); shards: (spec, binding or replicas) sorted by
        vocab_start, tiling [0, vocab). Each binding is called through its typed client, which pins
        every hop to knot_etag (None: not checked). row_cache_bytes: embedding rows kept from the
        shards' replies (embed()); a pipeline serves one knot version, so its rows are that version's."""
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
                sl = SliceSummary(spec_s.vocab_start, spec_s.vocab_end, *(e.array for e in res))
                bad = next((b for e in res if (b := not_for(e, frame, "sample")) is not None), None) or \
                    sl.check(h.shape[0], spec.lse)
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
        prefill, (T, dim) for a decode. rewind: the stations first drop their positions >= position."""
        h = x
        for i in range(len(self.station_sets)):
            h = await self._hop(i, call, mode, position, h, rewind)
        return h

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
