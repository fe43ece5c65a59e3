"""Issue 5 acceptance on the real weights: `knot cluster up` (the launcher, from docker-compose.yml,
on real SeaweedFS and Valkey), then POST /generate gives the tokens of the single-process engine."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from common.sampling import SamplingParams
from deploy import launcher, servers
from deploy.engine_local import LocalEngine
from tests.integration.conftest import http

pytestmark = [pytest.mark.realmodel, pytest.mark.integration]

PROMPTS = ["def fibonacci(n):", "<|im_start|>user\nWhat is a Python list?<|im_end|>\n<|im_start|>assistant\n"]
MAX_TOKENS = 8


def peak_rss_bytes(pid: int) -> int:
    """VmHWM: the process's peak resident set."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return 0


SMALL = ("qwen2.5-coder-0.5b", "worker")       # the 0.5B's halves fit a Worker's 128 MiB
STREAMING = ("qwen2.5-coder-1.5b", "worker")   # the 1.5B's do not: its stations stream (fluid memory)
RESIDENT = ("qwen2.5-coder-1.5b", "resident")


def cid(p) -> str:
    return "-".join(p)


def on(*clusters):
    """A test on some of the three clusters (each up once for the module): the coordinator's own
    features (tools, grammars, speculation) on the small one and the resident 1.5B; what memory
    changes (budgets, chunked prefill, the prompt cache of a fluid station) on the streaming one."""
    return pytest.mark.parametrize("real_cluster", clusters, indirect=True, ids=cid)


@pytest.fixture(scope="module", params=[SMALL, STREAMING, RESIDENT], ids=cid)
def real_cluster(request, tmp_path_factory):
    name, profile = request.param
    request.getfixturevalue("real_knot_05b" if "0.5b" in name else "real_knot_15b")  # fetched + encoded
    run_dir = tmp_path_factory.mktemp(f"cluster-{name}-{profile}")
    env = {**os.environ, "KNOT_PORT": str(servers.free_ports(1)[0])}
    for inherited in ("KNOT_KEY", "KNOT_PROFILE", "KNOT_RESIDENT_MAX_BYTES"):
        env.pop(inherited, None)
    cluster = launcher.Cluster(run_dir)
    running = cluster.up(model=name, env=env, profile=profile)
    try:
        yield name, cluster, {r.name: r for r in running}
    finally:
        cluster.down()


def stats(cluster, r) -> dict:
    """A station's /stats, called as the cluster's services call it (signed with its secret)."""
    status, _, raw = http("GET", r.url + "/stats", headers=cluster.signed("GET", r.url + "/stats"))
    assert status == 200, raw
    return json.loads(raw)


