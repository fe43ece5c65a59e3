"""The cluster page's health of a station or shard (services/coordinator/console.py): restarting while
it has not answered for less than PEER_WAIT_S, down after that, ready again when it answers; a
restart counted when it answers as another process (services/boot.py's instance)."""
import asyncio

import pytest

from services.boot import BootCache
from services.coordinator.console import Seen, down_for, health, observe
from services.coordinator.pipeline import PeerState

WAIT_S = 15.0
UP = {"instance": "a1", "memory": {"fits": True}}


def step(seen, peer, stats, now):
    observe(seen, stats, now)
    return health(stats, down_for(seen, peer, now), WAIT_S)


def test_a_peer_lost_is_restarting_until_peer_wait_s_then_down_and_ready_when_back():
    seen, peer = Seen(), PeerState("shard 3")
    assert [step(seen, peer, UP, 0.0), step(seen, peer, None, 1.0), step(seen, peer, None, 1.0 + WAIT_S - 0.1),
            step(seen, peer, None, 1.0 + WAIT_S), step(seen, peer, None, 60.0)] == \
        ["ready", "restarting", "restarting", "down", "down"]
    assert down_for(seen, peer, 60.0) == 59.0
    assert step(seen, peer, {**UP, "instance": "b2"}, 61.0) == "ready"
    assert (seen.restarts, seen.instance, down_for(seen, peer, 61.0)) == (1, "b2", None)
    # lost again: the clock starts over from this outage
    assert step(seen, peer, None, 100.0) == "restarting" and down_for(seen, peer, 100.5) == 0.5


def test_the_same_process_answering_again_is_no_restart():
    seen, peer = Seen(), PeerState("station 1")  # e.g. a stopped process continued (SIGSTOP, SIGCONT)
    for stats, now in ((UP, 0.0), (None, 1.0), (None, 2.0), (UP, 3.0)):
        observe(seen, stats, now)
    assert seen.restarts == 0 and seen.lost_since is None
    observe(seen, {**UP, "instance": "c3"}, 4.0)  # restarted between two snapshots: never seen lost
    assert seen.restarts == 1


def test_a_request_that_found_it_down_first_starts_the_clock():
    seen, peer = Seen(), PeerState("shard 0")
    observe(seen, UP, 0.0)
    peer.down(5.0)  # a hop failed at 5 s; the next snapshot is at 12 s
    assert step(seen, peer, None, 12.0) == "restarting" and down_for(seen, peer, 12.0) == 7.0
    assert step(seen, peer, None, 5.0 + WAIT_S) == "down"  # as the requests give up on it


def test_a_requests_old_outage_does_not_count_once_it_answered_since():
    seen, peer = Seen(), PeerState("shard 0")
    peer.down(1.0)  # no request has reached it since, so its PeerState still says down
    observe(seen, UP, 2.0)
    assert step(seen, peer, None, 100.0) == "restarting" and down_for(seen, peer, 100.0) == 0.0


def test_answering_peers_are_ready_or_streaming_whatever_the_clock():
    assert health(UP, None, WAIT_S) == "ready"
    assert health({"memory": {"fits": False}}, None, WAIT_S) == "streaming"
    assert health({}, None, WAIT_S) == "ready"  # a shard: no memory plan
    assert health(None, None, WAIT_S) == "down"  # never answered a snapshot's /stats


@pytest.mark.parametrize("wait_s", [0.0, 1.0])
def test_peer_wait_s_bounds_restarting(wait_s):
    assert health(None, 0.5, wait_s) == ("restarting" if wait_s > 0.5 else "down")


def test_a_boot_cache_names_its_process_at_the_first_boot_and_keeps_it_across_reloads():
    cache, other = BootCache(), BootCache()

    async def boots():
        assert cache.instance is None  # nothing drawn at import (a Worker may not draw then)
        await cache.get("k", lambda: asyncio.sleep(0, "v1"))
        first = cache.instance
        await cache.get("k", lambda: asyncio.sleep(0, "v2"), stale=lambda v: True)  # a reload
        await other.get("k", lambda: asyncio.sleep(0, "v1"))
        return first

    first = asyncio.run(boots())
    assert first is not None and len(first) == 12 and cache.instance == first and cache.reloads == 1
    assert other.instance != first  # another process (isolate) after a restart
