"""The adapter in CPython with the real workers-runtime-sdk 1.9.5 and workerd-shaped doubles:
every pitfall of docs/cloudflare.md, and a whole generation through the Worker entrypoints
(`knot deploy cloudflare` output over the tiny knot) equal to the in-process cluster's."""
from __future__ import annotations

import asyncio
import hashlib
import json

import pytest
from hypothesis import given, settings, strategies as st

from common.runtime import Env, NotFound, PreconditionFailed, RangeNotSatisfiable, Request, Response
from deploy import wrangler
from deploy.cloudflare import convert, workers_bindings
from deploy.cloudflare.entry import worker_entrypoint
from services.coordinator import subrequests
from deploy.knotfile import open_model
from tests.cloudflare import fakejs
from tests.cloudflare import webapi
from tests.cloudflare.fakejs import JsException, JsObject
from tests.cloudflare.workerd import Cloud, ExecutionContext, Fetcher, KvNamespace, R2Bucket
from tests.inprocess import build_cluster

OBJECT = bytes(range(256)) * 40  # 10,240 bytes


def sdk_wrapped(js_binding):
    """The binding as the SDK hands it over (env.X through _EnvWrapper): bodies come back as memoryview."""
    from workers import _EnvWrapper

    return getattr(_EnvWrapper(JsObject({"B": js_binding})), "B")


# ---------------------------------------------------------------- R2


@pytest.mark.parametrize("wrap", [False, True], ids=["raw", "sdk-wrapped"])
async def test_r2_range_reads_and_the_offset_pitfalls(wrap):
    js_bucket = R2Bucket({"k": OBJECT})
    b = workers_bindings.R2Bucket(sdk_wrapped(js_bucket) if wrap else js_bucket)
    got = await b.get("k", (100, 300))
    assert got.body == OBJECT[100:300] and got.size == len(OBJECT) and got.range == (100, 300)
    assert (await b.get("k")).body == OBJECT
    n = len(OBJECT)
    with pytest.raises(RangeNotSatisfiable, match="runs past"):  # R2 clamps: a short read must not pass
        await b.get("k", (n - 10, n + 10))
    with pytest.raises(RangeNotSatisfiable, match="runs past"):  # "Unspecified error (0)"
        await b.get("k", (n, n + 1))
    with pytest.raises(RangeNotSatisfiable, match="runs past"):  # error 10039
        await b.get("k", (n + 5, n + 6))
    with pytest.raises(RangeNotSatisfiable, match="invalid"):
        await b.get("k", (5, 5))
    assert await b.get("missing", (0, 1)) is None
    assert await b.head("missing") is None
    assert (await b.head("k")).size == n


@pytest.mark.parametrize("wrap", [False, True], ids=["raw", "sdk-wrapped"])
async def test_r2_reads_pinned_to_a_version_refuse_a_replaced_object(wrap):
    js_bucket = R2Bucket({"k": OBJECT})
    b = workers_bindings.R2Bucket(sdk_wrapped(js_bucket) if wrap else js_bucket)
    etag = (await b.head("k")).etag
    got = await b.get("k", (100, 300), if_match=etag)
    assert got.body == OBJECT[100:300] and got.etag == etag
    assert (await b.get("k", if_match=etag)).body == OBJECT
    assert js_bucket.calls[-1] == ("get", "k", None, etag)  # onlyIf {etagMatches} reached the binding
    js_bucket.objects["k"] = OBJECT[::-1]  # replaced: same size, other bytes
    with pytest.raises(PreconditionFailed, match="no longer version|now version"):
        await b.get("k", (100, 300), if_match=etag)
    with pytest.raises(PreconditionFailed):
        await b.get("k", if_match=etag)
    assert (await b.get("k", (100, 300))).body == OBJECT[::-1][100:300]  # unpinned reads see the new one
    assert await b.get("missing", (0, 1), if_match=etag) is None


class IgnoresOnlyIf(R2Bucket):
    """A bucket that drops onlyIf (or answers null for a failed one, as older docs say)."""

    def __init__(self, objects, null_on_mismatch: bool):
        super().__init__(objects)
        self.null_on_mismatch = null_on_mismatch

    @fakejs.js_function
    def get(self, key, options=None):
        props = webapi._init_props(options, "R2Bucket.get")
        only_if = props.pop("onlyIf", None)
        want = None if only_if is None else only_if.etagMatches
        if self.null_on_mismatch and want is not None and want != hashlib.md5(self.objects[key]).hexdigest():
            return fakejs.JsPromise.resolve(None)
        return R2Bucket.get(self, key, JsObject(props))