def test_cluster_equals_knot_generate_and_respects_the_budget(real_cluster, record_property):
    name, cluster, running = real_cluster
    from deploy import models

    engine = LocalEngine.open(models.model_path(name))
    url = running["coordinator"].url
    for prompt in PROMPTS:
        for sampling in ({}, {"temperature": 0.7, "top_k": 40, "top_p": 0.9, "seed": 11}):
            status, _, raw = http("POST", url + "/generate", {"prompt": prompt, "max_tokens": MAX_TOKENS, **sampling},
                                  timeout_s=900)
            assert status == 200, raw
            body = json.loads(raw)
            want = engine.generate(engine.tokenizer.encode(prompt), SamplingParams(**sampling), max_tokens=MAX_TOKENS)
            assert body["prompt_tokens"] == want.prompt_ids
            assert body["tokens"] == want.token_ids, (prompt, sampling, body["text"], want.text)
            assert body["degraded_shards"] == []
    # fill in the middle: the prompt before, the suffix after
    fim = {"prompt": "def mean(xs):\n    ", "suffix": "\n    return total / len(xs)\n"}
    status, _, raw = http("POST", url + "/generate", {**fim, "max_tokens": MAX_TOKENS}, timeout_s=900)
    assert status == 200, raw
    body = json.loads(raw)
    want = engine.generate(engine.tokenizer.encode_fim(fim["prompt"], fim["suffix"]), SamplingParams(),
                           max_tokens=MAX_TOKENS)
    assert body["prompt_tokens"] == want.prompt_ids and body["tokens"] == want.token_ids, (body["text"], want.text)
    # a logit bias (the shards send full slices; the coordinator applies it): ban the greedy first token
    first = want.token_ids[0]
    status, _, raw = http("POST", url + "/generate", {**fim, "max_tokens": MAX_TOKENS,
                                                      "logit_bias": {str(first): -100}}, timeout_s=900)
    assert status == 200, raw
    body = json.loads(raw)
    want = engine.generate(want.prompt_ids, SamplingParams(logit_bias=((first, -100.0),)), max_tokens=MAX_TOKENS)
    assert body["tokens"] == want.token_ids and want.token_ids[0] != first, (body["text"], want.text)
    report = {}
    for st in ("station-0", "station-1"):
        s = stats(cluster, running[st])
        report[st] = {"peak_accounted_bytes": s["peak_accounted_bytes"], "budget_bytes": s["budget_bytes"],
                      "kept_tensors": s["kept_tensors"], "warden_bytes": s["warden_bytes"]}
        # the fluid-memory invariant, as accounted: tensors + activations + KV caches
        m = s["memory"]
        want = 128 << 20 if m["profile"] == "worker" else m["layer_bytes"] + (128 << 20)  # (24 GiB hosts: no cap)
        assert s["peak_accounted_bytes"] <= s["budget_bytes"] == want, s
    rss = {n: peak_rss_bytes(r.pid) for n, r in running.items() if r.kind == "process" and servers.pid_alive(r.pid)}
    report["peak_rss_mib"] = {n: round(b / 2**20, 1) for n, b in rss.items()}
    record_property("cluster_memory", json.dumps(report))
    print(f"\n{name}: {json.dumps(report, indent=1)}")


@on(SMALL, STREAMING)
def test_a_long_prompt_gives_the_tokens_of_knot_generate(real_cluster):
    """Issue 12: a prompt of thousands of tokens, in 256-token chunks through the stations with tiled
    attention, gives the single process's first tokens; the budget holds. (1,000 tokens for the
    1.5B, whose long prefill takes minutes on 2 cores: still four chunks and several key tiles.
    Not a skip: under CI=true a skipped real-model test fails.)"""
    name, cluster, running = real_cluster
    from deploy import models
    from deploy.commands.bench import long_prompt_ids

    n = 3000 if "0.5b" in name else 1000
    engine = LocalEngine.open(models.model_path(name))
    ids = long_prompt_ids(engine.tokenizer, n)
    status, _, raw = http("POST", running["coordinator"].url + "/v1/completions",
                          {"prompt": ids, "max_tokens": 4, "temperature": 0}, timeout_s=1800)
    assert status == 200, raw
    body = json.loads(raw)
    want = engine.generate(ids, SamplingParams(), max_tokens=4)
    assert body["usage"]["prompt_tokens"] == n
    assert body["choices"][0]["text"] == want.text
    for st in ("station-0", "station-1"):
        s = stats(cluster, running[st])
        assert s["peak_accounted_bytes"] <= s["budget_bytes"] and s["max_session_tokens"] > n + 4, s


def test_concurrent_generations_are_batched_and_each_equals_knot_generate(real_cluster):
    """Batched decode on real weights and real processes: requests in flight together share the
    stations' forwards and the shards' LM-head products, and each still gets exactly the tokens
    the single process gives it alone (the kernels compute every row independently)."""
    from concurrent.futures import ThreadPoolExecutor

    from deploy import models

    name, cluster, running = real_cluster
    engine = LocalEngine.open(models.model_path(name))
    url = running["coordinator"].url
    prompts = ["def quicksort(arr):", "import numpy as np\n", "class Stack:", "# read a CSV file\n"]
    before = {st: stats(cluster, running[st]) for st in ("station-0", "station-1")}

    def one(prompt):
        status, _, raw = http("POST", url + "/generate", {"prompt": prompt, "max_tokens": MAX_TOKENS}, timeout_s=900)
        assert status == 200, raw
        return json.loads(raw)

    with ThreadPoolExecutor(len(prompts)) as pool:
        bodies = list(pool.map(one, prompts))
    for prompt, body in zip(prompts, bodies):
        want = engine.generate(engine.tokenizer.encode(prompt), SamplingParams(), max_tokens=MAX_TOKENS)
        assert body["tokens"] == want.token_ids, (prompt, body["text"], want.text)
    for st, b in before.items():
        s = stats(cluster, running[st])
        batched = s["batched_items"] - b["batched_items"]
        assert s["batches"] - b["batches"] < batched, f"{st}: no forward carried two requests ({s})"


