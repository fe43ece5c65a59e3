"""The OpenAI-compatible API on a whole cluster in one process (embedded bindings, the real handlers),
plus the host's streaming contract on a real aiohttp server."""
from __future__ import annotations

import asyncio
import json
import re

import aiohttp
import pytest
from aiohttp import web

from common.runtime import Env, Request, Response, ServiceUnavailable
from common.sampling import SamplingParams
from deploy.engine_local import LocalEngine
from deploy.local.host import ServiceRuntime, build_app
from deploy.local.tasks import BackgroundTasks
from services.coordinator import handler as co_handler
from tests.inprocess import build_cluster
from tests.waits import until

PROMPT = "the def the"


@pytest.fixture(scope="module")
def engine(tiny_knot):
    return LocalEngine.open(tiny_knot)


def reference(engine, prompt_ids, max_tokens, **sampling):
    return engine.generate(prompt_ids, SamplingParams(**sampling), max_tokens=max_tokens)


async def post(c, path: str, body) -> Response:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    return await c.coordinator.fetch(Request("POST", f"https://coordinator{path}",
                                             {"Content-Type": "application/json"}, data))


async def read_sse(resp: Response, limit: int | None = None) -> list:
    """The events of a streamed reply: parsed JSON objects, and "[DONE]"."""
    assert resp.stream is not None and resp.headers["Content-Type"].startswith("text/event-stream")
    buf, events = b"", []
    try:
        async for chunk in resp.stream:
            buf += chunk
            while b"\n\n" in buf:
                line, buf = buf.split(b"\n\n", 1)
                assert line.startswith(b"data: "), line
                data = line[len(b"data: "):]
                events.append("[DONE]" if data == b"[DONE]" else json.loads(data))
            if limit is not None and len(events) >= limit:
                break
    finally:
        await resp.stream.aclose()
    return events


async def station_sessions(c) -> list[int]:
    return [(await st.fetch(Request("GET", "/stats"))).json()["sessions"] for st in c.stations]


@pytest.fixture
async def cluster(tiny_knot, tmp_path):
    c = await build_cluster(tiny_knot, tmp_path, 2, 4)
    yield c
    await c.drain()


# ---------------------------------------------------------------- completions and chat


async def test_completion_equals_generate_and_the_engine(cluster, engine):
    ids = engine.tokenizer.encode(PROMPT)
    want = reference(engine, ids, 8)
    r = await post(cluster, "/v1/completions", {"model": "whatever", "prompt": PROMPT, "max_tokens": 8})
    assert r.status == 200, r.body
    body = r.json()
    assert body["object"] == "text_completion" and body["id"].startswith("cmpl-") and body["model"] == "model"
    (choice,) = body["choices"]
    assert choice["text"] == want.text and choice["index"] == 0 and choice["logprobs"] is None
    assert choice["finish_reason"] == ("length" if len(want.token_ids) == 8 else "stop")
    assert body["usage"] == {"prompt_tokens": len(ids), "completion_tokens": len(want.token_ids),
                             "total_tokens": len(ids) + len(want.token_ids),
                             "prompt_tokens_details": {"cached_tokens": 0}}
    gen = (await cluster.generate(prompt=PROMPT, max_tokens=8)).json()
    assert gen["text"] == choice["text"] and gen["tokens"] == want.token_ids
    # a prompt of token ids, and a batch of one, give the same
    for prompt in (ids, [ids], [PROMPT]):
        again = (await post(cluster, "/v1/completions", {"prompt": prompt, "max_tokens": 8})).json()
        assert again["choices"][0]["text"] == want.text


async def test_completion_stream_matches_the_whole_reply(cluster, engine):
    ids = engine.tokenizer.encode(PROMPT)
    want = reference(engine, ids, 10)
    r = await post(cluster, "/v1/completions", {"prompt": PROMPT, "max_tokens": 10, "stream": True,
                                                "stream_options": {"include_usage": True}})
    assert r.status == 200 and r.headers["Cache-Control"] == "no-cache"
    events = await read_sse(r)
    assert events[-1] == "[DONE]"
    usage, chunks = events[-2], events[:-2]
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == len(want.token_ids)
    assert all(e["object"] == "text_completion" and e["id"] == chunks[0]["id"] for e in chunks)
    assert "".join(e["choices"][0]["text"] for e in chunks) == want.text
    assert [e["choices"][0]["finish_reason"] for e in chunks[:-1]] == [None] * (len(chunks) - 1)
    assert chunks[-1]["choices"][0]["finish_reason"] in ("stop", "length")
    assert await station_sessions(cluster) in ([0, 0], [1, 1])  # the release is in flight (wait_until)
    await cluster.drain()
    assert await station_sessions(cluster) == [0, 0]


