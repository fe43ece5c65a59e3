"""The Workers under workerd, Cloudflare's own runtime, offline (tests/cloudflare/workerd_runtime.py
builds its Pyodide 0.27.7 `dev` bundle from registry packages; numpy 2.0.2 is vendored into each
Worker's python_modules/ as `pywrangler sync` would).

- a Python Worker imports numpy under `workerd serve` and computes what CPython computes;
- the Workers `knot deploy cloudflare` wrote, unmodified but for the compatibility date and flags
  (workerd_runtime.COMPATIBILITY_DATE), run under miniflare (workerd_lane/lane.mjs) on its local R2,
  KV and SQLite Durable Objects: a generation through the coordinator Worker, locked down (API key,
  signed internal calls), equal to the in-process cluster's tokens, whole and streamed; rows sent
  down the tiers into KV with their TTL; a station's Durable Object session; a stream cancelled by
  its client, its station session released.
"""
from __future__ import annotations

import http.client
import json
import shutil
import socket
import subprocess
import time
import uuid
from pathlib import Path

import pytest

from common import signing
from common.tokenizer import Tokenizer
from deploy import wrangler
from deploy.knotfile import open_model
from tests.cloudflare import cloudflare_tools, workerd_runtime
from tests.inprocess import build_cluster

PROMPT = "def the"
MAX_TOKENS = 10
SECRET = "workerd-lane-internal-secret-0123456789abcdef"
API_KEY = "workerd-lane-api-key-0123456789abcdef"
LANE = Path(__file__).resolve().parent / "workerd_lane" / "lane.mjs"
READY_TIMEOUT_S = 900  # seven Python isolates start on 2 shared cores
REQUEST_TIMEOUT_S = 300
MAX_STREAM = 200  # the tiny model holds 256 positions


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get(port: int, path: str, timeout_s: float, proc: subprocess.Popen) -> tuple[int, bytes]:
    deadline = time.monotonic() + timeout_s
    while True:
        assert proc.poll() is None, f"workerd exited ({proc.returncode})"
        try:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout_s)
            conn.request("GET", path)
            res = conn.getresponse()
            return res.status, res.read()
        except (ConnectionError, OSError):
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)


PROBE = '''
import json, sys, importlib
import numpy as np
from workers import WorkerEntrypoint, Response

class Default(WorkerEntrypoint):
    async def fetch(self, request):
        a = np.arange(24, dtype=np.float32).reshape(4, 6) - 9  # integers: exact in any summation order
        missing = []
        for name in %(stdlib)r:
            try:
                importlib.import_module(name)
            except ImportError:
                missing.append(name)
        return Response(json.dumps({"python": sys.version.split()[0], "platform": sys.platform,
                                    "numpy": np.__version__, "product": (a @ a.T).tolist(), "missing": missing}))
'''


