"""Speculative decoding (common/speculative.py): drafts verified k at a time never change what is
generated; the stations take k rows and rewind past the first rejection, safely."""
from __future__ import annotations

import numpy as np
import pytest

from common import wire
from common.generation import Generation
from common.runtime import Request
from common.sampling import Sampler, SamplingParams
from common.speculative import (ACCEPT_DECAY, COPY_EXTENT, MAX_COOLDOWN, ROW_SHARE_PRIOR, Draft, DraftLength,
                                PromptLookup, SpeculationParams, TripCost, draft_vocab_runs, lookup, lookup_match,
                                verify)
from deploy.engine_local import LocalEngine
from tests.inprocess import build_cluster

CODE = "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\ndef"
# ngram_min=1: the tiny random model's text rarely repeats two tokens, and these tests need drafts
LOOKUP = SpeculationParams("prompt_lookup", max_draft=6, ngram_min=1)
TOP_P = dict(temperature=0.9, top_k=40, top_p=0.95, seed=1234)  # a request's sampling fields
# greedy (prompt lookup by default), and sampled prompt lookup, whose drafts the random tiny model
# often rejects: the cluster, the Workers and Pyodide run these against the single process
LOOKUP_CASES = [({}, None), (TOP_P, {"source": "prompt_lookup", "max_draft": 4})]
SAMPLED = [SamplingParams(), SamplingParams(**TOP_P), SamplingParams(temperature=1.0, seed=5, repetition_penalty=1.3)]


@pytest.fixture(scope="module")
def engine(tiny_knot):
    return LocalEngine.open(tiny_knot)


# ------------------------------------------------------------------ drafts


def test_lookup_copies_what_followed_the_latest_longest_match():
    #          0  1  2  3  4  5  6  7  8  9
    context = [5, 6, 7, 8, 9, 5, 6, 1, 2, 5, 6]
    # suffix (5, 6) last occurred at 5, followed by 1, 2, 5, 6; the earlier (5, 6, 7) is not the latest
    assert lookup(context, 3) == [1, 2, 5]
    assert lookup(context, 10) == [1, 2, 5, 6]
    assert lookup(context + [7], 2) == [8, 9], "the 3-gram (5, 6, 7) beats shorter matches"
    assert lookup([1, 2, 3, 4], 4) == [], "nothing repeats"
    assert lookup([3, 3, 3], 4) == [3], "a match may run into the suffix itself"
    assert lookup([7, 1, 7], 2) == [], "a lone repeated token drafts nothing (NGRAM_MIN = 2)"
    assert lookup([7, 1, 7], 2, ngram_min=1) == [1, 7]
    assert lookup(context, 0) == [] and lookup([], 3) == []


def test_draft_length_grows_after_full_acceptance_and_shrinks_after_a_rejection():
    d = DraftLength(8, start=4)
    d.update(4, 4)
    assert d.k == 6
    d.update(6, 2)
    assert d.k == 5
    for _ in range(9):
        d.update(d.k, 0)
    assert d.k == 1
    d.update(0, 0)
    assert d.k == 1, "a trip without drafts says nothing"
    for _ in range(9):
        d.update(d.k, d.k)
    assert d.k == 8


def test_drafts_that_all_fail_back_off_0_1_2_4_trips_and_an_accepted_one_ends_it():
    d = DraftLength(8)
    assert d.next() == 8
    d.update(8, 0)                                   # one draft that failed: half as long, no back-off yet
    assert d.next() == 4
    d.update(4, 0)                                   # two in a row: skip the next trip
    assert [d.next() for _ in range(2)] == [0, 2]
    d.update(2, 0)                                   # three: skip two
    assert [d.next() for _ in range(3)] == [0, 0, 1]
    d.update(1, 0)
    assert [d.next() for _ in range(5)] == [0, 0, 0, 0, 1]
    d.update(1, 1)                                   # all accepted: draft on the next trip, longer
    assert d.next() == 3 and d.failures == 0 and d.skipped == 7
    d.update(3, 1)                                   # partly accepted: one shorter
    assert d.k == 2
    for _ in range(12):
        d.update(1, 0)
    assert d.cooldown == MAX_COOLDOWN, "the back-off is capped"


# ------------------------------------------------------------------ the rule


def rows_for(tokens: list[int], vocab: int = 10) -> np.ndarray:
    """Rows whose argmax is each of tokens."""
    rows = np.zeros((len(tokens), vocab), np.float32)
    rows[np.arange(len(tokens)), tokens] = 5.0
    return rows


def test_with_a_trip_cost_drafts_back_off_where_their_tokens_come_slower_than_plain_trips():
    cost = TripCost()
    d = DraftLength(8, cost=cost)
    assert d.next() == 0 and d.skipped == 0, "no plain trip timed yet: the coming one is a probe, not a back-off"
    cost.observe_plain(0.1)
    assert d.next() == 8
    d.update(8, 3, seconds=0.5)                      # 4 tokens in 0.5 s: 0.125 each, a plain trip gives one in 0.1
    assert [d.next() for _ in range(2)] == [0, 7]
    d.update(7, 1, seconds=0.3)                      # 0.15 each, the mean 0.131: slow again, the back-off doubles
    assert [d.next() for _ in range(3)] == [0, 0, 6] and d.skipped == 3
    d.update(6, 6, seconds=0.35)                     # 7 tokens at 0.05 each: it paid, the back-off ends
    assert d.drafting_s == pytest.approx(0.1109375), "the mean remembers the slow trips"
    assert d.slow == 0 and d.next() == 8
    d.update(8, 3)                                   # not timed: acceptance alone decides, as without a cost
    assert d.next() == 7
    cost.observe_plain(0.2)
    assert cost.plain_s == pytest.approx(0.125), "a running mean of the plain trips"


def test_one_slow_trip_among_paying_ones_does_not_stop_drafting():
    """Drafts that pay (9 tokens at 0.05 s each, a plain trip gives one in 0.1), then one that went
    wrong early (2 tokens at 0.15 each): the drafting trips' mean stays under a plain trip's, so the
    next trip drafts (one fewer, for the rejection); judged alone, that trip would have skipped it.
    A slow trip where the mean is slow too backs off."""
    cost = TripCost()
    cost.observe_plain(0.1)
    d = DraftLength(8, cost=cost)
    for _ in range(3):
        d.update(8, 8, seconds=0.45)
    d.update(8, 1, seconds=0.3)
    assert d.drafting_s == pytest.approx(0.075) and d.slow == 0
    assert d.next() == 7 and d.skipped == 0
    d.update(7, 0, seconds=0.8)                      # 0.8 s for 1 token: the mean (0.256) is slower now
    assert d.slow == 1 and d.next() == 0 and d.skipped == 1


