"""Topology as data: default splits and the tiling checks, by exact equality."""
from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from common.topology import (ShardSpec, StationSpec, TopologyError, check_station_chain, check_vocab_tiling,
                             parse_range, split_layers, split_vocab)


def test_default_splits_match_the_seed():
    assert [(s.layer_start, s.layer_end, s.role) for s in split_layers(24)] == [(0, 12, "entry"), (12, 24, "exit")]
    assert [(s.layer_start, s.layer_end) for s in split_layers(28)] == [(0, 14), (14, 28)]
    shards = split_vocab(151_936, 8)
    assert all(s.n_rows == 18_992 for s in shards)
    assert shards[-1].vocab_end == 151_936
    assert [s.role for s in split_layers(24, 3)] == ["entry", "middle", "exit"]
    assert split_layers(5, 1)[0].role == "solo"


@given(st.integers(1, 64), st.data())
def test_splits_always_tile(n_layers, data):
    n_st = data.draw(st.integers(1, n_layers))
    check_station_chain(split_layers(n_layers, n_st), n_layers)
    vocab = data.draw(st.integers(1, 5000))
    n_sh = data.draw(st.integers(1, min(vocab, 64)))
    assert check_vocab_tiling(split_vocab(vocab, n_sh), vocab)[0].vocab_start == 0


def test_tiling_errors_name_the_problem():
    with pytest.raises(TopologyError, match=r"gap: tokens \[10, 12\)"):
        check_vocab_tiling([ShardSpec(0, 0, 10), ShardSpec(1, 12, 20)], 20)
    with pytest.raises(TopologyError, match="overlap: shard 1 starts at 8"):
        check_vocab_tiling([ShardSpec(0, 0, 10), ShardSpec(1, 8, 20)], 20)
    with pytest.raises(TopologyError, match=r"gap: tokens \[20, 25\)"):
        check_vocab_tiling([ShardSpec(0, 0, 20)], 25)
    with pytest.raises(TopologyError, match="beyond the vocabulary"):
        check_vocab_tiling([ShardSpec(0, 0, 30)], 25)
    with pytest.raises(TopologyError, match="no shards"):
        check_vocab_tiling([], 25)
    with pytest.raises(TopologyError, match="station 1 starts at layer 5, expected 4"):
        check_station_chain([StationSpec(0, 0, 4, "entry"), StationSpec(1, 5, 8, "exit")], 8)
    with pytest.raises(TopologyError, match="stations end at layer 6, the model has 8"):
        check_station_chain([StationSpec(0, 0, 6, "solo")], 8)
    with pytest.raises(TopologyError, match="expected START-END"):
        parse_range("12..40")
    assert parse_range("0-18992") == (0, 18992) and parse_range("3:4") == (3, 4)