def test_the_profile_is_reported_and_tells_the_truth(real_cluster):
    """Issue 16: /v1/models reports each station's profile and resident fraction, and the report
    is what happens: a station said to fit loads nothing for a second generation, one said to
    stream loads its layers again. The 1.5B streams at a Worker's 128 MiB and does not when resident."""
    name, cluster, running = real_cluster
    url = running["coordinator"].url
    status, _, raw = http("GET", url + "/v1/models")
    assert status == 200, raw
    memory = json.loads(raw)["data"][0]["memory"]
    profile = memory["profile"]
    if "1.5b" in name:
        assert [s["fits"] for s in memory["stations"]] == [profile == "resident"] * 2, memory
    body = {"prompt": "def add(a, b):", "max_tokens": 4}
    assert http("POST", url + "/generate", body, timeout_s=900)[0] == 200
    before = {st: stats(cluster, running[st]) for st in ("station-0", "station-1")}
    assert http("POST", url + "/generate", body, timeout_s=900)[0] == 200
    for i, st in enumerate(("station-0", "station-1")):
        s = stats(cluster, running[st])
        loaded = s["warden_tensors"] + s["r2_tensors"] - before[st]["warden_tensors"] - before[st]["r2_tensors"]
        assert (loaded == 0) == memory["stations"][i]["fits"], (st, loaded, memory["stations"][i])
    lines = cluster.memory_lines(list(running.values()))
    assert [f"profile {profile}" in line for line in lines[:2]] == [True, True], lines
    assert (len(lines) == 3) == (not all(s["fits"] for s in memory["stations"])), lines  # + the cluster line
    metrics = http("GET", url + "/metrics")[2].decode()
    assert f'knot_station_resident_fraction{{profile="{profile}",station="1"}}' in metrics


CODE_PROMPT = ('def has_close_elements(numbers: list[float], threshold: float) -> bool:\n'
               '    """Check if in given list of numbers, are any two numbers closer to each other than\n'
               '    given threshold.\n    >>> has_close_elements([1.0, 2.0, 3.0], 0.5)\n    False\n    """\n')


@on(SMALL, RESIDENT)
def test_speculation_and_shard_sampling_change_no_token(real_cluster):
    """Issue 15 on real weights: prompt-lookup speculation through the stations and the tokens
    decided from the shards' summaries give the single process's tokens without either, greedy
    and seeded; the speculative run verified drafts and the shards' summaries decided the tokens."""
    from deploy import models

    name, _, running = real_cluster
    engine = LocalEngine.open(models.model_path(name))
    url = running["coordinator"].url
    n = 48
    for sampling in ({}, {"temperature": 0.8, "top_p": 0.95, "seed": 3}):
        want = engine.generate(engine.tokenizer.encode(CODE_PROMPT), SamplingParams(**sampling), max_tokens=n)
        for spec in ("off", "prompt_lookup"):
            status, _, raw = http("POST", url + "/generate", {"prompt": CODE_PROMPT, "max_tokens": n,
                                                              "speculation": spec, **sampling}, timeout_s=900)
            assert status == 200, raw
            body = json.loads(raw)
            assert body["tokens"] == want.token_ids, (sampling, spec, body["text"], want.text)
            t = body["timings"]
            assert t["shard_sampling"]["summaries"] > 0, t
            if spec == "prompt_lookup":
                assert t["speculation"]["drafted"] > 0, t