def test_a_blind_sources_drafts_are_cut_to_what_their_acceptance_and_the_rows_cost_pay_for():
    """Prompt lookup's drafts carry no confidence: the generation's recent acceptance (a prior of 3
    in 4) and what a verified row costs (a quarter of a plain trip until measured) cut them to the
    length of the most expected tokens per second, which grows as rows come cheaper or drafts keep
    being accepted; a draft that copies a long match is left whole. A source with a confidence of
    its own (a draft model) is not cut."""
    cost = TripCost()
    cost.observe_verify(4, 0.5)
    assert cost.row_s is None, "no plain trip to weigh a verify against yet"
    cost.observe_plain(0.1)
    d = DraftLength(8, cost=cost, blind=True)
    eight = Draft(list(range(8)))
    assert cost.row_share() == ROW_SHARE_PRIOR and d.acceptance() == pytest.approx(0.75)
    assert d.next() == 8 and d.gainful() == 3        # 1.5625 expected tokens per plain trip's time; 8 would give 1.07
    assert d.bound(eight).tokens == [0, 1, 2]
    assert d.bound(Draft(eight.tokens, extent=COPY_EXTENT)) == Draft(eight.tokens, extent=COPY_EXTENT), "a copy"
    d.update(3, 0)                                   # rejected whole: 3 in 5 expected, the length halves to 4
    assert d.acceptance() == pytest.approx(0.6) and d.gainful() == 2
    cost.observe_verify(2, 0.12)                     # a row costs a tenth of a plain trip here
    assert cost.row_share() == pytest.approx(0.1) and d.gainful() == 3
    d.update(3, 3)                                   # accepted: the evidence decays by ACCEPT_DECAY a trip
    assert (d.hits, d.misses) == (3.0, ACCEPT_DECAY) and d.k == 6 and d.gainful() == 5
    cost.observe_verify(3, 0.05)                     # faster than a plain trip: a row costs nothing more
    assert cost.row_s == pytest.approx(0.0075) and d.gainful() == 6
    assert d.bound(Draft(eight.tokens[:6])).tokens == eight.tokens[:6]
    assert DraftLength(8, cost=cost).bound(Draft([1, 2, 3], extent=1)).tokens == [1, 2, 3], "not blind"
    assert DraftLength(8, blind=True).bound(eight) == eight, "no clock: acceptance alone decides, as before"


def test_lookup_says_how_far_the_context_matches_where_it_copies_from():
    context = [9, 1, 2, 3, 4, 5, 6, 7, 8, 1, 2, 3]   # the 3-gram (1, 2, 3) at 1, preceded by 9 there and 8 here
    assert lookup_match(context, 4) == ([4, 5, 6, 7], 3)
    copy = [5, 1, 2, 3, 4, 6, 0, 1, 2, 3, 4]         # (2, 3, 4), then 1 and 5/0 before it: 4 agree
    assert lookup_match(copy, 2) == ([6, 0], 4)
    long = list(range(30)) + list(range(20))
    assert lookup_match(long, 3) == ([20, 21, 22], 16), "at most extent_max"
    assert lookup_match([1, 2, 3, 4], 4) == ([], 0)
    assert PromptLookup().propose(None, copy, 2) == Draft([6, 0], extent=4)


class _Clock:
    def __init__(self):
        self.t = 0.0

    def perf_counter(self) -> float:
        return self.t


class _Timed:
    """An engine whose greedy token at generated index i is script[i], and whose trips take
    0.5 + per_row * rows seconds of a fake clock (per_row 0.5: 9 rows cost 5 plain trips)."""

    def __init__(self, vocab: int, script: list[int], clock: _Clock, per_row: float):
        self.vocab, self.script, self.clock, self.per_row, self.n0 = vocab, script, clock, per_row, 0

    def _row(self, i: int) -> np.ndarray:
        x = np.zeros(self.vocab, np.float32)
        x[self.script[i]] = 10.0
        return x

    async def prompt_logits(self, gen, ids):
        self.n0 = len(ids)
        return self._row(0)

    async def next_logits(self, gen, token, history):
        self.clock.t += 0.5 + self.per_row
        return self._row(len(history) - self.n0)

    async def verify_logits(self, gen, tokens, history):
        self.clock.t += 0.5 + self.per_row * len(tokens)
        first = len(history) - (len(tokens) - 1) - self.n0  # generated index the first row predicts
        return np.stack([self._row(first + j) for j in range(len(tokens))])


class _OneRight:
    """Drafts the right next token, then wrong ones: one accepted per trip. Each proposal takes a
    plain trip's time (a draft model's forwards, say)."""

    def __init__(self, script: list[int], n0: int, clock: _Clock):
        self.script, self.n0, self.clock = script, n0, clock

    def propose(self, gen, context, k):
        self.clock.t += 1.0
        i = len(context) - self.n0
        return Draft([self.script[i]] + [(self.script[i + 1 + j] + 1) % 50 for j in range(k - 1)])


async def test_the_generation_loop_times_its_trips_and_stops_drafting_where_it_does_not_pay(engine):
    """Drafts of which one token is right, each proposal as dear as a plain trip: without a TripCost
    every trip drafts (none fails whole); with the engine's, the loop backs off and the generation
    takes less time. The same tokens either way."""
    from common import generation

    clock = _Clock()  # the generation's clock, which times the trips too
    script = [(7 * i) % 50 + 1 for i in range(80)]
    spec = SpeculationParams("prompt_lookup", 8)

    async def run(cost):
        e = _Timed(engine.cfg.vocab_size, script, clock, per_row=0.5)
        gen = Generation([1, 2, 3], 60, speculation=spec)
        t0 = clock.t
        async for _ in generation.generate_events(e, gen, engine.tokenizer, clock.perf_counter,
                                                  _OneRight(script, 3, clock), cost):
            pass
        return gen, clock.t - t0

    (plain, plain_s), (timed, timed_s) = await run(None), await run(TripCost())
    assert plain.token_ids == timed.token_ids == script[:60]
    # one accepted per trip, so never a failure: 29 trips of 2 tokens, and a last one with room for 1
    assert plain.backed_off == 0 and plain.accepted == 29 and plain.trips == 30
    assert timed.backed_off > 30 and timed.drafted < plain.drafted // 2, (timed.backed_off, timed.drafted)
    assert timed_s < 0.8 * plain_s, (timed_s, plain_s)


class _WrongLookup:
    """Prompt lookup on a fresh completion: every draft wrong, at no cost; blind as PromptLookup."""

    def __init__(self, script: list[int], n0: int, blind: bool):
        self.script, self.n0, self.blind = script, n0, blind

    def propose(self, gen, context, k):
        i = len(context) - self.n0
        return Draft([(self.script[i + j] + 1) % 50 for j in range(k)])


async def test_the_generation_loop_bounds_a_blind_drafters_failing_drafts_by_what_rows_cost(engine):
    """Drafts that all fail, a verified row an eighth of a plain trip's 0.625 s: bounded by the
    acceptance (blind), the generation verifies fewer rows for them and takes less time than with
    the heuristic's lengths alone; the loop measures what a row costs. The same tokens either way."""
    from common import generation

    clock = _Clock()
    script = [(7 * i) % 50 + 1 for i in range(80)]
    spec = SpeculationParams("prompt_lookup", 8)

    async def run(blind):
        e, cost = _Timed(engine.cfg.vocab_size, script, clock, per_row=0.125), TripCost()
        gen = Generation([1, 2, 3], 60, speculation=spec)
        t0 = clock.t
        async for _ in generation.generate_events(e, gen, engine.tokenizer, clock.perf_counter,
                                                  _WrongLookup(script, 3, blind), cost):
            pass
        return gen, clock.t - t0, cost

    (seen, seen_s, _), (blind, blind_s, cost) = await run(False), await run(True)
    assert seen.token_ids == blind.token_ids == script[:60]
    assert seen.accepted == blind.accepted == 0
    assert blind.drafted < seen.drafted and blind_s < seen_s, (blind.drafted, seen.drafted, blind_s, seen_s)
    assert cost.row_s == pytest.approx(0.125)


def test_greedy_rule_accepts_the_argmax_and_replaces_the_first_miss():
    s = Sampler(SamplingParams())
    assert verify(s, rows_for([3, 4, 5, 6]), [1, 2], Draft([3, 4, 5])) == ([3, 4, 5, 6], 3), "all + the bonus"
    assert verify(s, rows_for([3, 7, 5, 6]), [1, 2], Draft([3, 4, 5])) == ([3, 7], 1), "stops at the miss"
    assert verify(s, rows_for([9, 4]), [1], Draft([3])) == ([9], 0)


