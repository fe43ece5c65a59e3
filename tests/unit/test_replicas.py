"""Replicas of stations and shards (issue 56): the layout renders them, the coordinator's settings
read them, and the pipeline pins generations to the least loaded replica that is up, moves off one
that fails, and lets one that comes back rejoin; against fakes of our station and shard interfaces.
tests/integration/test_replicas_cluster.py kills real processes mid-stream."""
from __future__ import annotations

import asyncio

import numpy as np
import pytest

from common import wire
from common.runtime import Env, Request, Response, ServiceUnavailable
from common.topology import ClusterLayout, ShardSpec, TopologyError
from deploy import compose_writer
from services.coordinator.handler import CoordinatorSettings
from services.coordinator.pipeline import Call, PeerUnavailable, Pipeline
from services.station.station_client import SessionLost

DIM = 4
HPARAMS = {"block_count": 4, "vocab_size": 1000}


# ---------------------------------------------------------------- the layout


def test_replicas_are_services_bindings_and_the_coordinators_lists():
    layout = ClusterLayout.build(HPARAMS, 2, 2, replicas=3)
    assert [s.name for s in layout.by_role("station")] == ["station-0", "station-0-r1", "station-0-r2",
                                                           "station-1", "station-1-r1", "station-1-r2"]
    assert [s.name for s in layout.by_role("shard")] == ["shard-0", "shard-0-r1", "shard-0-r2",
                                                         "shard-1", "shard-1-r1", "shard-1-r2"]
    # each replica runs its range's handler with the same vars
    assert layout.service("station-1-r2").vars == layout.service("station-1").vars
    assert layout.service("shard-0-r1").vars == layout.service("shard-0").vars
    co = layout.service("coordinator")
    assert co.vars["STATIONS"] == "STATION_0|STATION_0_R1|STATION_0_R2,STATION_1|STATION_1_R1|STATION_1_R2"
    assert co.vars["SHARDS"] == "SHARD_0|SHARD_0_R1|SHARD_0_R2:0-500,SHARD_1|SHARD_1_R1|SHARD_1_R2:500-1000"
    bound = {b.name: b.service for b in co.bindings if b.kind == "service"}
    assert bound["STATION_1_R2"] == "station-1-r2" and bound["SHARD_0_R1"] == "shard-0-r1"
    assert co.depends_on["shard-1-r2"] == "healthy"
    text = compose_writer.render_text(layout)
    assert "  station-0-r2:\n" in text and "STATION_1_R1: http://station-1-r1:8080" in text


def test_one_replica_is_todays_layout():
    one, default = ClusterLayout.build(HPARAMS, 2, 2, replicas=1), ClusterLayout.build(HPARAMS, 2, 2)
    assert one == default and one.service("coordinator").vars["STATIONS"] == "STATION_0,STATION_1"


@pytest.mark.parametrize("n", [0, -1, 9])
def test_a_replica_count_out_of_range_is_refused(n):
    with pytest.raises(TopologyError, match=f"{n} replicas"):
        ClusterLayout.build(HPARAMS, 2, 2, replicas=n)


def test_the_coordinator_reads_replicas_joined_by_a_bar():
    s = CoordinatorSettings.from_env(Env({}, {"KNOT_KEY": "m.knot", "STATIONS": "STATION_0|STATION_0_R1,STATION_1",
                                              "SHARDS": "SHARD_0|SHARD_0_R1:0-500,SHARD_1:500-1000"}))
    assert s.stations == (("STATION_0", "STATION_0_R1"), ("STATION_1",))
    assert s.shards == ((("SHARD_0", "SHARD_0_R1"), 0, 500), (("SHARD_1",), 500, 1000))
    for bad, why in (("STATION_0||STATION_0_R1", "an empty binding name"), ("STATION_0|STATION_0", "named twice")):
        with pytest.raises(TopologyError, match=why):
            CoordinatorSettings.from_env(Env({}, {"KNOT_KEY": "m.knot", "STATIONS": bad, "SHARDS": "SHARD_0:0-1"}))


# ---------------------------------------------------------------- the pipeline


class Station:
    """A station replica that keeps its sessions' lengths, as services/station does; `dead`: refuses
    every call as an unreachable process does."""

    def __init__(self, name: str, exit: bool = False):
        self.name, self.exit, self.dead = name, exit, False
        self.sessions: dict[str, int] = {}
        self.calls: list[tuple[str, int]] = []

    async def fetch(self, request: Request) -> Response:
        if self.dead:
            raise ServiceUnavailable(f"{self.name}: cannot connect")
        if request.method == "GET":  # /readyz, /healthz
            return Response.from_json({"ready": True})
        if request.path.startswith("/release/"):
            return Response.from_json({"released": self.sessions.pop(request.path.split("/")[-1], None) is not None})
        env = wire.decode_envelope(request.body)
        self.calls.append((env.request_id, env.position))
        held = self.sessions.get(env.request_id)
        if not (env.mode == "prefill" and env.position == 0) and held != env.position:
            return Response.from_json({"error": "UnknownSession", "message": "no session"}, 409)
        self.sessions[env.request_id] = env.seq_len
        rows = env.array[-1:] if self.exit and env.mode == "prefill" else env.array
        out = wire.Envelope(env.request_id, env.mode, env.position, env.seq_len, rows + 1)
        return Response.from_bytes(wire.encode_envelope(out), wire.ENVELOPE_CONTENT_TYPE)