def test_the_cluster_logprobs_are_the_single_process_logprobs(real_cluster):
    """Sharded equals unsplit across processes, numerically and not only in the greedy choice: the
    top-5 logprobs of each of 6 tokens after a chat prompt, through the launcher's processes
    (speculation off), equal the single process's to 1e-4. (A 1.5B near-tie had once been read as
    a cluster difference; it was a script's engine on the numpy path against the kernels. Both on
    the kernels agree exactly.)"""
    import time

    from common.generation import Generation, generate_events
    from common.sync import iterate_sync
    from deploy import models

    name, _, running = real_cluster
    engine = LocalEngine.open(models.model_path(name))
    ids = engine.tokenizer.encode_chat([{"role": "user", "content": "Explain a Python list comprehension."}])
    gen = Generation(ids, 6, SamplingParams(), (), 5, request_id="single")
    want = [dict(e.logprobs.top) for e in iterate_sync(generate_events(engine, gen, engine.tokenizer,
                                                                       time.perf_counter)) if getattr(e, "logprobs", None)]
    status, _, raw = http("POST", running["coordinator"].url + "/v1/completions",
                          {"prompt": ids, "max_tokens": 6, "temperature": 0, "logprobs": 5, "speculation": "off"},
                          timeout_s=900)
    assert status == 200, raw
    got = json.loads(raw)["choices"][0]["logprobs"]["top_logprobs"]
    assert len(got) == len(want) == 6
    for i, (g, w) in enumerate(zip(got, want)):
        w_text = {engine.tokenizer.decode([t]): lp for t, lp in w.items()}
        assert g.keys() == w_text.keys(), (i, g, w_text)
        assert max(abs(g[k] - w_text[k]) for k in g) < 1e-4, (i, g, w_text)


WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Get the current weather in a city",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                           "required": ["city"]}}}