def test_point_mass_drafts_give_the_sampler_tokens_at_each_position():
    """Sampled, a point-mass draft is accepted iff it is the token the sampler draws there, so a
    trip decides exactly the tokens that sampling row by row would."""
    rng = np.random.default_rng(0)
    rows = rng.normal(size=(4, 50)).astype(np.float32)
    p = SamplingParams(temperature=1.0, seed=11)
    context = [1, 2, 3]
    plain = [Sampler(p)(rows[j], context, len(context) + j) for j in range(4)]
    for draft in ([], plain[:1], plain[:3], [plain[0], (plain[1] + 1) % 50, plain[2]]):
        tokens, accepted = verify(Sampler(p), rows[:len(draft) + 1], context, Draft(draft))
        assert tokens == plain[:len(tokens)], draft
        assert accepted == len(tokens) - 1


# ------------------------------------------------------------------ engines


@pytest.mark.parametrize("prompt", ["the def the", CODE])
@pytest.mark.parametrize("case", range(len(SAMPLED)))
def test_speculation_changes_nothing_in_the_single_process(engine, prompt, case):
    ids = engine.tokenizer.encode(prompt)
    plain = engine.generate(ids, SAMPLED[case], max_tokens=40)
    spec = engine.generate(ids, SAMPLED[case], max_tokens=40, speculation=LOOKUP)
    assert spec == plain and spec.token_ids == plain.token_ids
    assert plain.trips == plain.decode_steps and plain.drafted == 0
    assert spec.drafted > 0 and spec.decode_steps == plain.decode_steps
    assert spec.trips + spec.accepted == spec.decode_steps, "each trip decides its accepted drafts and one more"
    if SAMPLED[case].greedy:
        assert spec.accepted > 0 and spec.trips < spec.decode_steps


async def test_cluster_speculation_equals_the_single_process(engine, tiny_knot, tmp_path):
    """Greedy requests use prompt lookup by default; the tokens are the single process's without it,
    the stations rewound their rejected drafts, and /generate reports the trips."""
    c = await build_cluster(tiny_knot, tmp_path, 2, 3)
    ids = engine.tokenizer.encode(CODE)
    for sampling, spec in [LOOKUP_CASES[0], ({}, "off"), LOOKUP_CASES[1]]:
        body = dict(prompt=CODE, max_tokens=40, **sampling) | ({} if spec is None else {"speculation": spec})
        r = (await c.generate(**body)).json()
        want = engine.generate(ids, SamplingParams(**sampling), max_tokens=40)
        assert r["tokens"] == want.token_ids, (sampling, spec)
        s = r["timings"]["speculation"]
        if spec == "off":
            assert s["source"] == "off" and s["drafted"] == 0 and s["tokens_per_trip"] == 1
        elif not sampling:
            assert s["source"] == "prompt_lookup" and 0 < s["accepted"] <= s["drafted"]
            assert s["trips"] < len(r["tokens"]) and s["tokens_per_trip"] > 1
        else:  # the random tiny model's samples rarely copy the prompt: drafts were verified, and
            # after those that failed the back-off drafted nothing for a while (DraftLength)
            assert s["source"] == "prompt_lookup" and 0 <= s["accepted"] < s["drafted"]
            assert s["backed_off"] > 0, s
        assert r["replays"] == 0
    metrics = (await c.coordinator.fetch(Request("GET", "/metrics"))).text()
    assert 'knot_spec_drafted_tokens_total{source="prompt_lookup"}' in metrics
    assert 'knot_spec_backed_off_trips_total{source="prompt_lookup"}' in metrics
    assert "knot_decode_trips_total" in metrics and "knot_tokens_per_trip_bucket" in metrics
    await c.drain()


def test_local_engine_verify_rows_equal_one_token_at_a_time(engine):
    """k rows in one forward give each row's logits as decoding them one by one does (tiny model: exact)."""
    ids = engine.tokenizer.encode(CODE)
    more = engine.tokenizer.encode(" add(a, b)")
    kv1, kv2 = engine.new_kv(), engine.new_kv()
    engine.prefill(ids, kv1)
    engine.prefill(ids, kv2)
    batch = engine.forward(more, kv1, len(ids), all_logits=True)
    one = np.stack([engine.decode(t, kv2, len(ids) + i) for i, t in enumerate(more)])
    np.testing.assert_array_equal(batch, one)


# ------------------------------------------------------------------ the station's rewind


async def test_station_rewinds_only_the_last_frame_and_then_computes_as_if_fresh(tiny_knot, tmp_path):
    c = await build_cluster(tiny_knot, tmp_path, 1, 1)
    st = c.stations[0]
    rng = np.random.default_rng(3)
    x = rng.standard_normal((9, 256)).astype(np.float32)

    async def forward(rid, mode, pos, rows, rewind=False):
        frame = wire.Envelope(rid, mode, pos, pos + rows.shape[0], rows, rewind)
        return await st.fetch(Request("POST", "/forward", {}, wire.encode_envelope(frame)))

    # reference: 6 positions, then 1 more, in a fresh session
    assert (await forward("ref", "prefill", 0, x[:6])).status == 200
    want = wire.decode_envelope((await forward("ref", "decode", 6, x[8:9])).body).array
    # speculative: the same 6, a trip of 3 rows (positions 6-8), two of them rejected
    assert (await forward("s", "prefill", 0, x[:5])).status == 200
    trip = await forward("s", "decode", 5, x[5:8])
    assert trip.status == 200 and wire.decode_envelope(trip.body).array.shape == (3, 256), "every row of a decode"
    for bad in [dict(pos=4, rewind=True), dict(pos=9, rewind=True), dict(pos=6)]:
        r = await forward("s", "decode", bad["pos"], x[8:9], bad.get("rewind", False))
        assert r.status == 409 and r.json()["error"] == "UnknownSession", bad
        assert "replay" in r.json()["message"]
    # the refusals changed nothing: a rewind to 6 drops positions 6 and 7 and runs as the fresh session did
    got = await forward("s", "decode", 6, x[8:9], rewind=True)
    assert got.status == 200
    np.testing.assert_array_equal(wire.decode_envelope(got.body).array, want)
    # only the last frame can be dropped: position 5 was before it
    r = await forward("s", "decode", 5, x[8:9], rewind=True)
    assert r.status == 409
    await c.drain()


def test_envelope_rewind_flag_round_trips_and_unknown_flags_are_refused():
    e = wire.Envelope("r", "decode", 4, 6, np.zeros((2, 3), np.float32), rewind=True)
    assert wire.decode_envelope(wire.encode_envelope(e)).rewind is True
    assert wire.decode_envelope(wire.encode_envelope(wire.Envelope("r", "decode", 4, 5, e.array[:1]))).rewind is False
    raw = bytearray(wire.encode_envelope(e))
    raw[18] |= 0x80  # an unknown flag bit, with a crc32 that matches
    import zlib
    raw[-4:] = zlib.crc32(bytes(raw[:-4])).to_bytes(4, "little")
    with pytest.raises(wire.MalformedFrame, match="flags"):
        wire.decode_envelope(bytes(raw))


def test_generation_record_reports_the_trips(engine):
    ids = engine.tokenizer.encode(CODE)
    g = engine.generate(ids, max_tokens=30, speculation=LOOKUP)
    s = g.speculation_summary()
    assert s["source"] == "prompt_lookup" and s["trips"] == g.trips and s["drafted"] == g.drafted
    assert s["tokens_per_trip"] == round(g.decode_steps / g.trips, 4)
    assert Generation([1], 1).speculation_summary()["source"] == "off"


