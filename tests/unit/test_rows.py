"""The sampler's rows (common/sampling.py Row): the whole logits (LogitsRow) and the shards' summary
(shard_sampling.RowSummary) sample the same token and give the same logprobs, masked or not; a
mask is exact (the masked row is the full logits with -inf outside it) through the shards, the
engines and speculative verification."""
from __future__ import annotations

import time
import uuid

import numpy as np
import pytest

from common.generation import Generation, generate_events
from common.runtime import Context
from common.sampling import LogitsRow, Sampler, SamplingParams, mask_from_bitset
from common.shard_sampling import SliceSummary, decide, merge, row_history, sample_spec, summarize
from common.speculative import Draft, PromptLookup, SpeculationParams, verify
from deploy.engine_local import LocalEngine
from services.coordinator.cluster_engine import ClusterGeneration
from services.coordinator.handler import coordinator_for
from tests.inprocess import build_cluster
from tests.unit.test_shard_sampling import PARAMS  # the last: x / T overflows float32



def _rows(x, p, key, seq, n_shards, top):
    """The shards' summaries of x (T, vocab), merged: what the coordinator's ClusterEngine gets."""
    T, vocab = x.shape
    draw = not p.greedy and not 0 < p.top_k < vocab and p.top_p >= 1.0 and p.min_p <= 0.0
    cuts = np.linspace(0, vocab, n_shards + 1).astype(int)
    position = len(seq) - T
    slices = [SliceSummary(a, b, *summarize(x[:, a:b], a, top, p, key, seq, position, draw, True))
              for a, b in zip(cuts[:-1], cuts[1:])]
    return merge(slices, vocab, position + 1)


def _mask(rng, vocab, kind, x):
    if kind == "random":
        m = rng.random(vocab) < rng.choice([0.02, 0.3, 0.9])
    elif kind == "all but one":
        m = np.zeros(vocab, bool)
    else:  # "top masked": every id but the row's argmax
        m = np.ones(vocab, bool)
        m[int(np.argmax(x))] = False
    if not m.any() or kind == "all but one":
        m[int(rng.integers(vocab))] = True
    return m


@pytest.mark.parametrize("case", range(len(PARAMS)))
@pytest.mark.parametrize("kind", ["random", "all but one", "top masked"])
def test_a_masked_summary_samples_and_scores_as_the_masked_logits(case, kind):
    """Random rows (ties too), masks, slices and candidates: the masked summary's token is the masked
    logits' wherever it decides, masked ids never come, and its logprobs are theirs; it decides
    most rows where its candidates hold what the masked row needs."""
    p = PARAMS[case]
    rng = np.random.default_rng([case, len(kind)])
    decided = total = served = 0
    for trial in range(80):
        vocab, T = int(rng.integers(20, 400)), int(rng.integers(1, 4))
        x = rng.standard_normal((T, vocab)).astype(np.float32) * 3
        if trial % 3 == 0:
            x = np.round(x).astype(np.float32)  # ties
        seq = rng.integers(0, vocab, int(rng.integers(T, 30))).tolist()
        key = int(rng.integers(1 << 62))
        top = int(rng.integers(1, 33)) if trial % 2 else vocab  # every other trial: the shards send all
        rows = _rows(x, p, key, seq, int(rng.integers(1, 9)), top)
        sampler = Sampler(p)
        sampler.key = key
        for j, row in enumerate(rows):
            hist = row_history(seq, T, j)
            allowed = _mask(rng, vocab, kind, x[j])
            full = LogitsRow(x[j]).masked(allowed)
            want = sampler(full, hist)
            assert allowed[want], "a masked id was sampled"
            assert np.array_equal(full.logits[allowed], x[j][allowed]) and (full.logits[~allowed] == -np.inf).all()
            got = row.masked(allowed)
            total += 1
            tid = decide(got, p, key)
            if tid is not None:
                decided += 1
                assert tid == want, (trial, j)
                assert sampler(got, hist) == want
            if got.serves(5) and not p.penalized:  # the shards send penalized logits (sample_spec: no logprobs then)
                served += 1
                a, b = got.logprobs(want, 5), full.logprobs(want, 5)
                assert [i for i, _ in a.top] == [i for i, _ in b.top]
                np.testing.assert_allclose([v for _, v in a.top], [v for _, v in b.top], rtol=0, atol=1e-9)
                assert a.logprob == pytest.approx(b.logprob, abs=1e-9)
            if top == vocab:  # nothing held back: the summary knows the masked row whole
                assert tid is not None and got.serves(5), (trial, j)
    assert decided > total // 2, (decided, total)
    assert p.penalized or served > total // 3, (served, total)


