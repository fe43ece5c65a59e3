"""The coordinator service: see handler.py."""
from services.coordinator.handler import MAX_BODY_BYTES, PUBLIC, TRACES, fetch, ready

# TRACES: the host hooks its OTLP exporter to it (deploy/local/host.py export_traces, KNOT_SERVICE=services.coordinator)
__all__ = ["MAX_BODY_BYTES", "PUBLIC", "TRACES", "fetch", "ready"]