@pytest.mark.parametrize("null_on_mismatch", [False, True], ids=["ignores-onlyIf", "null"])
async def test_r2_pinned_reads_hold_when_the_binding_ignores_onlyif_or_answers_null(null_on_mismatch):
    js_bucket = IgnoresOnlyIf({"k": OBJECT}, null_on_mismatch)
    b = workers_bindings.R2Bucket(js_bucket)
    etag = (await b.head("k")).etag
    js_bucket.objects["k"] = OBJECT[::-1]
    with pytest.raises(PreconditionFailed):
        await b.get("k", (0, 10), if_match=etag)
    with pytest.raises(PreconditionFailed):
        await b.get("k", if_match=etag)


async def test_the_r2_double_has_the_measured_shapes():
    js_bucket = R2Bucket({"k": OBJECT})
    n = len(OBJECT)
    clamped = await js_bucket.get("k", fakejs.to_js({"range": {"offset": n - 4, "length": 100}},
                                                    dict_converter=webapi.JsObjectStatics.fromEntries))
    assert (await clamped.arrayBuffer()).to_bytes() == OBJECT[-4:]
    with pytest.raises(JsException, match=r"Unspecified error \(0\)"):
        await js_bucket.get("k", JsObject({"range": JsObject({"offset": n, "length": 1})}))
    with pytest.raises(JsException, match="10039"):
        await js_bucket.get("k", JsObject({"range": JsObject({"offset": n + 1, "length": 1})}))
    # to_js(dict) without Object.fromEntries is a Map: its range is silently ignored
    whole = await js_bucket.get("k", fakejs.to_js({"range": {"offset": 0, "length": 1}}))
    assert (await whole.arrayBuffer()).to_bytes() == OBJECT
    with pytest.raises(JsException, match="TypeError"):  # raw put of a Python bytes object
        js_bucket.put("x", b"abc")


@settings(max_examples=60, deadline=None)
@given(st.integers(0, len(OBJECT) - 1).flatmap(lambda a: st.tuples(st.just(a), st.integers(a + 1, len(OBJECT)))))
def test_a_range_read_equals_a_slice_of_the_whole_object(rng):
    async def read():
        return await workers_bindings.R2Bucket(R2Bucket({"k": OBJECT})).get("k", rng)
    assert asyncio.run(read()).body == OBJECT[rng[0]:rng[1]]


async def test_r2_put_goes_through_to_js_and_list_sees_it():
    js_bucket = R2Bucket()
    b = workers_bindings.R2Bucket(js_bucket)
    meta = await b.put("a/knot", b"\x00\x01payload")
    assert meta.size == 9 and js_bucket.objects["a/knot"] == b"\x00\x01payload"
    assert [m.key for m in await b.list("a/")] == ["a/knot"]


# ---------------------------------------------------------------- KV


async def test_kv_bytes_ttl_and_the_60_second_floor():
    js_kv = KvNamespace()
    kv = workers_bindings.KV(sdk_wrapped(js_kv))
    await kv.put("row", b"\x00\xffrow", expiration_ttl=86400)
    assert await kv.get("row") == b"\x00\xffrow" and js_kv.ttls["row"] == 86400
    assert await kv.get("none") is None
    with pytest.raises(ValueError, match="at least 60"):
        await kv.put("row", b"x", expiration_ttl=10)
    with pytest.raises(JsException, match="at least 60"):  # what the platform would say
        await js_kv.put("row", "x", JsObject({"expirationTtl": 10}))
    await kv.delete("row")
    assert await kv.get("row") is None


# ---------------------------------------------------------------- service bindings, DO, waitUntil


async def _echo(request: Request, env: Env, ctx) -> Response:
    if request.path == "/missing":
        raise NotFound("no such thing")
    return Response.from_json({"method": request.method, "path": request.path, "query": request.query,
                               "body": request.body.hex(), "type": request.headers.get("content-type")})


class _OneWorker(Cloud):
    def __init__(self, handler):
        self.configs, self.pending, self.objects, self._envs = {}, [], {}, {}
        self._module = type("M", (), {"Default": worker_entrypoint(handler, public=True)})
        self._envs["echo"] = JsObject({"KNOT_BINDINGS": "{}", "KNOT_VARS": ""})

    def module(self, worker):
        return self._module


async def test_service_binding_fetch_keeps_method_headers_body():
    svc = workers_bindings.ServiceBinding(Fetcher(_OneWorker(_echo), "echo"), "ECHO")
    resp = await svc.fetch(Request("POST", "/x/y?a=1", {"Content-Type": "application/x-test"}, b"\x00\x01"))
    assert resp.status == 200
    assert resp.json() == {"method": "POST", "path": "/x/y", "query": {"a": "1"}, "body": "0001",
                           "type": "application/x-test"}
    missing = await svc.fetch(Request("GET", "https://peer/missing"))
    assert missing.status == 404 and missing.json()["error"] == "NotFound"


