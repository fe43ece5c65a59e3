"""The Cloudflare station budget on the real 0.5B: with the stations `knot deploy cloudflare` does not
warn about (6: four layers, ~39 MiB each), every station keeps its layers within its 56 MiB and a
second generation loads nothing; with 2 (~120 MiB each) the stations run fluid."""
from __future__ import annotations

import pytest

from common.runtime import Request
from deploy import wrangler
from deploy.commands.deploy import station_bytes
from tests.inprocess import build_cluster

pytestmark = pytest.mark.realmodel


async def _loads_in_second_generation(knot, tmp, n_stations: int) -> list[dict]:
    c = await build_cluster(knot, tmp, n_stations=n_stations, station_budget_bytes=wrangler.BUDGETS["station"])
    await c.generate(prompt="def f(x):", max_tokens=3)
    before = [(await s.fetch(Request("GET", "https://p/stats"))).json() for s in c.stations]
    await c.generate(prompt="def g(y):", max_tokens=3)
    after = [(await s.fetch(Request("GET", "https://p/stats"))).json() for s in c.stations]
    await c.drain()
    return [{"loads": a["warden_tensors"] + a["r2_tensors"] - b["warden_tensors"] - b["r2_tensors"],
             "peak": a["peak_accounted_bytes"], "kept": a["kept_bytes"]} for b, a in zip(before, after)]


async def test_six_stations_are_resident_two_run_fluid(real_knot_05b, tmp_path):
    budget = wrangler.BUDGETS["station"]
    six = station_bytes(str(real_knot_05b), 6)
    assert max(six) <= budget * 3 // 4 < max(station_bytes(str(real_knot_05b), 2))
    resident = await _loads_in_second_generation(real_knot_05b, tmp_path / "six", 6)
    assert all(s["loads"] == 0 and s["peak"] <= budget for s in resident), resident
    fluid = await _loads_in_second_generation(real_knot_05b, tmp_path / "two", 2)
    assert all(s["loads"] > 0 and s["peak"] <= budget for s in fluid), fluid