def test_a_python_worker_imports_numpy_under_workerd_serve(tmp_path):
    """The dev bundle, the empty stdlib tarballs and the vendored numpy, under `workerd serve` alone."""
    rt = workerd_runtime.runtime_dir()
    stdlib = ["_hashlib", "lzma", "_pydecimal", "pydoc_data", "sqlite3", "ssl", "test", "hashlib", "hmac", "zipfile"]
    (tmp_path / "entry.py").write_text(PROBE % {"stdlib": stdlib})
    vendored = tmp_path / "python_modules"
    shutil.copytree(rt / "numpy", vendored)  # embeds are relative to the config
    mods = ['(name = "entry.py", pythonModule = embed "entry.py")']
    for p in sorted(vendored.rglob("*")):
        if p.is_file() and ".dist-info" not in str(p):
            kind = "pythonModule" if p.suffix == ".py" else "data"
            name = p.relative_to(tmp_path)
            mods.append(f'(name = "{name}", {kind} = embed "{name}")')
    port = _free_port()
    flags = ", ".join(json.dumps(f) for f in ["python_workers", *workerd_runtime.EXTRA_FLAGS])
    (tmp_path / "config.capnp").write_text(f'''using Workerd = import "/workerd/workerd.capnp";
const config :Workerd.Config = (
  services = [(name = "main", worker = .probe)],
  sockets = [(name = "http", address = "127.0.0.1:{port}", http = (), service = "main")]
);
const probe :Workerd.Worker = (
  modules = [{", ".join(mods)}],
  compatibilityDate = "{workerd_runtime.COMPATIBILITY_DATE}",
  compatibilityFlags = [{flags}],
);
''')
    log = open(tmp_path / "workerd.log", "w")
    t0 = time.monotonic()
    proc = subprocess.Popen([str(rt / "workerd"), "serve", str(tmp_path / "config.capnp"), "--experimental"],
                            cwd=tmp_path, stdout=log, stderr=subprocess.STDOUT)
    try:
        status, body = _get(port, "/", READY_TIMEOUT_S, proc)
    except AssertionError:
        raise AssertionError(f"workerd serve: {(tmp_path / 'workerd.log').read_text()[-3000:]}") from None
    finally:
        proc.terminate()
        proc.wait(30)
        log.close()
    assert status == 200, (body[-2000:], (tmp_path / "workerd.log").read_text()[-3000:])
    got = json.loads(body)
    assert got["python"] == "3.12.7" and got["platform"] == "emscripten" and got["numpy"] == "2.0.2"
    import numpy as np

    a = np.arange(24, dtype=np.float32).reshape(4, 6) - 9  # integers: exact in any summation order
    assert got["product"] == (a @ a.T).tolist()
    # the unvendored CPython modules whose tarballs no registry carries (workerd_runtime's docstring)
    assert got["missing"] == ["_hashlib", "lzma", "_pydecimal", "pydoc_data", "sqlite3", "ssl", "test"]
    print(f"\nworkerd serve: python worker with numpy answered in {time.monotonic() - t0:.1f} s")


R2_PROBE = '''
"""knot-r2-probe: the adapter's R2Bucket on the runtime's R2 binding (tests/cloudflare/test_workerd.py)."""
import json
from workers import WorkerEntrypoint, Response
from deploy.cloudflare.workers_bindings import R2Bucket

DATA = bytes(range(256)) * 4


class Default(WorkerEntrypoint):
    async def fetch(self, request):
        bucket = R2Bucket(self.env.KNOT_BUCKET, "KNOT_BUCKET")
        meta = await bucket.put("probe.bin", DATA)
        out = {"etag": meta.etag, "size": meta.size}

        async def case(name, coro):
            try:
                got = await coro
                out[name] = ["none"] if got is None else ["ok", got.body.hex(), got.etag]
            except Exception as e:
                out[name] = [type(e).__name__, str(e)]

        await case("whole", bucket.get("probe.bin"))
        await case("range", bucket.get("probe.bin", (10, 20)))
        await case("past_end", bucket.get("probe.bin", (1000, 1100)))
        await case("at_size", bucket.get("probe.bin", (1024, 1030)))
        await case("beyond_size", bucket.get("probe.bin", (2000, 2010)))
        await case("pinned", bucket.get("probe.bin", if_match=meta.etag))
        await case("pinned_range", bucket.get("probe.bin", (5, 9), if_match=meta.etag))
        await case("replaced", bucket.get("probe.bin", if_match="0" * 32))
        await case("replaced_range", bucket.get("probe.bin", (5, 9), if_match="0" * 32))
        await case("missing", bucket.get("no-such-object"))
        return Response(json.dumps(out), headers={"Content-Type": "application/json"})
'''


def _write_r2_probe(out: Path) -> None:
    """One more Worker beside the generated ones: the adapter's R2Bucket alone, on the R2 binding."""
    probe = out / "knot-r2-probe"
    shutil.copytree(out / "knot-shard-0" / "src", probe / "src")
    (probe / "src" / "entry.py").write_text(R2_PROBE)
    (probe / "wrangler.json").write_text(json.dumps({
        "name": "knot-r2-probe", "main": "src/entry.py", "compatibility_date": "2026-11-01",
        "compatibility_flags": ["python_workers"], "r2_buckets": [{"binding": "KNOT_BUCKET", "bucket_name": "knots"}]}))