async def test_a_python_dict_init_is_refused_and_a_map_init_ignored():
    f = Fetcher(_OneWorker(_echo), "echo")
    with pytest.raises(JsException, match="TypeError"):
        f.fetch("https://peer/x", {"method": "POST", "headers": {"a": "b"}})
    resp = await f.fetch("https://peer/x", fakejs.to_js({"method": "POST"}))
    assert json.loads((await resp.arrayBuffer()).to_bytes())["method"] == "GET"


async def test_wait_until_needs_a_js_promise():
    done = []

    async def work():
        await asyncio.sleep(0)
        done.append(1)

    ctx = ExecutionContext()
    workers_bindings.JsContext(ctx).wait_until(work())
    for p in ctx.promises:
        await p
    assert done == [1]
    ctx = ExecutionContext()
    coro = work()
    ctx.waitUntil(coro)  # the Python awaitable itself: a borrowed proxy, destroyed on return
    with pytest.raises(JsException, match="destroyed"):
        await ctx.promises[0]
    coro.close()
    assert done == [1]  # the second work never ran


async def test_wait_until_failures_reject_the_promise():
    async def fail():
        raise RuntimeError("boom")

    ctx = ExecutionContext()
    workers_bindings.JsContext(ctx).wait_until(fail())
    with pytest.raises(JsException, match="boom"):
        await ctx.promises[0]


async def test_a_missing_binding_is_a_503_naming_it():
    cloud = _OneWorker(_echo)
    cloud._envs["echo"] = JsObject({"KNOT_BINDINGS": '{"KNOT_BUCKET": "r2"}', "KNOT_VARS": ""})
    resp = await cloud.fetch("echo", "https://w/x")
    body = json.loads((await resp.arrayBuffer()).to_bytes())
    assert resp.status == 503 and "KNOT_BUCKET" in body["message"]


# ---------------------------------------------------------------- streaming


async def test_stream_pulls_only_when_read_and_cancel_runs_the_producers_cleanup():
    produced, closed, started = [], [], asyncio.Event()
    gate = asyncio.Event()

    async def chunks():
        try:
            for i in range(100):
                if i == 2:
                    started.set()
                    await gate.wait()  # the pull in flight when the client cancels
                produced.append(i)
                yield f"chunk {i}\n".encode()
        finally:
            closed.append(True)

    stream = convert.readable_stream(chunks())
    assert stream.pulls == 0 and stream.high_water_mark == 0
    reader = stream.getReader()
    assert (await reader.read()).value.to_bytes() == b"chunk 0\n"
    assert (await reader.read()).value.to_bytes() == b"chunk 1\n"
    assert stream.pulls == 2 and produced == [0, 1]  # no read-ahead
    pending = asyncio.ensure_future(reader.read())
    await started.wait()
    await reader.cancel("client gone")
    assert closed == [True] and produced == [0, 1]
    assert (await pending).done


async def test_a_client_that_goes_away_cancels_the_stream_through_the_pipe_in_wait_until():
    """workerd's way (docs/cloudflare.md): no cancel reaches a response body; the body is the readable
    side of an IdentityTransformStream the stream is piped into, the pipe in waitUntil, and the
    runtime's cancel of that side (the client gone) cancels the stream: the producer's cleanup runs."""
    produced, closed, started, gate = [], [], asyncio.Event(), asyncio.Event()

    async def chunks():
        try:
            for i in range(100):
                if i == 2:
                    started.set()
                    await gate.wait()  # the pull in flight when the client goes away
                produced.append(i)
                yield f"chunk {i}\n".encode()
        finally:
            closed.append(True)

    ctx = ExecutionContext()
    body = convert.readable_stream(chunks(), workers_bindings.JsContext(ctx).wait_until)
    assert body.JS_TYPE == "ReadableStream" and len(ctx.promises) == 1 and body.pulls == 0
    reader = body.getReader()
    assert (await reader.read()).value.to_bytes() == b"chunk 0\n"
    assert (await reader.read()).value.to_bytes() == b"chunk 1\n"
    assert produced == [0, 1]  # no read-ahead through the pipe
    in_flight = asyncio.ensure_future(reader.read())
    await started.wait()
    await body.cancel("Network connection lost.")  # what workerd does to the body when the client goes
    await ctx.promises[0]  # the pipe's end: failed, as a pipe to a gone client does, and no error
    assert closed == [True] and produced == [0, 1]
    assert (await in_flight).done
    # read to its end, the pipe ends too
    whole_ctx = ExecutionContext()

    async def two():
        yield b"a"
        yield b"b"

    whole = convert.readable_stream(two(), workers_bindings.JsContext(whole_ctx).wait_until)
    assert await whole.read_all() == b"ab"
    await whole_ctx.promises[0]


