"""The whole compose topology in one process with embedded bindings (`knot serve --embedded`).

Same handlers, same environments (from docker-compose.yml), no servers:
    s3://BUCKET           -> DirectoryBucket(run_dir/bucket/BUCKET), shared by every service
    redis://HOST:PORT/DB  -> one MemoryKV per (HOST, DB, prefix), shared like the real Redis
    do+http://HOST/CLASS  -> the in-process DO host of service HOST
    do+local:CLASS        -> this service's own DO host
    http://HOST:PORT      -> LocalService: the handler of service HOST, called in-process
For quick starts and development only: the integration tests accept only real servers.
"""
from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from common.runtime import Env
from services import tracing
from deploy.local import compose_reader
from deploy.local.durable import DurableObjectHost, LocalNamespace
from deploy.local.embedded_bindings import DirectoryBucket, LocalService, MemoryKV
from deploy.local.host import ServiceRuntime, check_settings, load_service
from deploy.local.host_settings import BindingURL, ConfigError, HostSettings, open_binding
from deploy.local.tasks import BackgroundTasks


class EmbeddedCluster:
    def __init__(self, specs: list[compose_reader.ServiceSpec], run_dir: Path):
        self.specs = [s for s in specs if s.kind == "process" and not s.oneshot]
        self.run_dir = run_dir
        self.settings = {s.name: HostSettings.from_env(s.environment) for s in self.specs}
        self.runtimes: dict[str, ServiceRuntime] = {}
        self._buckets: dict[str, DirectoryBucket] = {}
        self._kvs: dict[tuple, MemoryKV] = {}

    def bucket_dir(self, bucket: str) -> Path:
        return self.run_dir / "bucket" / bucket

    def _binding(self, service: str, name: str, url: str) -> Any:
        def bucket(b: BindingURL) -> DirectoryBucket:
            if b.target not in self._buckets:
                self._buckets[b.target] = DirectoryBucket(self.bucket_dir(b.target))
            return self._buckets[b.target]

        def peer_service(b: BindingURL) -> LocalService:
            peer = self.runtimes[self._peer(b.host, url)]
            return LocalService(peer.handler, peer.env, peer.tasks)

        return open_binding(name, url, {
            "s3": bucket,
            "dir": lambda b: DirectoryBucket(b.target),
            # one store per Redis database and prefix, shared like the real Redis; memory: per binding
            "redis": lambda b: self._kvs.setdefault((b.host, urlsplit(b.target).path, b.prefix), MemoryKV()),
            "memory": lambda b: self._kvs.setdefault((service, name), MemoryKV()),
            "do+local": lambda b: self._namespace(service, b.target),
            "do+http": lambda b: self._namespace(self._peer(b.host, url), b.target),
            "http": peer_service, "https": peer_service,
        })

    def _peer(self, host: str | None, url: str) -> str:
        if host not in self.runtimes:
            raise ConfigError(f"binding {url}: no service named {host!r} in the layout")
        return host

    def _namespace(self, service: str, class_name: str) -> LocalNamespace:
        do_host = self.runtimes[service].do_host
        if do_host is None or class_name not in do_host.classes:
            raise ConfigError(f"service {service} does not host Durable Object class {class_name!r}")
        return LocalNamespace(do_host, class_name)

    def open(self, stack: contextlib.AsyncExitStack) -> dict[str, ServiceRuntime]:
        """Build every service's runtime; `stack` drains their wait_until work on exit."""
        for s in self.specs:  # first the runtimes, so bindings can point at any peer
            st = self.settings[s.name]
            svc = load_service(st.service)
            tasks = BackgroundTasks(f"{s.name} wait_until")
            do_host = (DurableObjectHost({c: svc.durable_objects[c] for c in st.durable_objects}, tasks)
                       if st.durable_objects else None)
            self.runtimes[s.name] = ServiceRuntime(s.name, svc.handler, Env(), tasks, do_host, svc.ready,
                                                 max_body_bytes=st.max_body_bytes or svc.max_body_bytes,
                                                 public=svc.public, header_timeout_s=st.header_timeout_s,
                                                 body_timeout_s=st.body_timeout_s)
            stack.push_async_callback(tasks.drain, st.shutdown_timeout_s)
        for s in self.specs:
            st, rt = self.settings[s.name], self.runtimes[s.name]
            rt.env.update(st.handler_vars())
            rt.env.update({n: tracing.traced(self._binding(s.name, n, u), n) for n, u in st.bindings.items()})
            check_settings(s.name, st.service, rt.env)
            if rt.do_host is not None:
                rt.do_host.env = rt.env
        return self.runtimes
