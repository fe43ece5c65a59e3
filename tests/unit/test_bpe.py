"""The pure-Python BPE (common/bpe.py) gives the ids of Hugging Face `tokenizers` (the oracle).

The vocabulary here is trained by tokenizers' own BpeTrainer on the test corpus (a few thousand
merges, byte-level), so the merges interact the way a real vocabulary's do; the Qwen2 vocabulary
itself is checked in tests/realmodel/test_bpe_qwen2.py.
"""
from __future__ import annotations

import json

import pytest
from hypothesis import given, settings, strategies as st
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import models, pre_tokenizers, trainers

from common.bpe import QWEN2_PATTERN, WHITE_SPACE, compile_pretokenizer, split_isolated
from common.tokenizer import QWEN2_PRE_REGEX, Tokenizer, TokenizerError, bytes_to_unicode
from tests.tokenizer_corpus import corpus

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>"]
USER_DEFINED = ["<tool_call>", "</tool_call>", "<|im_end|>x"]  # the last overlaps a control token


def trained_data(vocab_size: int = 3000) -> dict:
    """A byte-level BPE trained by tokenizers on the corpus, as a knot tokenizer dict."""
    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(corpus(), trainer)
    model = json.loads(tok.to_str())["model"]
    vocab = sorted(model["vocab"].items(), key=lambda kv: kv[1])
    tokens = [t for t, _ in vocab]
    merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    types = [1] * len(tokens) + [3] * len(SPECIALS) + [4] * len(USER_DEFINED)
    return {"model": "gpt2", "pre": "qwen2", "tokens": tokens + SPECIALS + USER_DEFINED, "merges": merges,
            "token_types": types, "bos_token_id": None, "eos_token_id": len(tokens) + 2, "add_bos_token": False}


DATA = trained_data()
HF = Tokenizer(DATA, backend="tokenizers")
PY = Tokenizer(DATA, backend="python")
TEXTS = corpus()


def test_the_trained_vocabulary_has_real_merges():
    assert HF.backend == "tokenizers" and PY.backend == "python"
    assert len(DATA["merges"]) > 2000
    line = "def has_close_elements(numbers: List[float], threshold: float) -> bool:"
    assert len(HF.encode(line)) < len(line) // 2, "the trained merges should compress code"


@pytest.mark.parametrize("special", [True, False])
def test_corpus_ids_equal(special):
    bad = [(i, t[:60]) for i, t in enumerate(TEXTS) if PY.encode(t, special) != HF.encode(t, special)]
    assert not bad, f"{len(bad)} of {len(TEXTS)} texts differ, e.g. {bad[:3]}"
    assert sum(len(PY.encode(t, special)) for t in TEXTS) > 10_000


def test_special_tokens_split_first_leftmost_longest():
    text = "<|im_start|>user<|im_end|>x<|im_end|><tool_call>"
    assert PY.encode(text) == HF.encode(text)
    ids = PY.encode(text)
    assert ids[0] == DATA["tokens"].index("<|im_start|>")
    assert DATA["tokens"].index("<|im_end|>x") in ids  # the longer user-defined token wins
    # special=False: control tokens are text, user-defined ones still split out
    plain = PY.encode(text, special=False)
    assert plain == HF.encode(text, special=False)
    assert DATA["tokens"].index("<|im_start|>") not in plain
    assert DATA["tokens"].index("<tool_call>") in plain


def test_pretokenizer_classes_are_unicode_not_pythons():
    rx = compile_pretokenizer(QWEN2_PATTERN)
    # U+001C..U+001F are whitespace to Python's \s, not to Unicode White_Space (Oniguruma's \s)
    assert list(split_isolated(rx, "a\x1c\x1db")) == ["a", "\x1c\x1d", "b"]
    assert list(split_isolated(rx, "a \u3000 b")) == ["a", " \u3000", " b"]
    assert list(split_isolated(rx, "x123 ٣४")) == ["x", "1", "2", "3", " ", "٣", "४"]
    assert "\u3000" in WHITE_SPACE and "\x1c" not in WHITE_SPACE
    assert "(?i:'s|'t|'re|'ve|'m|'ll|'d)" in QWEN2_PATTERN and QWEN2_PRE_REGEX.startswith("(?i:'s|'t|'re|")


def test_a_vocabulary_without_every_byte_is_refused():
    data = dict(DATA, tokens=[t for t in DATA["tokens"] if t != bytes_to_unicode()[0xFF]])
    data["token_types"] = DATA["token_types"][:len(data["tokens"])]
    data["merges"] = [m for m in DATA["merges"] if "ÿ" not in m]
    with pytest.raises(TokenizerError, match="bytes"):
        Tokenizer(data, backend="python")


def test_unknown_backend_is_refused():
    with pytest.raises(TokenizerError, match="backend"):
        Tokenizer(DATA, backend="rust")


_PIECES = ["def", " the", "  ", "   ", "\n", "\n\n", "\r\n", "\t", "'s", "'LL", "1", "42", "é", "ß", "日本", "🤖",
           "👨‍👩‍👧", "\u00a0", "\u3000", "\x1c", "<|im_start|>", "<|im_end|>", "<tool_call>", "<|im_end|>x",
           "<|end", "|>", "(", "))", "->", "_", "x", "Ⅻ", "٣", "\u0301"]


@settings(max_examples=400, deadline=None)
@given(st.text(alphabet=st.characters(blacklist_categories=["Cs", "Cn"]), max_size=60)
       | st.lists(st.sampled_from(_PIECES), max_size=16).map("".join)
       | st.text(alphabet=st.sampled_from(" \t\n\r\x0b\x0c\x85\xa0\u2000\u3000aZ1'"), max_size=30))
def test_hypothesis_ids_equal(text):
    assert PY.encode(text) == HF.encode(text)
    assert PY.encode(text, special=False) == HF.encode(text, special=False)
    assert PY.decode(PY.encode(text)) == text
