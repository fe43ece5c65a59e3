"""deploy/otlp.py: a request's spans reach an OTLP/HTTP endpoint (a real HTTP server here, decoding
what the SDK's exporter sends with the OTLP protobuf schema), under the trace id the client gave."""
import asyncio

import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from common.runtime import Request, Response
from deploy import otlp
from services import tracing
from tests.otlp_receiver import Receiver

TID, SID = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"


@pytest.fixture
def collector():
    with Receiver() as r:
        yield r.url, r.posts


class Station:
    async def fetch(self, request):
        s = tracing.Summary(0.0)
        s.record(None, None, "/__do/LayerWarden/layers", "LAYER_WARDEN", 0.001, 0.003, "200")
        return Response.from_json({}, headers={tracing.SPANS_HEADER: s.header()})


def test_each_request_is_exported_with_its_hops(collector):
    url, got = collector
    ring = tracing.Ring()
    export = otlp.OtlpExport(url + "/", "coordinator")
    ring.on_end.append(export)
    station = tracing.traced(Station(), "STATION_0")

    async def request():
        scope = tracing.begin(ring, {tracing.TRACEPARENT: f"00-{TID}-{SID}-01"}, "POST /generate")
        await station.fetch(Request("POST", "/forward"))
        tracing.end(ring, scope, "200")
        return scope

    scope = asyncio.run(request())
    export.close()  # flushes the batch
    assert [(path, ctype) for path, ctype, _ in got] == [("/v1/traces", "application/x-protobuf")]
    msg = ExportTraceServiceRequest.FromString(got[0][2])
    [rs] = msg.resource_spans
    assert {a.key: a.value.string_value for a in rs.resource.attributes}["service.name"] == "coordinator"
    spans = {s.name: s for ss in rs.scope_spans for s in ss.spans}
    assert set(spans) == {"POST /generate", "/forward", "/__do/LayerWarden/layers"}
    assert {s.trace_id.hex() for s in spans.values()} == {TID}
    root, hop, child = spans["POST /generate"], spans["/forward"], spans["/__do/LayerWarden/layers"]
    assert root.span_id.hex() == scope.span_id and root.parent_span_id.hex() == SID
    assert hop.parent_span_id == root.span_id and child.parent_span_id == hop.span_id
    assert root.start_time_unix_nano <= hop.start_time_unix_nano <= hop.end_time_unix_nano <= root.end_time_unix_nano


def test_the_host_exports_the_coordinators_ring_only_where_an_endpoint_is_set(collector):
    import contextlib
    from types import SimpleNamespace

    from deploy.local.host import export_traces
    from services.coordinator.handler import TRACES

    async def open_and_close(endpoint, service):
        async with contextlib.AsyncExitStack() as stack:
            export_traces(SimpleNamespace(otlp_endpoint=endpoint, service=service, name="coordinator"), stack)
            return list(TRACES.on_end)

    # the services as KNOT_SERVICE names them (docker-compose.yml): their packages
    assert asyncio.run(open_and_close(None, "services.coordinator")) == []
    assert asyncio.run(open_and_close(collector[0], "services.shard")) == []  # keeps no traces
    hooks = asyncio.run(open_and_close(collector[0], "services.coordinator"))
    assert [type(h) for h in hooks] == [otlp.OtlpExport] and TRACES.on_end == []  # unhooked at exit
