"""The constrained-decoding engine of the CPython hosts: llguidance (common/constraints.py).

Why llguidance: it is llama.cpp's own optional grammar engine and guidance's, builds a token mask
from JSON schemas, regexes and Lark grammars in well under a millisecond a token on a 150k
vocabulary (its slicer precomputes the token trie), supports rollback (drafts that are rejected)
and is kept by Microsoft with wheels on PyPI. It does not build for Pyodide, hence the installed
compiler.

The tokenizer is ours (common/tokenizer.py), handed over as llguidance's TokenizerWrapper: each
id's bytes, control tokens (and user-defined ones written like them, <tool_call>) marked with a
leading 0xff as llguidance's llama.cpp bridge does, so a grammar names them as tokens.
"""
from __future__ import annotations

import importlib.util
import json
import logging
import threading
from typing import Sequence

import numpy as np

from common.constraints import MAX_GRAMMAR_BYTES, Compiled, Constraint, ConstraintError, Grammar, install
from common.sampling import mask_from_bitset
from common.tokenizer import TOKEN_USER_DEFINED

log = logging.getLogger(__name__)

# llguidance's JSON compiler: the separators the models write themselves (", " and ": "), and no
# whitespace it could spin in until max_tokens.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


KEPT_TOKENIZERS = 2  # llguidance tokenizers kept (each holds its vocabulary's token trie)


class _Tokens:
    """Our tokenizer as llguidance's TokenizerWrapper reads it."""

    def __init__(self, tok, vocab_size: int):
        self.eos_token_id, self.bos_token_id = tok.eos_id, tok.bos_id
        self.tokens = [b"" if i >= len(tok.tokens) else  # the model's padding rows
                       b"\xff" + tok.tokens[i].encode() if _marker(tok, i) else tok.token_bytes(i)
                       for i in range(vocab_size)]
        self.special_token_ids = sorted(tok.control_ids)
        self._tok = tok

    def __call__(self, s: str) -> list[int]:
        return self._tok.encode(s, False)


def _marker(tok, i: int) -> bool:
    """A control token, or a user-defined one written like one (<tool_call>): a token, not text."""
    text = tok.tokens[i]
    return i in tok.control_ids or (tok.token_types[i] == TOKEN_USER_DEFINED and text.startswith("<")
                                    and text.endswith(">"))


class _Constraint:
    """One generation's matcher; allowed(seq) rolls back to the longest prefix it already holds
    and consumes the rest (a trip's drafts move ahead, rejected ones roll back)."""

    def __init__(self, matcher, n_prompt: int, vocab_size: int):
        self.m, self.n_prompt, self.vocab_size = matcher, n_prompt, vocab_size
        self.held: list[int] = []

    def allowed(self, seq: Sequence[int]) -> np.ndarray | None:
        reply = [int(t) for t in seq[self.n_prompt:]]
        k = 0
        while k < min(len(reply), len(self.held)) and reply[k] == self.held[k]:
            k += 1
        if k < len(self.held):
            if not self.m.rollback(len(self.held) - k):
                raise ConstraintError(f"the grammar's matcher cannot roll back: {self.m.get_error()}")
            del self.held[k:]
        rest = reply[k:]
        ok = self.m.validate_tokens(rest) if rest else 0  # checked first: a refused token would end the matcher
        if ok:
            if not self.m.consume_tokens(rest[:ok]):
                raise ConstraintError(f"the grammar's matcher refused tokens it had accepted: {self.m.get_error()}")
            self.held += rest[:ok]
        if ok < len(rest):
            # A draft outside the grammar: the row after it is never sampled (the row before it
            # gives that draft probability 0, so verification stops there), so no mask is needed.
            return None
        words = np.frombuffer(self.m.compute_bitmask(), "<u4")
        return mask_from_bitset(words, self.vocab_size)


class _Compiled:
    def __init__(self, tokenizer, grammar: str, vocab_size: int):
        import llguidance

        self._llg, self.tokenizer, self.grammar, self.vocab_size = llguidance, tokenizer, grammar, vocab_size

    def start(self, n_prompt: int) -> Constraint:
        m = self._llg.LLMatcher(self.tokenizer, self.grammar, log_level=0)
        if m.is_error():
            raise ConstraintError(m.get_error())
        return _Constraint(m, n_prompt, self.vocab_size)


