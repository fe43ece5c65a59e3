"""Sampling on the shards (common/shard_sampling.py): the tokens decided from the slices' summaries
are the full-logit sampler's, for the same seed, row by row and through the in-process cluster."""
from __future__ import annotations

import json

import numpy as np
import pytest

from common import wire
from common.generation import token_logprobs
from common.runtime import Request
from common.sampling import Sampler, SamplingParams, top_indices
from common.shard_sampling import LSE, SliceSummary, decide, merge, row_history, summarize
from deploy.engine_local import LocalEngine
from tests.inprocess import build_cluster

PARAMS = [
    SamplingParams(),
    SamplingParams(repetition_penalty=1.3, frequency_penalty=0.5, presence_penalty=0.2, penalty_last_n=8),
    SamplingParams(temperature=0.8),
    SamplingParams(temperature=1.0, top_k=5),
    SamplingParams(temperature=0.7, top_p=0.9),
    SamplingParams(temperature=1.2, min_p=0.05),
    SamplingParams(temperature=0.9, top_k=40, top_p=0.95, min_p=0.02),
    SamplingParams(temperature=1.0, top_p=0.5, repetition_penalty=1.2, presence_penalty=0.5, penalty_last_n=-1),
    SamplingParams(temperature=1e-39),  # x / T overflows float32: the sampler switches to float64 gaps
]


def _slices(vocab: int, n_shards: int) -> list[tuple[int, int]]:
    cuts = np.linspace(0, vocab, n_shards + 1).astype(int)
    return list(zip(cuts[:-1], cuts[1:]))


def _summaries(x, slices, top, p, key, seq, position, lse=None):
    draw = not p.greedy and not 0 < p.top_k < x.shape[1] and p.top_p >= 1.0 and p.min_p <= 0.0
    lse = (not p.greedy and p.top_p < 1.0) if lse is None else lse  # the coordinator's rule, no logprobs
    out = [SliceSummary(a, b, *summarize(x[:, a:b], a, top, p, key, seq, position, draw, lse)) for a, b in slices]
    assert all(s.check(x.shape[0], lse) is None for s in out)
    assert lse or all(np.isnan(s.stats[:, LSE]).all() for s in out), "not asked for: not computed"
    return out


def test_top_indices_order_by_value_then_lowest_index():
    x = np.array([1, 3, 3, 2, 3, 0, 2], np.float32)
    assert top_indices(x, 1).tolist() == [1]  # greedy's argmax: the lowest of equal maxima
    assert top_indices(x, 2).tolist() == [1, 2]
    assert top_indices(x, 4).tolist() == [1, 2, 4, 3]
    assert top_indices(x, 7).tolist() == [1, 2, 4, 3, 6, 0, 5]


@pytest.mark.parametrize("case", range(len(PARAMS)))
def test_summaries_decide_the_full_logit_token(case):
    """Random rows, integer-valued ones too (ties everywhere), 1 to 8 slices, 1 to 32 candidates:
    every decided token is the full-logit sampler's, and most rows are decided."""
    p = PARAMS[case]
    rng = np.random.default_rng(case)
    decided = total = 0
    for trial in range(60):
        vocab, T = int(rng.integers(20, 400)), int(rng.integers(1, 4))
        x = rng.standard_normal((T, vocab)).astype(np.float32) * 3
        if trial % 3 == 0:
            x = np.round(x).astype(np.float32)  # ties
        seq = rng.integers(0, vocab, int(rng.integers(T, 30))).tolist()
        position = len(seq) - T  # the first row's input token
        key, top = int(rng.integers(1 << 62)), int(rng.integers(1, 33))
        slices = _slices(vocab, int(rng.integers(1, 9)))
        rows = merge(_summaries(x, slices, top, p, key, seq, position), vocab, position + 1)
        sampler = Sampler(p)
        sampler.key = key
        for j, row in enumerate(rows):
            hist = row_history(seq, T, j)
            want = sampler(x[j], hist)
            got = decide(row, p, key)
            total += 1
            if got is not None:
                decided += 1
                assert got == want, (trial, j)
                assert sampler(row, hist) == want
    if p.temperature != 1e-39:
        assert decided > total // 2, (decided, total)
    else:
        assert decided == 0, "an overflowing x / T must fall back to the full slices"