@on(SMALL, RESIDENT)
def test_tool_calls_through_the_openai_client(real_cluster):
    """The official client gets parsed tool calls, whole and streamed, equal to the single process's
    reply; the call and the tool's answer sent back give the single process's prompt."""
    import openai

    from services.coordinator.tools import parse_tools, split_calls

    name, cluster, running = real_cluster
    from deploy import models

    engine = LocalEngine.open(models.model_path(name))
    client = openai.OpenAI(base_url=running["coordinator"].url + "/v1", api_key="unused", timeout=900)
    msgs = [{"role": "user", "content": "What is the weather like in Paris today?"}]
    want = engine.generate(engine.tokenizer.encode_chat(msgs, tools=[WEATHER]), SamplingParams(), max_tokens=60)
    _, want_calls = split_calls(want.text, parse_tools({"tools": [WEATHER]}))
    r = client.chat.completions.create(model=name, messages=msgs, tools=[WEATHER], temperature=0, max_tokens=60)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    got = [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls]
    assert got == [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in want_calls]
    assert got == [("get_weather", {"city": "Paris"})]
    # streamed: the client's deltas reassembled by index
    parts: dict[int, dict] = {}
    finish = None
    for chunk in client.chat.completions.create(model=name, messages=msgs, tools=[WEATHER], temperature=0,
                                                max_tokens=60, stream=True):
        delta = chunk.choices[0].delta
        assert not delta.content, delta  # a reply of calls sends no content
        for tc in delta.tool_calls or []:
            p = parts.setdefault(tc.index, {"name": "", "arguments": ""})
            p["name"] += tc.function.name or ""
            p["arguments"] += tc.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    assert finish == "tool_calls" and [(p["name"], json.loads(p["arguments"])) for p in parts.values()] == got
    # the call and the tool's reply in the history
    history = [*msgs, choice.message.model_dump(exclude_none=True),
               {"role": "tool", "tool_call_id": choice.message.tool_calls[0].id, "content": '{"temp_c": 18}'}]
    r = client.chat.completions.create(model=name, messages=history, tools=[WEATHER], temperature=0, max_tokens=24)
    ids = engine.tokenizer.encode_chat(
        [*msgs, {"role": "assistant", "content": "", "tool_calls": [
            {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
         {"role": "tool", "content": '{"temp_c": 18}'}], tools=[WEATHER])
    assert r.usage.prompt_tokens == len(ids)
    want = engine.generate(ids, SamplingParams(), max_tokens=24)
    assert r.choices[0].message.content == want.text or r.choices[0].finish_reason == "tool_calls"


SCHEMAS = {
    "nested": {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 20},
        "address": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                                     "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                    "required": ["city", "zip"], "additionalProperties": False}},
        "required": ["name", "address"], "additionalProperties": False},
    "array_enum": {"type": "object", "properties": {
        "langs": {"type": "array", "items": {"enum": ["python", "rust", "go"]}, "minItems": 1, "maxItems": 3},
        "level": {"type": "integer", "minimum": 1, "maximum": 5}},
        "required": ["langs", "level"], "additionalProperties": False},
    "any_of_format": {"type": "object", "properties": {
        "id": {"anyOf": [{"type": "integer"}, {"type": "string", "format": "uuid"}]},
        "born": {"type": "string", "format": "date"}, "ok": {"type": "boolean"}},
        "required": ["id", "born", "ok"], "additionalProperties": False},
}


@on(SMALL, RESIDENT)
def test_json_schema_output_validates_and_equals_the_single_process(real_cluster):
    """response_format json_schema / json_object through the cluster: every output is valid
    against its schema (jsonschema) and equal to the single process under the same grammar, greedy
    and seeded; the openai client's parse() gets a pydantic object; a required tool call parses."""
    import asyncio
    import uuid as uuid_

    import jsonschema
    import openai
    import pydantic

    from common import constraints
    from common.constraints import Grammar
    from common.generation import Generation, generate_events

    name, cluster, running = real_cluster
    from deploy import models

    engine = LocalEngine.open(models.model_path(name))
    tok = engine.tokenizer
    client = openai.OpenAI(base_url=running["coordinator"].url + "/v1", api_key="unused", timeout=900)
    msgs = [{"role": "user", "content": "Describe a programmer as a JSON object."}]
    ids = tok.encode_chat(msgs)

    def single(schema: dict, sampling: dict) -> str:
        compiled = constraints.compiler().compile(Grammar("json_schema", json.dumps(schema)), tok,
                                                  engine.cfg.vocab_size)
        gen = Generation(list(ids), 64, SamplingParams(**sampling), allowed=compiled.start(len(ids)).allowed,
                         request_id=uuid_.uuid4().hex)

        async def run():
            async for _ in generate_events(engine, gen, tok, time.perf_counter):
                pass
        asyncio.run(run())
        return gen.text

    import time
    # every schema greedy and seeded on the small model; one of each on the others (the grammar path is
    # the same; their single process is slower)
    small = name == "qwen2.5-coder-0.5b"
    for label, schema in SCHEMAS.items() if small else [("nested", SCHEMAS["nested"])]:
        for sampling in ({"temperature": 0}, {"temperature": 0.8, "seed": 5}) if small else ({"temperature": 0},):
            r = client.chat.completions.create(model=name, messages=msgs, max_tokens=64, **sampling,
                                               response_format={"type": "json_schema", "json_schema": {
                                                   "name": label, "schema": schema, "strict": True}})
            text = r.choices[0].message.content
            assert r.choices[0].finish_reason == "stop", (label, text)
            jsonschema.validate(json.loads(text), schema, format_checker=jsonschema.FormatChecker())
            assert text == single(schema, sampling), (label, sampling)
    r = client.chat.completions.create(model=name, messages=msgs, max_tokens=256, temperature=0,
                                       response_format={"type": "json_object"})  # any object: room to end it
    assert r.choices[0].finish_reason == "stop", r.choices[0].message.content
    assert isinstance(json.loads(r.choices[0].message.content), dict)

    class Programmer(pydantic.BaseModel):
        name: str = pydantic.Field(max_length=40)
        years: int
        languages: list[str] = pydantic.Field(max_length=5)  # maxItems: the grammar ends the list

    parsed = client.beta.chat.completions.parse(model=name, messages=msgs, max_tokens=256, temperature=0,
                                                response_format=Programmer)
    assert isinstance(parsed.choices[0].message.parsed, Programmer), parsed
    # a call the model must make: parsed, its arguments valid for the named function
    r = client.chat.completions.create(model=name, messages=[{"role": "user", "content": "Hi there!"}],
                                       tools=[WEATHER], max_tokens=48, temperature=0, parallel_tool_calls=False,
                                       tool_choice={"type": "function", "function": {"name": "get_weather"}})
    call = r.choices[0].message.tool_calls[0]
    assert r.choices[0].finish_reason == "tool_calls" and call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])


