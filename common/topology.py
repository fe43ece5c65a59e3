"""Cluster topology as data: layer ranges of stations, vocabulary slices of shards (seed section 1).

Pure functions, tested by exact equality.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Sequence

ROLES = ("entry", "middle", "exit", "solo")


class TopologyError(ValueError):
    pass


@dataclass(frozen=True)
class StationSpec:
    index: int
    layer_start: int
    layer_end: int  # exclusive
    role: str  # entry / middle / exit; "solo" when one station holds every layer

    @property
    def n_layers(self) -> int:
        return self.layer_end - self.layer_start


@dataclass(frozen=True)
class ShardSpec:
    index: int
    vocab_start: int
    vocab_end: int  # exclusive

    def owns(self, token: int) -> bool:
        return self.vocab_start <= token < self.vocab_end

    @property
    def n_rows(self) -> int:
        return self.vocab_end - self.vocab_start


def role_of(index: int, n_stations: int) -> str:
    if n_stations == 1:
        return "solo"
    return "entry" if index == 0 else "exit" if index == n_stations - 1 else "middle"


def split_layers(n_layers: int, n_stations: int = 2) -> list[StationSpec]:
    """Contiguous, near-equal layer ranges: 24 layers / 2 -> [0,12) [12,24); 28 / 2 -> [0,14) [14,28)."""
    if not 1 <= n_stations <= n_layers:
        raise TopologyError(f"{n_stations} stations for {n_layers} layers: need 1 <= stations <= layers")
    bounds = [n_layers * i // n_stations for i in range(n_stations + 1)]
    return [StationSpec(i, bounds[i], bounds[i + 1], role_of(i, n_stations)) for i in range(n_stations)]


def split_vocab(vocab_size: int, n_shards: int = 8) -> list[ShardSpec]:
    """Contiguous vocabulary slices: 151,936 / 8 = 18,992 rows each; a remainder goes to the last ones."""
    if not 1 <= n_shards <= vocab_size:
        raise TopologyError(f"{n_shards} shards for a vocabulary of {vocab_size}")
    bounds = [vocab_size * i // n_shards for i in range(n_shards + 1)]
    return [ShardSpec(i, bounds[i], bounds[i + 1]) for i in range(n_shards)]


def check_station_chain(stations: Sequence[StationSpec], n_layers: int) -> None:
    """Stations must chain [0, n_layers) in order, each non-empty."""
    if not stations:
        raise TopologyError("no stations configured: need at least 1")
    at = 0
    for s in stations:
        if s.layer_start != at:
            raise TopologyError(f"station {s.index} starts at layer {s.layer_start}, expected {at} "
                                f"(stations must chain [0, {n_layers}) with no gap or overlap)")
        if s.layer_end <= s.layer_start:
            raise TopologyError(f"station {s.index} has an empty layer range [{s.layer_start}, {s.layer_end})")
        at = s.layer_end
    if at != n_layers:
        raise TopologyError(f"stations end at layer {at}, the model has {n_layers}")


def check_vocab_tiling(shards: Iterable[ShardSpec], vocab_size: int) -> list[ShardSpec]:
    """Shard ranges must tile [0, vocab_size) with no gap and no overlap. Returns them sorted."""
    ordered = sorted(shards, key=lambda s: (s.vocab_start, s.vocab_end))
    if not ordered:
        raise TopologyError("no shards configured: need at least 1")
    at = 0
    for s in ordered:
        if s.vocab_end <= s.vocab_start:
            raise TopologyError(f"shard {s.index} has an empty range [{s.vocab_start}, {s.vocab_end})")
        if s.vocab_start > at:
            raise TopologyError(f"vocabulary gap: tokens [{at}, {s.vocab_start}) belong to no shard")
        if s.vocab_start < at:
            raise TopologyError(f"vocabulary overlap: shard {s.index} starts at {s.vocab_start}, "
                                f"tokens before {at} already belong to another shard")
        at = s.vocab_end
    if at != vocab_size:
        raise TopologyError(f"vocabulary gap: tokens [{at}, {vocab_size}) belong to no shard"
                            if at < vocab_size else
                            f"shards reach token {at}, beyond the vocabulary of {vocab_size}")
    return ordered


def parse_range(text: str, what: str = "range") -> tuple[int, int]:
    """'a-b' or 'a:b' -> (a, b), b exclusive."""
    for sep in ("-", ":"):
        if sep in text:
            a, b = text.split(sep, 1)
            try:
                return int(a), int(b)
            except ValueError:
                break
    raise TopologyError(f"{what} {text!r}: expected START-END with integers, END exclusive")
