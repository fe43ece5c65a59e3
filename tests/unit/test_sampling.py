from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from common.sampling import Sampler, SamplingParams, apply_logit_bias, apply_penalties, min_p, top_k, top_p

LOGITS = np.array([1.0, 3.0, -2.0, 2.5, 0.0, 3.0], np.float32)


def test_greedy_is_argmax_lowest_id_on_ties():
    assert Sampler(SamplingParams())(LOGITS) == 1
    assert Sampler(SamplingParams(temperature=0.0, top_k=1, seed=3))(LOGITS) == 1


def test_penalties_like_llamacpp():
    p = SamplingParams(repetition_penalty=2.0, presence_penalty=0.5, frequency_penalty=0.25)
    out = apply_penalties(LOGITS, [1, 1, 2, 4], p)
    # positive logits are divided, the others multiplied; then count * freq + presence
    assert out[1] == pytest.approx(3.0 / 2 - 2 * 0.25 - 0.5)
    assert out[2] == pytest.approx(-2.0 * 2 - 0.25 - 0.5)
    assert out[4] == pytest.approx(0.0 - 0.25 - 0.5)
    np.testing.assert_array_equal(np.delete(out, [1, 2, 4]), np.delete(LOGITS, [1, 2, 4]))
    # Greedy sees the penalties: token 5 now wins over the penalised token 1.
    assert Sampler(p)(LOGITS, history=[1]) == 5
    # The window is the last penalty_last_n tokens.
    far = SamplingParams(repetition_penalty=2.0, penalty_last_n=1)
    assert apply_penalties(LOGITS, [1, 4], far)[1] == LOGITS[1]


def test_logit_bias_is_added_before_the_penalties():
    p = SamplingParams(logit_bias=((1, -2.5), (5, 1.0)))
    out = apply_logit_bias(LOGITS, p)
    np.testing.assert_array_equal(out, LOGITS + np.where(np.arange(LOGITS.size) == 1, -2.5, 0)
                                  + np.where(np.arange(LOGITS.size) == 5, 1.0, 0).astype(np.float32))
    assert apply_logit_bias(LOGITS, SamplingParams()) is LOGITS and out is not LOGITS
    # llama.cpp's order: the bias, then the penalties see the biased logit (3 - 2.5 = 0.5, then / 2)
    both = SamplingParams(logit_bias=((1, -2.5),), repetition_penalty=2.0)
    z = Sampler(both).scores(LOGITS, history=[1])
    assert z[1] == pytest.approx((3.0 - 2.5) / 2)
    # greedy: a ban moves the argmax to the next best; a boost wins
    assert Sampler(SamplingParams(logit_bias=((1, -100.0),)))(LOGITS) == 5
    assert Sampler(SamplingParams(logit_bias=((0, 100.0),)))(LOGITS) == 0
    # sampled: a banned token is never drawn, over many seeds
    banned = SamplingParams(temperature=1.0, logit_bias=((1, -100.0),))
    assert 1 not in {Sampler(SamplingParams(**{**banned.__dict__, "seed": s}))(LOGITS) for s in range(300)}
    for bad in (((2, 1.0), (1, 1.0)), ((1, 1.0), (1, 2.0)), ((-1, 1.0),), ((1, float("nan")),)):
        with pytest.raises(ValueError, match="logit_bias"):
            SamplingParams(logit_bias=bad)


def test_top_k_top_p_min_p_filters():
    assert np.isfinite(top_k(LOGITS, 2)).sum() == 2 and np.isfinite(top_k(LOGITS, 2))[[1, 5]].all()
    x = np.log(np.array([0.5, 0.3, 0.15, 0.05], np.float32))
    assert np.isfinite(top_p(x, 0.5)).tolist() == [True, False, False, False]
    assert np.isfinite(top_p(x, 0.7)).tolist() == [True, True, False, False]
    assert np.isfinite(top_p(x, 0.95)).tolist() == [True, True, True, False]
    assert np.isfinite(min_p(x, 0.2)).tolist() == [True, True, True, False]  # 0.05 < 0.2 * 0.5
    assert np.isfinite(min_p(x, 0.7)).tolist() == [True, False, False, False]


def test_same_seed_same_tokens_and_seeds_differ():
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(50, 1000)).astype(np.float32)
    p = SamplingParams(temperature=1.0, top_p=0.95, seed=1234)
    s1, s2 = Sampler(p), Sampler(p)
    assert [s1(l) for l in logits] == [s2(l) for l in logits]
    s3 = Sampler(SamplingParams(temperature=1.0, top_p=0.95, seed=99))
    s4 = Sampler(p)
    assert [s3(l) for l in logits] != [s4(l) for l in logits]


@settings(max_examples=30, deadline=None)
@given(st.integers(0, 2 ** 32 - 1), st.integers(1, 5), st.floats(0.05, 1.0), st.floats(0.0, 0.5))
def test_sample_is_always_a_kept_token(seed, k, p_top, p_min):
    p = SamplingParams(temperature=0.8, top_k=k, top_p=p_top, min_p=p_min, seed=seed)
    tok = Sampler(p)(LOGITS)
    kept = np.isfinite(min_p(top_p(top_k(LOGITS, k), p_top), p_min))
    assert kept[tok]


def test_temperature_sampling_follows_softmax():
    logits = np.log(np.array([0.6, 0.3, 0.1], np.float32))
    s = Sampler(SamplingParams(temperature=1.0, seed=7))
    counts = np.bincount([s(logits, position=i) for i in range(3000)], minlength=3) / 3000
    np.testing.assert_allclose(counts, [0.6, 0.3, 0.1], atol=0.04)
    cold = Sampler(SamplingParams(temperature=0.05, seed=7))
    assert {cold(logits, position=i) for i in range(50)} == {0}
    # The noise is keyed by the position: the same position draws the same token, in any order.
    assert [s(logits, position=i) for i in (5, 9, 5)] == [s(logits, position=5), s(logits, position=9),
                                                           s(logits, position=5)]


def test_invalid_params_raise():
    with pytest.raises(ValueError):
        SamplingParams(temperature=-1)
    with pytest.raises(ValueError):
        SamplingParams(top_p=0.0)
