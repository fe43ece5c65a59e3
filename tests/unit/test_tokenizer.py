from __future__ import annotations

import pytest
from hypothesis import given, settings, strategies as st

from common.tokenizer import TooManyTokens, Tokenizer, TokenizerError, bytes_to_unicode

BYTE_TOKENS = [c for _, c in sorted(bytes_to_unicode().items())]  # id == byte value
MERGES = ["Ġ t", "h e", "Ġt he", "i n", "Ġ Ġ", "ĠĠ ĠĠ", "d e", "de f", "Ċ Ċ"]
MERGED = ["Ġt", "he", "Ġthe", "in", "ĠĠ", "ĠĠĠĠ", "de", "def", "ĊĊ"]
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<tool_call>"]
SPECIAL_TYPES = [3, 3, 3, 4]  # control, control, control, user-defined

# A cut-down Qwen2.5 template: same jinja features (whitespace control, loop, raise_exception).
QWEN_TEMPLATE = """{%- if messages[0]['role'] == 'system' %}
    {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}
{%- else %}
    {{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
    {%- if message.role not in ['system', 'user', 'assistant'] %}
        {{- raise_exception('unknown role ' + message.role) }}
    {%- elif (message.role == "user") or (message.role == "system" and not loop.first) or (message.role == "assistant") %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""


def tiny_data(**over) -> dict:
    tokens = BYTE_TOKENS + MERGED + SPECIALS
    return {"model": "gpt2", "pre": "qwen2", "tokens": tokens, "merges": MERGES,
            "token_types": [1] * (len(tokens) - len(SPECIALS)) + SPECIAL_TYPES,
            "bos_token_id": None, "eos_token_id": tokens.index("<|im_end|>"), "padding_token_id": None,
            "add_bos_token": False, "chat_template": QWEN_TEMPLATE} | over


TOK = Tokenizer(tiny_data())
ID = {t: i for i, t in enumerate(TOK.tokens)}


def test_bpe_merges_and_pretokenizer():
    # "def" merges, " the" merges to one token, the leading "the" has no space so stays "t"+"he".
    assert TOK.encode("def the") == [ID["def"], ID["Ġthe"]]
    assert TOK.encode("the") == [ID["t"], ID["he"]]
    # qwen2 splits digits one by one, and contractions apart from the word.
    assert TOK.encode("123") == [ID["1"], ID["2"], ID["3"]]
    assert TOK.encode("we'll") == [ID["w"], ID["e"], ID["'"], ID["l"], ID["l"]]
    # whitespace runs: "\s+(?!\S)" leaves the last space to join the next word.
    assert TOK.encode("    the") == [ID["ĠĠ"], ID["Ġ"], ID["Ġthe"]]
    assert TOK.encode("a\n\nb") == [ID["a"], ID["ĊĊ"], ID["b"]]


def test_special_tokens_encode_to_single_ids():
    ids = TOK.encode("<|im_start|>user\nin<|im_end|><tool_call>")
    assert ids == [ID["<|im_start|>"], ID["u"], ID["s"], ID["e"], ID["r"], ID["Ċ"], ID["in"],
                   ID["<|im_end|>"], ID["<tool_call>"]]
    # special=False: control tokens are plain text, user-defined ones still match (llama.cpp).
    plain = TOK.encode("<|im_end|><tool_call>", special=False)
    assert ID["<|im_end|>"] not in plain and plain[-1] == ID["<tool_call>"]
    assert TOK.decode(plain) == "<|im_end|><tool_call>"
    assert TOK.eog_ids == {ID["<|im_end|>"], ID["<|endoftext|>"]}


def test_decode_and_skip_special():
    ids = TOK.encode("<|im_start|>héllo 🤖<|im_end|>")
    assert TOK.decode(ids) == "<|im_start|>héllo 🤖<|im_end|>"
    assert TOK.decode(ids, skip_special=True) == "héllo 🤖"


@settings(max_examples=200, deadline=None)
@given(st.text(alphabet=st.characters(blacklist_categories=["Cs"]), max_size=40) |
       st.lists(st.sampled_from(["def", " the", "  ", "\n", "\r\n", "\t", "'s", "1", "é", "日本", "🤖",
                                 "<|im_start|>", "<tool_call>", "<|end", "|>"]), max_size=12).map("".join))
def test_roundtrip_and_streaming(text):
    ids = TOK.encode(text)
    assert TOK.decode(ids) == text
    sd = TOK.stream()
    pieces = [sd.push(i) for i in ids] + [sd.flush()]
    assert "".join(pieces) == text
    assert all("\ufffd" not in p for p in pieces)  # a split character is held back, never mangled


def test_streaming_holds_back_split_utf8():
    ids = TOK.encode("🤖")  # 4 bytes, 4 byte tokens here
    assert len(ids) == 4
    sd = TOK.stream()
    assert [sd.push(i) for i in ids] == ["", "", "", "🤖"]


def test_chat_template():
    out = TOK.render_chat([{"role": "user", "content": "Write fizzbuzz"}])
    assert out == ("<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant."
                   "<|im_end|>\n<|im_start|>user\nWrite fizzbuzz<|im_end|>\n<|im_start|>assistant\n")
    out = TOK.render_chat([{"role": "system", "content": "S"}, {"role": "user", "content": "U"}],
                          add_generation_prompt=False)
    assert out == "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nU<|im_end|>\n"
    with pytest.raises(Exception, match="unknown role tool"):
        TOK.render_chat([{"role": "tool", "content": "x"}])
    with pytest.raises(TokenizerError, match="no chat template"):
        Tokenizer(tiny_data(chat_template=None)).render_chat([{"role": "user", "content": "x"}])


def test_bad_data_raises():
    with pytest.raises(TokenizerError, match="only gpt2"):
        Tokenizer(tiny_data(model="llama"))
    with pytest.raises(TokenizerError, match="pre-tokenizer"):
        Tokenizer(tiny_data(pre="deepseek-coder"))
    with pytest.raises(TokenizerError, match="token types"):
        Tokenizer(tiny_data(token_types=[1]))


@pytest.mark.realmodel
def test_real_qwen_ids():
    try:
        from deploy.knotfile import open_model
        from deploy.models import knot_cache_path, model_path
        path = model_path("qwen2.5-coder-0.5b")
    except Exception as e:  # not fetched
        pytest.skip(f"qwen2.5-coder-0.5b not available: {e}")
    knot = knot_cache_path(path)  # reads its tokenizer 70x faster than the GGUF
    tok = Tokenizer(open_model(knot if knot.is_file() else path).tokenizer_data())
    assert tok.encode("Hello world") == [9707, 1879]
    assert tok.encode("<|im_start|>user\nhi<|im_end|>") == [151644, 872, 198, 6023, 151645]
    assert tok.eos_id == 151645 and tok.eog_ids >= {151643, 151645}


FIM = ["<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>", "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>"]


def fim_tokenizer(types: list[int] | None = None, backend: str | None = None) -> Tokenizer:
    d = tiny_data()
    return Tokenizer(tiny_data(tokens=d["tokens"] + FIM, token_types=d["token_types"] + (types or [3] * len(FIM))),
                     backend=backend)


@pytest.mark.parametrize("backend", ["tokenizers", "python"])
def test_fill_in_the_middle_ids(backend):
    tok = fim_tokenizer(backend=backend)
    fid = {t: tok.tokens.index(t) for t in FIM}
    assert tok.fim_ids == {"prefix": fid["<|fim_prefix|>"], "suffix": fid["<|fim_suffix|>"],
                           "middle": fid["<|fim_middle|>"]}
    ids = tok.encode_fim("def the", "in the")
    # Qwen2.5-Coder's prefix-suffix-middle order, the texts as encode() gives them
    assert ids == [fid["<|fim_prefix|>"], *tok.encode("def the"), fid["<|fim_suffix|>"], *tok.encode("in the"),
                   fid["<|fim_middle|>"]]
    assert ids == tok.encode("<|fim_prefix|>def the<|fim_suffix|>in the<|fim_middle|>")
    assert tok.encode_fim("", "") == [fid["<|fim_prefix|>"], fid["<|fim_suffix|>"], fid["<|fim_middle|>"]]
    # Code that quotes a marker keeps it as text: no second suffix, no early middle.
    quoted = tok.encode_fim('s = "<|fim_middle|>"', "<|im_end|>")
    assert [i for i in quoted if i in tok.control_ids] == [fid["<|fim_prefix|>"], fid["<|fim_suffix|>"],
                                                           fid["<|fim_middle|>"]]
    assert tok.decode(quoted) == '<|fim_prefix|>s = "<|fim_middle|>"<|fim_suffix|><|im_end|><|fim_middle|>'


def test_fill_in_the_middle_bounded_and_refused():
    tok = fim_tokenizer()
    n = len(tok.encode_fim("the " * 20, "def " * 10))
    assert tok.encode_fim("the " * 20, "def " * 10, max_tokens=n) == tok.encode_fim("the " * 20, "def " * 10)
    for prefix, suffix in (("the " * 20, "def " * 10), ("the " * 60, ""), ("", "def " * 60)):
        with pytest.raises(TooManyTokens) as e:
            tok.encode_fim(prefix, suffix, max_tokens=n - 1)
        assert e.value.max_tokens == n - 1 and e.value.n_tokens > n - 1  # the whole prompt's count, markers too
    with pytest.raises(TokenizerError, match="no fill-in-the-middle tokens"):
        TOK.encode_fim("a", "b")
    assert TOK.fim_ids is None
    # Markers the GGUF does not type control are text like any other: no fill in the middle with them.
    assert fim_tokenizer(types=[1] * len(FIM)).fim_ids is None


def test_fim_pad_and_separators_end_a_generation():
    """As in llama.cpp (special_eog_ids gets fim_pad, fim_rep and fim_sep): past <|file_sep|> the model
    writes another file; tests/oracle/test_llamacpp.py checks the real model's set against llama.cpp's."""
    tok = fim_tokenizer()
    ends = {tok.tokens.index(t) for t in ("<|fim_pad|>", "<|repo_name|>", "<|file_sep|>")}
    assert tok.eog_ids == {ID["<|im_end|>"], ID["<|endoftext|>"]} | ends
    assert not tok.eog_ids & {tok.fim_ids[r] for r in ("prefix", "suffix", "middle")}
    assert fim_tokenizer(types=[1] * len(FIM)).eog_ids == {ID["<|im_end|>"], ID["<|endoftext|>"]}