class Shard:
    def __init__(self, name: str):
        self.name, self.dead, self.calls = name, False, 0

    async def fetch(self, request: Request) -> Response:
        if self.dead:
            raise ServiceUnavailable(f"{self.name}: cannot connect")
        if request.method == "GET":  # /readyz, /healthz
            return Response.from_json({"ready": True})
        self.calls += 1
        env = wire.decode_envelope(request.body)
        x = np.repeat(env.array.astype(np.float32)[:, None], DIM, axis=1)  # row t = token id
        return Response.from_bytes(wire.encode_envelope(wire.Envelope(env.request_id, "embed", env.position,
                                                                      env.seq_len, x)), wire.ENVELOPE_CONTENT_TYPE)


def cluster(peer_wait_s: float = 0.0):
    st = [[Station("s0"), Station("s0r1")], [Station("s1", True), Station("s1r1", True)]]
    sh = [Shard("h0"), Shard("h0r1")]
    return Pipeline(st, [(ShardSpec(0, 0, 1000), sh)], DIM, 1000, 5.0, 5.0, peer_wait_s), st, sh


async def step(p: Pipeline, call: Call, tokens: list[int], position: int) -> np.ndarray:
    x = await p.embed(call, tokens, position)
    if position == 0:
        return await p.prefill(call, tokens, [(0, len(tokens))])
    return await p.stations_forward(call, "decode", position, x)


async def test_generations_spread_over_the_least_loaded_replicas_and_keep_them():
    p, st, sh = cluster()
    a, b = Call("a"), Call("b")
    await step(p, a, [1, 2, 3], 0)
    await step(p, b, [4, 5], 0)
    assert [r.binding for r in a.picks.values()] == ["SHARD_0", "STATION_0", "STATION_1"]
    assert [r.binding for r in b.picks.values()] == ["SHARD_0_R1", "STATION_0_R1", "STATION_1_R1"]
    for _ in range(3):  # every later token on the same replicas
        await step(p, a, [7], st[1][0].sessions["a"])
    assert "a" not in st[1][1].sessions and st[1][0].sessions["a"] == 6
    await p.release("b", b.picks)  # b's replicas are the least loaded again
    assert [r.load for r in p.station_sets[1].replicas] == [1, 0] and not b.picks
    c = Call("c")
    await step(p, c, [9], 0)
    assert c.picks[("station", 1)].binding == "STATION_1_R1"


async def test_a_dead_station_replica_moves_the_generation_by_replay_and_a_dead_shard_one_at_once():
    p, st, sh = cluster(peer_wait_s=30.0)  # a wait would show: failover must not wait for PEER_WAIT_S
    a = Call("a")
    await step(p, a, [1, 2, 3], 0)
    st[1][0].dead = True
    with pytest.raises(SessionLost, match="station 1 is down .* moves to station 1 replica 1"):
        await step(p, a, [7], 3)
    assert a.picks[("station", 1)].binding == "STATION_1_R1"
    assert p.station_sets[1].replicas[0].state.down_since is not None
    await step(p, a, [1, 2, 3], 0)  # the engine's replay, from position 0, lands on the new replica
    await step(p, a, [7], 3)
    assert st[1][1].sessions["a"] == 4
    sh[0].dead = True
    calls = sh[1].calls
    h = await step(p, a, [8], 4)  # the shard's call runs again on its other replica: no error
    assert sh[1].calls == calls + 1 and a.picks[("shard", 0)].binding == "SHARD_0_R1" and h.shape == (1, DIM)


async def test_a_range_with_no_replica_up_is_503_naming_it_and_a_replica_that_answers_rejoins():
    p, st, sh = cluster(peer_wait_s=0.0)
    for s in sh:
        s.dead = True
    with pytest.raises(PeerUnavailable, match=r"shard 0: none of its 2 replicas is up"):
        await step(p, Call("a"), [1], 0)
    assert all(r.state.down_since is not None for r in p.shard_sets[0][1].replicas)
    sh[1].dead = False
    p.probe_down()  # what a new generation's choice, and a /metrics scrape, do
    await asyncio.sleep(0.05)
    assert [r.state.down_since is None for r in p.shard_sets[0][1].replicas] == [False, True]
    b = Call("b")
    await step(p, b, [1], 0)
    assert b.picks[("shard", 0)].binding == "SHARD_0_R1"


