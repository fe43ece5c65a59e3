"""Issue 6 acceptance on real processes: the OpenAI-compatible API of the coordinator, driven by the
official `openai` client (completions, chat, streaming) and by raw HTTP (errors, a client that hangs
up mid-stream, concurrency, the queue bound), on the pipeline of docker-compose.yml."""
from __future__ import annotations

import dataclasses
import json
import time
from concurrent.futures import ThreadPoolExecutor
from http.client import HTTPConnection
from urllib.parse import urlsplit

import openai
import pytest

from common.sampling import SamplingParams
from tests.integration.conftest import http, wait_for
from tests.integration.test_pipeline_cluster import cluster, engine  # noqa: F401 - the same real cluster

PROMPT = "the def the"
MODEL = "pipeline"  # KNOT_KEY "pipeline.knot" without the suffix


def reference(engine, ids, max_tokens, **sampling):
    return engine.generate(ids, SamplingParams(**sampling), max_tokens=max_tokens)


@pytest.fixture(scope="module")
def client(cluster):  # noqa: F811
    return openai.OpenAI(base_url=cluster.url("coordinator") + "/v1", api_key="unused", max_retries=0, timeout=120)


def station_stats(cluster, name):  # noqa: F811
    status, _, raw = http("GET", cluster.url(name) + "/stats")
    assert status == 200, raw
    return json.loads(raw)


def test_models(client):
    assert [m.id for m in client.models.list().data] == [MODEL]


def test_completions_and_chat_with_the_openai_client(client, engine):  # noqa: F811
    ids = engine.tokenizer.encode(PROMPT)
    want = reference(engine, ids, 12)
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12)
    assert r.choices[0].text == want.text and r.model == MODEL
    assert r.usage.prompt_tokens == len(ids) and r.usage.completion_tokens == len(want.token_ids)
    assert r.choices[0].finish_reason == ("length" if len(want.token_ids) == 12 else "stop")

    params = dict(temperature=0.8, top_p=0.9, seed=7, presence_penalty=0.3, frequency_penalty=0.2)
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, extra_body={"top_k": 30, "min_p": 0.02},
                                  **params)
    assert r.choices[0].text == reference(engine, ids, 12, top_k=30, min_p=0.02, **params).text

    messages = [{"role": "user", "content": "def fib"}]
    chat_ids = engine.tokenizer.encode(engine.tokenizer.render_chat(messages))
    want = reference(engine, chat_ids, 8)
    r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8)
    assert r.choices[0].message.role == "assistant" and r.choices[0].message.content == want.text
    assert r.usage.prompt_tokens == len(chat_ids)

    full = reference(engine, ids, 12).text
    if len(full) > 3:
        stop = full[2:4]
        r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, stop=[stop])
        assert r.choices[0].finish_reason == "stop" and r.choices[0].text == full[:full.index(stop)]


def test_n_choices_and_logit_bias_with_the_openai_client(client, engine):  # noqa: F811
    """The official client reads n choices, whole and streamed, and sends logit_bias as it is."""
    ids = engine.tokenizer.encode(PROMPT)
    params = dict(temperature=0.9, seed=21)
    want = [reference(engine, ids, 8, **{**params, "seed": 21 + i}).text for i in range(3)]
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, n=3, **params)
    assert [c.index for c in r.choices] == [0, 1, 2] and [c.text for c in r.choices] == want
    texts = ["", "", ""]
    for chunk in client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, n=3, stream=True, **params):
        for c in chunk.choices:
            texts[c.index] += c.text
    assert texts == want
    first = reference(engine, ids, 1).token_ids[0]
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, logit_bias={str(first): -100})
    assert r.choices[0].text == reference(engine, ids, 6, logit_bias=((first, -100.0),)).text