# ------------------------------------------------------------------ a draft model


@pytest.fixture(scope="module")
def other_tiny(tmp_path_factory):
    """A second tiny model: the same vocabulary and tokenizer, other weights (a poor draft)."""
    from deploy.encoder import encode
    from tests.tiny_gguf import TinySpec, write_tiny_gguf

    d = tmp_path_factory.mktemp("draft")
    encode(write_tiny_gguf(d / "draft.gguf", TinySpec(seed=1)), d / "draft.knot", progress=False)
    return LocalEngine.open(d / "draft.knot")


def test_greedy_draft_model_changes_nothing(tiny_knot, other_tiny):
    e = LocalEngine.open(tiny_knot, draft=other_tiny)
    good = LocalEngine.open(tiny_knot, draft=LocalEngine.open(tiny_knot))  # a perfect draft
    good.draft.confidence = 0.0  # the tiny model doubts all its guesses: draft them anyway
    # the perfect draft's head scoring ids below 200 and the specials: it cannot draft the rest
    narrow = LocalEngine.open(tiny_knot, draft=LocalEngine.open(tiny_knot), draft_head_ids=200)
    narrow.draft.confidence = 0.0
    ids = e.tokenizer.encode(CODE)
    plain = e.generate(ids, max_tokens=30)
    records = {}
    for name, engine in (("poor", e), ("narrow", narrow), ("perfect", good)):
        spec = records[name] = engine.generate(ids, max_tokens=30, speculation=SpeculationParams("draft_model", 4))
        assert spec.token_ids == plain.token_ids and spec.drafted > 0, name
    assert spec.accepted == spec.drafted and spec.trips < spec.decode_steps / 2, "the perfect draft is always right"
    outside = [t for t in plain.token_ids if 200 <= t < 267]  # neither below 200 nor special
    assert outside and records["narrow"].accepted < records["narrow"].drafted, \
        (outside, "the narrow head misses exactly those: a rejected draft each, the same tokens")
    assert e.draft.sessions == {}, "the draft model's caches are released with the generation"


def test_draft_vocab_runs_are_the_ids_below_and_the_specials_above():
    assert draft_vocab_runs(300, 200, [5, 269, 267, 268, 290, 400]) == [(0, 200), (267, 270), (290, 291)]
    assert draft_vocab_runs(300, 200, [200, 201]) == [(0, 202)] and draft_vocab_runs(300, 200, []) == [(0, 200)]
    assert draft_vocab_runs(300, 0, [267]) is None and draft_vocab_runs(300, 300, [7]) is None


def test_a_draft_head_over_some_ids_gives_their_logits_bit_for_bit_and_minus_inf_elsewhere(engine):
    ids = engine.tokenizer.encode(CODE)
    vocab = engine.cfg.vocab_size
    runs = draft_vocab_runs(vocab, 200, engine.tokenizer.special_ids)
    assert runs == [(0, 200), (vocab - 3, vocab)], "the tiny tokenizer's three specials come last"
    full = engine.forward(ids, engine.new_kv(), 0, all_logits=True)                    # (T, vocab)
    part = engine.forward(ids, engine.new_kv(), 0, all_logits=True, vocab_runs=runs)   # (T, vocab)
    scored = np.zeros(vocab, dtype=bool)
    for a, b in runs:
        scored[a:b] = True
    assert part.shape == full.shape and part.dtype == np.float32
    assert np.array_equal(part[:, scored], full[:, scored]), "the scored ids' logits are the whole head's bits"
    assert np.isneginf(part[:, ~scored]).all(), "the others can never be drafted"


# Sampled: the standard rule keeps the target's distribution. The tiny model draws its first three
# tokens (top-3 at temperature 1: 27 sequences) N times with a draft model whose logits are the
# target's times 3 (sharper: most drafts accepted, the rest replaced from the residual), and
# Pearson's chi-square compares the counts with the exact probabilities, computed by enumeration.
# The seeds are fixed, so the statistic is too: it is a draw from chi-square(26) where the rule is
# right (p < 0.001 beyond 54.05), and far beyond that where drafts pass unchecked (asserted below).
CHI2_26_P001 = 54.05
N_SAMPLES = 1000


def test_draft_model_reads_a_prompt_ahead_in_chunks_and_then_drafts_the_same(tiny_knot, monkeypatch):
    """prefill() feeds a prompt in the prefill's chunks, computing only the last row's logits; the
    first draft after it feeds one token and drafts what a draft from scratch does."""
    import common.speculative as spec

    e = LocalEngine.open(tiny_knot)
    rows = []

    def forward(tokens, kv, pos):
        out = e.forward(tokens, kv, pos)
        rows.append((len(tokens), out.shape[0]))
        return out

    monkeypatch.setattr(spec, "prefill_chunks", lambda n: [(a, min(a + 7, n)) for a in range(0, n, 7)])
    prompt = e.tokenizer.encode(CODE)
    assert len(prompt) > 14
    cold = spec.DraftModel(forward, e.new_kv, confidence=0.0).draft("a", prompt + [5], 4, SamplingParams(), 0)
    rows.clear()
    dm = spec.DraftModel(forward, e.new_kv, confidence=0.0)
    assert dm.prefill("b", prompt) == len(prompt) and dm.prefill("b", prompt) == 0
    assert rows == [(min(7, len(prompt) - a), 1) for a in range(0, len(prompt), 7)], rows
    rows.clear()
    assert dm.draft("b", prompt + [5], 4, SamplingParams(), 0) == cold
    assert rows == [(1, 1)] * 4, "the first draft fed the one new token, then drafted"


def test_draft_model_stops_where_it_doubts_the_chain(tiny_knot):
    """DRAFT_CONFIDENCE: drafts end before the first token (after the first) at which the product of
    the drafts' probabilities under the draft model falls below the threshold; the cache keeps
    exactly the drafts it was fed."""
    import common.speculative as spec

    e = LocalEngine.open(tiny_knot)
    ctx = e.tokenizer.encode(CODE)
    seen = []

    def forward(tokens, kv, pos):
        out = e.forward(tokens, kv, pos)
        seen.append(spec.top_probability(out[-1]))
        return out

    free = spec.DraftModel(forward, e.new_kv, confidence=0.0).draft("a", ctx, 6, SamplingParams(), 0)[0]
    p = seen[:]  # the draft model's confidence in each of the six drafts
    assert len(free) == 6 and len(p) == 6
    chain = np.cumprod(p)  # in the first i + 1 drafts together
    cut = sorted(chain[1:])[2]  # a threshold the chain falls below, after some drafts
    first_doubt = next(i for i in range(1, 6) if chain[i] < cut)
    assert min(p[1:]) >= cut, (p, cut, "each draft alone passes the threshold: only the chain's product stops them")
    dm = spec.DraftModel(forward, e.new_kv, confidence=cut)
    got, _ = dm.draft("b", ctx, 6, SamplingParams(), 0)
    assert got == free[:first_doubt], (p, cut)
    kv, held = dm.sessions["b"]
    assert held == ctx + got and kv.n_positions() == len(held), "the drafts it fed, and only those"
    assert spec.DraftModel(forward, e.new_kv, confidence=1.1).draft("c", ctx, 6, SamplingParams(), 0)[0] == \
        free[:1], "the first draft is always made"


