"""Property tests at the trust boundaries (issue 13, item 5): whatever a client or a peer sends,
the answer is a result or a clean 4xx with a reason, never a 500, and the cluster still gives the
baseline tokens afterwards.

    - the JSON bodies of every public endpoint, over the whole in-process cluster;
    - every binary frame decoder (envelopes, tensor frames and batches, sampling specs, warden request bodies),
      on arbitrary bytes and on valid frames with bytes changed and the crc32 made to match.
"""
from __future__ import annotations

import asyncio
import json
import struct
import zlib

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from common import wire
from common.runtime import Request
from tests.inprocess import build_cluster

PROMPT = "the def the"
ENDPOINTS = ["/generate", "/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"]

# ---------------------------------------------------------------- JSON values a hostile client can send

scalars = st.one_of(  # NaN and Infinity too: Python's json reads them
    st.none(), st.booleans(),
    st.integers(min_value=-2 ** 70, max_value=2 ** 70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=30),  # includes lone surrogates: JSON can spell them
)
json_values = st.recursive(scalars, lambda inner: st.one_of(
    st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=8), inner, max_size=4)), max_leaves=12)
finite = st.floats(allow_nan=False, allow_infinity=False)
any_float = st.floats(allow_nan=True, allow_infinity=True)


def mostly(valid, *junk):
    """Mostly valid values (junk about once in ten), so that many bodies run a real generation."""
    return st.integers(0, 9).flatmap(lambda i: st.one_of(*junk, json_values) if i == 0 else valid)


message = st.fixed_dictionaries({"role": mostly(st.sampled_from(["system", "user", "assistant"])),
                                 "content": mostly(st.text(max_size=40))})
OPTIONAL = {
    "temperature": mostly(st.floats(0, 2), any_float),
    "top_p": mostly(st.floats(0, 1), any_float),
    "top_k": mostly(st.integers(-1, 50), st.integers(-3, 10 ** 12)),
    "min_p": mostly(st.floats(0, 1), any_float),
    "seed": mostly(st.integers(0, 2 ** 64 - 1), st.integers(-2 ** 65, 2 ** 65)),
    "stop": mostly(st.text(max_size=5), st.lists(st.text(max_size=5), max_size=3)),
    "stream": mostly(st.booleans()),
    "logprobs": mostly(st.booleans(), st.integers(-2, 30)),
    "top_logprobs": mostly(st.integers(0, 20), st.integers(-2, 30)),
    "presence_penalty": mostly(st.floats(-2, 2), any_float),
    "frequency_penalty": mostly(st.floats(-2, 2), any_float),
    "repetition_penalty": mostly(st.floats(0.5, 2), any_float),
    "n": mostly(st.integers(1, 3), st.integers(-2, 10)),
    "model": mostly(st.text(max_size=10)),
    "stream_options": mostly(st.fixed_dictionaries({}, optional={"include_usage": st.booleans()})),
    "echo": json_values,
    "suffix": mostly(st.text(max_size=5)),
    "logit_bias": mostly(st.dictionaries(st.integers(0, 300).map(str), st.floats(-100, 100), max_size=3)),
}
PROMPTS = {
    "prompt": mostly(st.text(min_size=1, max_size=40), st.lists(st.integers(-5, 400), max_size=6)),
    "messages": mostly(st.lists(message, min_size=1, max_size=3)),
}


def bodies(path: str):
    if path == "/detokenize":
        return st.fixed_dictionaries({"tokens": mostly(st.lists(st.integers(-5, 400), max_size=8))})
    if path == "/tokenize":  # /generate's prompt fields and the chat's flag
        return st.builds(lambda required, optional: {**required, **optional},
                         st.fixed_dictionaries({}, optional=PROMPTS),
                         st.fixed_dictionaries({}, optional={"suffix": OPTIONAL["suffix"],
                                                             "add_generation_prompt": mostly(st.booleans())}))
    key = "messages" if "chat" in path else "prompt"
    return st.builds(lambda required, optional, max_tokens: {**required, **optional, "max_tokens": max_tokens},
                     st.fixed_dictionaries({key: PROMPTS[key]}),
                     st.fixed_dictionaries({}, optional=OPTIONAL),
                     # always present and mostly small: a valid body runs a short generation, not the context
                     mostly(st.integers(1, 3)))


@pytest.fixture(scope="module")
def loop():
    lp = asyncio.new_event_loop()
    yield lp
    lp.close()


@pytest.fixture(scope="module")
def cluster(loop, tiny_knot, tmp_path_factory):
    c = loop.run_until_complete(build_cluster(tiny_knot, tmp_path_factory.mktemp("fuzz"), 2, 4))
    yield c
    loop.run_until_complete(c.drain())


async def call(c, path: str, data: bytes) -> tuple[int, bytes]:
    r = await c.coordinator.fetch(Request("POST", f"https://coordinator{path}",
                                          {"Content-Type": "application/json"}, data))
    body = r.body
    if r.stream is not None:
        chunks = []
        try:
            async for chunk in r.stream:
                chunks.append(bytes(chunk))
        finally:
            await r.stream.aclose()
        body = b"".join(chunks)
    return r.status, body