def test_all_candidates_decide_everything():
    """top >= every slice: nothing is held back, so every row is decided."""
    rng = np.random.default_rng(1)
    x = rng.standard_normal((2, 50)).astype(np.float32)
    for p in PARAMS[:-1]:
        rows = merge(_summaries(x, _slices(50, 3), 50, p, 9, [1, 2, 3], 1), 50, 2)
        sampler = Sampler(p)
        sampler.key = 9
        for j, row in enumerate(rows):
            assert decide(row, p, 9) == sampler(x[j], row_history([1, 2, 3], 2, j)), p


def test_logprobs_from_summaries_match_the_full_row():
    from common.generation import token_logprobs

    rng = np.random.default_rng(2)
    x = rng.standard_normal((1, 300)).astype(np.float32) * 4
    p = SamplingParams(temperature=0.8)
    rows = merge(_summaries(x, _slices(300, 4), 8, p, 3, [5], 0, lse=True), 300, 1)
    tid = decide(rows[0], p, 3)
    got, want = token_logprobs(rows[0], tid, 5), token_logprobs(x[0], tid, 5)
    assert [i for i, _ in got.top] == [i for i, _ in want.top]
    np.testing.assert_allclose([v for _, v in got.top], [v for _, v in want.top], rtol=0, atol=1e-6)
    assert abs(got.logprob - want.logprob) < 1e-6


def test_sample_spec_round_trips_and_bad_specs_are_refused():
    env = wire.Envelope("r", "logits", 4, 6, np.ones((2, 3), np.float32))
    spec = wire.SampleSpec(16, 0.7, (1 << 64) - 5, True, 1.2, 0.1, 0.3, -1, (9, 8, 7))
    got, genv = wire.decode_sample_request(wire.encode_sample_request(spec, env))
    assert got == spec and genv.request_id == "r" and np.array_equal(genv.array, env.array)
    greedy = wire.SampleSpec(1, 0.0, 3, lse=False)
    assert wire.decode_sample_request(wire.encode_sample_request(greedy, env))[0] == greedy
    head = wire._SAMPLE_HEAD
    good = bytearray(wire.encode_sample_request(spec, env))
    for field, value in [(8, 0), (8, wire.MAX_SAMPLE_TOP + 1), (16, float("nan")), (32, 0.0), (5, 4), (16, 0.0)]:
        bad = bytearray(good)
        fmt = {8: "<I", 16: "<d", 32: "<d", 5: "<B"}[field]
        import struct
        import zlib
        struct.pack_into(fmt, bad, field, value)
        n = head.size + 4 * 3
        struct.pack_into("<I", bad, n, zlib.crc32(bytes(bad[:n])))
        with pytest.raises(wire.MalformedFrame):
            wire.decode_sample_request(bytes(bad))
    with pytest.raises(wire.ChecksumMismatch):
        wire.decode_sample_request(bytes(good[:20]) + b"\x00" + bytes(good[21:]))
    with pytest.raises(wire.MalformedFrame):
        wire.decode_sample_request(bytes(good) + b"x")


CASES = [dict(), dict(temperature=0.9, seed=7), dict(temperature=0.8, top_k=20, top_p=0.9, seed=11),
         dict(temperature=1.0, min_p=0.1, seed=3, repetition_penalty=1.3, presence_penalty=0.4),
         dict(temperature=0.7, top_p=0.6, seed=5, frequency_penalty=0.5)]