def test_a_masked_row_has_no_probability_outside_the_mask_and_its_logprobs_are_renormalized():
    rng = np.random.default_rng(5)
    x = rng.standard_normal(64).astype(np.float32)
    allowed = rng.random(64) < 0.25
    row = LogitsRow(x).masked(allowed)
    probs = Sampler(SamplingParams(temperature=0.8, top_p=0.95)).probs(row)
    assert (probs[~allowed] == 0).all() and probs[allowed].sum() == pytest.approx(1.0)
    lp = row.logprobs(int(np.flatnonzero(allowed)[0]), 64)
    assert len(lp.top) == allowed.sum() and all(allowed[i] for i, _ in lp.top)
    assert sum(np.exp(v) for _, v in lp.top) == pytest.approx(1.0)
    only = np.zeros(64, bool)
    only[7] = True
    for p in PARAMS:  # one id allowed: it is the token, whatever the chain
        assert Sampler(p)(LogitsRow(x).masked(only), [1, 2, 3]) == 7
    with pytest.raises(ValueError, match="no token is kept"):
        Sampler(SamplingParams())(LogitsRow(x).masked(np.zeros(64, bool)), [1])


def test_a_bitset_mask_is_llguidances_layout():
    words = np.array([0b1001, 1 << 31, 0], np.uint32)
    m = mask_from_bitset(words, 70)
    assert np.flatnonzero(m).tolist() == [0, 3, 63]
    with pytest.raises(ValueError, match="bits"):
        mask_from_bitset(words, 97)


@pytest.mark.parametrize("summary", [False, True])
def test_verification_rejects_a_draft_outside_the_mask(summary):
    """Drafts that are each row's argmax: all accepted unmasked; a mask without the second draft
    rejects it and puts the masked row's token in its place."""
    rng = np.random.default_rng(3)
    vocab, k = 50, 3
    drafts = [11, 22, 33]
    x = rng.standard_normal((k + 1, vocab)).astype(np.float32)
    for j, d in enumerate(drafts + [44]):
        x[j, d] = 9.0
    x[1, 5] = 8.0  # the best allowed once 22 is masked
    context = [1, 2, 3]
    for p in (SamplingParams(), SamplingParams(temperature=0.5, seed=4)):
        sampler = Sampler(p)

        def rows(masks):
            if summary:
                base = _rows(x, p, sampler.key, context + drafts, 2, vocab)
            else:
                base = [LogitsRow(r) for r in x]
            return [r if m is None else r.masked(m) for r, m in zip(base, masks)]

        if p.greedy:
            assert verify(sampler, rows([None] * 4), context, Draft(drafts)) == (drafts + [44], 3)
        no22 = np.ones(vocab, bool)
        no22[22] = False
        got, accepted = verify(sampler, rows([None, no22, None, None]), context, Draft(drafts))
        assert accepted == 1 and got[0] == 11 and got[1] != 22, got
        if p.greedy:
            assert got == [11, 5]
        # a sampled draft model's drafts (q puts all its mass on the draft): rejected too, never taken
        q = np.zeros((k, vocab))
        q[np.arange(k), drafts] = 1.0
        for seed in range(20):
            s = Sampler(SamplingParams(temperature=1.0, seed=seed))
            full = [LogitsRow(r) for r in x]
            full[1] = full[1].masked(no22)
            got, accepted = verify(s, full, context, Draft(drafts, q))
            assert accepted <= 1 and 22 not in got, (seed, got)


def _allowed(vocab: int, eog: set[int], share: float = 0.2):
    """A constraint that changes with the sequence: a share of the ids, chosen by its length, and
    never the end of generation (so the runs are long)."""
    def allowed(seq):
        m = np.random.default_rng(len(seq)).random(vocab) < share
        m[list(eog)] = False
        return m
    return allowed