async def test_stream_error_ends_the_stream_with_it():
    async def chunks():
        yield b"a"
        raise ValueError("producer failed")

    resp = convert.response_to_js(Response.from_stream(chunks(), "text/plain"))
    with pytest.raises(JsException, match="producer failed"):
        await resp.js_object.arrayBuffer()


async def test_response_translation_keeps_status_headers_and_null_bodies():
    r = convert.response_to_js(Response.from_bytes(b"\x00\x01", "application/x-knot", status=201,
                                                   headers={"X-A": "1"}))
    assert r.status == 201 and r.headers["x-a"] == "1" and await r.bytes() == b"\x00\x01"
    empty = convert.response_to_js(Response(204, {"X-B": "2"}))
    assert empty.status == 204 and await empty.bytes() == b""
    back = await convert.response_from_js(webapi.Response.new(fakejs.Uint8Array(b"ok"),
                                                              JsObject({"status": 202, "headers": JsObject({"X-C": "3"})})))
    assert (back.status, back.body, back.headers["x-c"]) == (202, b"ok", "3")


# ---------------------------------------------------------------- a whole generation


@pytest.fixture
def deployment(tiny_knot, tmp_path):
    return _deploy(tiny_knot, tmp_path / "out")


SECRET = "adapter-test-internal-secret-0123456789abcdef"  # as `wrangler secret put` gives every Worker


def _deploy(tiny_knot, out, public: bool = True, secrets: dict | None = None, **shard_vars) -> Cloud:
    hp = open_model(tiny_knot).header.hparams
    workers = wrangler.plan(int(hp["block_count"]), int(hp["vocab_size"]), "model.knot", 2, 4, public=public)
    for w in workers:
        if w.role == "shard":
            w.vars.update(shard_vars)
    wrangler.write(out, workers, public=public)
    cloud = Cloud(out, {"KNOT_INTERNAL_SECRET": SECRET} if secrets is None else secrets)
    cloud.bucket("knots").objects["model.knot"] = tiny_knot.read_bytes()
    return cloud


def _clear_boot_caches():
    from services.coordinator import handler as co
    from services.shard import handler as sh
    from services.station import handler as st

    for m in (co, sh, st):
        m._booted.clear()


def _signed(worker: str, method: str, path: str, body: bytes = b"", secret: str = SECRET) -> dict:
    """The headers another Worker's binding sends with this call (deploy/cloudflare/workers_bindings.Signer)."""
    return dict(workers_bindings.Signer(secret, worker).signed(Request(method, path, body=body)).headers.items())


async def _json(resp) -> dict:
    return json.loads((await resp.arrayBuffer()).to_bytes())


async def test_embedding_rows_reach_kv_through_the_workers(tiny_knot, tmp_path):
    """With the wardens not warmed (WARM_WARDEN=off), a row goes down the tiers, and its write to KV goes
    through the Worker's waitUntil into the KV binding."""
    cloud = _deploy(tiny_knot, tmp_path / "out", WARM_WARDEN="off")
    _clear_boot_caches()
    resp = await cloud.fetch("knot-coordinator", "https://knot-coordinator/generate", "POST",
                             json.dumps({"prompt": "def the", "max_tokens": 3}).encode(),
                             {"Content-Type": "application/json"})
    assert resp.status == 200, await _json(resp)
    assert await cloud.drain() == []
    assert cloud.kvs[wrangler.KV_ID_PLACEHOLDER].values, "embedding rows reached KV"


