"""Prompt prefixes as chains of block keys: what lets a request reuse the KV caches an earlier
prompt left on the stations (docs/runtime.md, "Prompt caching").

A prompt is cut into blocks of PREFIX_BLOCK_TOKENS tokens from position 0; keys[j] names the
tokens [0, j * B) and nothing else: it hashes keys[j - 1] with block j's token ids, so two prompts
share keys[j] exactly when their first j blocks are equal. A station keeps a block's KV under its
key (services/station/prefix_store.py); the coordinator asks the stations how many leading blocks of
a prompt they all hold (POST /prefix) and starts its prefill after them (resume_at).

Why a resumed prompt gives a cold one's tokens: a prompt is prefilled in chunks cut from position 0
(common.kvcache.prefill_chunks); a prefill resumed at a block inside a chunk runs that chunk's last
rows, then the very chunks a cold one runs, on KV caches whose bits are those the cold one computed
(blocks an earlier prompt left, in a chunk that may have ended elsewhere). Each row's bits depend on
its own keys alone (common.ops.Ops.attention: a prompt chunk's tiles and sums do not depend on its
rows or its end; the matmuls, norms and RoPE are row-exact), unless one side's rows are few enough to
run row by row (ops.row_by_row), which resume_at avoids. Why blocks smaller than a chunk: a re-sent
prompt recomputes about half a block of what it shares with the cached one (benchmarks/prompt_cache.py).
"""
from __future__ import annotations

import hashlib
from typing import Sequence

import numpy as np

from common.kvcache import PREFILL_CHUNK_TOKENS
from common.ops import row_by_row
from common.wire import PREFIX_KEY_BYTES

PREFIX_BLOCK_TOKENS = 64
assert PREFILL_CHUNK_TOKENS % PREFIX_BLOCK_TOKENS == 0, "a chunk holds whole blocks"
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


def resume_at(n_tokens: int, held: int, block: int = PREFIX_BLOCK_TOKENS,
              chunk: int = PREFILL_CHUNK_TOKENS) -> int:
    """The most leading blocks (at most held) after which a prompt of n_tokens may resume with the
    cold prefill's bits: the resumed first chunk [j * block, end) and the cold chunk that ends at
    `end` run attention the same way (both row by row, or neither; ops.row_by_row)."""
    for j in range(min(held, reusable_blocks(n_tokens, block)), 0, -1):
        a = j * block
        end = min((a // chunk + 1) * chunk, n_tokens)  # the cold chunk holding a ends here
        if a % chunk == 0 or row_by_row(end - a, end) == row_by_row(end - a // chunk * chunk, end):
            return j
    return 0
