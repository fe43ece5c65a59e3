"""Fair scheduling on real processes (issue 52): the default layout (2 stations, 8 shards) on real
SeaweedFS and Valkey, serving a synthetic model of 16 layers. A short request sent while a
2,048-token prompt is being prefilled (eight chunks of 256) finishes while that prefill still
runs: its frames go between the phases of the long prompt's chunks (INTERLEAVE_ROWS). Both have
the single-process engine's tokens."""
from __future__ import annotations

import json
import threading

import pytest

from common.sampling import SamplingParams
from deploy.encoder import encode
from deploy.engine_local import LocalEngine
from tests.integration.conftest import http, pipeline_services, wait_for
from tests.tiny_gguf import TinySpec, write_tiny_gguf

KNOT_KEY = "fair.knot"
# 8 layers a station and matrices of 1024: a phase of a 256-row chunk is a small part of the chunk
SPEC = TinySpec(n_layers=16, hidden=1024, ffn=1536, n_head=8, n_kv_head=2, context=4096, seed=7)
LONG_TOKENS = 2048  # eight prefill chunks
SHORT_TOKENS = 8


@pytest.fixture(scope="module")
def fair_knot(tmp_path_factory, s3_settings):
    from deploy.local.server_bindings import s3_client

    d = tmp_path_factory.mktemp("fair")
    path = d / "fair.knot"
    encode(write_tiny_gguf(d / "fair.gguf", SPEC), path, progress=False)
    s3_client(s3_settings).upload_file(str(path), "knots", KNOT_KEY)
    return path


@pytest.fixture(scope="module")
def cluster(procs, fair_knot):
    with pipeline_services(procs, fair_knot, KNOT_KEY) as p:
        yield p


def station_stats(cluster, name: str) -> dict:
    status, _, raw = http("GET", cluster.url(name) + "/stats")
    assert status == 200, raw
    return json.loads(raw)


def generate(cluster, body: dict, out: dict) -> None:
    status, _, raw = http("POST", cluster.url("coordinator") + "/generate", body, timeout_s=300)
    out["status"], out["body"] = status, json.loads(raw)


def test_a_short_request_finishes_during_a_long_prefill(cluster, fair_knot):
    engine = LocalEngine.open(fair_knot)
    long_prompt = ("0123456789" * LONG_TOKENS)[:LONG_TOKENS]  # a digit is a token
    generate(cluster, {"prompt": "1 2", "max_tokens": 2}, {})  # every service has loaded its weights
    forwards = station_stats(cluster, "station-0")["forwards"]
    long_out: dict = {}
    long_req = threading.Thread(target=generate, args=(cluster, {"prompt": long_prompt, "max_tokens": 1}, long_out))
    long_req.start()
    try:
        # the long prompt's first chunk has passed station 0: seven more are to come
        wait_for(lambda: station_stats(cluster, "station-0")["forwards"] > forwards, 120, "the long prefill started")
        short_out: dict = {}
        generate(cluster, {"prompt": "12 34", "max_tokens": SHORT_TOKENS, "temperature": 0.8, "seed": 5}, short_out)
        assert long_req.is_alive(), "the long prompt's prefill ended before the short request did"
    finally:
        long_req.join(300)
    assert short_out["status"] == 200 and long_out["status"] == 200, (short_out, long_out)
    short, long = short_out["body"], long_out["body"]
    assert len(short["tokens"]) == SHORT_TOKENS and len(long["prompt_tokens"]) == LONG_TOKENS
    assert sum(station_stats(cluster, f"station-{i}")["interjected_items"] for i in (0, 1)) > 0
    assert short["tokens"] == engine.generate(short["prompt_tokens"], SamplingParams(temperature=0.8, seed=5),
                                              max_tokens=SHORT_TOKENS).token_ids
    assert long["tokens"] == engine.generate(long["prompt_tokens"], SamplingParams(), max_tokens=1).token_ids