async def test_generation_through_the_workers_equals_the_inprocess_cluster(deployment, tiny_knot, tmp_path):
    body = {"prompt": "def the", "max_tokens": 12}
    _clear_boot_caches()
    cluster = await build_cluster(tiny_knot, tmp_path / "local", n_stations=2, n_shards=4)
    want = (await cluster.generate(**body)).json()
    await cluster.drain()
    _clear_boot_caches()
    resp = await deployment.fetch("knot-coordinator", "https://knot-coordinator/generate", "POST",
                                  json.dumps(body).encode(), {"Content-Type": "application/json"})
    got = await _json(resp)
    assert resp.status == 200, got
    assert got["tokens"] == want["tokens"] and len(got["tokens"]) == 12
    assert got["prompt_tokens"] == want["prompt_tokens"] and got["degraded_shards"] == []
    assert await deployment.drain() == []  # the stations' releases ran through waitUntil
    # every station, shard and warden ran as a Worker or a Durable Object
    classes = {k[1] for k in deployment.objects}
    assert classes == {"Station", "LayerWarden", "CobordismWarden"}
    assert {k[2] for k in deployment.objects if k[1] == "Station"} == {
        _do_hex("knot-station-0/Station", "model.knot|0-1"), _do_hex("knot-station-1/Station", "model.knot|1-2")}
    # each shard had its CobordismWarden read its slice of the embedding (WARM_WARDEN=on): one ranged read,
    # widened to the knot's checksum chunks
    header = open_model(tiny_knot).header
    reads = {c[2] for c in deployment.bucket("knots").calls if c[0] == "get" and c[2]}
    base = header.tensor_range("token_embd.weight")[0]
    for a, b in cluster.shard_ranges:
        start, end = header.row_range("token_embd.weight", a, b)
        start, end = header.chunk_span("token_embd.weight", start - base, end - base)
        assert (base + start, end - start) in reads, (a, b)

    # streamed, with logprobs: the same tokens arrive through the ReadableStream
    _clear_boot_caches()
    sresp = await deployment.fetch("knot-coordinator", "https://knot-coordinator/v1/chat/completions", "POST",
                                   json.dumps({"messages": [{"role": "user", "content": "def the"}],
                                               "max_tokens": 8, "stream": True, "logprobs": True}).encode(),
                                   {"Content-Type": "application/json"})
    assert sresp.status == 200 and sresp.headers.get("content-type").startswith("text/event-stream")
    stream_tokens, reader = [], sresp.body.getReader()
    raw = b""
    while not (got := await reader.read()).done:
        raw += got.value.to_bytes()
    events = [json.loads(line[6:]) for line in raw.decode().split("\n\n") if line.startswith("data: {")]
    for ev in events:
        lp = ev["choices"][0]["logprobs"] if ev["choices"] else None
        if lp:
            stream_tokens += [bytes(e["bytes"]) for e in lp["content"]]
    assert raw.endswith(b"data: [DONE]\n\n")
    _clear_boot_caches()
    cluster2 = await build_cluster(tiny_knot, tmp_path / "local2", n_stations=2, n_shards=4)
    want2 = (await cluster2.generate(messages=[{"role": "user", "content": "def the"}], max_tokens=8)).json()
    await cluster2.drain()
    tok = open_model(tiny_knot).tokenizer_data()
    from common.tokenizer import Tokenizer

    t = Tokenizer(tok)
    assert stream_tokens == [t.token_bytes(i) for i in want2["tokens"]] and stream_tokens
    assert await deployment.drain() == []


async def test_speculative_trips_through_the_workers_give_the_single_process_tokens(deployment, tiny_knot):
    """Drafts verified as one multi-row trip through the Station Durable Objects, the rejected ones
    rewound there: greedy (prompt lookup by default) and sampled, the tokens of the single process
    without speculation (the oracle shares no station code with the Workers)."""
    from common.sampling import SamplingParams
    from deploy.engine_local import LocalEngine
    from tests.unit.test_speculative import CODE, LOOKUP_CASES

    engine = LocalEngine.open(tiny_knot)
    ids = engine.tokenizer.encode(CODE)
    _clear_boot_caches()
    got = []
    n = 40  # a missed rewind showed at the 25th token
    for sampling, spec in LOOKUP_CASES:
        body = dict(prompt=CODE, max_tokens=n, **sampling) | ({} if spec is None else {"speculation": spec})
        resp = await deployment.fetch("knot-coordinator", "https://knot-coordinator/generate", "POST",
                                      json.dumps(body).encode(), {"Content-Type": "application/json"})
        got.append(await _json(resp))
        assert resp.status == 200, got[-1]
        assert got[-1]["tokens"] == engine.generate(ids, SamplingParams(**sampling), max_tokens=n).token_ids, body
        assert got[-1]["replays"] == 0 and got[-1]["degraded_shards"] == []
    greedy, rejected = (g["timings"]["speculation"] for g in got)
    assert greedy["source"] == "prompt_lookup" and 0 < greedy["accepted"] <= greedy["drafted"], greedy
    assert greedy["trips"] < len(got[0]["tokens"]), greedy
    # a rejected draft: the stations rewound their KV caches past it, and the tokens still agree
    assert rejected["source"] == "prompt_lookup" and rejected["accepted"] < rejected["drafted"], rejected
    # no drafter deploys (a draft model is far over an isolate's 128 MB): asking for one is a 400 naming it
    resp = await deployment.fetch("knot-coordinator", "https://knot-coordinator/generate", "POST",
                                  json.dumps({"prompt": CODE, "max_tokens": 4, "speculation": "draft_model"}).encode(),
                                  {"Content-Type": "application/json"})
    err = await _json(resp)
    assert resp.status == 400 and "DRAFTER" in err["message"], err
    assert await deployment.drain() == []


