"""A station's prompt cache: the KV of recent prompts' blocks, kept under their keys (common/prefix.py).

A block is PREFIX_BLOCK_TOKENS positions of every layer the station runs, copied out of a session's
KVCache once a prefill frame that holds that block has run; its key names the tokens [0, end)
and its parent's key the tokens [0, start), so blocks form a tree of prefixes that several prompts
share. A prefill frame at position P > 0 whose session is missing starts a new session from the
chain that ends at its PREFIX key, if every block of it is still here (restore).

Bytes are counted in the station's KV bytes (the budget's), the store never holds more than its
capacity, and it is the first thing evicted when a forward or a session needs room, least recently
used first. A restore touches its chain from the last block to the first, and a new block touches
the chain it hangs from, so a parent is never older than its children and eviction takes leaves
before the blocks they hang from (a long prompt's first blocks outlive its last ones). A new block
that would fit only by evicting its own prefix is refused, so a prompt longer than the cache keeps
its first blocks rather than none.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import numpy as np

from common.kvcache import KVCache
from common.prefix import PREFIX_BLOCK_TOKENS


def block_bytes(kv: KVCache, n_layers: int, block_tokens: int = PREFIX_BLOCK_TOKENS) -> int:
    """What one block of n_layers layers of kv's shape and dtype holds: its keys and values."""
    return 2 * block_tokens * kv.n_kv_head * kv.head_dim * kv.dtype.itemsize * n_layers


@dataclass(frozen=True)
class Block:
    parent: bytes | None  # the key of the block before it; None for the first block
    start: int
    end: int
    k: dict[int, np.ndarray]  # layer -> (end - start, n_kv, hd), the storage dtype
    v: dict[int, np.ndarray]

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.k.values()) + sum(a.nbytes for a in self.v.values())


class PrefixStore:
    def __init__(self, capacity_bytes: int, block_tokens: int = PREFIX_BLOCK_TOKENS):
        self.capacity_bytes, self.block_tokens = capacity_bytes, block_tokens
        self.blocks: OrderedDict[bytes, Block] = OrderedDict()  # least recently used first
        self.nbytes = 0
        self.hits = self.misses = self.evictions = self.stored = self.refused = 0
        self.reused_tokens = 0  # positions restored into sessions instead of computed

    def __len__(self) -> int:
        return len(self.blocks)

    def block_bytes(self, kv: KVCache, n_layers: int) -> int:
        """What one block of n_layers layers holds."""
        return block_bytes(kv, n_layers, self.block_tokens)

    def chain(self, key: bytes, end: int) -> list[Block] | None:
        """The blocks of the prefix key names, first to last, if all are here and tile [0, end); None
        otherwise. Touches them, the last first."""
        found: list[tuple[bytes, Block]] = []
        k: bytes | None = key
        while k is not None:  # each block ends where the one after it starts: the walk goes down to 0
            b = self.blocks.get(k)
            if b is None or b.end != (found[-1][1].start if found else end) or b.start >= b.end:
                return None
            found.append((k, b))
            k = b.parent
        if not found or found[-1][1].start != 0:
            return None
        for k, _ in found:  # the first block ends up the most recently used: parents outlive children
            self.blocks.move_to_end(k)
        return [b for _, b in reversed(found)]

    def held(self, keys: list[bytes]) -> int:
        """The most leading blocks of a prompt (keys[j] names its first j blocks; keys[0] the empty
        prefix) this store can restore: the largest j whose chain is here whole, else 0."""
        for j in range(len(keys) - 1, 0, -1):
            if self.chain(keys[j], j * self.block_tokens) is not None:
                return j
        return 0

    def restore(self, key: bytes, end: int, kv: KVCache, layers: range) -> bool:
        """Fill the empty kv with the prefix key names, [0, end) in every layer; whether it was here."""
        blocks = self.chain(key, end)
        if blocks is None or any(layer not in b.k for b in blocks for layer in layers):
            self.misses += 1
            return False
        positions = np.arange(0, end, dtype=np.int64)
        for layer in layers:
            kv.append(layer, np.concatenate([b.k[layer] for b in blocks]), np.concatenate([b.v[layer] for b in blocks]),
                      positions)
        self.hits += 1
        self.reused_tokens += end
        return True

    def put(self, key: bytes, parent: bytes | None, start: int, kv: KVCache, layers: range, room: int) -> bool:
        """Keep positions [start, start + block) of kv's layers under key (parent: the key of the
        prefix before it), evicting the least recently used blocks while it would not fit the
        capacity, nor `room` (the bytes the station can spare now beside this store). Whether it is kept."""
        end = start + self.block_tokens
        if key in self.blocks:
            self.blocks.move_to_end(key)
            return True
        need = self.block_bytes(kv, len(layers))
        limit = min(self.capacity_bytes, self.nbytes + room)  # evicting a block frees what it held
        orphan = parent is not None and ((p := self.blocks.get(parent)) is None or p.end != start)
        if need > limit or orphan or any(kv.n_tokens(layer) < end for layer in layers):
            self.refused += 1  # an orphan could never be restored: its prefix is gone
            return False
        ancestors = self._touch_chain(parent, start)  # the most recently used now: evicted last
        while self.nbytes + need > limit:
            if len(self.blocks) <= len(ancestors):
                # only its own prefix is left to evict: keep the prefix (a prompt keeps its head
                # when the cache cannot hold it whole), not a block that could never be restored
                self.refused += 1
                return False
            self.evict_one()
        k, v = {}, {}
        for layer in layers:
            ks, vs, pos = kv.layer(layer)
            if not np.array_equal(pos[start:end], np.arange(start, end)):  # never a block out of place
                self.refused += 1
                return False
            k[layer], v[layer] = ks[start:end].copy(), vs[start:end].copy()
        block = Block(parent, start, end, k, v)
        self.blocks[key] = block
        self.nbytes += block.nbytes
        self.stored += 1
        for ancestor in ancestors:  # more recent than this leaf again, the first block last
            self.blocks.move_to_end(ancestor)
        return True

    def _touch_chain(self, parent: bytes | None, at: int) -> list[bytes]:
        """Make the chain of blocks that ends at `at` under key `parent` the most recently used, the
        first block last (so parents outlive children); -> their keys, parent first."""
        keys: list[bytes] = []
        while parent is not None and (b := self.blocks.get(parent)) is not None and b.end == at:
            self.blocks.move_to_end(parent)
            keys.append(parent)
            at, parent = b.start, b.parent  # strictly down (b.start < b.end): the walk ends
        return keys

    def evict_one(self) -> bool:
        """Drop the least recently used block; whether there was one."""
        if not self.blocks:
            return False
        _, b = self.blocks.popitem(last=False)
        self.nbytes -= b.nbytes
        self.evictions += 1
        return True

    def stats(self) -> dict:
        return {"capacity_bytes": self.capacity_bytes, "bytes": self.nbytes, "blocks": len(self.blocks),
                "block_tokens": self.block_tokens, "hits": self.hits, "misses": self.misses,
                "evictions": self.evictions, "stored": self.stored, "refused": self.refused,
                "reused_tokens": self.reused_tokens}