async def baseline(c) -> list[int]:
    status, body = await call(c, "/generate", json.dumps({"prompt": PROMPT, "max_tokens": 6}).encode())
    assert status == 200, body
    return json.loads(body)["tokens"]


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                  HealthCheck.too_slow])
@given(data=st.data())
def test_public_json_bodies_get_a_result_or_a_4xx(loop, cluster, data):
    path = data.draw(st.sampled_from(ENDPOINTS))
    body = data.draw(st.integers(0, 9).flatmap(lambda i: json_values if i == 0 else bodies(path)))
    raw = json.dumps(body, allow_nan=True).encode()
    status, reply = loop.run_until_complete(call(cluster, path, raw))
    assert status < 500, (status, reply[:300], raw[:300])
    if status >= 400:
        assert json.loads(reply).get("error"), reply  # a reason, in the endpoint's error shape
    else:
        assert b"server_error" not in reply, reply[-300:]  # a stream that failed after its status line


def test_the_cluster_gives_the_baseline_after_the_fuzzing(loop, cluster, tiny_knot):
    # runs after the property test in this module: the same cluster, the same isolates
    from deploy.engine_local import LocalEngine
    from common.sampling import SamplingParams

    eng = LocalEngine.open(tiny_knot)
    want = eng.generate(eng.tokenizer.encode(PROMPT), SamplingParams(), max_tokens=6).token_ids
    assert loop.run_until_complete(baseline(cluster))[:len(want)] == want


# ---------------------------------------------------------------- binary frames


def _valid_frames() -> dict[str, bytes]:
    rng = np.random.default_rng(0)
    env = wire.encode_envelope(wire.Envelope("req-1", "prefill", 0, 3, rng.standard_normal((3, 8), np.float32)))
    tok = wire.encode_envelope(wire.Envelope("req-2", "embed", 2, 4, np.array([1, 7], np.int32)))
    t = wire.TensorFrame("blk.0.attn_q.weight", "Q8_0", (32, 2), memoryview(bytes(range(68))), 0)
    spec = wire.SampleSpec(4, 0.8, 77, True, 1.1, 0.2, 0.1, 64, (1, 2, 3))
    sample = wire.encode_sample_request(spec, wire.Envelope("req-3", "logits", 5, 8,
                                                            rng.standard_normal((3, 8), np.float32)))
    return {"envelope": env, "tokens": tok, "tensor": wire.encode_tensor(t), "batch": wire.encode_batch([t, t]),
            "sample": sample}


VALID = _valid_frames()
DECODERS = {"envelope": wire.decode_envelope, "tokens": wire.decode_envelope, "tensor": wire.decode_tensor,
            "batch": wire.decode_batch, "sample": wire.decode_sample_request}


def _fix_crc(buf: bytearray) -> bytes:
    """The frame's trailing crc32 recomputed, so a change reaches the checks past the crc."""
    if len(buf) >= 4:
        buf[-4:] = struct.pack("<I", zlib.crc32(bytes(buf[:-4])))
    return bytes(buf)


@settings(max_examples=400, deadline=None)
@given(kind=st.sampled_from(sorted(VALID)), data=st.data())
def test_frame_decoders_raise_only_wire_errors(kind, data):
    buf = bytearray(VALID[kind])
    for _ in range(data.draw(st.integers(1, 4))):
        at = data.draw(st.integers(0, len(buf) - 1))
        buf[at] = data.draw(st.integers(0, 255))
    cut = data.draw(st.integers(0, len(buf)))
    frames = [bytes(buf), _fix_crc(buf), _fix_crc(bytearray(buf[:cut])), bytes(buf[:cut])]
    for frame in frames:
        try:
            DECODERS[kind](frame)
        except wire.WireError:
            pass


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=200))
def test_request_body_decoders_raise_only_wire_errors(body):
    for decode in (wire.decode_envelope, wire.decode_tensor, wire.decode_batch, wire.decode_names, wire.decode_rows,
                   wire.decode_sample_request, wire.decode_envelopes):
        try:
            decode(body)
        except wire.WireError:
            pass


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(kind=st.sampled_from(["envelope", "tokens", "sample"]), data=st.data())
def test_stations_and_shards_answer_a_4xx_to_bad_frames(loop, cluster, kind, data):
    buf = bytearray(VALID[kind])
    for _ in range(data.draw(st.integers(1, 3))):
        buf[data.draw(st.integers(0, len(buf) - 1))] = data.draw(st.integers(0, 255))
    frame = _fix_crc(buf) if data.draw(st.booleans()) else bytes(buf)
    targets = [(cluster.stations[0], "/forward"), (cluster.shards[0], "/embed"), (cluster.shards[0], "/logits"),
               (cluster.shards[0], "/sample")]
    for svc, path in targets:
        r = loop.run_until_complete(svc.fetch(Request("POST", path, {}, frame)))
        assert r.status < 500, (path, r.status, r.body[:300])