def _do_hex(class_key: str, name: str) -> str:
    import hashlib

    return hashlib.sha256(f"{class_key}\x00{name}".encode()).hexdigest()


async def test_bad_input_is_a_4xx_and_the_workers_survive(deployment):
    _clear_boot_caches()
    bad = await deployment.fetch("knot-coordinator", "https://knot-coordinator/generate", "POST", b"{not json",
                                 {"Content-Type": "application/json"})
    assert bad.status == 400 and "JSON" in (await _json(bad))["message"]
    frame = await deployment.fetch("knot-shard-0", "https://knot-shard-0/embed", "POST", b"garbage",
                                   _signed("knot-shard-0", "POST", "/embed", b"garbage"))
    assert frame.status == 400 and "malformed envelope" in (await _json(frame))["message"]
    ok = await deployment.fetch("knot-coordinator", "https://knot-coordinator/generate", "POST",
                                json.dumps({"prompt": "the", "max_tokens": 2}).encode())
    assert ok.status == 200 and len((await _json(ok))["tokens"]) == 2
    assert await deployment.drain() == []


def test_configs_fit_the_isolate_and_bind_what_the_handlers_read(tiny_knot, tmp_path):
    workers = wrangler.plan(24, 151936, "qwen2.5-coder-0.5b.knot")
    assert [w.name for w in workers][:2] == ["knot-layer-warden", "knot-cobordism-warden"]
    assert workers[-1].name == "knot-coordinator" and len(workers) == 13
    for w in workers:
        cfg = w.config()
        budget = int(cfg["vars"].get("MEMORY_BUDGET_BYTES", 0))
        assert budget + wrangler.RUNTIME_RESERVE_BYTES <= wrangler.ISOLATE_BYTES, w.name
        declared = json.loads(cfg["vars"]["KNOT_BINDINGS"])
        wired = ({b["binding"] for b in cfg.get("r2_buckets", [])} | {b["binding"] for b in cfg.get("kv_namespaces", [])}
                 | {b["name"] for b in cfg.get("durable_objects", {}).get("bindings", [])}
                 | {b["binding"] for b in cfg.get("services", [])})
        assert set(declared) == wired, w.name
        assert cfg["compatibility_flags"] == ["python_workers"]
    co = workers[-1].config()
    assert co["vars"]["STATIONS"] == "STATION_0,STATION_1"
    assert json.loads(co["vars"]["KNOT_BINDINGS"])["STATION_1"] == "do-service:qwen2.5-coder-0.5b.knot|12-24"


# ---------------------------------------------------------------- locked down: signatures, secrets, the API key


async def test_internal_workers_answer_only_calls_signed_for_them(deployment):
    """A leaked route is still refused: an internal Worker (and a Durable Object behind it) answers only
    calls signed with the cluster's secret for that Worker, once each."""
    url = "https://knot-shard-0/stats"
    unsigned = await deployment.fetch("knot-shard-0", url)
    assert unsigned.status == 401 and "X-Knot-Signature" in (await _json(unsigned))["message"]
    headers = _signed("knot-shard-0", "GET", "/stats")
    ok = await deployment.fetch("knot-shard-0", url, headers=headers)
    assert ok.status == 200 and (await _json(ok))["vocab_start"] == 0
    again = await deployment.fetch("knot-shard-0", url, headers=headers)  # the same call, replayed
    assert again.status == 401 and "already used" in (await _json(again))["message"]
    elsewhere = await deployment.fetch("knot-shard-0", url, headers=_signed("knot-shard-1", "GET", "/stats"))
    assert elsewhere.status == 401 and "another service" in (await _json(elsewhere))["message"]
    forged = await deployment.fetch("knot-shard-0", url, headers=_signed("knot-shard-0", "GET", "/stats",
                                                                        secret="x" * 43))
    assert forged.status == 401 and "does not match" in (await _json(forged))["message"]
    changed = await deployment.fetch("knot-shard-0", "https://knot-shard-0/stats?x=1",
                                     headers=_signed("knot-shard-0", "GET", "/stats"))
    assert changed.status == 401
    # a station's Worker forwards to its Durable Object, which checks the call its stub signed again
    station = await deployment.fetch("knot-station-0", "https://knot-station-0/stats",
                                     headers=_signed("knot-station-0", "GET", "/stats"))
    assert station.status == 200 and (await _json(station))["layer_start"] == 0
    assert (await deployment.fetch("knot-station-0", "https://knot-station-0/stats")).status == 401
    assert await deployment.drain() == []


