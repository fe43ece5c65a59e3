"""The local host: aiohttp around the Worker-shaped handlers, and the bindings they use.

host.py      aiohttp <-> common.runtime translation, /healthz, /readyz, request ids, DO routes
bindings.py  real bindings: S3 (boto3 in threads), Redis KV, HTTP service and DO bindings
embedded.py  in-process bindings: a directory bucket, a KV with TTL, in-process services
durable.py   Durable Object instances: one per name, requests serialized like an input gate
tasks.py     wait_until: owned background tasks, drained on shutdown
logs.py      structured (JSON) logs carrying the request id
"""