async def test_chat_uses_the_models_template(cluster, engine):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    ids = engine.tokenizer.encode(engine.tokenizer.render_chat(messages))
    want = reference(engine, ids, 6)
    r = await post(cluster, "/v1/chat/completions", {"model": "m", "messages": messages, "max_tokens": 6})
    assert r.status == 200, r.body
    body = r.json()
    assert body["object"] == "chat.completion" and body["id"].startswith("chatcmpl-")
    (choice,) = body["choices"]
    assert choice["message"] == {"role": "assistant", "content": want.text}
    assert body["usage"]["prompt_tokens"] == len(ids)
    # content as a list of text parts, and max_completion_tokens, mean the same
    parts = [{"role": "system", "content": [{"type": "text", "text": "be "}, {"type": "text", "text": "brief"}]},
             messages[1]]
    again = (await post(cluster, "/v1/chat/completions", {"messages": parts, "max_completion_tokens": 6})).json()
    assert again["choices"][0]["message"]["content"] == want.text
    # streamed: a role chunk first, then content deltas, then the finish chunk
    events = await read_sse(await post(cluster, "/v1/chat/completions",
                                       {"messages": messages, "max_tokens": 6, "stream": True}))
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert all(e["object"] == "chat.completion.chunk" for e in chunks)
    assert "".join(e["choices"][0]["delta"].get("content", "") for e in chunks) == want.text
    assert chunks[-1]["choices"][0]["delta"] == {} and chunks[-1]["choices"][0]["finish_reason"] in ("stop", "length")


async def test_sampling_params_and_stop(cluster, engine):
    ids = engine.tokenizer.encode(PROMPT)
    params = dict(temperature=0.9, top_k=40, top_p=0.95, min_p=0.01, seed=1234, presence_penalty=0.5,
                  frequency_penalty=0.25)
    want = reference(engine, ids, 12, **params)
    body = (await post(cluster, "/v1/completions", {"prompt": PROMPT, "max_tokens": 12, **params})).json()
    assert body["choices"][0]["text"] == want.text
    full = reference(engine, ids, 12).text
    if len(full) > 3:
        stop = full[2:4]
        for s in (stop, [stop, "zzzz"]):
            body = (await post(cluster, "/v1/completions", {"prompt": PROMPT, "max_tokens": 12, "stop": s})).json()
            assert body["choices"][0]["finish_reason"] == "stop"
            assert body["choices"][0]["text"] == full[:full.index(stop)]


async def test_logit_bias(cluster, engine):
    """The engine's tokens under the same bias, greedy and sampled; the coordinator applies it to full
    slices (the shards' summaries are of unbiased logits)."""
    ids = engine.tokenizer.encode(PROMPT)
    plain = reference(engine, ids, 8).token_ids
    bias = {str(plain[0]): -100, str(plain[1]): 5.5}  # ban the first token, push the second
    for params in ({}, dict(temperature=0.8, top_k=20, seed=7, presence_penalty=0.4)):
        want = reference(engine, ids, 8, logit_bias=((plain[0], -100.0), (plain[1], 5.5)), **params)
        assert want.token_ids[0] != plain[0]
        if not params:
            assert want.token_ids != plain
        gen = (await cluster.generate(prompt=PROMPT, max_tokens=8, logit_bias=bias, **params)).json()
        assert gen["tokens"] == want.token_ids, (params, gen)
        assert gen["timings"]["shard_sampling"]["summaries"] == 0
        body = (await post(cluster, "/v1/completions", {"prompt": PROMPT, "max_tokens": 8, "logit_bias": bias,
                                                        **params})).json()
        assert body["choices"][0]["text"] == want.text
    chat = (await post(cluster, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                                         "max_tokens": 3, "logit_bias": {"0": 100}})).json()
    assert chat["choices"][0]["message"]["content"] == engine.tokenizer.decode([0, 0, 0])