def test_a_greedy_draft_model_copies_the_context_where_its_first_draft_agrees(tiny_knot):
    """COPY_NGRAM: where the context's last 3 tokens occurred before, k tokens followed them, and the
    draft model's first draft is the first of those, a greedy trip drafts them, at one forward. A
    shorter copy, a first draft that disagrees, a sampled request, or copy_ngram=None drafts from
    the model."""
    import common.speculative as spec

    e = LocalEngine.open(tiny_knot)
    best, calls = [40], []

    def forward(tokens, kv, pos):  # a draft model whose every guess is best[0]
        calls.append(len(tokens))
        out = np.zeros((1, e.cfg.vocab_size), dtype=np.float32)
        out[0, best[0]] = 10.0
        return out

    ctx = [1, 2, 3, 40, 41, 42, 43, 44, 9, 1, 2, 3]  # 1 2 3 was followed by 40 41 42 43 44
    dm = spec.DraftModel(forward, e.new_kv, confidence=0.0)
    assert dm.draft("a", ctx, 4, SamplingParams(), 0) == ([40, 41, 42, 43], None)
    assert calls == [len(ctx)] and dm.copies == 1, "the prompt's forward gave the first draft; no more"
    assert dm.sessions["a"][1] == ctx, "the copies were not fed"
    best[0], calls[:] = 7, []
    assert dm.draft("a", ctx, 4, SamplingParams(), 0) == ([7, 7, 7, 7], None) and calls == [1, 1, 1, 1]
    best[0] = 40
    # a cycle: 1 2 3 last occurred 4 tokens back, too few for 6 drafts, so the model drafts them
    assert dm.draft("c", [1, 2, 3, 40, 1, 2, 3], 6, SamplingParams(), 0) == ([40] * 6, None) and dm.copies == 1
    tokens, scores = dm.draft("a", ctx, 4, SamplingParams(temperature=1.0, seed=3), 1)
    assert scores is not None and len(scores) == len(tokens) == 4 and dm.copies == 1, "sampled: the model's draws"
    off = spec.DraftModel(forward, e.new_kv, confidence=0.0, copy_ngram=None)
    assert off.draft("b", ctx, 4, SamplingParams(), 0) == ([40] * 4, None) and off.copies == 0


def test_draft_model_keeps_its_kv_caches_within_the_budget(tiny_knot):
    """With a KV budget, the least recently used sessions go before one grows past it; a dropped
    session drafts the same again from its context, and a sequence that cannot fit alone is a 413."""
    import common.speculative as spec
    from common.runtime import PayloadTooLarge, status_for

    e = LocalEngine.open(tiny_knot)
    bound = lambda n: e.new_kv().nbytes_bound(n, e.cfg.n_layer)  # noqa: E731
    ctx = e.tokenizer.encode(CODE)
    n = len(ctx) + 5  # a context and its drafts
    budget = 2 * bound(n) + bound(n) // 2  # two such sessions fit, three do not
    free = spec.DraftModel(e.forward, e.new_kv, confidence=0.0)
    dm = spec.DraftModel(e.forward, e.new_kv, confidence=0.0, kv_budget_bytes=budget, kv_bound=bound)
    assert bound(dm.max_tokens()) <= budget < bound(dm.max_tokens() + 1)
    want = {rid: free.draft(rid, ctx + [i], 6, SamplingParams(), 0)[0] for i, rid in enumerate("abc")}
    for i, rid in enumerate("ab"):
        assert dm.draft(rid, ctx + [i], 6, SamplingParams(), 0)[0] == want[rid]
    assert list(dm.sessions) == ["a", "b"] and dm.sessions_evicted == 0
    dm.draft("a", ctx + [0], 6, SamplingParams(), 0)  # "a" is now the most recently used
    assert dm.draft("c", ctx + [2], 6, SamplingParams(), 0)[0] == want["c"]
    assert list(dm.sessions) == ["a", "c"] and dm.sessions_evicted == 1, "the least recently used went"
    assert dm.kv_bytes <= budget
    assert dm.draft("b", ctx + [1], 6, SamplingParams(), 0)[0] == want["b"], "fed again from its context"
    assert list(dm.sessions) == ["c", "b"] and dm.kv_bytes <= budget and dm.sessions_evicted == 2
    with pytest.raises(PayloadTooLarge) as err:
        dm.prefill("d", list(range(dm.max_tokens() + 1)))
    assert status_for(err.value) == 413 and "MEMORY_BUDGET_BYTES" in str(err.value)
    assert "d" not in dm.sessions and dm.kv_bytes <= budget
    with pytest.raises(ValueError):
        spec.DraftModel(e.forward, e.new_kv, kv_budget_bytes=budget)


@pytest.mark.parametrize("narrow", [False, True])
def test_sampled_draft_model_keeps_the_distribution(tiny_knot, narrow):
    """narrow: the draft's head leaves out the token the target likes best after its likeliest
    first one (a draft head over some ids, DRAFT_HEAD_IDS), so q is 0 there and that token comes
    from the residual only."""
    from common.speculative import DraftModel

    e = LocalEngine.open(tiny_knot)
    ids = e.tokenizer.encode("the def the")
    params = lambda seed: SamplingParams(temperature=1.0, top_k=3, seed=seed)  # noqa: E731

    def step(prefix, forward=None):  # the distribution of the next token after ids + prefix
        logits = e.prefill(ids + prefix, e.new_kv()) if forward is None else forward(ids + prefix, e.new_kv(), 0)[-1]
        return Sampler(params(0)).probs(logits, ids + prefix)

    runs = None
    if narrow:
        p1 = step([])
        left_out = int(np.argmax(step([int(np.argmax(p1))])))
        runs = [(0, left_out), (left_out + 1, e.cfg.vocab_size)]
    draft = lambda t, kv, p: 3.0 * e.forward(t, kv, p, all_logits=True, vocab_runs=runs)  # noqa: E731
    e.draft = DraftModel(draft, e.new_kv)

    p, q = {}, {}  # sequence of 3 -> probability under the target; with t2, t3 from the draft
    p1 = step([])
    for a in map(int, np.flatnonzero(p1)):
        p2, q2 = step([a]), step([a], draft)
        for b in map(int, np.flatnonzero(p2)):
            p3, q3 = step([a, b]), step([a, b], draft)
            for c in map(int, np.flatnonzero(p3)):
                p[(a, b, c)] = p1[a] * p2[b] * p3[c]
                q[(a, b, c)] = p1[a] * q2[b] * q3[c]
    assert len(p) == 27 and abs(sum(p.values()) - 1) < 1e-9
    counts: dict = {}
    drafted = accepted = 0
    for seed in range(N_SAMPLES):
        g = e.generate(ids, params(seed), max_tokens=4, speculation=SpeculationParams("draft_model", 2))
        counts[tuple(g.token_ids[:3])] = counts.get(tuple(g.token_ids[:3]), 0) + 1
        drafted, accepted = drafted + g.drafted, accepted + g.accepted
    assert set(counts) <= set(p), "only sequences the target can produce"
    keys = sorted(p)
    obs = np.array([counts.get(k, 0) for k in keys])
    exp = np.array([p[k] * N_SAMPLES for k in keys])
    assert exp.min() > 5, "Pearson's test wants every expected count above 5"
    chi2 = float(((obs - exp) ** 2 / exp).sum())
    assert chi2 < CHI2_26_P001, f"chi-square {chi2:.1f} over 26 degrees of freedom"
    assert 0.3 < accepted / drafted < 0.95, (accepted, drafted, "both branches of the rule ran")
    if narrow:  # the draft cannot propose the left-out token, yet it comes out as often as p says
        unproposed = [k for k in keys if q[k] == 0]
        assert unproposed and sum(counts.get(k, 0) for k in unproposed) > 0, unproposed
    # The test's power: drafts accepted unchecked would give q's counts, whose expected statistic is
    # N * sum (q - p)^2 / p (+ 26) -- far beyond the threshold.
    noncentral = N_SAMPLES * sum((q[k] - p[k]) ** 2 / p[k] for k in keys)
    assert noncentral > 4 * CHI2_26_P001, noncentral