class Lane:
    """The lane's miniflare process and plain HTTP to its Workers (http.client: no gzip, chunks as sent)."""

    def __init__(self, proc: subprocess.Popen, info: dict, log: Path):
        self.proc, self.info, self.log = proc, info, log
        u = info["url"].rstrip("/").split("://", 1)[1]
        self.host, self.port = u.split(":")[0], int(u.split(":")[1])

    def open(self, worker: str, path: str, body: dict | None = None, method: str = "POST", *,
             api_key: str | None = API_KEY,
             signed: bool = False) -> tuple[http.client.HTTPConnection, http.client.HTTPResponse]:
        data = b"" if body is None else json.dumps(body).encode()
        headers = {"MF-Original-URL": f"http://{worker}{path}", "Content-Type": "application/json"}
        if api_key is not None:
            headers["Authorization"] = f"Bearer {api_key}"
        if signed:
            headers[signing.SIGNATURE_HEADER] = signing.sign(SECRET, method, path, data, time.time(), uuid.uuid4().hex,
                                                            to=worker)
        conn = http.client.HTTPConnection(self.host, self.port, timeout=REQUEST_TIMEOUT_S)
        conn.request(method, path, body=data if method != "GET" else None, headers=headers)
        return conn, conn.getresponse()

    def call(self, worker: str, path: str, body: dict | None = None, method: str = "POST",
             **kw) -> tuple[int, dict, bytes]:
        conn, res = self.open(worker, path, body, method, **kw)
        try:
            return res.status, dict(res.getheaders()), res.read()
        finally:
            conn.close()

    def kv_keys(self, binding: str, worker: str) -> list[dict]:
        self.proc.stdin.write(f"KV {binding} {worker}\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        assert line.startswith("KV "), (line, self.log.read_text()[-3000:])
        return json.loads(line[3:])

    def logs(self) -> str:
        return self.log.read_text(errors="replace")


@pytest.fixture(scope="module")
def lane(tiny_knot, tmp_path_factory):
    rt = workerd_runtime.runtime_dir()
    tmp = tmp_path_factory.mktemp("workerd")
    hp = open_model(tiny_knot).header.hparams
    out = tmp / "deploy"
    workers = wrangler.plan(int(hp["block_count"]), int(hp["vocab_size"]), "model.knot", 2, 2, public=False)
    for w in workers:  # shard 0's rows go down the tiers (RAM, then KV through waitUntil), shard 1's warden warms
        if w.name == "knot-shard-0":
            w.vars["WARM_WARDEN"] = "off"
    wrangler.write(out, workers, public=False)
    _write_r2_probe(out)
    config = {"miniflare": str(workerd_runtime.miniflare_module()), "workerd": str(rt / "workerd"),
              "deploy": str(out), "entry": "knot-coordinator", "python_modules": [str(rt / "numpy")],
              "compatibility_date": workerd_runtime.COMPATIBILITY_DATE, "extra_flags": workerd_runtime.EXTRA_FLAGS,
              "secrets": {"KNOT_INTERNAL_SECRET": SECRET, "KNOT_API_KEY": API_KEY},
              "bucket_binding": "KNOT_BUCKET", "objects": {"model.knot": str(tiny_knot)}}
    (tmp / "lane.json").write_text(json.dumps(config))
    log = tmp / "lane.log"
    t0 = time.monotonic()
    with open(log, "w") as err:
        proc = subprocess.Popen([str(cloudflare_tools.node()), str(LANE), str(tmp / "lane.json")],
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err, text=True)
    try:
        line = proc.stdout.readline()  # bounded: READY_TIMEOUT_S below kills a lane that never starts
        assert line.startswith("READY "), f"lane did not start ({proc.poll()}):\n{log.read_text()[-4000:]}"
        info = json.loads(line[len("READY "):])
        print(f"\nworkerd lane: {len(info['workers'])} Workers ready in {info['ready_s']} s "
              f"({time.monotonic() - t0:.1f} s with the runtime's cache)")
        yield Lane(proc, info, log)
    finally:
        if proc.poll() is None:
            proc.stdin.close()
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)


def _events(text: str) -> list[dict]:
    return [json.loads(e[6:]) for e in text.split("\n\n") if e.startswith("data: {")]


