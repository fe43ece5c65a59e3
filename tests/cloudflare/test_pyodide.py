"""The project under Pyodide 0.27.7 in Node 22, offline (tests/cloudflare/node/harness.mjs):
numpy from Pyodide's own wheel (hash-checked against its pyodide-lock.json), the real
workers-runtime-sdk, and the Workers `knot deploy cloudflare` writes.

- common/ dequantizes all 13 types bit-exactly as CPython does;
- the pure-Python tokenizer (tokenizers cannot import there) gives tokenizers' ids;
- the coordinator, both stations (Durable Objects), the shards and both wardens run a tiny model
  end to end through the adapter, greedy tokens equal to CPython's, streamed too, and speculative
  trips (drafts verified in one pass, the rejected ones rewound) give the single process's tokens;
- tool calls in `auto` mode: the template renders the tools, a reply of plain text stays text (whole
  and streamed, equal to CPython's), and <tool_call> blocks parse as on CPython; what needs the
  grammar engine (llguidance is native code) is a 400 that says so.
"""
from __future__ import annotations

import json
import subprocess
from pathlib import Path

import numpy as np
import pytest

from common.quant import QUANT_TYPES, dequantize
from common.runtime import Request
from common.sampling import SamplingParams
from common.tokenizer import Tokenizer
from deploy import wrangler
from deploy.engine_local import LocalEngine
from deploy.knotfile import open_model
from tests.cloudflare import cloudflare_tools
from tests.inprocess import build_cluster
from tests.tokenizer_corpus import corpus
from tests.unit.test_quant import ne0_for, random_raw
from tests.unit.test_speculative import CODE, LOOKUP_CASES
from tests.unit.test_tool_calls import TIME, WEATHER, call_text

HERE = Path(__file__).resolve().parent
HARNESS = HERE / "node" / "harness.mjs"
PROMPT = "def the"
SECRET = "pyodide-test-internal-secret-0123456789abcdef"  # what `wrangler secret put` would give each Worker
MAX_TOKENS = 10