async def test_cluster_draft_model_service_equals_the_single_process(tiny_knot, other_tiny, tmp_path, monkeypatch):
    """The drafter service drafts as the in-process draft model does: the same records, greedy and
    sampled; its sessions are released after each request; a bad draft request is a 400. Its boot
    reads the payload in many ranged reads (an odd size, so the last one is short)."""
    from services.drafter import handler as drafter_handler

    from services.drafter import drafter_client

    monkeypatch.setattr(drafter_handler, "BOOT_READ_BYTES", 10_007)
    monkeypatch.setattr(drafter_client, "PRIME_CHUNK_TOKENS", 7)  # a prompt is read in several calls
    # The records are compared, and TripCost's back-off reads the clock: at 1 token accepted in 7 a
    # drafting trip's seconds per token sit near a plain trip's, so a loaded machine (CI, 50% stolen
    # time) backed off in one engine and not the other (drafted 7 against 5, the same tokens). A
    # plain trip that costs forever keeps the back-off to acceptance alone, in both.
    monkeypatch.setattr(TripCost, "observe_plain", lambda self, seconds: setattr(self, "plain_s", float("inf")))
    c = await build_cluster(tiny_knot, tmp_path, 2, 3, draft_knot=other_tiny.model.path)
    local = LocalEngine.open(tiny_knot, draft=other_tiny)
    ids = local.tokenizer.encode(CODE)
    # Unset SPEC_MAX_DRAFT drafts by source (6 from the draft model, 8 by prompt lookup); set, it
    # applies to both; a request's max_draft wins over either.
    from services.coordinator.handler import coordinator_for
    from services.coordinator.params import parse_generate
    co = await coordinator_for(c.coordinator.env)
    chosen = {(src, md): co.speculation(parse_generate({"prompt": "x", "speculation": src if md is None else
                                                        {"source": src, "max_draft": md}}), 1).max_draft
              for src in ("draft_model", "prompt_lookup") for md in (None, 3)}
    assert chosen == {("draft_model", None): 6, ("prompt_lookup", None): 8, ("draft_model", 3): 3,
                      ("prompt_lookup", 3): 3}
    with monkeypatch.context() as m:
        m.setattr(co, "settings", __import__("dataclasses").replace(co.settings, max_draft=5))
        assert [co.speculation(parse_generate({"prompt": "x", "speculation": s}), 1).max_draft
                for s in ("draft_model", "prompt_lookup")] == [5, 5]
    for sampling in ({}, dict(temperature=0.9, top_k=40, seed=7)):
        r = (await c.generate(prompt=CODE, max_tokens=24, speculation="draft_model", **sampling)).json()
        want = local.generate(ids, SamplingParams(**sampling), max_tokens=24,
                              speculation=SpeculationParams("draft_model", 6))
        assert r["tokens"] == want.token_ids, sampling
        s = r["timings"]["speculation"]
        assert (s["source"], s["drafted"], s["accepted"], s["trips"]) == \
            ("draft_model", want.drafted, want.accepted, want.trips)
        # each drafting trip's call to the drafter is timed as a hop of its own, beside the stations'
        assert 0 < r["timings"]["hops"]["draft"]["calls"] <= s["trips"], r["timings"]["hops"]
    metrics = (await c.coordinator.fetch(Request("GET", "/metrics"))).text()
    assert 'knot_hop_latency_seconds_count{hop="draft"}' in metrics
    await c.drain()
    drafter = c.coordinator.env.DRAFTER
    stats = (await drafter.fetch(Request("GET", "/stats"))).json()
    assert stats["sessions"] == 0 and stats["drafted_tokens"] > 0
    assert len(ids) > 14 and (stats["primes"], stats["primed_tokens"]) == (2 * -(-len(ids) // 7), 2 * len(ids)), \
        "each prompt was read ahead of its drafts, 7 tokens more per call"
    payload = other_tiny.model.header.payload_nbytes
    assert stats["r2_reads"] >= -(-payload // 10_007) > 1, (stats, payload)
    for body, needle in [({"request_id": "r", "context": [], "k": 2, "key": 1}, "context"),
                         ({"request_id": "r", "context": [1], "k": 99, "key": 1}, "k must be"),
                         ({"request_id": "r", "context": [1], "k": 2, "key": 1, "sampling": {"temperature": -1}},
                          "sampling")]:
        r = await drafter.fetch(Request("POST", "/draft", {}, __import__("json").dumps(body).encode()))
        assert r.status == 400 and needle in r.json()["message"], (body, r.body)
    for body, needle in [({"request_id": "r", "context": [1, -2]}, "context"), ({"context": [1]}, "request_id"),
                         ([1, 2], "JSON object")]:
        r = await drafter.fetch(Request("POST", "/prime", {}, __import__("json").dumps(body).encode()))
        assert r.status == 400 and needle in r.json()["message"], (body, r.body)
    r = await c.generate(prompt=CODE, max_tokens=4, speculation={"source": "draft_model", "max_draft": 40})
    assert r.status == 400 and "max_draft" in r.json()["message"]
    for sampling, source in (({}, "draft_model"), (dict(temperature=0.9, seed=7), "off")):  # auto, with a drafter
        r = (await c.generate(prompt=CODE, max_tokens=4, **sampling)).json()
        assert r["timings"]["speculation"]["source"] == source, sampling
    await c.drain()


async def test_the_drafters_head_scores_the_ids_of_draft_head_ids_as_the_single_process_does(tiny_knot, tmp_path,
                                                                                              monkeypatch):
    """DRAFT_HEAD_IDS=200: the drafter's head scores ids below 200 and the three specials, drafts
    none of the others, and drafts as the in-process draft model with draft_head_ids=200 does."""
    monkeypatch.setattr(TripCost, "observe_plain", lambda self, seconds: setattr(self, "plain_s", float("inf")))
    c = await build_cluster(tiny_knot, tmp_path, 2, 3, draft_knot=tiny_knot, drafter_vars={"DRAFT_HEAD_IDS": "200"})
    local = LocalEngine.open(tiny_knot, draft=LocalEngine.open(tiny_knot), draft_head_ids=200)
    ids = local.tokenizer.encode(CODE)
    for sampling in ({}, dict(temperature=0.9, top_k=40, seed=7)):
        r = (await c.generate(prompt=CODE, max_tokens=24, speculation="draft_model", **sampling)).json()
        want = local.generate(ids, SamplingParams(**sampling), max_tokens=24,
                              speculation=SpeculationParams("draft_model", 6))
        s = r["timings"]["speculation"]
        assert (r["tokens"], s["drafted"], s["accepted"], s["trips"]) == \
            (want.token_ids, want.drafted, want.accepted, want.trips), sampling
    drafter = c.coordinator.env.DRAFTER
    vocab = local.cfg.vocab_size
    assert (await drafter.fetch(Request("GET", "/stats"))).json()["head_ids"] == 200 + 3
    body = {"request_id": "narrow", "context": ids, "k": 8, "key": 3, "sampling": {"temperature": 1.5}}
    r = await drafter.fetch(Request("POST", "/draft", {}, __import__("json").dumps(body).encode()))
    drafts, scores = (e.array for e in wire.decode_envelopes(r.body))
    assert len(drafts) and all(t < 200 or t >= vocab - 3 for t in drafts.tolist()), drafts
    assert np.isneginf(scores[:, 200:vocab - 3]).all() and np.isfinite(scores[:, :200]).all()
    await c.drain()


@pytest.mark.parametrize("fault", ["prime down", "draft down", "draft timeout", "draft out of vocabulary"])
async def test_a_drafter_fault_leaves_the_generation_without_drafts_and_the_same_tokens(tiny_knot, other_tiny,
                                                                                          tmp_path, fault):
    """The drafter only speeds a generation up: when it fails one (unreachable, timed out, a reply
    outside the vocabulary), that generation goes on without drafts and gives the same tokens,
    greedy and sampled, and says so (timings.speculation.drafter_error, the metrics). The next
    generation asks the drafter again."""
    from common.runtime import Response, ServiceUnavailable

    c = await build_cluster(tiny_knot, tmp_path, 2, 3, draft_knot=other_tiny.model.path)
    binding = c.coordinator.env.DRAFTER
    real_fetch = binding.fetch
    path, how = {"prime down": ("/prime", "down"), "draft down": ("/draft", "down"),
                 "draft timeout": ("/draft", "slow"), "draft out of vocabulary": ("/draft", "bad")}[fault]
    failing = True

    async def fetch(request):
        if failing and request.path.endswith(path):
            if how == "down":
                raise ServiceUnavailable(f"POST {request.path}: connection refused")
            if how == "slow":
                raise TimeoutError(f"{request.path}: no answer")
            envs = [wire.Envelope("r", "draft", 0, 1, np.asarray([-5], np.int32))]
            return Response(200, {"Content-Type": wire.ENVELOPE_CONTENT_TYPE}, wire.encode_envelopes(envs))
        return await real_fetch(request)

    binding.fetch = fetch
    for sampling in ({}, dict(temperature=0.9, top_k=40, seed=7)):
        off = (await c.generate(prompt=CODE, max_tokens=16, speculation="off", **sampling)).json()
        r = await c.generate(prompt=CODE, max_tokens=16, speculation="draft_model", **sampling)
        assert r.status == 200, r.body
        r = r.json()
        assert r["tokens"] == off["tokens"], (fault, sampling)
        s = r["timings"]["speculation"]
        assert s["drafted"] == 0 and path in s["drafter_error"], s
        if how == "bad":
            assert "outside the vocabulary" in s["drafter_error"], s
    metrics = (await c.coordinator.fetch(Request("GET", "/metrics"))).text()
    assert "knot_spec_drafter_faults_total 2.0" in metrics, [m for m in metrics.splitlines() if "fault" in m]
    failing = False
    r = (await c.generate(prompt=CODE, max_tokens=16, speculation="draft_model")).json()
    s = r["timings"]["speculation"]
    assert s["drafted"] > 0 and s["drafter_error"] is None, s
    await c.drain()


async def test_a_drafter_refuses_to_boot_on_a_corrupt_tensor_and_generations_go_on_without_it(tiny_knot, other_tiny,
                                                                                              tmp_path):
    """The bucket is not trusted: one flipped byte in the draft model's weights would change no
    served token (the target checks each draft) but would make every draft worthless in silence.
    The drafter checks each tensor's crc32 at boot, as stations and shards do on their reads."""
    from deploy.knotfile import open_model

    header = open_model(other_tiny.model.path).header
    name = next(n for n in header.tensors if ".ffn_down." in n)
    start, end = header.tensor_range(name)
    data = bytearray(other_tiny.model.path.read_bytes())
    data[(start + end) // 2] ^= 0x10
    corrupt = tmp_path / "draft-corrupt.knot"
    corrupt.write_bytes(bytes(data))
    c = await build_cluster(tiny_knot, tmp_path, 1, 2, draft_knot=corrupt)
    r = await c.coordinator.env.DRAFTER.fetch(Request("GET", "/stats"))
    assert r.status == 503 and f"tensor {name}: crc32" in r.json()["message"], r.body
    # The coordinator boots without it (it used to refuse to boot, taking the cluster down with the
    # drafter): auto goes without the draft model, and a request for it goes without drafts.
    off = await c.generate(prompt=CODE, max_tokens=8, speculation="off")
    assert off.status == 200, off.body
    for source in ("draft_model", "prompt_lookup"):  # auto tries it, then leaves it out for DRAFTER_TIMEOUT_S
        auto = (await c.generate(prompt=CODE, max_tokens=8)).json()
        assert auto["tokens"] == off.json()["tokens"] and auto["timings"]["speculation"]["source"] == source
    r = await c.generate(prompt=CODE, max_tokens=8, speculation="draft_model")
    assert r.status == 200, r.body
    s = r.json()["timings"]["speculation"]
    assert r.json()["tokens"] == off.json()["tokens"] and s["drafted"] == 0, s
    assert "/stats" in s["drafter_error"] and "crc32" in s["drafter_error"], s
    await c.drain()


async def test_a_drafter_down_at_the_coordinators_boot_is_checked_again_and_then_drafts(tiny_knot, other_tiny,
                                                                                       tmp_path):
    """The drafter only speeds generations up: one that is down when the coordinator boots leaves it
    serving without drafts, and the first generation that drafts once it answers checks it (its
    vocabulary, its limit) and drafts. Before the check nothing but /stats is sent to it."""
    from common.runtime import ServiceUnavailable

    c = await build_cluster(tiny_knot, tmp_path, 2, 3, draft_knot=other_tiny.model.path)
    binding = c.coordinator.env.DRAFTER
    real_fetch, down, paths = binding.fetch, True, []

    async def fetch(request):
        paths.append(request.path)
        if down:
            raise ServiceUnavailable(f"GET {request.path}: connection refused")
        return await real_fetch(request)

    binding.fetch = fetch
    off = (await c.generate(prompt=CODE, max_tokens=16, speculation="off")).json()
    assert paths == ["/stats"]  # the boot asked, and went on
    r = (await c.generate(prompt=CODE, max_tokens=16, speculation="draft_model")).json()
    assert r["tokens"] == off["tokens"] and "/stats" in r["timings"]["speculation"]["drafter_error"]
    await c.drain()
    assert set(paths) == {"/stats"}
    down = False
    r = (await c.generate(prompt=CODE, max_tokens=16, speculation="draft_model")).json()
    s = r["timings"]["speculation"]
    assert r["tokens"] == off["tokens"] and s["drafted"] > 0 and s["drafter_error"] is None, s
    assert c.coordinator.env.DRAFTER is binding and "/draft" in paths
    await c.drain()


async def test_a_hung_drafter_holds_the_coordinators_boot_no_longer_than_peer_wait_s(tiny_knot, other_tiny, tmp_path):
    import asyncio
    import time

    c = await build_cluster(tiny_knot, tmp_path, 1, 2, draft_knot=other_tiny.model.path,
                            coordinator_vars={"PEER_WAIT_S": "0.3", "DRAFTER_TIMEOUT_S": "30"})

    async def hang(request):
        await asyncio.sleep(3600)

    c.coordinator.env.DRAFTER.fetch = hang
    t0 = time.monotonic()
    r = await c.generate(prompt=CODE, max_tokens=4, speculation="off")
    assert r.status == 200, r.body
    assert time.monotonic() - t0 < 20  # the boot waited PEER_WAIT_S for /stats, not DRAFTER_TIMEOUT_S
    await c.drain()


async def test_a_hung_drafter_costs_one_generation_its_timeout_and_auto_leaves_it_out_meanwhile(
        tiny_knot, other_tiny, tmp_path):
    """A drafter that hangs: a generation waits DRAFTER_TIMEOUT_S for it at most, then goes on
    without drafts and the same tokens. For DRAFTER_TIMEOUT_S after that fault, auto picks prompt
    lookup (a hung drafter would otherwise cost every generation its timeout); then the draft model
    again, once the drafter answers."""
    import asyncio
    import time

    timeout_s = 0.5
    c = await build_cluster(tiny_knot, tmp_path, 2, 3, draft_knot=other_tiny.model.path,
                            coordinator_vars={"DRAFTER_TIMEOUT_S": str(timeout_s)})
    binding = c.coordinator.env.DRAFTER
    real_fetch, hung = binding.fetch, True

    async def fetch(request):
        if hung and request.path.endswith("/draft"):
            await asyncio.sleep(30)
        return await real_fetch(request)

    binding.fetch = fetch
    off = (await c.generate(prompt=CODE, max_tokens=16, speculation="off")).json()
    t0 = time.monotonic()
    r = (await c.generate(prompt=CODE, max_tokens=16)).json()  # auto: the draft model
    assert time.monotonic() - t0 < 10 * timeout_s + 5, "waited past the drafter's timeout"
    s = r["timings"]["speculation"]
    assert r["tokens"] == off["tokens"] and s["source"] == "draft_model", s
    assert s["drafted"] == 0 and "/draft: TimeoutError" in s["drafter_error"], s
    r = (await c.generate(prompt=CODE, max_tokens=16)).json()  # within the timeout of the fault
    assert r["timings"]["speculation"]["source"] == "prompt_lookup" and r["tokens"] == off["tokens"], r["timings"]
    hung = False
    await asyncio.sleep(timeout_s)
    r = (await c.generate(prompt=CODE, max_tokens=16)).json()
    s = r["timings"]["speculation"]
    assert s["source"] == "draft_model" and s["drafted"] > 0 and s["drafter_error"] is None, s
    assert r["tokens"] == off["tokens"]
    await c.drain()


async def test_cluster_drafts_only_as_far_as_the_drafters_kv_budget_holds(tiny_knot, other_tiny, tmp_path,
                                                                              monkeypatch):
    """The drafter's MEMORY_BUDGET_BYTES covers its sessions' KV caches, and its /stats says the
    longest sequence they hold. The coordinator drafts with it only up to there (auto picks prompt
    lookup for a longer prompt; an explicit draft_model is a 400), and the tokens are speculation
    off's. A budget with no room for the caches fails the drafter's boot, naming the numbers."""
    import json

    from common.kvcache import PREFILL_CHUNK_TOKENS
    from services.drafter import handler as drafter_handler

    monkeypatch.setattr(drafter_handler, "MIN_CONTEXT_TOKENS", 8)
    cfg = other_tiny.cfg
    work = other_tiny.arch.activation_bytes(PREFILL_CHUNK_TOKENS, cfg.context_length) + 32 * cfg.vocab_size
    budget = lambda n: other_tiny.model.header.payload_nbytes + work + \
        other_tiny.new_kv().nbytes_bound(n, cfg.n_layer)  # noqa: E731  (holds n tokens, not n + 1)
    limit = 12
    ids = other_tiny.tokenizer.encode(CODE)
    assert len(ids) >= limit
    c = await build_cluster(tiny_knot, tmp_path, 2, 3, draft_knot=other_tiny.model.path,
                            drafter_vars={"MEMORY_BUDGET_BYTES": str(budget(limit))})
    stats = (await c.coordinator.env.DRAFTER.fetch(Request("GET", "/stats"))).json()
    assert stats["max_context_tokens"] == limit and stats["kv_bytes"] == 0, stats
    off = (await c.generate(prompt="the", max_tokens=30, speculation="off")).json()
    r = (await c.generate(prompt="the", max_tokens=30, speculation="draft_model")).json()
    assert r["tokens"] == off["tokens"] and r["timings"]["speculation"]["drafted"] > 0
    stats = (await c.coordinator.env.DRAFTER.fetch(Request("GET", "/stats"))).json()
    assert stats["drafts"] > 0 and stats["kv_bytes"] <= stats["kv_budget_bytes"], stats
    r = (await c.generate(prompt=CODE, max_tokens=4)).json()  # auto: the prompt is too long for the drafter
    assert r["timings"]["speculation"]["source"] == "prompt_lookup", r["timings"]
    r = await c.generate(prompt=CODE, max_tokens=4, speculation="draft_model")
    assert r.status == 400 and "MEMORY_BUDGET_BYTES" in r.json()["message"], r.body
    body = {"request_id": "x", "context": ids[:limit] + ids[:limit]}
    r = await c.coordinator.env.DRAFTER.fetch(Request("POST", "/prime", {}, json.dumps(body).encode()))
    assert r.status == 413 and "MEMORY_BUDGET_BYTES" in r.json()["message"], r.body
    await c.drain()
    c = await build_cluster(tiny_knot, tmp_path / "small", 1, 1, draft_knot=other_tiny.model.path,
                            drafter_vars={"MEMORY_BUDGET_BYTES": str(budget(4))})
    r = await c.coordinator.env.DRAFTER.fetch(Request("GET", "/stats"))
    assert r.status == 503 and "MEMORY_BUDGET_BYTES" in r.json()["message"] and "room for 4 tokens" in \
        r.json()["message"], r.body
    await c.drain()


async def test_the_drafter_answers_while_a_prompt_is_read(tiny_knot, other_tiny, tmp_path):
    """The drafter's model runs off its event loop, one call at a time: /stats answers while a
    /prime computes, and a /draft (and a /release) of another request waits for it, then runs."""
    import asyncio
    import json
    import threading

    c = await build_cluster(tiny_knot, tmp_path, 1, 1, draft_knot=other_tiny.model.path)
    drafter = c.coordinator.env.DRAFTER
    assert (await drafter.fetch(Request("GET", "/stats"))).status == 200  # booted
    from services.drafter import handler as drafter_handler

    d = await drafter_handler.drafter_for(drafter.env)
    gate, entered = threading.Event(), threading.Event()
    prefill = d.draft_model.prefill

    def slow_prefill(rid, context):
        entered.set()
        assert gate.wait(10), "the test never opened the gate"
        return prefill(rid, context)

    d.draft_model.prefill = slow_prefill
    ids = other_tiny.tokenizer.encode(CODE)
    post = lambda path, body: drafter.fetch(Request("POST", path, {}, json.dumps(body).encode()))  # noqa: E731
    prime = asyncio.ensure_future(post("/prime", {"request_id": "a", "context": ids}))
    draft = asyncio.ensure_future(post("/draft", {"request_id": "b", "context": ids, "k": 2, "key": 1}))
    release = asyncio.ensure_future(post("/release/b", {}))
    await asyncio.get_running_loop().run_in_executor(None, entered.wait, 10)
    stats = await asyncio.wait_for(drafter.fetch(Request("GET", "/stats")), 5)  # the loop is free
    assert stats.status == 200 and stats.json()["primes"] == 0
    await asyncio.sleep(0.05)
    assert not (prime.done() or draft.done() or release.done()), "the draft waits for the prime's model"
    gate.set()
    r = await asyncio.wait_for(prime, 30)
    assert r.status == 200 and r.json()["fed"] == len(ids)
    assert (await asyncio.wait_for(draft, 30)).status == 200
    assert (await asyncio.wait_for(release, 30)).json()["released"] is True
    await c.drain()


async def test_draft_model_without_a_drafter_is_a_400(tiny_knot, tmp_path):
    c = await build_cluster(tiny_knot, tmp_path, 1, 1)
    r = await c.generate(prompt="the", max_tokens=4, speculation="draft_model")
    assert r.status == 400 and "no draft model" in r.json()["message"]
    r = await c.generate(prompt="the", max_tokens=4, speculation="sideways")
    assert r.status == 400 and "speculation source" in r.json()["message"]
    await c.drain()
