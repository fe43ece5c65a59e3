"""Prompt prefixes as chains of block keys: what lets a request reuse the KV caches an earlier
prompt left on the stations (docs/runtime.md, "Prompt caching").

A prompt is cut into blocks of PREFIX_BLOCK_TOKENS tokens from position 0; keys[j] names the
tokens [0, j * B) and nothing else: it hashes keys[j - 1] with block j's token ids, so two prompts
share keys[j] exactly when their first j blocks are equal. A station keeps a block's KV under its
key (services/station/prefix_store.py); the coordinator asks the stations how many leading blocks of
a prompt they all hold (POST /prefix) and starts its prefill after them.

Why the blocks are the prefill chunks: a prompt is prefilled in chunks cut from position 0
(common.kvcache.prefill_chunks), so a prefill resumed after j blocks runs the very chunks a cold
one runs from there, on KV caches whose bits are those the cold one computed: the tokens equal a
cold run's, exactly.
"""
from __future__ import annotations

import hashlib
from typing import Sequence

import numpy as np

from common.kvcache import PREFILL_CHUNK_TOKENS
from common.wire import PREFIX_KEY_BYTES

PREFIX_BLOCK_TOKENS = PREFILL_CHUNK_TOKENS
KEY_BYTES = PREFIX_KEY_BYTES
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