def run_harness(config: dict, tmp: Path, timeout_s: float = 900) -> dict:
    config = {"pyodide": str(cloudflare_tools.pyodide_dir()), "numpy": str(cloudflare_tools.numpy_wheel()),
              "checks": "/checks", "python_path": ["/sdk"], **config}
    config.setdefault("mounts", {})
    config["mounts"].update({"/checks": str(HERE), "/sdk": str(cloudflare_tools.workers_sdk())})
    path = tmp / "harness.json"
    path.write_text(json.dumps(config))
    proc = subprocess.run([str(cloudflare_tools.node()), str(HARNESS), str(path)], capture_output=True, text=True,
                          timeout=timeout_s)
    lines = [l for l in proc.stdout.splitlines() if l.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, f"harness failed ({proc.returncode}):\n{proc.stderr[-4000:]}"
    return json.loads(lines[-1][len("RESULT "):])


def dequant_cases(path: Path) -> Path:
    rng = np.random.default_rng(7)
    arrays = {}
    for t in QUANT_TYPES:
        ne0 = ne0_for(t)
        for label, raw in (("random", random_raw(t, 4, ne0, rng)), ("zero", np.zeros_like(random_raw(t, 2, ne0, rng)))):
            shape = (ne0, raw.shape[0])
            arrays[f"{t}#{label}/raw"] = raw
            arrays[f"{t}#{label}/want"] = dequantize(raw, t, shape)
            arrays[f"{t}#{label}/shape"] = np.array(shape)
    np.savez(path, **arrays)
    return path


def tokenizer_case(data: dict, texts: list[str], path: Path) -> Path:
    hf = Tokenizer(data, backend="tokenizers")
    path.write_text(json.dumps({"tokenizer": data, "texts": texts, "ids": [hf.encode(t) for t in texts]}))
    return path


# n choices streamed: their chunks interleave (asyncio.wait over each choice's events, on Pyodide's loop)
CHOICES = {"prompt": "the", "max_tokens": 6, "n": 2, "seed": 5, "temperature": 0.9, "stream": True}
# speculative trips (LOOKUP_CASES): greedy drafts by prompt lookup (the default), and sampled ones of
# which some are rejected, so the Station Durable Objects rewind (a missed rewind showed at the 26th)
SPECULATIVE_TOKENS = 40
# tools in auto mode (no grammar: the model's own output, parsed); what needs the grammar engine is a 400
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
TOOLS_AUTO = {"messages": ASK, "tools": [WEATHER, TIME], "max_tokens": MAX_TOKENS}
NEEDS_GRAMMAR = [  # (body, the field the 400 names)
    ({"messages": ASK, "max_tokens": 4, "response_format": {"type": "json_schema", "json_schema": {
        "name": "weather", "schema": {"type": "object", "properties": {"city": {"type": "string"}}}}}},
     "response_format"),
    ({"messages": ASK, "max_tokens": 4, "tools": [WEATHER], "tool_choice": "required"}, "tool_choice"),
]
TOOL_TEXTS = [  # replies the parser reads: calls, bare call objects, and what stays text
    "Let me look.\n" + call_text(("get_weather", {"city": "Paris"}), ("get_time", {})),
    '{"name": "get_weather", "arguments": {"city": "Paris"}}',
    '```json\n{\n  "name": "get_weather",\n  "arguments": {\n    "city": "Paris"\n  }\n}\n```',
    "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Pa",
    call_text(("rm_rf", {})),
    "```python\nprint(1)\n```",
]


def _clear_boot_caches():
    from services.coordinator import handler as co
    from services.shard import handler as sh
    from services.station import handler as st

    for m in (co, sh, st):
        m._booted.clear()


@pytest.fixture(scope="module")
def pyodide_run(tiny_knot, tmp_path_factory):
    """One harness run: dequant, tokenizer (a trained vocabulary), and a generation through the Workers."""
    from tests.unit.test_bpe import trained_data

    tmp = tmp_path_factory.mktemp("pyodide")
    hp = open_model(tiny_knot).header.hparams
    out = tmp / "deploy"
    workers = wrangler.plan(int(hp["block_count"]), int(hp["vocab_size"]), "model.knot", 2, 4, public=True)
    for w in workers:  # two shards' wardens warm their slices, two send rows down the tiers to KV
        if w.name in ("knot-shard-0", "knot-shard-1"):
            w.vars["WARM_WARDEN"] = "off"
    wrangler.write(out, workers, public=True)
    chat = {"messages": [{"role": "user", "content": PROMPT}], "max_tokens": MAX_TOKENS, "stream": True,
            "logprobs": True}
    config = {
        "mounts": {"/deploy": str(out), "/data": str(tmp)},
        "python_path": ["/deploy/knot-coordinator/src", "/deploy/knot-coordinator/python_modules", "/sdk"],
        "dequant": f"/data/{dequant_cases(tmp / 'dequant.npz').name}",
        "tokenizer": f"/data/{tokenizer_case(trained_data(), corpus()[:80], tmp / 'tok.json').name}",
        "deploy": str(out), "deploy_mount": "/deploy", "bucket": "knots", "knot_key": "model.knot",
        "knot": str(tiny_knot), "secrets": {"KNOT_INTERNAL_SECRET": SECRET},
        "tool_calls": f"/data/{_tool_call_case(tmp / 'tool_calls.json').name}",
        "requests": [
            {"worker": "knot-coordinator", "path": "/generate", "body": {"prompt": PROMPT, "max_tokens": MAX_TOKENS}},
            {"worker": "knot-coordinator", "path": "/v1/chat/completions", "body": chat, "stream": True},
            {"worker": "knot-coordinator", "path": "/generate", "body": {"prompt": 7}},
            {"worker": "knot-station-0", "path": "/stats", "method": "GET", "signed": True},
            {"worker": "knot-coordinator", "path": "/v1/completions", "body": CHOICES, "stream": True},
            *({"worker": "knot-coordinator", "path": "/generate",
               "body": {"prompt": CODE, "max_tokens": SPECULATIVE_TOKENS, **sampling,
                        **({} if spec is None else {"speculation": spec})}} for sampling, spec in LOOKUP_CASES),
            {"worker": "knot-station-0", "path": "/stats", "method": "GET"},  # unsigned: refused
            {"worker": "knot-coordinator", "path": "/v1/chat/completions", "body": TOOLS_AUTO},
            {"worker": "knot-coordinator", "path": "/v1/chat/completions", "body": {**TOOLS_AUTO, "stream": True},
             "stream": True},
            *({"worker": "knot-coordinator", "path": "/v1/chat/completions", "body": body} for body, _ in NEEDS_GRAMMAR),
        ],
    }
    return run_harness(config, tmp)


def _tool_call_case(path: Path) -> Path:
    path.write_text(json.dumps({"body": {"tools": [WEATHER, TIME]}, "texts": TOOL_TEXTS}))
    return path


def test_pyodide_environment(pyodide_run):
    s = pyodide_run["setup"]
    assert s["platform"] == "emscripten" and s["python"].startswith("3.12") and s["numpy"] == "2.0.2"
    assert pyodide_run["tokenizers_importable"] is False
    assert pyodide_run["threads"].startswith("RuntimeError")
    print("\npyodide timings:", pyodide_run["timings"], "import common:", s["import_common_s"],
          "s; wasm heap:", pyodide_run["wasm_heap_bytes"] >> 20, "MiB")


def test_dequant_is_bit_exact_with_cpython_for_all_13_types(pyodide_run):
    got = pyodide_run["dequant"]
    assert {k.split("#")[0] for k in got} == set(QUANT_TYPES) and len(QUANT_TYPES) == 13
    assert all(v["bit_exact"] for v in got.values()), {k: v for k, v in got.items() if not v["bit_exact"]}


def test_pure_python_tokenizer_equals_tokenizers_under_pyodide(pyodide_run):
    t = pyodide_run["tokenizer"]
    assert t["backend"] == "python" and t["texts"] == 80 and t["tokens"] > 1000
    assert t["n_mismatches"] == 0, t["mismatches"]


async def test_a_generation_through_the_workers_under_pyodide_equals_cpython(pyodide_run, tiny_knot, tmp_path,
                                                                            numpy_matmul):
    """CPython on the numpy matmul path, as Pyodide runs (the C kernels sum in another order)."""
    gen, stream, bad, stats, choices, *speculative, unsigned = pyodide_run["requests"][:-2 - len(NEEDS_GRAMMAR)]
    _clear_boot_caches()
    cluster = await build_cluster(tiny_knot, tmp_path, n_stations=2, n_shards=4)
    want = (await cluster.generate(prompt=PROMPT, max_tokens=MAX_TOKENS)).json()
    want_chat = (await cluster.generate(messages=[{"role": "user", "content": PROMPT}], max_tokens=MAX_TOKENS)).json()
    want_choices = [(await cluster.generate(**{k: v for k, v in CHOICES.items() if k not in ("n", "stream", "seed")},
                                            **{"seed": CHOICES["seed"] + i})).json()["text"] for i in range(2)]
    await cluster.drain()
    _clear_boot_caches()
    assert gen["status"] == 200, gen["text"]
    body = json.loads(gen["text"])
    assert body["tokens"] == want["tokens"] and len(body["tokens"]) == MAX_TOKENS
    assert body["degraded_shards"] == [] and gen["wait_until_failures"] == []
    # streamed: SSE through a ReadableStream, one chunk per event at least
    assert stream["status"] == 200 and stream["content_type"].startswith("text/event-stream")
    events = [json.loads(e[6:]) for e in stream["text"].split("\n\n") if e.startswith("data: {")]
    streamed = [bytes(x["bytes"]) for ev in events if ev["choices"] and ev["choices"][0]["logprobs"]
                for x in ev["choices"][0]["logprobs"]["content"]]
    tok = Tokenizer(open_model(tiny_knot).tokenizer_data())
    assert streamed == [tok.token_bytes(i) for i in want_chat["tokens"]] and streamed
    assert stream["text"].endswith("data: [DONE]\n\n") and stream["chunks"] >= len(streamed)
    assert stream["wait_until_failures"] == []
    # bad input: a 400 naming the problem, and the Workers go on
    assert bad["status"] == 400 and "prompt" in json.loads(bad["text"])["message"]
    assert stats["status"] == 200 and json.loads(stats["text"])["layer_start"] == 0  # signed for knot-station-0
    assert unsigned["status"] == 401 and "X-Knot-Signature" in json.loads(unsigned["text"])["message"]
    # n = 2, streamed: each choice's chunks make the text of its seed's generation
    assert choices["status"] == 200 and choices["text"].endswith("data: [DONE]\n\n"), choices["text"][-300:]
    events = [json.loads(e[6:]) for e in choices["text"].split("\n\n") if e.startswith("data: {")]
    assert ["".join(ev["choices"][0]["text"] for ev in events if ev["choices"][0]["index"] == i)
            for i in range(2)] == want_choices
    # every role ran: stations and wardens as Durable Objects, rows through KV, weights from R2
    classes = {k.split("/")[1] for k in pyodide_run["objects"]}
    assert classes == {"Station", "LayerWarden", "CobordismWarden"}
    assert pyodide_run["kv_rows"] > 0 and pyodide_run["r2_reads"] > 0
    header = open_model(tiny_knot).header
    ranges = {tuple(r) for r in pyodide_run["r2_ranges"]}
    base = header.tensor_range("token_embd.weight")[0]

    def read_of(a: int, b: int) -> tuple[int, int]:  # (offset, length): rows [a, b) widened to whole chunks
        s, e = (x - base for x in header.row_range("token_embd.weight", a, b))
        s, e = header.chunk_span("token_embd.weight", s, e)
        return base + s, e - s

    # (a row read by shards 0 and 1 widens to a chunk a slice also spans: only the warm-ups are told apart)
    assert all(read_of(a, b) in ranges for a, b in cluster.shard_ranges[2:]), \
        "shards 2 and 3 (WARM_WARDEN=on) had their slices read whole"
    print(f"\npyodide: /generate of {MAX_TOKENS} tokens in {gen['seconds']} s, stream in {stream['seconds']} s")
    # speculative trips: the single process's tokens without speculation (no station code in that oracle)
    engine = LocalEngine.open(tiny_knot)
    ids = engine.tokenizer.encode(CODE)
    spec_stats = []
    assert len(speculative) == len(LOOKUP_CASES)
    for (sampling, spec), got in zip(LOOKUP_CASES, speculative):
        assert got["status"] == 200, got["text"]
        body = json.loads(got["text"])
        want = engine.generate(ids, SamplingParams(**sampling), max_tokens=SPECULATIVE_TOKENS).token_ids
        assert body["tokens"] == want, (sampling, spec)
        spec_stats.append(body["timings"]["speculation"])
    greedy, rejected = spec_stats
    assert greedy["source"] == "prompt_lookup" and 0 < greedy["accepted"] <= greedy["drafted"], greedy
    assert greedy["trips"] < SPECULATIVE_TOKENS, greedy
    assert rejected["source"] == "prompt_lookup" and rejected["accepted"] < rejected["drafted"], rejected


async def test_tool_calls_in_auto_mode_under_pyodide_and_a_400_for_what_needs_the_grammar_engine(
        pyodide_run, tiny_knot, tmp_path, numpy_matmul):
    """docs/cloudflare.md: tools in `auto` mode work on the Workers (the calls parsed from the model's
    own output); response_format json_schema and tool_choice "required" need llguidance: a 400 naming
    the field and why. The reference is the in-process cluster (CPython, same request)."""
    from services.coordinator.tools import ToolStream, parse_tools, split_calls
    from tests.cloudflare.pyodide_checks import TEXT, tool_call_outcome

    whole, streamed, *needs_grammar = pyodide_run["requests"][-2 - len(NEEDS_GRAMMAR):]
    # the parser under Pyodide reads each reply as CPython does (calls, bare objects, text)
    tools = parse_tools({"tools": [WEATHER, TIME]})
    want_parsed = [tool_call_outcome(t, tools, split_calls, ToolStream) for t in TOOL_TEXTS]
    assert pyodide_run["tool_calls"] == want_parsed
    assert [w["whole"] != TEXT for w in want_parsed] == [True, True, True, False, False, False]
    # a tools request in auto mode: the template lists the tools (same prompt as CPython's), and the
    # tiny model's reply, plain text, stays text, whole and streamed
    _clear_boot_caches()
    cluster = await build_cluster(tiny_knot, tmp_path, n_stations=2, n_shards=4)
    want = (await cluster.coordinator.fetch(Request("POST", "https://coordinator/v1/chat/completions",
                                                    {"Content-Type": "application/json"},
                                                    json.dumps(TOOLS_AUTO).encode()))).json()
    await cluster.drain()
    _clear_boot_caches()
    assert whole["status"] == 200, whole["text"]
    got = json.loads(whole["text"])
    assert got["usage"]["prompt_tokens"] == want["usage"]["prompt_tokens"]
    assert got["choices"][0]["message"] == want["choices"][0]["message"]
    assert got["choices"][0]["finish_reason"] == want["choices"][0]["finish_reason"] in ("length", "stop")
    assert not want["choices"][0]["message"].get("tool_calls") and want["choices"][0]["message"]["content"]
    assert streamed["status"] == 200 and streamed["text"].endswith("data: [DONE]\n\n"), streamed["text"][-300:]
    events = [json.loads(e[6:]) for e in streamed["text"].split("\n\n") if e.startswith("data: {")]
    deltas = [ev["choices"][0]["delta"] for ev in events if ev["choices"]]
    assert "".join(d.get("content") or "" for d in deltas) == want["choices"][0]["message"]["content"]
    assert not any(d.get("tool_calls") for d in deltas)
    # what needs the grammar engine: a 400 naming the field, and that it is not available here
    for (body, field), res in zip(NEEDS_GRAMMAR, needs_grammar):
        assert res["status"] == 400, (field, res["text"][:500])
        err = json.loads(res["text"])
        message = err.get("message") or err["error"]["message"]
        assert field in message and "not available" in message and "Pyodide" in message, message


@pytest.mark.realmodel
def test_pure_python_tokenizer_on_qwen2_under_pyodide(real_knot_05b, tmp_path):
    data = open_model(real_knot_05b).tokenizer_data()
    texts = corpus()
    out = tmp_path / "deploy"
    wrangler.write(out, [w for w in wrangler.plan(24, 151936, "m.knot") if w.role == "coordinator"])
    config = {"mounts": {"/data": str(tmp_path), "/deploy": str(out)},
              "python_path": ["/deploy/knot-coordinator/src", "/deploy/knot-coordinator/python_modules", "/sdk"],
              "tokenizer": f"/data/{tokenizer_case(data, texts, tmp_path / 'qwen2.json').name}"}
    t = run_harness(config, tmp_path)["tokenizer"]
    assert t["backend"] == "python" and t["texts"] == len(texts)
    assert t["n_mismatches"] == 0, t["mismatches"]
    print(f"\nqwen2 tokenizer under pyodide: build {t['build_s']} s, {t['tokens']} tokens in {t['encode_s']} s")