async def test_cluster_shard_sampling_gives_the_single_process_tokens(tiny_knot, tmp_path):
    """The same seed gives the single process's (full-logit) tokens through the cluster, with
    speculation too; the shards answered /sample, and a shard that sends garbage is degraded, not trusted."""
    engine = LocalEngine.open(tiny_knot)
    c = await build_cluster(tiny_knot, tmp_path, 2, 3)
    prompt = "def add(a, b):\n    return a + b\n\ndef"
    ids = engine.tokenizer.encode(prompt)
    for case in CASES:
        for spec in ("off", {"source": "prompt_lookup", "max_draft": 4}):
            r = (await c.generate(prompt=prompt, max_tokens=24, speculation=spec, **case)).json()
            want = engine.generate(ids, SamplingParams(**case), max_tokens=24)
            assert r["tokens"] == want.token_ids, (case, spec)
            ss = r["timings"]["shard_sampling"]
            assert ss["summaries"] > 0 and r["degraded_shards"] == []
            assert ss["summaries"] + ss["full_slices"] == r["timings"]["speculation"]["trips"] + 1
    stats = [(await s.fetch(Request("GET", "/stats"))).json() for s in c.shards]
    assert all(s["sample_calls"] > 0 for s in stats)
    # logprobs (the OpenAI endpoints', which /generate does not serve; chat's entries carry each
    # token's bytes): the single process's tokens, and each one's logprob and top 3 as the full
    # logits give them
    messages = [{"role": "user", "content": prompt}]
    body = {"messages": messages, "max_tokens": 8, "logprobs": True, "top_logprobs": 3, "temperature": 0.9, "seed": 2}
    r = (await c.coordinator.fetch(Request("POST", "https://coordinator/v1/chat/completions",
                                           {"Content-Type": "application/json"}, json.dumps(body).encode()))).json()
    chat_ids = engine.tokenizer.encode_chat(messages)
    want = engine.generate(chat_ids, SamplingParams(temperature=0.9, seed=2), max_tokens=8).token_ids
    content = r["choices"][0]["logprobs"]["content"]
    assert len(content) == len(want) > 0
    # the logits after the prompt and each token but the last: (len(want), vocab)
    rows = engine.forward(chat_ids + want[:-1], engine.new_kv(), 0, all_logits=True)[len(chat_ids) - 1:]
    tb = engine.tokenizer.token_bytes
    for t, row, got in zip(want, rows, content):
        ref = token_logprobs(row, t, 3)
        assert got["bytes"] == list(tb(t)) and got["logprob"] == pytest.approx(ref.logprob, abs=1e-5)
        assert [e["bytes"] for e in got["top_logprobs"]] == [list(tb(i)) for i, _ in ref.top]
        assert [e["logprob"] for e in got["top_logprobs"]] == pytest.approx([v for _, v in ref.top], abs=1e-5)
    await c.drain()


async def test_shard_sample_endpoint_refuses_bad_requests(tiny_knot, tmp_path):
    c = await build_cluster(tiny_knot, tmp_path, 1, 2)
    engine = LocalEngine.open(tiny_knot)
    dim, vocab = engine.cfg.dim, engine.cfg.vocab_size
    h = np.ones((1, dim), np.float32)
    ok = wire.SampleSpec(4, 0.5, 1)
    cases = {
        "wrong dim": wire.encode_sample_request(ok, wire.Envelope("r", "logits", 0, 1, np.ones((1, dim + 1), np.float32))),
        "wrong mode": wire.encode_sample_request(ok, wire.Envelope("r", "embed", 0, 1, h)),
        "NaN hidden": wire.encode_sample_request(ok, wire.Envelope("r", "logits", 0, 1, h * np.nan)),
        "history id": wire.encode_sample_request(wire.SampleSpec(4, 0.5, 1, history=(vocab,)),
                                                 wire.Envelope("r", "logits", 0, 1, h)),
        "no spec": wire.encode_envelope(wire.Envelope("r", "logits", 0, 1, h)),
    }
    for what, body in cases.items():
        r = await c.shards[0].fetch(Request("POST", "/sample", {}, body))
        assert r.status == 400, (what, r.status, r.body[:200])
    r = await c.shards[0].fetch(Request("POST", "/sample", {}, wire.encode_sample_request(
        ok, wire.Envelope("r", "logits", 0, 1, h))))
    assert r.status == 200
    ids, vals, stats = (e.array for e in wire.decode_envelopes(r.body))
    assert ids.shape == (1, 4) and vals.shape == (1, 4) and stats.shape == (1, 5)
    await c.drain()