@on(SMALL, STREAMING)
def test_a_cached_prompt_prefix_gives_the_tokens_of_a_cold_one(real_cluster):
    """Issue 50, prompt caching: a long context re-sent with a new tail starts after the blocks the
    stations kept, and its tokens equal the single process's and a cold run's (cache_prompt false),
    greedy and seeded. A fluid station (the worker profile on these models' two stations) keeps
    the first blocks its slack holds, or none, which /v1/models says why; the request runs either way."""
    name, cluster, running = real_cluster
    from deploy import models
    from deploy.commands.bench import long_prompt_ids
    from common.kvcache import PREFILL_CHUNK_TOKENS
    from common.prefix import PREFIX_BLOCK_TOKENS, block_keys, resume_at

    url = running["coordinator"].url
    status, _, raw = http("GET", url + "/v1/models")
    card = json.loads(raw)["data"][0]["prompt_cache"]
    engine = LocalEngine.open(models.model_path(name))
    n = 700 if "0.5b" in name else 600  # the cached blocks end inside a prefill chunk, past its first tile
    ids = long_prompt_ids(engine.tokenizer, n + 40)
    first, second = ids[:n], ids
    status, _, raw = http("POST", url + "/v1/completions", {"prompt": first, "max_tokens": 1, "temperature": 0},
                          timeout_s=1800)
    assert status == 200, raw
    # the first prompt's blocks each station kept (a fluid one's cache may hold only the first few)
    keys = b"".join(block_keys(first))
    held = []
    for st in ("station-0", "station-1"):
        target = running[st].url + "/prefix"
        status, _, raw = http("POST", target, keys, headers=cluster.signed("POST", target, keys))
        assert status == 200, raw
        held.append(json.loads(raw)["blocks"])
    held = min(held)
    blocks = resume_at(n + 40, held) * PREFIX_BLOCK_TOKENS if card["on"] else 0
    assert not card["on"] or held >= 1, card
    if held == n // PREFIX_BLOCK_TOKENS:  # all of them: the prompt resumes inside a chunk
        assert blocks % PREFILL_CHUNK_TOKENS, blocks
    for sampling in ({"temperature": 0}, {"temperature": 0.8, "seed": 3}):
        replies = {}
        for cache in (True, False):
            status, _, raw = http("POST", url + "/v1/completions", {"prompt": second, "max_tokens": 6,
                                                                    "cache_prompt": cache, **sampling},
                                  timeout_s=1800)
            assert status == 200, raw
            replies[cache] = json.loads(raw)
        assert replies[True]["usage"]["prompt_tokens_details"]["cached_tokens"] >= blocks
        assert replies[False]["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        assert replies[True]["choices"][0]["text"] == replies[False]["choices"][0]["text"], sampling
        if sampling["temperature"] == 0:
            assert replies[True]["choices"][0]["text"] == engine.generate(second, SamplingParams(),
                                                                          max_tokens=6).text
    if not card["on"]:  # only a fluid station turns it off: it says why
        off = [s for s in card["stations"] if not s["holds"]]
        assert off and all("budget" in s["why_not"] for s in off), card
    else:
        for st in ("station-0", "station-1"):
            s = stats(cluster, running[st])["prefix_cache"]
            assert s["hits"] >= 2 and s["bytes"] <= s["capacity_bytes"], s