def test_streaming_with_the_openai_client(client, engine, cluster):  # noqa: F811
    ids = engine.tokenizer.encode(PROMPT)
    want = reference(engine, ids, 16)
    chunks = list(client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=16, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == want.text
    assert chunks[-1].choices[0].finish_reason in ("stop", "length")

    messages = [{"role": "user", "content": "def fib"}]
    want = reference(engine, engine.tokenizer.encode(engine.tokenizer.render_chat(messages)), 8)
    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, stream=True,
                                                 stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want.text
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(want.token_ids)
    wait_for(lambda: all(station_stats(cluster, f"station-{i}")["sessions"] == 0 for i in (0, 1)),
             what="KV sessions released")


@pytest.mark.parametrize("body,param,code,needle", [
    (b"{oops", None, None, "not JSON"),
    ({"model": MODEL, "prompt": 5}, "prompt", None, "prompt must be"),
    ({"model": MODEL, "prompt": "x", "max_tokens": "ten"}, "max_tokens", None, "must be an integer"),
    ({"model": MODEL, "prompt": "x", "max_tokens": 0}, "max_tokens", None, ">= 1"),
    ({"model": MODEL, "prompt": "x", "temperature": -1}, "temperature", None, ">= 0"),
    ({"model": MODEL, "prompt": "x", "n": 9}, "n", None, "n must be <= 8, got 9"),
    ({"model": MODEL, "prompt": "x", "suffix": "y"}, "suffix", None, "no fill-in-the-middle tokens"),
    ({"model": MODEL, "prompt": "x", "logit_bias": {"100000": 1}}, "logit_bias", None, "outside the vocabulary"),
    ({"model": MODEL, "prompt": "the " * 400}, "prompt", "context_length_exceeded", "context length"),
])
def test_errors_over_raw_http(cluster, body, param, code, needle):  # noqa: F811
    status, headers, raw = http("POST", cluster.url("coordinator") + "/v1/completions", body,
                                {"Content-Type": "application/json"})
    assert status == 400 and headers["Content-Type"].startswith("application/json"), raw
    err = json.loads(raw)["error"]
    assert err["type"] == "invalid_request_error" and err["param"] == param and err["code"] == code
    assert needle in err["message"], err


def test_openai_client_sees_context_length_exceeded(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "the " * 400}])
    assert e.value.code == "context_length_exceeded" and e.value.status_code == 400