async def test_logprobs(cluster, engine):
    body = (await post(cluster, "/v1/completions", {"prompt": PROMPT, "max_tokens": 5, "logprobs": 3})).json()
    lp = body["choices"][0]["logprobs"]
    n = body["usage"]["completion_tokens"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == len(lp["text_offset"]) == n
    for tok, p, top in zip(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"]):
        assert p <= 0 and len(top) <= 3
        assert max(top.values()) == pytest.approx(p)  # greedy: the chosen token is the most likely one
    body = (await post(cluster, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                                         "max_tokens": 3, "logprobs": True, "top_logprobs": 2})).json()
    content = body["choices"][0]["logprobs"]["content"]
    assert len(content) == body["usage"]["completion_tokens"]
    assert all(len(c["top_logprobs"]) == 2 and c["logprob"] == pytest.approx(c["top_logprobs"][0]["logprob"])
               for c in content)


async def test_models(cluster):
    body = (await cluster.coordinator.fetch(Request("GET", "/v1/models"))).json()
    assert body["object"] == "list" and [m["id"] for m in body["data"]] == ["model"]
    assert (await cluster.coordinator.fetch(Request("GET", "/v1/models/model"))).json()["id"] == "model"
    r = await cluster.coordinator.fetch(Request("GET", "/v1/models/gpt-4"))
    assert r.status == 404 and r.json()["error"]["type"] == "invalid_request_error"


# ---------------------------------------------------------------- errors


@pytest.mark.parametrize("path,body,param,code,needle", [
    ("/v1/completions", b"{not json", None, None, "not JSON"),
    ("/v1/completions", b"[1, 2]", None, None, "JSON object"),
    ("/v1/completions", {"prompt": 5}, "prompt", None, "prompt must be"),
    ("/v1/completions", {"prompt": "x", "temperature": "hot"}, "temperature", None, "must be a number"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 0}, "max_tokens", None, "max_tokens must be >= 1"),
    ("/v1/completions", {"prompt": "x", "max_tokens": -5}, "max_tokens", None, "max_tokens must be >= 1"),
    ("/v1/completions", {"prompt": "x", "temperature": -0.5}, "temperature", None, "temperature must be >= 0"),
    ("/v1/completions", {"prompt": "x", "n": 9}, "n", None, "n must be <= 8, got 9"),
    ("/v1/completions", {"prompt": "x", "n": 0}, "n", None, "n must be >= 1, got 0"),
    ("/v1/completions", {"prompt": "x", "stream": "yes"}, "stream", None, "boolean"),
    ("/v1/completions", {"prompt": "x", "stop": 3}, "stop", None, "stop must be"),
    ("/v1/completions", {"prompt": "x", "stop": ["a"] * 17}, "stop", None, "at most 16 strings, got 17"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "stop": "x" * 1025}, "stop", None,
     "at most 1024 characters, got one of 1025"),
    ("/v1/completions", {"prompt": ["a", "b"]}, "prompt", None, "batch of 2"),
    ("/v1/completions", {"prompt": "the " * 300}, "prompt", "context_length_exceeded", "at most the context length 256"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 1000}, "max_tokens", "context_length_exceeded",
     "exceeds the context length 256"),
    ("/v1/chat/completions", {"messages": "hi"}, "messages", None, "messages must be"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": 5}]}, "messages", None, "content must be"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "n": 2.5}, "n", None,
     "n must be an integer"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "the " * 300}]}, "messages",
     "context_length_exceeded", "context length"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "max_tokens": 0}, "max_tokens", None,
     ">= 1"),
    # the tiny model has no fill-in-the-middle tokens
    ("/v1/completions", {"prompt": "x", "suffix": "y"}, "suffix", None, "no fill-in-the-middle tokens"),
    ("/v1/completions", {"prompt": "x", "suffix": ""}, "suffix", None, "no fill-in-the-middle tokens"),
    ("/v1/completions", {"prompt": "x", "suffix": 3}, "suffix", None, "suffix must be a string"),
    ("/v1/completions", {"prompt": [1, 2], "suffix": "y"}, "suffix", None, "prompt given as text"),
    ("/v1/completions", {"prompt": "x", "logit_bias": [1]}, "logit_bias", None, "must be an object"),
    ("/v1/completions", {"prompt": "x", "logit_bias": {"a": 1}}, "logit_bias", None, "'a' is not a token id"),
    ("/v1/completions", {"prompt": "x", "logit_bias": {"-1": 1}}, "logit_bias", None, "'-1' is not a token id"),
    ("/v1/completions", {"prompt": "x", "logit_bias": {"1": 1, "01": 2}}, "logit_bias", None, "once"),
    ("/v1/completions", {"prompt": "x", "logit_bias": {"1": 101}}, "logit_bias", None,
     "logit_bias['1'] must be a number in [-100, 100], got 101"),
    ("/v1/completions", {"prompt": "x", "logit_bias": {"1": None}}, "logit_bias", None, "must be a number"),
    ("/v1/completions", {"prompt": "x", "logit_bias": {"1": "5"}}, "logit_bias", None, "must be a number"),
    ("/v1/completions", {"prompt": "x", "logit_bias": {"270": 1}}, "logit_bias", None,
     "token id 270 is outside the vocabulary [0, 270)"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                              "logit_bias": {str(i): 1 for i in range(1025)}}, "logit_bias", None,
     "at most 1024 tokens, got 1025"),
])
async def test_errors_in_openai_shape(cluster, path, body, param, code, needle):
    r = await post(cluster, path, body)
    assert r.status == 400, r.body
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["type"] == "invalid_request_error" and err["param"] == param and err["code"] == code
    assert needle in err["message"], err