async def test_a_worker_without_its_secret_refuses_every_call(tiny_knot, tmp_path):
    cloud = _deploy(tiny_knot, tmp_path / "out", secrets={})
    shard = await cloud.fetch("knot-shard-0", "https://knot-shard-0/stats", headers=_signed("knot-shard-0", "GET",
                                                                                             "/stats"))
    body = await _json(shard)
    assert shard.status == 503 and "KNOT_INTERNAL_SECRET" in body["message"] and "wrangler secret put" in body["message"]
    co = await cloud.fetch("knot-coordinator", "https://knot-coordinator/generate", "POST",
                           json.dumps({"prompt": "the", "max_tokens": 2}).encode())
    assert co.status == 503 and "KNOT_INTERNAL_SECRET" in (await _json(co))["message"]


async def test_the_coordinator_wants_its_api_key_unless_public(tiny_knot, tmp_path):
    body = json.dumps({"prompt": "the", "max_tokens": 2}).encode()
    url = "https://knot-coordinator/generate"
    unset = _deploy(tiny_knot, tmp_path / "unset", public=False)  # the key's `wrangler secret put` not run yet
    r = await unset.fetch("knot-coordinator", url, "POST", body)
    assert r.status == 503 and "KNOT_API_KEY" in (await _json(r))["message"]
    key = "k" * 43
    cloud = _deploy(tiny_knot, tmp_path / "keyed", public=False,
                    secrets={"KNOT_INTERNAL_SECRET": SECRET, "KNOT_API_KEY": key})
    _clear_boot_caches()
    r = await cloud.fetch("knot-coordinator", url, "POST", body)
    assert r.status == 401
    r = await cloud.fetch("knot-coordinator", url, "POST", body, {"Authorization": f"Bearer {key}"})
    assert r.status == 200 and len((await _json(r))["tokens"]) == 2
    assert await cloud.drain() == []


def test_no_coordinator_without_an_api_key_is_written_unless_public(tmp_path):
    workers = wrangler.plan(24, 151936, "m.knot", public=True)  # a coordinator without KNOT_API_KEY
    with pytest.raises(wrangler.DeployError, match="--public"):
        wrangler.write(tmp_path / "out", workers)
    assert not (tmp_path / "out").exists()
    leaky = wrangler.plan(24, 151936, "m.knot")
    leaky[0].exposed = True  # a warden on workers.dev
    with pytest.raises(wrangler.DeployError, match="knot-layer-warden: an internal Worker with workers_dev True"):
        wrangler.write(tmp_path / "out", leaky)


# ---------------------------------------------------------------- the subrequest limit


async def test_a_generation_ends_with_length_before_the_subrequest_limit(tiny_knot, tmp_path):
    """With SUBREQUEST_LIMIT small, a generation stops with finish_reason "length", says why, and
    its tokens are the first ones of the unlimited generation; the count never passes the limit."""
    body = {"prompt": "def the", "max_tokens": 30, "speculation": "off"}
    free = _deploy(tiny_knot, tmp_path / "free")
    _clear_boot_caches()
    await free.fetch("knot-coordinator", "https://knot-coordinator/generate", "POST", json.dumps(body).encode())
    want = await _json(await free.fetch("knot-coordinator", "https://knot-coordinator/generate", "POST",
                                        json.dumps(body).encode()))
    assert len(want["tokens"]) == 30 and want["limited_by"] is None
    assert want["subrequests"]["limit"] == wrangler.PLAN_SUBREQUESTS["paid"]
    per_token = 1 + 2 + 4  # one shard embeds the token, 2 stations, 4 LM-head slices
    assert want["subrequests"]["used"] <= 1 + 2 * per_token + 4 + 29 * per_token  # the head, prompt, tokens

    out = tmp_path / "limited"
    hp = open_model(tiny_knot).header.hparams
    limit = 100
    workers = wrangler.plan(int(hp["block_count"]), int(hp["vocab_size"]), "model.knot", 2, 4, public=True,
                            subrequest_limit=limit)
    wrangler.write(out, workers, public=True)
    cloud = Cloud(out, {"KNOT_INTERNAL_SECRET": SECRET})
    cloud.bucket("knots").objects["model.knot"] = tiny_knot.read_bytes()
    _clear_boot_caches()
    for _ in range(2):  # the first also pays for the coordinator's boot
        resp = await cloud.fetch("knot-coordinator", "https://knot-coordinator/generate", "POST",
                                 json.dumps(body).encode())
        got = await _json(resp)
        assert resp.status == 200, got
        assert got["finish_reason"] == "length" and got["limited_by"] == "subrequests"
        assert resp.headers.get("x-knot-limited-by") == "subrequests"
        assert 0 < len(got["tokens"]) < 30 and got["tokens"] == want["tokens"][:len(got["tokens"])]
        assert got["subrequests"]["used"] + 2 <= limit  # the stations' releases still fit
        # it stopped only when one more trip (at most per_token: the embedding row cache saves some) would not fit
        assert got["subrequests"]["used"] + 2 + per_token > limit, got["subrequests"]
    assert await cloud.drain() == []