def _open_stream(cluster, max_tokens: int):  # noqa: F811
    """A raw streaming request; returns the connection and its response, the first event read."""
    u = urlsplit(cluster.url("coordinator"))
    conn = HTTPConnection(u.hostname, u.port, timeout=60)
    conn.request("POST", "/v1/completions", json.dumps({"prompt": PROMPT, "max_tokens": max_tokens,
                                                        "stream": True}), {"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200 and resp.getheader("Content-Type").startswith("text/event-stream")
    assert resp.readline().startswith(b"data: {")
    return conn, resp


def test_client_disconnect_mid_stream_frees_the_kv_sessions(cluster):  # noqa: F811
    before = station_stats(cluster, "station-1")["forwards"]
    conn, resp = _open_stream(cluster, 200)
    wait_for(lambda: station_stats(cluster, "station-1")["sessions"] == 1, what="a live session")
    resp.close()
    conn.close()  # hang up mid-generation
    wait_for(lambda: all(station_stats(cluster, f"station-{i}")["sessions"] == 0 for i in (0, 1)),
             timeout_s=30, what="the stations' KV sessions freed")
    forwards = station_stats(cluster, "station-1")["forwards"] - before
    time.sleep(0.5)
    assert station_stats(cluster, "station-1")["forwards"] - before == forwards, "generation stopped"
    assert forwards < 150, f"generation stopped early ({forwards} of ~200 forwards)"
    _, _, raw = http("GET", cluster.url("coordinator") + "/metrics")
    assert 'knot_generations_total{outcome="cancelled"}' in raw.decode()


def _step_batching(cluster) -> dict[str, float]:  # noqa: F811
    """The coordinator's continuous-batching counters, from GET /metrics."""
    status, _, raw = http("GET", cluster.url("coordinator") + "/metrics")
    assert status == 200
    out = {}
    for line in raw.decode().splitlines():
        for name, key in (('knot_bundles_total{hop="station"}', "station"), ('knot_bundles_total{hop="shard"}', "shard"),
                          ("knot_bundle_parts_alone_total", "alone"), ('knot_step_batches_total{count="items"}', "items")):
            if line.startswith(name + " "):
                out[key] = float(line.rsplit(" ", 1)[1])
    return out


def test_concurrent_requests_each_get_their_own_tokens(cluster, client, engine):  # noqa: F811
    """Each gets its single-process tokens while their decode steps cross the hops together
    (continuous batching: one bundle per station and shard, STEP_BATCH)."""
    prompts = [PROMPT, "def the def", "the the", "x = def"]
    alone = [reference(engine, engine.tokenizer.encode(p), 12).text for p in prompts]
    before = _step_batching(cluster)

    def one(p):
        return client.completions.create(model=MODEL, prompt=p, max_tokens=12).choices[0].text

    with ThreadPoolExecutor(len(prompts)) as pool:
        assert list(pool.map(one, prompts)) == alone
    after = _step_batching(cluster)
    assert after["station"] > before["station"] and after["shard"] > before["shard"], (before, after)
    assert after["alone"] == before["alone"], "no part failed"


def test_429_beyond_the_queue(cluster, engine):  # noqa: F811
    original = cluster.specs["coordinator"]
    cluster.stop("coordinator")
    cluster.specs["coordinator"] = dataclasses.replace(original, environment={
        **original.environment, "MAX_CONCURRENT_REQUESTS": "1", "MAX_QUEUED_REQUESTS": "0", "RETRY_AFTER_S": "2"})
    try:
        cluster.start("coordinator")
        conn, resp = _open_stream(cluster, 40)  # holds the only slot while it streams
        try:
            status, headers, raw = http("POST", cluster.url("coordinator") + "/v1/completions",
                                        {"prompt": PROMPT, "max_tokens": 2})
            assert status == 429 and headers["Retry-After"] == "2", raw
            assert json.loads(raw)["error"]["code"] == "rate_limit_exceeded"
            c = openai.OpenAI(base_url=cluster.url("coordinator") + "/v1", api_key="unused", max_retries=0)
            with pytest.raises(openai.RateLimitError):
                c.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2)
            rest = resp.read()  # the first stream is unaffected and completes
            assert rest.endswith(b"data: [DONE]\n\n")
        finally:
            conn.close()
        want = reference(engine, engine.tokenizer.encode(PROMPT), 2).text
        body = json.loads(http("POST", cluster.url("coordinator") + "/v1/completions",
                               {"prompt": PROMPT, "max_tokens": 2})[2])
        assert body["choices"][0]["text"] == want
    finally:
        cluster.stop("coordinator")
        cluster.specs["coordinator"] = original
        cluster.start("coordinator")


def test_metrics(client, cluster):  # noqa: F811
    client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3)
    status, headers, raw = http("GET", cluster.url("coordinator") + "/metrics")
    assert status == 200 and headers["Content-Type"].startswith("text/plain")
    text = raw.decode()
    assert 'knot_requests_total{endpoint="completions",status="200"}' in text
    for hop in ("embed", "station_0", "station_1", "logits"):
        assert f'knot_hop_latency_seconds_count{{hop="{hop}"}}' in text
    ratio = {ln.split()[0]: float(ln.split()[1]) for ln in text.splitlines() if ln.startswith("knot_warden_hit_ratio")}
    assert 0 < ratio['knot_warden_hit_ratio{service="shards"}'] <= 1
    assert all(f'knot_peer_stats_up{{peer="shard_{i}"}} 1.0' in text for i in range(8))