@pytest.fixture(scope="module")
def fim_knot(tmp_path_factory):
    """The tiny model with Qwen2.5-Coder's fill-in-the-middle markers in its vocabulary."""
    from deploy.encoder import encode
    from tests.tiny_gguf import TinySpec, write_tiny_gguf

    d = tmp_path_factory.mktemp("fim")
    encode(write_tiny_gguf(d / "fim.gguf", TinySpec(fim=True)), d / "fim.knot", progress=False)
    return d / "fim.knot"


async def test_fill_in_the_middle(fim_knot, tmp_path):
    """suffix: the engine's tokens on <|fim_prefix|>prompt<|fim_suffix|>suffix<|fim_middle|>, the two
    texts as plain text, on /v1/completions (whole and streamed) and /generate alike."""
    engine = LocalEngine.open(fim_knot)
    tok = engine.tokenizer
    prefix, suffix = "def the<|fim_middle|>", " in the"  # a quoted marker stays text
    ids = tok.encode_fim(prefix, suffix)
    assert ids == [tok.fim_ids["prefix"], *tok.encode(prefix, special=False), tok.fim_ids["suffix"],
                   *tok.encode(suffix, special=False), tok.fim_ids["middle"]]
    want = reference(engine, ids, 8)
    c = await build_cluster(fim_knot, tmp_path, 2, 4)
    try:
        body = (await post(c, "/v1/completions", {"prompt": prefix, "suffix": suffix, "max_tokens": 8})).json()
        assert body["choices"][0]["text"] == want.text and body["usage"]["prompt_tokens"] == len(ids), body
        gen = (await c.generate(prompt=prefix, suffix=suffix, max_tokens=8)).json()
        assert gen["tokens"] == want.token_ids and gen["text"] == want.text
        assert (await post(c, "/tokenize", {"prompt": prefix, "suffix": suffix})).json()["tokens"] == ids
        events = await read_sse(await post(c, "/v1/completions", {"prompt": prefix, "suffix": suffix,
                                                                  "max_tokens": 8, "stream": True}))
        assert "".join(e["choices"][0]["text"] for e in events[:-1]) == want.text
        # without suffix: the plain completion of the same text, with its marker as a control token
        plain = (await c.generate(prompt=prefix, max_tokens=8)).json()
        assert plain["tokens"] == reference(engine, tok.encode(prefix), 8).token_ids
        # the suffix counts against the context; and /generate's messages take no suffix
        r = await post(c, "/v1/completions", {"prompt": "x", "suffix": "the " * 300})
        assert r.status == 400 and r.json()["error"]["code"] == "context_length_exceeded", r.body
        r = await c.generate(messages=[{"role": "user", "content": "x"}], suffix="y")
        assert r.status == 400 and "prompt given as text" in r.json()["message"], r.body
    finally:
        await c.drain()


async def test_tokenize_gives_the_ids_a_generation_runs_on(cluster, engine):
    tok = engine.tokenizer
    messages = [{"role": "user", "content": "hi <|im_end|>"}]
    for body, want in [({"prompt": PROMPT}, tok.encode(PROMPT)),
                       ({"prompt": "<|im_start|>the"}, tok.encode("<|im_start|>the")),  # as /generate: specials
                       ({"messages": messages}, tok.encode_chat(messages)),
                       ({"messages": messages, "add_generation_prompt": False}, tok.encode_chat(messages, False))]:
        r = await post(cluster, "/tokenize", body)
        assert r.status == 200, r.body
        assert r.json() == {"count": len(want), "max_model_len": 256, "tokens": want}
        if "prompt" in body:  # the same ids as the generation's
            gen = (await cluster.generate(**body, max_tokens=1)).json()
            assert gen["prompt_tokens"] == want
    assert (await post(cluster, "/tokenize", {"messages": messages})).json()["tokens"] != \
        (await post(cluster, "/tokenize", {"messages": messages, "add_generation_prompt": False})).json()["tokens"]
    ids = tok.encode("the def <|im_end|> é")
    r = await post(cluster, "/detokenize", {"tokens": ids})
    assert r.status == 200 and r.json() == {"prompt": "the def <|im_end|> é"}


