"""Prompt prefixes as chains of block keys: what lets a request reuse the KV caches an earlier
prompt left on the stations (docs/runtime.md, "Prompt caching").

A prompt is cut into blocks of PREFIX_BLOCK_TOKENS tokens from position 0; keys[j] names the
tokens [0, j * B) and nothing else: it hashes keys[j - 1] with block j's token ids, so two prompts
share keys[j] exactly when their first j blocks are equal. A station keeps a block's KV under its
key (services/station/prefix_store.py); the coordinator remembers which keys it has had stored
(PrefixIndex) and starts a prompt's prefill after the longest run of them.

Why the blocks are the prefill chunks: a prompt is prefilled in chunks cut from position 0
(common.kvcache.prefill_chunks), so a prefill resumed after j blocks runs the very chunks a cold
one runs from there, on KV caches whose bits are those the cold one computed: the tokens equal a
cold run's, exactly.
"""
from __future__ import annotations

import hashlib
from collections import OrderedDict
from typing import Sequence

import numpy as np

from common.kvcache import PREFILL_CHUNK_TOKENS

PREFIX_BLOCK_TOKENS = PREFILL_CHUNK_TOKENS
KEY_BYTES = 16
ROOT = bytes(KEY_BYTES)  # keys[0]: the empty prefix


def block_keys(ids: Sequence[int], block: int = PREFIX_BLOCK_TOKENS) -> list[bytes]:
    """ids -> keys[0 .. len(ids) // block]: keys[j] names ids[:j * block]; keys[0] is ROOT."""
    arr = np.asarray(ids, dtype="<i4")  # (n,) the ids as they are hashed
    keys = [ROOT]
    for j in range(len(arr) // block):
        h = hashlib.sha256(keys[-1])
        h.update(arr[j * block:(j + 1) * block].tobytes())
        keys.append(h.digest()[:KEY_BYTES])
    return keys


def reusable_blocks(n_tokens: int, block: int = PREFIX_BLOCK_TOKENS) -> int:
    """The most whole blocks a prompt of n_tokens may take from a cache: at least its last token is
    computed, since its row gives the first token's logits."""
    return max(n_tokens - 1, 0) // block


class PrefixIndex:
    """The block keys a coordinator has had stored on the stations, least recently used first.

    A hint, never the truth: a station may have evicted a block since (or restarted), and then it
    answers UnknownSession and the prompt runs cold (ClusterEngine.prompt_logits)."""

    def __init__(self, max_keys: int):
        self.max_keys = max_keys
        self._keys: OrderedDict[bytes, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._keys)

    def longest(self, keys: Sequence[bytes], n_tokens: int) -> int:
        """How many leading blocks of a prompt (keys from block_keys, n_tokens long) to take from the
        stations' caches: the last j <= reusable_blocks(n_tokens) whose key is known (keys[j] names
        the whole prefix, so its earlier blocks need no look-up)."""
        for j in range(min(reusable_blocks(n_tokens), len(keys) - 1), 0, -1):
            if keys[j] in self._keys:
                return j
        return 0

    def add(self, keys: Sequence[bytes]) -> None:
        """Keys stored by a prefill that ran (ROOT is never stored), newest last."""
        for k in keys:
            if k == ROOT:
                continue
            self._keys[k] = None
            self._keys.move_to_end(k)
        while len(self._keys) > self.max_keys:
            self._keys.popitem(last=False)

    def forget(self, keys: Sequence[bytes]) -> None:
        for k in keys:
            self._keys.pop(k, None)
