"""Byte-level BPE in pure Python: the same ids as Hugging Face `tokenizers` for a GPT-2-style
tokenizer (Qwen2's), for hosts where that Rust extension does not exist (Pyodide, Workers).

common/tokenizer.py builds this only when `tokenizers` does not import; tests hold the two equal
(tests/unit/test_bpe.py, and on the real Qwen2 vocabulary tests/realmodel/test_bpe_qwen2.py).

The pipeline, as tokenizers runs it for the tokenizer common/tokenizer.py builds:
  1. split out added tokens: leftmost-longest match of their literal text (AddedVocabulary);
  2. split the rest with the pre-tokenizer regex, keeping the gaps (Split, behavior "isolated");
  3. map each piece's UTF-8 bytes to GPT-2's printable alphabet (ByteLevel, use_regex=False);
  4. merge the lowest-ranked adjacent pair, every occurrence left to right, until none is left
     (models.BPE; the same result as its priority queue: one rank is one pair, and merging
     never recreates the pair it merged).
"""
from __future__ import annotations

import re
import unicodedata
from functools import lru_cache
from typing import Iterable, Iterator, Mapping, Sequence

# ref: llama-vocab.cpp LLAMA_VOCAB_PRE_TYPE_QWEN2, written with Oniguruma's \p{L} \p{N} \s.
# Python's `re` has no \p{..}, and its \s also matches U+001C..U+001F, which are not Unicode
# White_Space (what Oniguruma's \s is); so the three classes are spelled out below as {L}, {N}, {S}.
QWEN2_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n{L}{N}]?[{L}]+|[{N}]"
    r"| ?[^{S}{L}{N}]+[\r\n]*|[{S}]*[\r\n]+|[{S}]+(?![^{S}])|[{S}]+"
)

# Unicode White_Space (PropList.txt): what Oniguruma's \s matches in Unicode mode.
WHITE_SPACE = "\t\n\v\f\r \x85\xa0\u1680\u2000-\u200a\u2028\u2029\u202f\u205f\u3000"

# Planes 4..13 hold no assigned code point in any Unicode version so far; skipping them makes the
# scan below four times shorter. Plane 14 holds tags and variation selectors (not L or N).
_SCAN_RANGES = ((0, 0x40000), (0xE0000, 0xE1000))


def _class_ranges(first_letter: str) -> str:
    """A regex class body of every code point whose general category starts with first_letter."""
    out, start, prev = [], None, None
    for lo, hi in _SCAN_RANGES:
        for cp in range(lo, hi):
            if unicodedata.category(chr(cp))[0] == first_letter:
                if start is None:
                    start = cp
                elif cp != prev + 1:
                    out.append((start, prev))
                    start = cp
                prev = cp
    if start is not None:
        out.append((start, prev))
    return "".join(re.escape(chr(a)) if a == b else f"{re.escape(chr(a))}-{re.escape(chr(b))}" for a, b in out)


@lru_cache(maxsize=None)
def compile_pretokenizer(pattern: str) -> re.Pattern:
    """The pattern with {L}, {N}, {S} filled in (Unicode letters, numbers, White_Space)."""
    return re.compile(pattern.replace("{L}", _class_ranges("L")).replace("{N}", _class_ranges("N"))
                      .replace("{S}", WHITE_SPACE))


def split_isolated(regex: re.Pattern, text: str) -> Iterator[str]:
    """Every match, and every gap between matches, in order (tokenizers' Split "isolated")."""
    at = 0
    for m in regex.finditer(text):
        if m.start() > at:
            yield text[at:m.start()]
        if m.end() > m.start():
            yield m.group()
        at = m.end()
    if at < len(text):
        yield text[at:]


class BPEError(ValueError):
    pass


class BytePairEncoder:
    """vocab (token text -> id), merges [(a, b)] by rank, added tokens (text -> id, matched first)."""

    def __init__(self, vocab: Mapping[str, int], merges: Sequence[tuple[str, str]], pattern: str,
                 byte_to_char: Mapping[int, str], added: Mapping[str, int] | None = None):
        self.vocab = dict(vocab)
        self.byte_to_char = [byte_to_char[b] for b in range(256)]
        missing = [b for b, c in enumerate(self.byte_to_char) if c not in self.vocab]
        if missing:
            raise BPEError(f"byte-level vocabulary lacks the tokens of bytes {missing[:8]}: "
                           f"such text could not be encoded")
        self.ranks: dict[tuple[str, str], int] = {}
        for rank, (a, b) in enumerate(merges):
            if a + b not in self.vocab:
                raise BPEError(f"merge {a!r} {b!r} (rank {rank}) makes {a + b!r}, which is not in the vocabulary")
            self.ranks[(a, b)] = rank  # a repeated merge takes its last rank, as tokenizers' merge map does
        self.pretokenizer = compile_pretokenizer(pattern)
        self.added = dict(added or {})
        self._added_re: dict[frozenset, re.Pattern | None] = {}
        self._cache: dict[str, tuple[int, ...]] = {}

    def _added_regex(self, texts: frozenset) -> re.Pattern | None:
        if texts not in self._added_re:
            # Longest first: at one start, Python's alternation takes the first that matches, so this
            # is leftmost-longest, as tokenizers' Aho-Corasick (MatchKind::LeftmostLongest).
            alts = sorted(texts, key=lambda t: (-len(t), t))
            self._added_re[texts] = re.compile("|".join(map(re.escape, alts))) if alts else None
        return self._added_re[texts]

    def encode(self, text: str, added: Iterable[str] | None = None) -> list[int]:
        """text -> ids. `added`: the added-token texts to split out (default: all of them)."""
        texts = frozenset(self.added if added is None else added)
        regex = self._added_regex(texts)
        ids: list[int] = []
        at = 0
        if regex is not None:
            for m in regex.finditer(text):
                self._encode_plain(text[at:m.start()], ids)
                ids.append(self.added[m.group()])
                at = m.end()
        self._encode_plain(text[at:], ids)
        return ids

    def _encode_plain(self, text: str, ids: list[int]) -> None:
        for piece in split_isolated(self.pretokenizer, text):
            word = "".join(self.byte_to_char[b] for b in piece.encode("utf-8"))
            got = self._cache.get(word)
            if got is None:
                got = self._cache[word] = tuple(self.vocab[p] for p in self._merge(word))
            ids.extend(got)

    def _merge(self, word: str) -> list[str]:
        parts = list(word)
        ranks = self.ranks
        while len(parts) > 1:
            best, best_rank = -1, None
            for i in range(len(parts) - 1):
                r = ranks.get((parts[i], parts[i + 1]))
                if r is not None and (best_rank is None or r < best_rank):
                    best, best_rank = i, r
            if best_rank is None:
                break
            a, b = parts[best], parts[best + 1]
            merged, i = parts[:best], best
            while i < len(parts):
                if i + 1 < len(parts) and parts[i] == a and parts[i + 1] == b:
                    merged.append(a + b)
                    i += 2
                else:
                    merged.append(parts[i])
                    i += 1
            parts = merged
        return parts