@pytest.mark.parametrize("path,body,needle", [
    ("/tokenize", {"prompt": "x", "max_tokens": 3}, "does not take 'max_tokens'"),
    ("/tokenize", {}, "exactly one of"),
    ("/tokenize", {"prompt": 3}, "prompt must be a string"),
    ("/tokenize", {"prompt": "x", "suffix": "y"}, "no fill-in-the-middle tokens"),
    ("/tokenize", {"messages": [{"role": "user", "content": "x"}], "add_generation_prompt": "no"}, "boolean"),
    ("/tokenize", {"prompt": "the " * 300}, "context length"),
    ("/tokenize", {"prompt": ""}, "encodes to no tokens"),
    ("/detokenize", {"tokens": [1, "2"]}, '{"tokens": [token ids]}'),
    ("/detokenize", {"tokens": [1], "skip": True}, '{"tokens": [token ids]}'),
    ("/detokenize", {"tokens": [270]}, "id 270 is outside the vocabulary [0, 270)"),
    ("/detokenize", {"tokens": [1] * 257}, "at most 256 ids"),
])
async def test_tokenize_refuses_with_a_400_naming_the_problem(cluster, path, body, needle):
    r = await post(cluster, path, body)
    assert r.status == 400 and needle in r.json()["message"], r.body


async def test_unknown_route_and_method(cluster):
    r = await cluster.coordinator.fetch(Request("POST", "/v1/embeddings", {}, b"{}"))
    assert r.status == 404 and "no such endpoint" in r.json()["error"]["message"]
    r = await cluster.coordinator.fetch(Request("GET", "/v1/completions"))
    assert r.status == 405 and r.json()["error"]["type"] == "invalid_request_error"


async def test_error_mid_stream_is_an_event(cluster):
    class Dead:
        async def fetch(self, request):
            raise ServiceUnavailable("shard killed by the test")

    for i in range(len(cluster.shards)):
        cluster.coordinator.env._items[f"SHARD_{i}"] = Dead()
    cluster.coordinator.env._items["PEER_WAIT_S"] = "0"  # no wait for a restart
    co_handler._booted.clear()
    # Boot checks only the stations, so the request starts (the status is out); the shards fail.
    events = await read_sse(await post(cluster, "/v1/chat/completions",
                                       {"messages": [{"role": "user", "content": "x"}], "stream": True}))
    assert events[-1] == "[DONE]"
    err = events[-2]["error"]
    named = {(int(a), int(b)) for a, b in re.findall(r"vocabulary \[(\d+), (\d+)\)\) is down", err["message"])}
    assert err["type"] == "server_error" and named and named <= set(cluster.shard_ranges), err
    await cluster.drain()
    assert await station_sessions(cluster) == [0, 0]
    co_handler._booted.clear()


# ---------------------------------------------------------------- cancellation and concurrency


async def test_closing_a_stream_stops_generation_and_frees_the_kv(cluster):
    r = await post(cluster, "/v1/completions", {"prompt": PROMPT, "max_tokens": 200, "stream": True})
    events = await read_sse(r, limit=2)  # reads two chunks, then closes the stream like a client that left
    assert len(events) == 2 and "[DONE]" not in events
    co = await co_handler.coordinator_for(cluster.coordinator.env)
    assert co.admission.active == 0, "the slot is given back"
    await cluster.drain()
    assert await station_sessions(cluster) == [0, 0]
    forwards = (await cluster.stations[1].fetch(Request("GET", "/stats"))).json()["forwards"]
    assert forwards < 20, f"generation stopped early, {forwards} forwards"
    metrics = (await cluster.coordinator.fetch(Request("GET", "/metrics"))).text()
    assert 'knot_generations_total{outcome="cancelled"} 1.0' in metrics


async def test_concurrent_requests_do_not_cross_talk(cluster, engine):
    prompts = [PROMPT, "def the def", "the the", "x = def"]
    alone = [reference(engine, engine.tokenizer.encode(p), 8).text for p in prompts]
    bodies = await asyncio.gather(*(post(cluster, "/v1/completions", {"prompt": p, "max_tokens": 8})
                                    for p in prompts))
    assert [b.json()["choices"][0]["text"] for b in bodies] == alone
    await cluster.drain()
    assert await station_sessions(cluster) == [0, 0]