async def test_a_generation_through_the_workers_under_workerd_equals_cpython(lane, tiny_knot, tmp_path, numpy_matmul):
    """Locked down as deployed (API key, signed internal calls); the reference is the in-process
    cluster on the numpy matmul path, as test_pyodide takes it."""
    from tests.cloudflare.test_pyodide import _clear_boot_caches

    _clear_boot_caches()
    cluster = await build_cluster(tiny_knot, tmp_path, n_stations=2, n_shards=2)
    want = (await cluster.generate(prompt=PROMPT, max_tokens=MAX_TOKENS)).json()
    want_chat = (await cluster.generate(messages=[{"role": "user", "content": PROMPT}], max_tokens=MAX_TOKENS)).json()
    await cluster.drain()
    _clear_boot_caches()

    t0 = time.monotonic()
    status, headers, body = lane.call("knot-coordinator", "/generate", {"prompt": PROMPT, "max_tokens": MAX_TOKENS})
    took = time.monotonic() - t0
    assert status == 200, (body[-3000:], lane.logs()[-4000:])
    got = json.loads(body)
    assert got["tokens"] == want["tokens"] and len(got["tokens"]) == MAX_TOKENS
    assert got["degraded_shards"] == [] and got["replays"] == 0, got
    # streamed: SSE through a ReadableStream, one chunk per event at least
    chat = {"messages": [{"role": "user", "content": PROMPT}], "max_tokens": MAX_TOKENS, "stream": True,
            "logprobs": True}
    conn, res = lane.open("knot-coordinator", "/v1/chat/completions", chat)
    chunks = []
    while chunk := res.read1(65536):
        chunks.append(chunk)
    conn.close()
    text = b"".join(chunks).decode()
    assert res.status == 200 and res.getheader("Content-Type", "").startswith("text/event-stream"), text[-2000:]
    streamed = [bytes(x["bytes"]) for ev in _events(text) if ev["choices"] and ev["choices"][0]["logprobs"]
                for x in ev["choices"][0]["logprobs"]["content"]]
    tok = Tokenizer(open_model(tiny_knot).tokenizer_data())
    assert streamed == [tok.token_bytes(i) for i in want_chat["tokens"]] and streamed
    assert text.endswith("data: [DONE]\n\n") and len(chunks) > 1
    # locked down: no key, 401; bad input, a 400 naming it; an internal Worker wants a signature for it
    status, _, body = lane.call("knot-coordinator", "/generate", {"prompt": PROMPT}, api_key=None)
    assert status == 401, body
    status, _, body = lane.call("knot-coordinator", "/generate", {"prompt": 7})
    assert status == 400 and "prompt" in json.loads(body)["message"]
    status, _, body = lane.call("knot-station-0", "/stats", method="GET", api_key=None, signed=True)
    assert status == 200 and json.loads(body)["layer_start"] == 0, body
    status, _, body = lane.call("knot-station-0", "/stats", method="GET", api_key=None)
    assert status == 401 and signing.SIGNATURE_HEADER in json.loads(body)["message"], body
    # what the doubles cannot show: none of workerd's refusals on the way (I/O across requests, RPC)
    for refusal in ("Cannot perform I/O on behalf of a different request", "reserved method", "Traceback"):
        assert refusal not in lane.logs(), lane.logs()[-4000:]
    print(f"\nworkerd lane: /generate of {MAX_TOKENS} tokens in {took:.2f} s (the first request boots the Workers)")


def test_tools_in_auto_mode_under_workerd_and_a_400_for_what_needs_the_grammar_engine(lane):
    """Issue 50 on the Workers: a tools request in `auto` mode whose reply is plain text stays text
    (the template renders the tools under workerd's Pyodide); response_format json_schema and
    tool_choice "required" need llguidance, native code: a 400 naming the field and why.
    (test_pyodide.py compares the reply with CPython's and runs the <tool_call> parser there.)"""
    from tests.cloudflare.test_pyodide import NEEDS_GRAMMAR, TOOLS_AUTO

    status, _, body = lane.call("knot-coordinator", "/v1/chat/completions", TOOLS_AUTO)
    assert status == 200, (body[-2000:], lane.logs()[-3000:])
    choice = json.loads(body)["choices"][0]
    assert choice["finish_reason"] in ("length", "stop") and choice["message"]["content"], choice
    assert not choice["message"].get("tool_calls"), choice
    for request, field in NEEDS_GRAMMAR:
        status, _, body = lane.call("knot-coordinator", "/v1/chat/completions", request)
        error = json.loads(body)["error"]
        assert status == 400 and error["param"] == field, body
        assert field in error["message"] and "not available" in error["message"] and "Pyodide" in error["message"], body


