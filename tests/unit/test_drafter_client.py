"""The coordinator's client of the drafter treats its replies as untrusted: a draft id outside the
vocabulary, or scores that are not a distribution over it, is a BadGateway that names the problem.

Why: the target verifies every draft, but not every draft's id. Under the sampled accept/reject
rule a negative id indexes numpy from the end (p[-5] is the probability of the vocabulary's
fifth-last token), so a drafted -5 could be accepted and served as a token; a NaN in the scores
turns the residual distribution into NaN; a draft its own scores give no probability (q(d) = 0)
passes the accept rule u * q(d) < p(d) whenever the target allows it at all."""
from __future__ import annotations

import numpy as np
import pytest

from common import wire
from common.runtime import BadGateway, Request, Response
from common.sampling import SamplingParams
from services.drafter.drafter_client import DrafterClient

VOCAB = 50
GREEDY, SAMPLED = SamplingParams(), SamplingParams(temperature=0.8, seed=1)


class Drafter:
    """A binding that answers /draft with the given ids (and scores)."""

    def __init__(self, ids, scores=None):
        self.envs = [wire.Envelope("r", "draft", 3, 3 + len(ids), np.asarray(ids, np.int32))]
        if scores is not None:
            self.envs.append(wire.Envelope("r", "draft", 3, 3 + len(ids), np.asarray(scores, np.float32)))

    async def fetch(self, request: Request) -> Response:
        return Response(200, {"Content-Type": wire.ENVELOPE_CONTENT_TYPE}, wire.encode_envelopes(self.envs))


def client(binding) -> DrafterClient:
    return DrafterClient(binding, 5.0, vocab_size=VOCAB)


async def test_good_drafts_pass():
    ids, scores = await client(Drafter([4, VOCAB - 1])).draft("r", [1, 2, 3], 2, GREEDY, 7)
    assert ids == [4, VOCAB - 1] and scores is None
    z = np.zeros((2, VOCAB), np.float32)
    z[:, 10:] = -np.inf  # filtered out by top-k or top-p: a -inf score is a zero probability
    ids, scores = await client(Drafter([4, 9], z)).draft("r", [1, 2, 3], 2, SAMPLED, 7)
    assert ids == [4, 9] and scores.shape == (2, VOCAB)


@pytest.mark.parametrize("ids", [[-5], [3, VOCAB], [2**31 - 1]])
@pytest.mark.parametrize("sampling", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
async def test_a_draft_id_outside_the_vocabulary_is_refused(ids, sampling):
    scores = None if sampling is GREEDY else np.zeros((len(ids), VOCAB))
    with pytest.raises(BadGateway, match=rf"ids outside the vocabulary \[0, {VOCAB}\)"):
        await client(Drafter(ids, scores)).draft("r", [1, 2, 3], 2, sampling, 7)


@pytest.mark.parametrize("bad, needle", [
    (lambda z: z.__setitem__((0, 3), np.nan), "NaN or \\+inf"),
    (lambda z: z.__setitem__((1, 0), np.inf), "NaN or \\+inf"),
    (lambda z: z.__setitem__(1, -np.inf), "no finite score"),
    (lambda z: z.__setitem__((1, 2), -np.inf), "no probability under the scores"),  # id 2 drafted at row 1
])
async def test_scores_that_are_not_a_distribution_are_refused(bad, needle):
    z = np.zeros((2, VOCAB), np.float32)
    bad(z)
    with pytest.raises(BadGateway, match=needle):
        await client(Drafter([1, 2], z)).draft("r", [1, 2, 3], 2, SAMPLED, 7)


async def test_scores_over_another_vocabulary_are_refused():
    with pytest.raises(BadGateway, match=f"expected \\(2, {VOCAB}\\)"):
        await client(Drafter([1, 2], np.zeros((2, VOCAB - 1)))).draft("r", [1, 2, 3], 2, SAMPLED, 7)