async def test_queue_bound_gives_429_with_retry_after(cluster, engine):
    env = cluster.coordinator.env._items
    env.update({"MAX_CONCURRENT_REQUESTS": "1", "MAX_QUEUED_REQUESTS": "1", "RETRY_AFTER_S": "3"})
    first = await post(cluster, "/v1/completions", {"prompt": PROMPT, "max_tokens": 4, "stream": True})
    # `first` holds the only slot until its stream ends; the next request waits in the queue,
    queued = asyncio.create_task(post(cluster, "/v1/completions", {"prompt": PROMPT, "max_tokens": 4}))
    co = await co_handler.coordinator_for(cluster.coordinator.env)
    await until(lambda: co.admission.queued == 1, what="the second request queued")
    assert not queued.done()
    # and one more finds the queue full.
    r = await post(cluster, "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]})
    assert r.status == 429 and r.headers["Retry-After"] == "3"
    err = r.json()["error"]
    assert err["type"] == "rate_limit_error" and err["code"] == "rate_limit_exceeded"
    assert "MAX_QUEUED_REQUESTS=1" in err["message"]
    r = await cluster.generate(prompt=PROMPT, max_tokens=2)
    assert r.status == 429 and r.headers["Retry-After"] == "3"
    want = reference(engine, engine.tokenizer.encode(PROMPT), 4).text
    events = await read_sse(first)
    assert "".join(e["choices"][0]["text"] for e in events[:-1]) == want
    assert (await queued).json()["choices"][0]["text"] == want
    co = await co_handler.coordinator_for(cluster.coordinator.env)
    assert co.admission.active == 0 and co.admission.queued == 0
    metrics = (await cluster.coordinator.fetch(Request("GET", "/metrics"))).text()
    assert 'knot_requests_total{endpoint="chat_completions",status="429"} 1.0' in metrics


# ---------------------------------------------------------------- metrics


async def test_metrics(cluster):
    await post(cluster, "/v1/completions", {"prompt": PROMPT, "max_tokens": 4})
    await cluster.generate(prompt=PROMPT, max_tokens=3)
    await post(cluster, "/v1/completions", {"prompt": "x", "max_tokens": 0})
    r = await cluster.coordinator.fetch(Request("GET", "/metrics"))
    assert r.status == 200 and r.headers["Content-Type"].startswith("text/plain")
    text = r.text()
    for line in ['knot_requests_total{endpoint="completions",status="200"} 1.0',
                 'knot_requests_total{endpoint="completions",status="400"} 1.0',
                 'knot_requests_total{endpoint="generate",status="200"} 1.0',
                 'knot_time_to_first_token_seconds_count 2.0',
                 'knot_hop_latency_seconds_count{hop="station_0"}',
                 'knot_hop_latency_seconds_count{hop="embed"}',
                 'knot_hop_latency_seconds_count{hop="logits"}',
                 'knot_peer_stats_up{peer="shard_3"} 1.0',
                 'knot_station_kv_sessions{station="1"}',
                 'knot_warden_hit_ratio{service="stations"}',
                 'knot_warden_hit_ratio{service="shards"}',
                 'knot_requests_active 0.0']:
        assert line in text, line
    completion = next(ln for ln in text.splitlines() if ln.startswith('knot_tokens_total{kind="completion"}'))
    assert float(completion.split()[-1]) >= 1
    itl = next(ln for ln in text.splitlines() if ln.startswith("knot_inter_token_latency_seconds_count"))
    assert float(itl.split()[-1]) >= 1


async def test_degradations_are_counted(cluster, engine):
    class Dead:
        async def fetch(self, request):
            raise ServiceUnavailable("shard killed by the test")

    ids = engine.tokenizer.encode(PROMPT)
    victim = next(i for i, (a, b) in enumerate(cluster.shard_ranges) if any(a <= t < b for t in ids))
    cluster.coordinator.env._items[f"SHARD_{victim}"] = Dead()
    co_handler._booted.clear()
    r = await post(cluster, "/v1/completions", {"prompt": PROMPT, "max_tokens": 2, "shard_failure": "degrade"})
    assert r.status == 200 and r.headers["X-Knot-Shard-Failure"] == "degrade", r.body
    text = (await cluster.coordinator.fetch(Request("GET", "/metrics"))).text()
    assert f'knot_shard_degradations_total{{shard="{victim}",stage="embed"}} 1.0' in text
    assert f'knot_peer_stats_up{{peer="shard_{victim}"}} 0.0' in text
    co_handler._booted.clear()


# ---------------------------------------------------------------- the host's streaming contract


class Producer:
    """A streaming handler whose chunks come slowly; it records whether its stream was closed."""

    def __init__(self, n: int):
        self.n, self.sent, self.closed = n, 0, asyncio.Event()

    async def chunks(self):
        try:
            for i in range(self.n):
                yield f"chunk {i}\n".encode()
                self.sent += 1
                await asyncio.sleep(0.02)
        finally:
            self.closed.set()

    async def fetch(self, request, env, ctx) -> Response:
        return Response.from_stream(self.chunks(), "text/plain", headers={"X-Kind": "stream"})


async def _serve(handler):
    rt = ServiceRuntime("streamer", handler, Env(), BackgroundTasks("test"))
    runner = web.AppRunner(build_app(rt))
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    return runner, f"http://127.0.0.1:{port}"


async def test_host_streams_chunk_by_chunk_and_closes_on_disconnect():
    p = Producer(5)
    runner, url = await _serve(p.fetch)
    try:
        async with aiohttp.ClientSession() as s:
            async with s.get(url + "/x") as r:
                assert r.status == 200 and r.headers["X-Kind"] == "stream" and "X-Request-Id" in r.headers
                assert r.headers.get("Transfer-Encoding") == "chunked"
                first = await r.content.readline()
                assert first == b"chunk 0\n" and p.sent < 5, "the first chunk arrives before the last is made"
                assert await r.content.read() == b"".join(f"chunk {i}\n".encode() for i in range(1, 5))
        assert p.closed.is_set()
        slow = Producer(10_000)
        runner2, url2 = await _serve(slow.fetch)
        try:
            async with aiohttp.ClientSession() as s:
                async with s.get(url2 + "/x") as r:
                    await r.content.readline()
                    r.close()  # the client goes away mid-stream
            await asyncio.wait_for(slow.closed.wait(), 5)
            assert slow.sent < 10_000
        finally:
            await runner2.cleanup()
    finally:
        await runner.cleanup()


async def test_admission_queue_is_bounded_and_survives_cancellation():
    from services.coordinator.admission import Admission
    from services.coordinator.errors import TooManyRequests

    a = Admission(max_active=1, max_queued=2, retry_after_s=1)
    await a.acquire()
    w1, w2 = asyncio.create_task(a.acquire()), asyncio.create_task(a.acquire())
    await asyncio.sleep(0)
    assert (a.active, a.queued) == (1, 2)
    with pytest.raises(TooManyRequests) as e:
        await a.acquire()
    assert e.value.status == 429 and e.value.headers == {"Retry-After": "1"}
    w1.cancel()  # a queued client that gave up leaves the line
    await asyncio.gather(w1, return_exceptions=True)
    assert a.queued == 1
    a.release()  # the slot goes to the next in line
    await w2
    assert (a.active, a.queued) == (1, 0)
    a.release()
    assert a.active == 0


async def test_admission_takes_a_requests_slots_at_once():
    """n choices take n slots together, first come first served: two requests that each hold part of
    what they need would otherwise wait on each other forever."""
    from services.coordinator.admission import Admission

    a = Admission(max_active=3, max_queued=4, retry_after_s=1)
    await a.acquire(2)
    big = asyncio.create_task(a.acquire(2))  # needs 2, 1 is free: waits, holding nothing
    await asyncio.sleep(0)
    small = asyncio.create_task(a.acquire(1))  # would fit, but does not overtake the head of the line
    await asyncio.sleep(0)
    assert (a.active, a.queued) == (2, 2) and not big.done() and not small.done()
    a.release(2)
    await big
    await asyncio.sleep(0)
    assert small.done() and a.active == 3 and a.queued == 0
    a.release(1)
    head = asyncio.create_task(a.acquire(3))  # 1 free of 3: waits
    after = asyncio.create_task(a.acquire(1))
    await asyncio.sleep(0)
    head.cancel()  # the head leaves the line: the one behind it fits now
    await asyncio.gather(head, return_exceptions=True)
    await asyncio.wait_for(after, 1)
    assert a.active == 3 and a.queued == 0
    a.release(2)
    a.release(1)
    assert a.active == 0


async def test_n_choices(cluster, engine):
    """n > 1: choice i is the generation with seed + i, run side by side; the prompt counts once in usage."""
    ids = engine.tokenizer.encode(PROMPT)
    params = dict(temperature=0.9, top_k=40, seed=11)
    want = [reference(engine, ids, 8, **{**params, "seed": 11 + i}) for i in range(3)]
    assert len({tuple(w.token_ids) for w in want}) > 1, "the seeds give different choices"
    body = (await post(cluster, "/v1/completions", {"prompt": PROMPT, "max_tokens": 8, "n": 3, **params})).json()
    assert [c["index"] for c in body["choices"]] == [0, 1, 2]
    assert [c["text"] for c in body["choices"]] == [w.text for w in want]
    assert body["usage"] == {"prompt_tokens": len(ids), "completion_tokens": sum(len(w.token_ids) for w in want),
                             "total_tokens": len(ids) + sum(len(w.token_ids) for w in want),
                             "prompt_tokens_details": {"cached_tokens": 0}}
    # streamed: each chunk names its choice; each choice's chunks make its text, and it finishes once
    r = await post(cluster, "/v1/completions", {"prompt": PROMPT, "max_tokens": 8, "n": 3, "stream": True,
                                                "stream_options": {"include_usage": True}, **params})
    events = await read_sse(r)
    assert events[-1] == "[DONE]" and events[-2]["usage"] == body["usage"]
    chunks = events[:-2]
    for i, w in enumerate(want):
        mine = [e["choices"][0] for e in chunks if e["choices"][0]["index"] == i]
        assert "".join(c["text"] for c in mine) == w.text
        assert [c["finish_reason"] is not None for c in mine].count(True) == 1 and mine[-1]["finish_reason"]
    # chat: a role chunk per choice; greedy choices are all the same generation
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "n": 2}
    body = (await post(cluster, "/v1/chat/completions", chat)).json()
    assert body["choices"][0]["message"] == body["choices"][1]["message"]
    events = await read_sse(await post(cluster, "/v1/chat/completions", {**chat, "stream": True}))
    roles = [e["choices"][0]["index"] for e in events[:-1] if e["choices"][0]["delta"].get("role")]
    assert sorted(roles) == [0, 1]
    for i in (0, 1):
        text = "".join(e["choices"][0]["delta"].get("content", "") for e in events[:-1]
                       if e["choices"][0]["index"] == i)
        assert text == body["choices"][i]["message"]["content"]
    await cluster.drain()
    co = await co_handler.coordinator_for(cluster.coordinator.env)
    assert co.admission.active == 0 and await station_sessions(cluster) == [0, 0]