def test_the_shards_request_under_a_mask():
    """Greedy under a mask asks for sample_top candidates, not 1; all rows masked: no slice
    log-sum-exps (the masked rows' come from their candidates); logprobs or top_p alone under a
    mask wider than the slices' candidates: the full slices at once."""
    vocab, few, wide = 1000, np.zeros(1000, bool), np.ones(1000, bool)
    few[:40] = True

    def spec(masks, logprobs=None, **sampling):
        gen = Generation([1, 2], 4, SamplingParams(**sampling), logprobs=logprobs)
        return sample_spec(gen, [1, 2], len(masks), 64, vocab, 3, masks)

    assert spec([None]).top == 1 and spec([few]).top == 64
    assert spec([None], logprobs=2).lse and not spec([few], logprobs=2).lse and spec([None, few], logprobs=2).lse
    assert spec([wide], logprobs=2) is None and spec([wide], temperature=0.7, top_p=0.9) is None
    assert spec([wide], temperature=0.7, top_k=10, top_p=0.9) is not None, "top_p after top_k needs no denominator"
    assert spec([wide]) is not None and spec([wide], temperature=0.7, min_p=0.1) is not None


async def test_a_constraint_is_exact_through_the_engines_and_speculation(tiny_knot, tmp_path):
    """Generation.allowed through the single process and the cluster (summaries and full slices),
    speculation on and off: every token allowed at its position, and the same tokens everywhere."""
    engine = LocalEngine.open(tiny_knot)
    tok, vocab = engine.tokenizer, engine.cfg.vocab_size
    c = await build_cluster(tiny_knot, tmp_path, 2, 3)
    co = await coordinator_for(c.coordinator.env)
    prompt = tok.encode("def add(a, b):\n    return a + b\n\ndef add(a, b):\n    return")
    allowed = _allowed(vocab, set(tok.eog_ids))
    spec_on = SpeculationParams("prompt_lookup", 4)
    full_slices = 0
    for p in (SamplingParams(), SamplingParams(temperature=0.9, seed=7), SamplingParams(temperature=0.8, top_k=20,
                                                                                         top_p=0.9, seed=3)):
        runs = {}
        for spec in (SpeculationParams(), spec_on):
            gen = Generation(list(prompt), 16, p, allowed=allowed, request_id=uuid.uuid4().hex, speculation=spec)
            drafter = PromptLookup() if spec.on else None
            async for _ in generate_events(engine, gen, tok, time.perf_counter, drafter):
                pass
            runs["local", spec.on] = gen.token_ids
            cg = ClusterGeneration(list(prompt), 16, p, allowed=allowed, request_id=uuid.uuid4().hex,
                                   speculation=spec)
            async for _ in co.events(cg, Context(c.tasks.add)):
                pass
            runs["cluster", spec.on] = cg.token_ids
            full_slices += cg.full_rows
            assert cg.shard_sampled > 0, "the shards' summaries decided some rows"
        want = runs["local", False]
        assert len(want) == 16 and all(allowed(prompt + want[:i])[t] for i, t in enumerate(want)), want
        assert all(v == want for v in runs.values()), (p, runs)
        plain = Generation(list(prompt), 16, p, request_id=uuid.uuid4().hex)
        async for _ in generate_events(engine, plain, tok, time.perf_counter):
            pass
        assert plain.token_ids != want, "the constraint changed what is generated"
    assert full_slices > 0, "some masked summaries sent the cluster to the full slices (a masked best draw)"
    # logprobs under a narrow constraint: the masked logits' own (from a complete masked summary or
    # the full slices; the first is tested above on random rows)
    narrow = _allowed(vocab, set(tok.eog_ids), 40 / vocab)
    gen = Generation(list(prompt), 8, SamplingParams(), logprobs=3, allowed=narrow, request_id=uuid.uuid4().hex)
    want = [ev.logprobs async for ev in generate_events(engine, gen, tok, time.perf_counter)
            if getattr(ev, "logprobs", None)]
    cg = ClusterGeneration(list(prompt), 8, SamplingParams(), logprobs=3, allowed=narrow, request_id=uuid.uuid4().hex)
    got = [ev.logprobs async for ev in co.events(cg, Context(c.tasks.add)) if getattr(ev, "logprobs", None)]
    assert cg.token_ids == gen.token_ids and len(got) == len(want) == 8
    for n, (a, b) in enumerate(zip(got, want)):
        assert [i for i, _ in a.top] == [i for i, _ in b.top] and narrow(prompt + gen.token_ids[:n])[a.top[2][0]]
        np.testing.assert_allclose([v for _, v in a.top] + [a.logprob], [v for _, v in b.top] + [b.logprob], atol=1e-6)
    await c.drain()