# ---------------------------------------------------------------- affinity (prompt caching's routing)


async def test_one_affinity_keeps_its_replicas_and_a_hot_one_still_spreads():
    p, st, sh = cluster()
    rset = p.station_sets[1]
    first = [rset.choose(affinity=b"prefix-a").binding for _ in range(3)]  # nothing pinned: always its own
    assert len(set(first)) == 1
    others = {rset.choose(affinity=bytes([i])).binding for i in range(16)}
    assert others == {"STATION_1", "STATION_1_R1"}  # affinities are spread by their hash
    calls = [Call(f"g{i}", affinity=b"prefix-a") for i in range(6)]
    for c in calls:  # six at once on one hot prefix: bounded loads, not all on one replica
        await step(p, c, [1, 2], 0)
    loads = sorted(r.load for r in rset.replicas)
    assert sum(loads) == 6 and loads[-1] <= 4, loads  # at most ceil(1.25 * the mean)
    assert calls[0].picks[("station", 1)].binding == first[0]
    assert {c.picks[("shard", 0)].load for c in calls} == {3}  # shards: load alone


def test_the_affinity_header_is_bounded():
    from services.coordinator.handler import _affinity
    from common.runtime import BadRequest

    assert _affinity(Request("POST", "https://c/v1/completions", {"X-Session-Affinity": "chat-42"})) == b"hint:chat-42"
    assert _affinity(Request("POST", "https://c/v1/completions")) is None
    for bad in ("", " ", "x" * 257):
        with pytest.raises(BadRequest, match="X-Session-Affinity"):
            _affinity(Request("POST", "https://c/v1/completions", {"X-Session-Affinity": bad}))


def test_cloudflare_renders_a_worker_per_replica_bound_to_the_coordinator():
    from deploy import wrangler

    workers = {w.name: w for w in wrangler.plan(4, 1000, "m.knot", 2, 2, replicas=2)}
    assert {"knot-station-1-r1", "knot-shard-0-r1"} <= set(workers)
    one, other = workers["knot-station-1"], workers["knot-station-1-r1"]
    assert one.vars["STATION_INSTANCE"] == other.vars["STATION_INSTANCE"]  # each its own Worker's Durable Object
    co = workers["knot-coordinator"]
    assert co.vars["SHARDS"] == "SHARD_0|SHARD_0_R1:0-500,SHARD_1|SHARD_1_R1:500-1000"
    assert co.peers["STATION_1_R1"] == "knot-station-1-r1" and co.peers["SHARD_0_R1"] == "knot-shard-0-r1"


async def test_a_hung_replica_is_left_after_the_failover_silence_not_peer_wait():
    from services.coordinator.pipeline import FAILOVER_SILENCE_S

    p, st, sh = cluster(peer_wait_s=60.0)
    a = Call("a")
    await step(p, a, [1, 2, 3], 0)
    never = asyncio.Event()

    async def hang(request: Request) -> Response:  # a lost node: no answer, not even to /healthz
        await never.wait()

    st[1][0].fetch = hang
    t0 = asyncio.get_running_loop().time()
    with pytest.raises(SessionLost, match="answers nothing"):
        await step(p, a, [7], 3)
    waited = asyncio.get_running_loop().time() - t0
    assert FAILOVER_SILENCE_S <= waited < FAILOVER_SILENCE_S + 1.5, waited
    assert a.picks[("station", 1)].binding == "STATION_1_R1"


async def test_a_first_prefill_lands_on_another_replica_without_a_replay():
    p, st, sh = cluster(peer_wait_s=30.0)
    st[0][0].dead = True
    h = await step(p, Call("a"), [1, 2, 3], 0)  # no SessionLost: the session starts where the frame lands
    assert h.shape == (1, DIM) and "a" in st[0][1].sessions and "a" not in st[0][0].sessions


async def test_a_hung_replica_has_the_others_swept_so_its_node_mates_go_at_once():
    from services.coordinator.pipeline import FAILOVER_SILENCE_S

    p, st, sh = cluster(peer_wait_s=60.0)
    a = Call("a")
    await step(p, a, [1, 2, 3], 0)
    never = asyncio.Event()

    async def hang(request: Request) -> Response:  # a lost node takes shard 0's and station 1's replica 0
        await never.wait()

    sh[0].fetch = st[1][0].fetch = hang
    t0 = asyncio.get_running_loop().time()
    with pytest.raises(SessionLost):  # the shard is found hung first, the sweep finds the station
        await step(p, a, [7], 3)
    waited = asyncio.get_running_loop().time() - t0
    assert waited < 2 * FAILOVER_SILENCE_S, waited  # one silence, not one per replica on the node
    assert [r.state.down_since is not None for r in p.station_sets[1].replicas] == [True, False]
    assert [r.state.down_since is not None for r in p.station_sets[0].replicas] == [False, False]