def test_rows_go_to_workers_kv_with_their_ttl_through_wait_until(lane):
    """The cobordism warden puts the rows it read from R2 into KV in ctx.waitUntil, with expirationTtl 24 h."""
    if not lane.kv_keys("EMBED_CACHE", "knot-cobordism-warden"):  # after the generation test, or on its own
        status, _, body = lane.call("knot-coordinator", "/generate", {"prompt": PROMPT, "max_tokens": 2})
        assert status == 200, body
    deadline = time.monotonic() + 30
    while not (keys := lane.kv_keys("EMBED_CACHE", "knot-cobordism-warden")) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert keys, lane.logs()[-3000:]
    now = time.time()
    assert all(k["expiration"] is not None and 86400 - 3600 < k["expiration"] - now <= 86400 for k in keys), keys[:3]


def _station_stats(lane: Lane) -> dict:
    status, _, body = lane.call("knot-station-0", "/stats", method="GET", api_key=None, signed=True)
    assert status == 200, body
    return json.loads(body)


def test_a_cancelled_stream_ends_the_generation_and_releases_its_session(lane, tiny_knot):
    """A client that goes away after the first chunk: the generation stops well short of its natural
    length (workerd stops pulling the coordinator's ReadableStream), and the station Durable Object's
    session is released. workerd calls no cancel on the response body: the stream is piped into an
    IdentityTransformStream, the pipe in waitUntil, and the pipe cancels it (deploy/cloudflare/convert.py);
    without that, the session stayed until SESSION_TTL_S."""
    from common.sampling import SamplingParams
    from deploy.engine_local import LocalEngine

    engine = LocalEngine.open(tiny_knot)
    natural = len(engine.generate(engine.tokenizer.encode(PROMPT), SamplingParams(temperature=0.0),
                                  max_tokens=MAX_STREAM).token_ids)
    before = _station_stats(lane)
    body = {"prompt": PROMPT, "max_tokens": MAX_STREAM, "temperature": 0, "stream": True, "speculation": "off"}
    conn, res = lane.open("knot-coordinator", "/v1/completions", body)
    assert res.status == 200, res.read()[-2000:]
    first = res.read1(65536)
    assert first.startswith(b"data: {") and b"[DONE]" not in first, first
    conn.close()  # the client goes away
    deadline = time.monotonic() + 30
    while (after := _station_stats(lane))["sessions"] and time.monotonic() < deadline:
        time.sleep(0.5)
    time.sleep(2)  # a generation that was not cancelled would go on forwarding meanwhile
    after = _station_stats(lane)
    forwards = after["forwards"] - before["forwards"]
    assert natural > 100 and forwards < natural // 2, (natural, forwards)
    assert after["sessions"] == 0, (after, lane.logs()[-3000:])
    print(f"\nworkerd lane: cancelled after the first chunk: {forwards} station forwards of {natural} tokens, "
          f"{after['sessions']} station session(s) left")


def test_r2_ranges_and_preconditions_through_the_adapter_under_workerd(lane):
    """docs/cloudflare.md's R2 pitfalls on miniflare's R2 through workerd's binding: ranges past the
    end and at or beyond the size are 416 (never a short read), a read pinned to another etag is 412."""
    status, _, body = lane.call("knot-r2-probe", "/", method="GET", api_key=None)
    assert status == 200, (body[-2000:], lane.logs()[-3000:])
    got = json.loads(body)
    data = bytes(range(256)) * 4
    etag = got["etag"]
    assert got["size"] == 1024 and etag
    assert got["whole"] == ["ok", data.hex(), etag]
    assert got["range"] == ["ok", data[10:20].hex(), etag]
    for case in ("past_end", "at_size", "beyond_size"):
        assert got[case][0] == "RangeNotSatisfiable", (case, got[case])
    assert got["pinned"] == ["ok", data.hex(), etag]
    assert got["pinned_range"] == ["ok", data[5:9].hex(), etag]
    assert got["replaced"][0] == got["replaced_range"][0] == "PreconditionFailed", got
    assert got["missing"] == ["none"]
