"""The coordinator runs without prometheus_client (a Worker bundle may lack it): generations are
served, and GET /metrics says what is missing instead of failing obscurely."""
from __future__ import annotations

import builtins
import importlib
import sys

import pytest

from common.runtime import ServiceUnavailable


@pytest.fixture
def metrics_without_prometheus(monkeypatch):
    real_import = builtins.__import__

    def no_prometheus(name, *args, **kwargs):
        if name.split(".")[0] == "prometheus_client":
            raise ImportError(f"No module named {name!r}")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_prometheus)
    for mod in [m for m in sys.modules if m.split(".")[0] == "prometheus_client"]:
        monkeypatch.delitem(sys.modules, mod)
    import services.coordinator.metrics as metrics
    yield importlib.reload(metrics)
    monkeypatch.undo()
    importlib.reload(metrics)


async def test_metrics_count_nothing_and_exposition_names_the_package(metrics_without_prometheus):
    from services.coordinator.admission import Admission

    m = metrics_without_prometheus.CoordinatorMetrics(Admission(2, 2, 1))
    assert not m.enabled
    m.requests.labels("generate", "200").inc()
    m.hops.labels("embed").observe(0.01)
    m.observe_hop("station_0", 0.02)
    m.ttft.observe(0.1)
    m.knot_reloads.inc()

    class Spec:
        source = "prompt_lookup"

    class Gen:  # a finished speculative generation (common.generation.Generation's fields)
        trips, decode_steps, drafted, accepted, backed_off, speculation, drafter_error = 3, 7, 6, 4, 2, Spec(), "x"

    m.observe_speculation(Gen())  # every instrument it touches counts nothing
    await m.gather(None)  # nothing is asked of a pipeline
    assert m.services.stations == []
    with pytest.raises(ServiceUnavailable, match="prometheus_client"):
        m.exposition()


def test_with_prometheus_the_exposition_is_prometheus_text():
    from services.coordinator.admission import Admission
    from services.coordinator.metrics import CoordinatorMetrics

    m = CoordinatorMetrics(Admission(2, 2, 1))
    m.requests.labels("generate", "200").inc()
    body = m.exposition().text()
    assert 'knot_requests_total{endpoint="generate",status="200"} 1.0' in body