class Llguidance:
    """The compiler; llguidance is imported at the first grammar, so a process that never
    constrains (every service but the coordinator) does not load it."""
    name = "llguidance"

    def __init__(self):
        # id(tokenizer) -> (the tokenizer, llguidance's over it). The entry holds the tokenizer, so its
        # id cannot be reused by another while the entry exists; the oldest is dropped past
        # KEPT_TOKENIZERS (a reload brings a new model's tokenizer).
        self._tokenizers: dict[int, tuple[object, object]] = {}
        self._lock = threading.Lock()

    @property
    def _llg(self):
        import llguidance

        return llguidance

    def _tokenizer(self, tok, vocab_size: int):
        key = id(tok)
        with self._lock:
            held = self._tokenizers.get(key)
            if held is None or held[0] is not tok:
                wrapper = self._llg.TokenizerWrapper(_Tokens(tok, vocab_size))
                held = tok, self._llg.LLTokenizer(wrapper, n_vocab=vocab_size, eos_token=sorted(tok.eog_ids))
                self._tokenizers[key] = held
                while len(self._tokenizers) > KEPT_TOKENIZERS:
                    self._tokenizers.pop(next(iter(self._tokenizers)))
            return held[1]

    def compile(self, grammar: Grammar, tokenizer, vocab_size: int) -> Compiled:
        if len(grammar.source.encode()) > MAX_GRAMMAR_BYTES:
            raise ConstraintError(f"the grammar's source is {len(grammar.source.encode())} bytes; at most "
                                  f"{MAX_GRAMMAR_BYTES}")
        LLMatcher = self._llg.LLMatcher
        try:
            if grammar.kind == "json_schema":
                text = LLMatcher.grammar_from_json_schema(grammar.source, overrides=JSON_OPTIONS)
            elif grammar.kind == "tool_calls":
                text = LLMatcher.grammar_from_lark(tool_calls_lark(json.loads(grammar.source), grammar.parallel,
                                                                   _call_ids(tokenizer)))
            else:
                raise ConstraintError(f"no grammar of kind {grammar.kind!r}")
        except (ValueError, TypeError) as e:
            raise ConstraintError(str(e)) from None
        lt = self._tokenizer(tokenizer, vocab_size)
        err = LLMatcher.validate_grammar(text, lt)
        if err:
            raise ConstraintError(err)
        return _Compiled(lt, text, vocab_size)


def _call_ids(tok) -> tuple[int, int]:
    ids = [tok.encode(t, False) for t in ("<tool_call>", "</tool_call>")]
    if not all(len(i) == 1 for i in ids):
        raise ConstraintError("this model's vocabulary has no <tool_call> and </tool_call> tokens")
    return ids[0][0], ids[1][0]


def tool_calls_lark(tools: dict[str, dict], parallel: bool, call_ids: tuple[int, int]) -> str:
    """The reply of tool calls in the model's format: <tool_call>\\n{"name": n, "arguments": {...}}
    \\n</tool_call>, the arguments matching function n's parameters; one call, or more where
    parallel (separated by a newline, as the template writes them)."""
    body = {"anyOf": [{"type": "object", "properties": {"name": {"const": name}, "arguments": schema},
                       "required": ["name", "arguments"], "additionalProperties": False}
                      for name, schema in tools.items()],
            "x-guidance": JSON_OPTIONS}
    open_, close = call_ids
    repeat = ' ("\\n" call)*' if parallel else ""
    return (f"start: call{repeat}\n"
            f'call: <[{open_}]> "\\n" body "\\n" <[{close}]>\n'
            f"body: %json {json.dumps(body)}\n")


def install_llguidance() -> bool:
    """Install llguidance as this process's constraint compiler where it is installed."""
    if importlib.util.find_spec("llguidance") is None:
        log.info("constrained decoding off: llguidance is not installed")
        return False
    install(Llguidance())
    return True