async def test_n_choices_closing_the_stream_frees_every_choice(cluster):
    r = await post(cluster, "/v1/completions", {"prompt": PROMPT, "max_tokens": 200, "n": 3, "stream": True})
    co = await co_handler.coordinator_for(cluster.coordinator.env)
    assert co.admission.active == 3
    events = await read_sse(r, limit=4)
    assert len(events) == 4 and "[DONE]" not in events
    assert co.admission.active == 0, "the slots are given back"
    await cluster.drain()
    assert await station_sessions(cluster) == [0, 0]


async def test_n_beyond_the_concurrency_is_a_400(cluster):
    cluster.coordinator.env._items.update({"MAX_CONCURRENT_REQUESTS": "2"})
    r = await post(cluster, "/v1/completions", {"prompt": PROMPT, "n": 3})
    assert r.status == 400 and r.json()["error"]["param"] == "n", r.body
    assert "at most 2 (MAX_CONCURRENT_REQUESTS)" in r.json()["error"]["message"]


async def test_api_key_guards_every_endpoint_with_openai_401(cluster):
    """KNOT_API_KEY set: without `Authorization: Bearer KEY` (or with another key) every endpoint is
    401, in OpenAI's error shape under /v1; with it, the request goes through."""
    key = "k" * 40
    cluster.coordinator.env._items["KNOT_API_KEY"] = key
    co_handler._booted.clear()
    body = {"prompt": PROMPT, "max_tokens": 2}
    for auth in (None, "Bearer wrong", f"Basic {key}", "Bearer "):
        headers = {"Authorization": auth} if auth else {}
        for method, path in [("POST", "/v1/completions"), ("GET", "/v1/models")]:
            r = await cluster.coordinator.fetch(Request(method, path, headers, json.dumps(body).encode()
                                                        if method == "POST" else b""))
            err = r.json()["error"]
            assert r.status == 401 and err["code"] == "invalid_api_key" and err["type"] == "invalid_request_error", r.body
            assert r.headers["WWW-Authenticate"] == "Bearer" and key not in r.text()
        r = await cluster.coordinator.fetch(Request("POST", "/generate", headers, json.dumps(body).encode()))
        assert r.status == 401 and key not in r.text(), r.body
    ok = {"Authorization": f"Bearer {key}"}
    r = await cluster.coordinator.fetch(Request("POST", "/v1/completions", ok, json.dumps(body).encode()))
    assert r.status == 200, r.body
    r = await cluster.coordinator.fetch(Request("POST", "/generate", ok, json.dumps(body).encode()))
    assert r.status == 200, r.body
    co_handler._booted.clear()


