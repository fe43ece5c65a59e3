"""A small OTLP/HTTP trace receiver for the tests: a real HTTP server on a free 127.0.0.1 port that
keeps every POST and decodes its body with the OTLP protobuf schema (ExportTraceServiceRequest, from
the opentelemetry-proto package the SDK installs), as a collector would."""
from __future__ import annotations

import threading
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.trace.v1.trace_pb2 import Span


@dataclass(frozen=True)
class Exported:
    service: str  # the resource's service.name
    span: Span

    def attribute(self, key: str):
        value = next((a.value for a in self.span.attributes if a.key == key), None)
        return None if value is None else getattr(value, value.WhichOneof("value"))


class Receiver:
    """with Receiver() as r: r.url is the OTLP base URL; r.posts the (path, content type, body) got."""

    def __init__(self) -> None:
        self.posts: list[tuple[str, str, bytes]] = []
        posts, lock = self.posts, threading.Lock()

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = self.rfile.read(int(self.headers["Content-Length"]))
                with lock:
                    posts.append((self.path, self.headers["Content-Type"], body))
                self.send_response(200)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> "Receiver":
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()

    def spans(self) -> list[Exported]:
        """Every span of every export request got so far, with its resource's service.name."""
        out = []
        for _, _, body in list(self.posts):
            for rs in ExportTraceServiceRequest.FromString(body).resource_spans:
                service = next(a.value.string_value for a in rs.resource.attributes if a.key == "service.name")
                out += [Exported(service, s) for ss in rs.scope_spans for s in ss.spans]
        return out
