"""benchmarks/draft_replay.py's replay: the stop rules and the trip cost model, on made-up chains."""
from __future__ import annotations

from benchmarks.draft_replay import kept, replay


def test_each_stops_at_a_doubted_draft_and_product_at_a_doubted_chain():
    probs = [0.9, 0.6, 0.9, 0.3]
    assert kept(probs, "each", 0.5) == 3       # 0.3 alone is doubted
    assert kept(probs, "product", 0.5) == 2    # 0.9 * 0.6 * 0.9 = 0.486 is
    assert kept(probs, "each", 0.0) == 4 and kept([0.1], "product", 0.9) == 1, "the first draft is always kept"


def test_a_trip_gives_the_accepted_drafts_and_one_token_and_costs_its_rows_and_forwards():
    target = [1, 2, 3, 4]
    chains = [[(1, .9), (2, .9), (9, .9)], [], [], [(4, .9), (5, .9), (6, .1)]]
    # first trip: 3 drafts, 2 accepted, then the target's 3; second: drafts 4 and 5, which stop at
    # the doubted 6 (its forward was made), 4 accepted and the sequence ends
    ms, drafted, accepted, trips = replay([7], target, chains, "each", 0.5, (10.0, 1.0, 2.0), max_draft=3)
    assert (drafted, accepted, trips) == (5, 3, 2)
    assert ms == (10 + 3 * 1 + 3 * 2) + (10 + 2 * 1 + 3 * 2)


def test_copying_drafts_the_context_where_the_first_draft_agrees_at_one_forward():
    prompt = [5, 6, 7, 1, 2, 3, 9]
    # the context ends 5 6 7 again (target[:3]): 1 2 3 followed it; the model's first draft is 1
    target = [5, 6, 7, 1, 2, 3, 4]
    chains = [[(5, .9), (6, .9)], [(6, .9), (7, .9)], [(7, .9), (0, .9)], [(1, .9), (0, .9)], [], [], [], []]
    cost = (10.0, 1.0, 2.0)
    # without copying: trips at 0 (5, 6 accepted, then 7), at 3 (1 accepted, 0 rejected: 2), and
    # at 5 and 6 with no drafts
    assert replay(prompt, target, chains, "each", 0.0, cost, 3) == (16 + 16 + 10 + 10, 4, 3, 4)
    # copying at 3: 1 2 3 drafted at one forward, all accepted, then the bonus 4
    assert replay(prompt, target, chains, "each", 0.0, cost, 3, copy=True) == (16 + (10 + 3 * 1 + 1 * 2), 5, 5, 2)
    chains[3][0] = (0, .9)  # the model's first draft disagrees with the context: no copy
    assert replay(prompt, target, chains, "each", 0.0, cost, 3, copy=True)[1:] == (4, 2, 5)
