"""Issue 16: memory profiles. `worker` keeps a station at its configured (Worker) budget, `resident`
sizes it so its layers stay; the profile reaches every station from one variable, each station
says at boot what it decided, and /v1/models and /metrics report it."""
from __future__ import annotations

import pytest

from common.runtime import Request
from common.topology import ClusterLayout
from deploy import launcher
from services.station.station_memory import MemoryPlan, describe_plan, plan_memory
from tests.inprocess import build_cluster

MiB = 1 << 20


# ------------------------------------------------------------ the plan (pure)

def test_worker_budget_that_holds_the_layers_streams_nothing():
    p = plan_memory("worker", 128 * MiB, layer_bytes=100 * MiB, largest_phase_bytes=5 * MiB, fixed_bytes=10 * MiB)
    assert (p.budget_bytes, p.kept_bytes, p.streamed_bytes_per_token, p.fits) == (128 * MiB, 100 * MiB, 0, True)
    assert p.resident_fraction == 1.0


def test_worker_budget_short_of_the_layers_streams_the_rest_and_leaves_room_for_one_phase():
    p = plan_memory("worker", 128 * MiB, layer_bytes=400 * MiB, largest_phase_bytes=30 * MiB, fixed_bytes=10 * MiB)
    assert p.budget_bytes == 128 * MiB
    assert p.kept_bytes == 128 * MiB - 10 * MiB - 30 * MiB  # the streamed phase needs room beside the kept ones
    assert p.streamed_bytes_per_token == 400 * MiB - p.kept_bytes
    assert not p.fits and p.resident_fraction == pytest.approx(88 / 400)


def test_prefetch_sets_aside_two_phases_when_they_fit_and_one_otherwise():
    p = plan_memory("worker", 128 * MiB, 400 * MiB, 30 * MiB, 10 * MiB, largest_pair_bytes=50 * MiB)
    assert p.prefetch and p.held_phase_bytes == 50 * MiB
    assert p.kept_bytes == 128 * MiB - 10 * MiB - 50 * MiB  # the running phase and the next one load beside
    no_room = plan_memory("worker", 128 * MiB, 400 * MiB, 30 * MiB, 10 * MiB, largest_pair_bytes=119 * MiB)
    assert not no_room.prefetch and no_room.kept_bytes == 128 * MiB - 10 * MiB - 30 * MiB
    fits = plan_memory("worker", 128 * MiB, 100 * MiB, 30 * MiB, 10 * MiB, largest_pair_bytes=50 * MiB)
    assert fits.fits and not fits.prefetch, "nothing streams: nothing to prefetch"
    assert "the next phase while one computes" in describe_plan("station", (0, 14), p)
    assert "while one computes" not in describe_plan("station", (0, 14), no_room)


def test_resident_budget_is_the_layers_plus_the_worker_budget_capped_by_the_host():
    p = plan_memory("resident", 128 * MiB, layer_bytes=400 * MiB, largest_phase_bytes=30 * MiB, fixed_bytes=10 * MiB)
    assert (p.budget_bytes, p.streamed_bytes_per_token, p.fits) == (528 * MiB, 0, True)
    capped = plan_memory("resident", 128 * MiB, 400 * MiB, 30 * MiB, 10 * MiB, resident_max_bytes=300 * MiB)
    assert capped.budget_bytes == 300 * MiB and not capped.fits
    assert capped.streamed_bytes_per_token == 400 * MiB - (300 - 10 - 30) * MiB


def test_an_unknown_profile_is_refused():
    with pytest.raises(ValueError, match="memory profile 'fast'"):
        plan_memory("fast", MiB, 1, 1, 1)


def test_the_start_up_line_says_fit_or_stream_and_how_to_switch():
    fits = plan_memory("resident", 128 * MiB, 400 * MiB, 30 * MiB, 10 * MiB)
    line = describe_plan("station-0", (0, 14), fits)
    assert "station-0 layers [0, 14): profile resident" in line and "resident (nothing streamed" in line
    streams = plan_memory("worker", 128 * MiB, 400 * MiB, 30 * MiB, 10 * MiB)
    line = describe_plan("station-1", (14, 28), streams)
    assert "do not fit" in line and "streams ~" in line and "tok/s" in line and "--profile resident" in line
    assert MemoryPlan(**{k: v for k, v in streams.as_dict().items() if k in MemoryPlan.__dataclass_fields__}) == streams


# ------------------------------------------------------------ one variable reaches every station

