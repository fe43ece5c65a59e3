"""The coordinator's traces to an OpenTelemetry collector over OTLP/HTTP, through the standard SDK.

Only when OTEL_EXPORTER_OTLP_ENDPOINT is set (the host: deploy/local/host.py); nothing leaves the
cluster otherwise. Here, not in services/: the SDK does not import under Pyodide. The coordinator's
export holds the whole cluster's spans: the other services keep none (services/tracing.py).

Each request's spans go once, as its server span ends (tracing.Ring.on_end): that span and every
span under it recorded by then. The stations' KV releases, which run after the reply, are not among
them (GET /traces/<id> shows them). A callee's summed span (no id of its own) gets one here, its
count and summed duration as attributes. The SDK's BatchSpanProcessor sends from its own thread,
bounded (its queue drops past 2,048 spans) and with the exporter's timeout, so a slow or absent
collector never holds a request.
"""
from __future__ import annotations

import random

from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from opentelemetry.trace import SpanContext, SpanKind, Status, StatusCode, TraceFlags

from services import tracing

TRACES_PATH = "/v1/traces"  # OTLP/HTTP: the signal's path under OTEL_EXPORTER_OTLP_ENDPOINT
EXPORT_TIMEOUT_S = 10.0
_SCOPE = InstrumentationScope("knot-cluster.tracing")


def _ok(status: str) -> bool:
    return status == "ok" or (status.isdigit() and int(status) < 400)


class OtlpExport:
    """A Ring.on_end hook exporting each ended request's spans; close() flushes and stops its thread."""

    def __init__(self, endpoint: str, service_name: str, exporter: SpanExporter | None = None):
        self.exporter = exporter or OTLPSpanExporter(endpoint=endpoint.rstrip("/") + TRACES_PATH,
                                                     timeout=EXPORT_TIMEOUT_S)
        self.processor = BatchSpanProcessor(self.exporter)
        self.resource = Resource.create({"service.name": service_name})

    def __call__(self, trace: tracing.Trace, root: tracing.Span) -> None:
        trace_id = int(trace.trace_id, 16)
        ids = {root.span_id}
        mine = [root]
        for s in trace.spans:  # a child is recorded after its parent
            if s is not root and s.parent_id in ids:
                mine.append(s)
                if s.span_id is not None:
                    ids.add(s.span_id)
        for s in mine:
            self.processor.on_end(self._span(trace, trace_id, s))

    def _span(self, trace: tracing.Trace, trace_id: int, s: tracing.Span) -> ReadableSpan:
        start_ns = int((trace.started_at + s.start_s) * 1e9)
        span_id = int(s.span_id, 16) if s.span_id is not None else random.getrandbits(64) or 1
        context = SpanContext(trace_id, span_id, is_remote=False, trace_flags=TraceFlags(TraceFlags.SAMPLED))
        parent = (None if s.parent_id is None else
                  SpanContext(trace_id, int(s.parent_id, 16), is_remote=True, trace_flags=TraceFlags(TraceFlags.SAMPLED)))
        attributes = {"peer.service": s.peer, "knot.status": s.status, "knot.calls": s.count}
        if s.busy_s is not None:
            attributes["knot.busy_ms"] = round(s.busy_s * 1e3, 3)
        return ReadableSpan(s.name, context, parent, self.resource, attributes,
                            kind=SpanKind.SERVER if s.peer == "coordinator" else SpanKind.CLIENT,
                            status=Status(StatusCode.UNSET if _ok(s.status) else StatusCode.ERROR, s.status),
                            start_time=start_ns, end_time=start_ns + int(s.duration_s * 1e9),
                            instrumentation_scope=_SCOPE)

    def close(self) -> None:
        self.processor.shutdown()  # sends what is queued, within the exporter's timeout