async def test_the_page_is_public_its_data_behind_the_api_key(cluster):
    """KNOT_API_KEY set: GET / (the page's code, no data) answers without it; the page's data
    (/cluster, /traces, /traces/<id>) is 401 without the key and served with it."""
    key = "k" * 40
    cluster.coordinator.env._items["KNOT_API_KEY"] = key
    co_handler._booted.clear()
    ok = {"Authorization": f"Bearer {key}"}
    r = await cluster.coordinator.fetch(Request("GET", "/"))
    assert r.status == 200 and r.headers["Content-Type"].startswith("text/html") and key not in r.text()
    r = await cluster.coordinator.fetch(Request("POST", "/generate", ok, json.dumps({"prompt": PROMPT,
                                                                                        "max_tokens": 2}).encode()))
    trace_id = r.headers["X-Trace-Id"]
    for path in ("/cluster", "/traces", f"/traces/{trace_id}"):
        for headers in ({}, {"Authorization": "Bearer wrong"}):
            assert (await cluster.coordinator.fetch(Request("GET", path, headers))).status == 401, path
        r = await cluster.coordinator.fetch(Request("GET", path, ok))
        assert r.status == 200, (path, r.body)
    assert [s["name"] for s in r.json()["spans"]][0] == "POST /generate"
    co_handler._booted.clear()