def test_the_profile_reaches_every_station_of_the_compose_plan():
    layout = ClusterLayout.build({"block_count": 28, "vocab_size": 151936}, 3, 4)
    for profile in ("worker", "resident"):
        specs = launcher.plan(layout, {"KNOT_PROFILE": profile, "KNOT_RESIDENT_MAX_BYTES": "123456789",
                                       "KNOT_REDIS_PASSWORD": "generated", "KNOT_INTERNAL_SECRET": "k" * 43,
                                       "MINIO_ROOT_USER": "bucket-key", "MINIO_ROOT_PASSWORD": "bucket-secret-key"})
        stations = [s for s in specs if s.name.startswith("station-")]
        assert len(stations) == 3
        for s in stations:
            assert s.environment["MEMORY_PROFILE"] == profile
            assert s.environment["RESIDENT_MAX_BYTES"] == "123456789"
    default = [s for s in launcher.plan(layout, {"KNOT_REDIS_PASSWORD": "generated", "KNOT_INTERNAL_SECRET": "k" * 43,
                                       "MINIO_ROOT_USER": "bucket-key", "MINIO_ROOT_PASSWORD": "bucket-secret-key"}) if s.name.startswith("station-")]
    assert {s.environment["MEMORY_PROFILE"] for s in default} == {"worker"}
    # docker compose's cap keeps a resident station under its container's 512m (the launcher sets its own)
    assert {s.environment["RESIDENT_MAX_BYTES"] for s in default} == {str(384 << 20)}


def test_launcher_profile_flag_wins_and_resident_is_capped_by_the_host(monkeypatch):
    monkeypatch.setattr(launcher, "available_memory_bytes", lambda: 8 << 30)
    assert launcher.profile_env(None, {}, 2) == {"KNOT_PROFILE": "worker"}
    assert launcher.profile_env("worker", {"KNOT_PROFILE": "resident"}, 2) == {"KNOT_PROFILE": "worker"}
    assert launcher.profile_env(None, {"KNOT_PROFILE": "resident"}, 2) == {
        "KNOT_PROFILE": "resident", "KNOT_RESIDENT_MAX_BYTES": str((8 << 30) * 3 // 4 // 2)}
    assert launcher.profile_env("resident", {"KNOT_RESIDENT_MAX_BYTES": "999"}, 2) == {"KNOT_PROFILE": "resident"}


# ------------------------------------------------------------ through the cluster (tiny model, in process)

async def _cluster_report(tiny_knot, tmp_path, profile: str, budget: int):
    c = await build_cluster(tiny_knot, tmp_path / profile, n_stations=2, n_shards=2, station_budget_bytes=budget,
                            station_vars={"MEMORY_PROFILE": profile})
    def get(service, path):
        return service.fetch(Request("GET", path))

    first = (await c.generate(prompt="the", max_tokens=4)).json()
    stats0 = [(await get(s, "/stats")).json() for s in c.stations]
    again = (await c.generate(prompt="the", max_tokens=4)).json()
    stats1 = [(await get(s, "/stats")).json() for s in c.stations]
    card = (await get(c.coordinator, "/v1/models")).json()["data"][0]
    metrics = (await get(c.coordinator, "/metrics")).body.decode()
    await c.drain()
    loads = [b["warden_tensors"] + b["r2_tensors"] - a["warden_tensors"] - a["r2_tensors"]
             for a, b in zip(stats0, stats1)]
    return first["tokens"], again["tokens"], stats1, card["memory"], metrics, loads


@pytest.mark.asyncio
async def test_worker_streams_and_resident_keeps_the_layers_with_the_same_tokens(tiny_knot, tmp_path):

    # A budget too small for the tiny layers to stay, big enough for a short sequence: per station
    # ~627 kB of layer tensors, ~807 kB fixed beside them (resident norms, a decode step's
    # activations, the matmul tile of its largest tensor); the layers fit from 1,433,233 bytes.
    tight = 1_400_000
    w_tokens, w_again, w_stats, w_card, w_metrics, w_loads = await _cluster_report(tiny_knot, tmp_path, "worker", tight)
    r_tokens, r_again, r_stats, r_card, r_metrics, r_loads = await _cluster_report(tiny_knot, tmp_path, "resident",
                                                                                    tight)
    assert w_tokens == r_tokens == w_again == r_again  # the profile changes memory, never tokens

    assert w_card["profile"] == "worker"
    assert all(not s["fits"] and s["streamed_bytes_per_token"] > 0 and s["budget_bytes"] == tight
               for s in w_card["stations"]), w_card
    assert all(n > 0 for n in w_loads), w_loads  # a second generation loads its layers again

    assert r_card["profile"] == "resident"
    for s, st in zip(r_card["stations"], r_stats):
        assert s["fits"] and s["resident_fraction"] == 1.0 and s["streamed_bytes_per_token"] == 0
        assert s["budget_bytes"] == st["memory"]["layer_bytes"] + tight == st["budget_bytes"]
        assert st["peak_accounted_bytes"] <= st["budget_bytes"]
    assert r_loads == [0, 0]  # nothing loaded the second time: the layers stayed

    assert 'knot_station_resident_fraction{profile="resident",station="0"} 1.0' in r_metrics
    assert 'knot_station_streamed_bytes_per_token{station="1"} 0.0' in r_metrics
    assert 'profile="worker",station="0"}' in w_metrics

