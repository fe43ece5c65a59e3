"""The Cloudflare Python Workers adapter: the same handlers as the aiohttp host, under Pyodide.

No model logic here, only translation (docs/cloudflare.md has the table):
    convert.py           JS Request/Response <-> common.runtime Request/Response, streams as ReadableStream
    workers_bindings.py  R2, Workers KV, Durable Object namespaces, service bindings, waitUntil
    entry.py             a WorkerEntrypoint per role and the Durable Object classes, built from services/

These modules import `js` and `pyodide.ffi`, which exist only under Pyodide (tests/cloudflare gives
CPython test doubles of them); like common/ and services/ they import no aiohttp, boto3 or redis.
`knot deploy cloudflare` (deploy/wrangler.py) copies them into every Worker bundle.
"""