async def test_a_streamed_generation_says_why_it_ended_at_the_subrequest_limit(tiny_knot, tmp_path):
    """A stream is read by the runtime's pulls, not the request's task: the generation still counts into
    its invocation, and its last chunk says why it ended."""
    hp = open_model(tiny_knot).header.hparams
    limit = 100
    out = tmp_path / "limited"
    wrangler.write(out, wrangler.plan(int(hp["block_count"]), int(hp["vocab_size"]), "model.knot", 2, 4,
                                      public=True, subrequest_limit=limit), public=True)
    cloud = Cloud(out, {"KNOT_INTERNAL_SECRET": SECRET})
    cloud.bucket("knots").objects["model.knot"] = tiny_knot.read_bytes()
    _clear_boot_caches()
    await cloud.fetch("knot-coordinator", "https://knot-coordinator/generate", "POST",
                      json.dumps({"prompt": "the", "max_tokens": 1}).encode())  # boots the coordinator
    resp = await cloud.fetch("knot-coordinator", "https://knot-coordinator/v1/completions", "POST",
                             json.dumps({"prompt": "def the", "max_tokens": 30, "stream": True}).encode(),
                             {"Content-Type": "application/json"})
    assert resp.status == 200
    subrequests.begin(None)  # the runtime's pulls run in another context than the request's
    reader, raw = resp.body.getReader(), b""
    while not (got := await reader.read()).done:
        raw += got.value.to_bytes()
    events = [json.loads(e[6:]) for e in raw.decode().split("\n\n") if e.startswith("data: {")]
    last = events[-1]
    assert last["choices"][0]["finish_reason"] == "length" and last["limited_by"] == "subrequests", last
    assert 0 < last["subrequests"]["used"] and last["subrequests"]["used"] + 2 <= limit, last
    text = "".join(ev["choices"][0]["text"] for ev in events)
    assert text and raw.endswith(b"data: [DONE]\n\n")
    assert await cloud.drain() == []


async def test_a_cached_prompt_prefix_through_the_workers(tmp_path):
    """Prompt caching on the Workers: the Station Durable Objects keep a prompt's blocks, the
    coordinator asks them (POST /prefix) and resumes after them; the tokens equal a cold run's."""
    from common.kvcache import PREFILL_CHUNK_TOKENS
    from common.prefix import PREFIX_BLOCK_TOKENS, resume_at
    from tests.tiny_gguf import TinySpec, tiny_knot

    knot = tiny_knot(tmp_path, TinySpec(hidden=64, ffn=128, n_head=2, n_kv_head=1, context=1024, seed=9), "long")
    _clear_boot_caches()
    cloud = _deploy(knot, tmp_path / "out")
    prompt = "".join(str(i * 7 % 10) for i in range(350))  # a digit is a token

    async def generate(**body) -> dict:
        resp = await cloud.fetch("knot-coordinator", "https://knot-coordinator/generate", "POST",
                                 json.dumps({"max_tokens": 6, **body}).encode(), {"Content-Type": "application/json"})
        got = await _json(resp)
        assert resp.status == 200, got
        return got

    first = await generate(prompt=prompt)
    hit = await generate(prompt=prompt + "12345")
    cold = await generate(prompt=prompt + "12345", cache_prompt=False)
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    resumed = resume_at(len(hit["prompt_tokens"]), len(first["prompt_tokens"]) // PREFIX_BLOCK_TOKENS)
    assert resumed * PREFIX_BLOCK_TOKENS % PREFILL_CHUNK_TOKENS  # inside a chunk
    assert hit["usage"]["prompt_tokens_details"]["cached_tokens"] == resumed * PREFIX_BLOCK_TOKENS
    assert cold["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert hit["tokens"] == cold["tokens"] and hit["prompt_tokens"] == cold["prompt_tokens"]
    assert await cloud.drain() == []
