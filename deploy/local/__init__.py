"""The local host: aiohttp around the Worker-shaped handlers, the bindings they use, and the pieces
that run a cluster layout as local processes or in one process.

host.py              aiohttp <-> common.runtime translation, /healthz, /readyz, request ids, DO routes;
                     the start-up check of a service's settings
host_settings.py     HostSettings from the environment (via common/settings.py); the binding URL
                     schemes and their one parser, parse_binding / open_binding
server_bindings.py   real bindings: S3 (boto3 in threads), Redis KV, HTTP service and DO bindings
embedded_bindings.py in-process bindings: a directory bucket, a KV with TTL, in-process services
durable.py           Durable Object instances: one per name, requests serialized like an input gate
tasks.py             wait_until: owned background tasks, drained on shutdown
logs.py              structured (JSON) logs carrying the request id
compose_reader.py    a compose document read back into processes to start (substitution, order, addresses)
embedded_cluster.py  every service of a layout in one process with embedded bindings (knot serve --embedded)
init.py              the compose init job: fetch, encode and upload the model once
probe.py             the healthcheck command: exit 0 when a URL answers 200
"""
