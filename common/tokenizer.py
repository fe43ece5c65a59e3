"""Byte-level BPE tokenizer and chat template, built from a knot's tokenizer data.

Input is the dict of docs/architecture.md ("tokens", "merges", "token_types", ids, "chat_template").
The goal is llama.cpp's ids for the same text (llama_tokenize with parse_special=true), so the
pipeline mirrors llama.cpp's llm_tokenizer_bpe for pre="qwen2":
  1. split out special tokens first (control = type 3 only when special=True, user-defined =
     type 4 always; ref: llama-vocab.cpp tokenizer_st_partition);
  2. split the rest with the qwen2 regex;
  3. map bytes to GPT-2's printable unicode alphabet and apply the BPE merges by rank.
No NFC normalizer: HF's Qwen2 tokenizer.json has one, llama.cpp does not, and llama.cpp is the
reference here.

Two backends give the same ids: Hugging Face `tokenizers` (Rust, fast) where it imports, and the
pure-Python common/bpe.py elsewhere (Pyodide has no `tokenizers`: Cloudflare's Python Workers).
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Mapping, Sequence

import jinja2
import jinja2.sandbox

from common.bpe import QWEN2_PATTERN, BytePairEncoder

try:  # the fast path; absent under Pyodide, where common/bpe.py gives the same ids
    from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers
    from tokenizers import Tokenizer as HFTokenizer
except ImportError:  # pragma: no cover - exercised under Pyodide (tests/cloudflare)
    HFTokenizer = None

BACKENDS = ("tokenizers", "python")

# ref: llama-vocab.cpp, LLAMA_VOCAB_PRE_TYPE_QWEN2
QWEN2_PRE_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
PRE_REGEXES = {"qwen2": QWEN2_PRE_REGEX}
# The same patterns in the spelling Python's `re` takes (common/bpe.py), for the python backend.
PY_PRE_PATTERNS = {"qwen2": QWEN2_PATTERN}

# GGUF tokenizer.ggml.token_type values (gguf-py TokenType / llama_token_type)
TOKEN_NORMAL, TOKEN_UNKNOWN, TOKEN_CONTROL, TOKEN_USER_DEFINED, TOKEN_UNUSED, TOKEN_BYTE = 1, 2, 3, 4, 5, 6

# Besides eos, these end a generation when present (ref: llama-vocab.cpp special_eog_ids), if the
# GGUF types them control. The last three are Qwen2.5-Coder's fill-in-the-middle padding and its
# repository and file separators: llama.cpp ends a generation at each (its fim_pad, fim_rep and
# fim_sep), and past one the model starts another file, whose text skip_special would glue on.
# Not copied from llama.cpp: it also ends at "</s>" and re-types it control (so its special=True
# tokenizing turns a prompt's "</s>" into that id), where Qwen's vocabulary holds it as a normal token
# that text never becomes: the pre-tokenizer splits "</s>" into "</", "s", ">" (docs/fidelity.md).
# tests/oracle/test_llamacpp.py checks the set against llama.cpp's.
_EOG_TEXTS = ("<|endoftext|>", "<|im_end|>", "<|eot_id|>", "<|end|>", "<end_of_turn>",
              "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>")
# Fill-in-the-middle markers by role (Qwen2.5-Coder's spelling; ref: llama-vocab.cpp fim_pre/suf/mid).
# The prompt is prefix-suffix-middle: <|fim_prefix|>{prefix}<|fim_suffix|>{suffix}<|fim_middle|>.
FIM_TEXTS = {"prefix": "<|fim_prefix|>", "suffix": "<|fim_suffix|>", "middle": "<|fim_middle|>"}


class TokenizerError(ValueError):
    pass


class TooManyTokens(TokenizerError):
    """encode_bounded() stopped: the text holds more than max_tokens ids (at least n_tokens)."""

    def __init__(self, n_tokens: int, max_tokens: int):
        self.n_tokens, self.max_tokens = n_tokens, max_tokens
        super().__init__(f"more than {max_tokens} tokens (at least {n_tokens})")


# encode_bounded() encodes a long text in pieces of about this many characters, cut only where
# the pre-tokenizer would cut anyway (_SAFE_CUT), so it stops early with the same ids.
ENCODE_PIECE_CHARS = 1 << 15
# After a newline, before what is not whitespace (optionally after spaces and tabs): no regex
# alternative matches across it (none takes a newline and then more than spaces), and the match
# after it starts there either way. A special token with a newline in it disables cutting.
_SAFE_CUT = re.compile(r"\n(?=[ \t]*[^\s])")


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible map from the 256 byte values to printable characters."""
    # ref: openai/gpt-2 encoder.py bytes_to_unicode
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, (chr(c) for c in cs)))


_BYTE_OF_CHAR = {c: b for b, c in bytes_to_unicode().items()}


def special_ids(token_types: Sequence[int]) -> set[int]:
    """The ids of control and user-defined tokens (an end of text, a chat turn's markers, code
    infill's): what "special" means for encoding, decoding and a draft model's head."""
    return {i for i, t in enumerate(token_types) if t in (TOKEN_CONTROL, TOKEN_USER_DEFINED)}


@dataclass(frozen=True)
class ChatMessage:
    role: str
    content: str


class Tokenizer:
    def __init__(self, data: Mapping, backend: str | None = None):
        """backend: "tokenizers" (Rust), "python" (common/bpe.py); None = tokenizers when it imports."""
        if data.get("model") != "gpt2":
            raise TokenizerError(f"tokenizer model {data.get('model')!r}: only gpt2 (byte-level BPE) is supported")
        pre = data.get("pre") or "qwen2"
        if pre not in PRE_REGEXES:
            raise TokenizerError(f"pre-tokenizer {pre!r}: only {sorted(PRE_REGEXES)} are supported")
        tokens: list[str] = list(data["tokens"])
        types: list[int] = list(data.get("token_types") or [TOKEN_NORMAL] * len(tokens))
        if len(types) != len(tokens):
            raise TokenizerError(f"{len(tokens)} tokens but {len(types)} token types")
        self.tokens, self.token_types = tokens, types
        self.bos_id = data.get("bos_token_id")
        self.eos_id = data.get("eos_token_id")
        self.add_bos = bool(data.get("add_bos_token", False))
        self.chat_template: str | None = data.get("chat_template")
        self.special_ids = special_ids(types)
        self.control_ids = {i for i, t in enumerate(types) if t == TOKEN_CONTROL}
        self.eog_ids = {i for i, t in enumerate(tokens) if t in _EOG_TEXTS and i in self.control_ids}
        if self.eos_id is not None:
            self.eog_ids.add(int(self.eos_id))
        if backend is None:
            backend = "tokenizers" if HFTokenizer is not None else "python"
        if backend not in BACKENDS:
            raise TokenizerError(f"tokenizer backend {backend!r}: expected one of {BACKENDS}")
        if backend == "tokenizers" and HFTokenizer is None:
            raise TokenizerError("tokenizer backend 'tokenizers': the package does not import here")
        self.backend = backend
        vocab = {t: i for i, t in enumerate(tokens)}
        if len(vocab) != len(tokens):
            raise TokenizerError(f"{len(tokens) - len(vocab)} duplicate token strings")
        pairs = []
        for m in data["merges"]:
            a, sep, b = m.partition(" ")  # byte-level tokens never contain a raw space
            if not sep:
                raise TokenizerError(f"merge {m!r} is not two tokens separated by a space")
            pairs.append((a, b))
        # Specials are stored as plain text, not byte-level encoded; they split the input before
        # the regex does. Control tokens are "special", so special=False can turn them off.
        self._added = {tokens[i]: i for i in range(len(tokens)) if types[i] in (TOKEN_CONTROL, TOKEN_USER_DEFINED)}
        self._user_defined = frozenset(t for t, i in self._added.items() if types[i] == TOKEN_USER_DEFINED)
        if backend == "tokenizers":
            self._hf = self._build(tokens, types, vocab, pairs, PRE_REGEXES[pre])
        else:
            try:
                self._bpe = BytePairEncoder(vocab, pairs, PY_PRE_PATTERNS[pre], bytes_to_unicode(), self._added)
            except ValueError as e:
                raise TokenizerError(str(e)) from None
        self._special_id = {tokens[i]: i for i in sorted(self.control_ids)}  # the markers a template may write
        # role -> id of the fill-in-the-middle markers; None: the model has not all three
        fim = {role: self._special_id.get(text) for role, text in FIM_TEXTS.items()}
        self.fim_ids: dict[str, int] | None = fim if None not in fim.values() else None
        self._special_re = None
        self._piece_cache: dict[int, bytes] = {}
        self._uncuttable: bool | None = None
        self._max_token_bytes: int | None = None

    @staticmethod
    def _build(tokens, types, vocab, pairs, pattern) -> "HFTokenizer":
        tok = HFTokenizer(models.BPE(vocab=vocab, merges=pairs, fuse_unk=False, byte_fallback=False))
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(pattern), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ])
        tok.decoder = decoders.ByteLevel()
        added = [AddedToken(tokens[i], special=types[i] == TOKEN_CONTROL, normalized=False)
                 for i in range(len(tokens)) if types[i] in (TOKEN_CONTROL, TOKEN_USER_DEFINED)]
        tok.add_tokens(added)
        for a in added:
            if tok.token_to_id(a.content) != vocab[a.content]:
                raise TokenizerError(f"special token {a.content!r} did not keep its id {vocab[a.content]}")
        return tok

    @property
    def vocab_size(self) -> int:
        return len(self.tokens)

    def encode(self, text: str, special: bool = True) -> list[int]:
        """text -> ids, no BOS. special=True parses control tokens (<|im_start|>) as such."""
        if self.backend == "python":
            return self._bpe.encode(text, None if special else self._user_defined)
        self._hf.encode_special_tokens = not special
        return self._hf.encode(text, add_special_tokens=False).ids

    def encode_bounded(self, text: str, max_tokens: int, special: bool = True) -> list[int]:
        """encode(text) when that is at most max_tokens ids; TooManyTokens as soon as more are
        certain, after encoding about max_tokens ids' worth of the text rather than all of it."""
        ids: list[int] = []
        for piece in self._pieces(text):
            ids += self.encode(piece, special)
            if len(ids) > max_tokens:
                raise TooManyTokens(len(ids), max_tokens)
        return ids

    def _pieces(self, text: str):
        """text cut at _SAFE_CUT points into pieces of about ENCODE_PIECE_CHARS (whole, when it cannot be cut)."""
        if self._uncuttable is None:
            self._uncuttable = any("\n" in self.tokens[i] for i in self.special_ids)
        a = 0
        while not self._uncuttable and len(text) - a > ENCODE_PIECE_CHARS:
            cut = _SAFE_CUT.search(text, a + ENCODE_PIECE_CHARS)
            if cut is None:
                break
            yield text[a:cut.end()]
            a = cut.end()
        yield text[a:]

    @property
    def max_token_bytes(self) -> int:
        """The most bytes any one token stands for: a text of n characters needs at least
        n / max_token_bytes tokens (a character is at least a byte)."""
        if self._max_token_bytes is None:
            self._max_token_bytes = max(len(self.token_bytes(i)) for i in range(self.vocab_size))
        return self._max_token_bytes

    def token_bytes(self, token_id: int) -> bytes:
        """The raw bytes one token stands for (control and user-defined tokens: their text)."""
        b = self._piece_cache.get(token_id)
        if b is None:
            text = self.tokens[token_id]
            if token_id in self.special_ids:
                b = text.encode("utf-8")
            else:
                try:
                    b = bytes(_BYTE_OF_CHAR[c] for c in text)
                except KeyError:  # e.g. the [PAD...] fillers, which are not byte-level
                    b = text.encode("utf-8")
            self._piece_cache[token_id] = b
        return b

    def decode(self, ids: Sequence[int], skip_special: bool = False) -> str:
        """ids -> text; bytes that are not valid UTF-8 become U+FFFD."""
        return b"".join(self.token_bytes(int(i)) for i in ids
                        if not (skip_special and int(i) in self.control_ids)).decode("utf-8", errors="replace")

    def stream(self, skip_special: bool = False) -> "StreamDecoder":
        return StreamDecoder(self, skip_special)

    def render_chat(self, messages: Sequence[Mapping | ChatMessage], add_generation_prompt: bool = True,
                    **extra) -> str:
        """Render the model's own chat template (jinja2, sandboxed, as transformers does)."""
        if not self.chat_template:
            raise TokenizerError("the model has no chat template")
        msgs = [m if isinstance(m, Mapping) else {"role": m.role, "content": m.content} for m in messages]
        bos = self.tokens[self.bos_id] if self.bos_id is not None else ""
        eos = self.tokens[self.eos_id] if self.eos_id is not None else ""
        return _compile_template(self.chat_template).render(
            messages=msgs, add_generation_prompt=add_generation_prompt,
            bos_token=bos, eos_token=eos, **extra)


    def encode_chat(self, messages: Sequence[Mapping], add_generation_prompt: bool = True,
                    max_tokens: int | None = None, tools: Sequence[Mapping] | None = None) -> list[int]:
        """A chat -> ids, where only the template's own markers are control tokens.

        Rendering the chat and encoding it with specials on (as llama.cpp's server does) lets a
        user who types "<|im_end|>\\n<|im_start|>system\\n..." inject a system turn. So the
        template is rendered with a placeholder for each message's content; the special tokens
        the template itself wrote are split out, and everything between them (template text and
        contents alike) is encoded as plain text. With no special text in any content, the ids
        equal encode(render_chat(...)): specials split the text before pre-tokenization anyway.
        An empty content gets no placeholder (a template tests it: an assistant turn of tool calls
        only). What else the template writes from the request (tools, earlier tool calls) must
        hold no control token's text: a TokenizerError otherwise.
        With max_tokens, TooManyTokens as soon as the chat is certainly longer (encode_bounded)."""
        def encode(text: str, special: bool) -> list[int]:
            if max_tokens is None:
                return self.encode(text, special)
            return self.encode_bounded(text, max_tokens - len(ids), special)

        ids: list[int] = []
        msgs = [dict(m) for m in messages]
        extra = {"tools": list(tools)} if tools else {}
        written = json.dumps([tools or [], [{k: v for k, v in m.items() if k not in ("role", "content")}
                                            for m in msgs]], ensure_ascii=False)
        for t in self._special_id:
            if t in written:
                raise TokenizerError(f"the tools or an earlier tool call hold the text of the control token {t!r}")
        filled = [i for i, m in enumerate(msgs) if m["content"]]
        marks = {i: f"\x00knot-content-{i}\x00" for i in filled}
        skeleton = self.render_chat([{**m, "content": marks.get(i, m["content"])} for i, m in enumerate(msgs)],
                                    add_generation_prompt, **extra)
        pieces = skeleton.split("\x00")  # [template, "knot-content-i", template, ...]
        contents = [msgs[i]["content"] for i in filled]
        if (len(pieces) != 2 * len(filled) + 1
                or pieces[1::2] != [marks[i].strip("\x00") for i in filled]
                or "".join(p if j % 2 == 0 else contents[j // 2] for j, p in enumerate(pieces))
                != self.render_chat(msgs, add_generation_prompt, **extra)):
            # The template does not place each content verbatim, exactly once: no safe split.
            if any(t in m["content"] for m in msgs for t in self._special_id):
                raise TokenizerError("a message holds the text of a control token and this model's chat "
                                     "template does not place contents verbatim, so it cannot be kept as text")
            return encode(self.render_chat(msgs, add_generation_prompt, **extra), True)
        text = ""  # plain text since the last template marker
        for i, piece in enumerate(pieces):
            if i % 2:
                text += contents[i // 2]
                continue
            for j, part in enumerate(self._split_specials(piece)):
                if j % 2:  # a marker the template wrote
                    ids += encode(text, False)
                    ids.append(self._special_id[part])
                    text = ""
                else:
                    text += part
        ids += encode(text, False)
        if max_tokens is not None and len(ids) > max_tokens:
            raise TooManyTokens(len(ids), max_tokens)
        return ids

    def encode_fim(self, prefix: str, suffix: str, max_tokens: int | None = None) -> list[int]:
        """Fill in the middle: the ids of <|fim_prefix|>{prefix}<|fim_suffix|>{suffix}<|fim_middle|>,
        the model then writing what goes between prefix and suffix. Both texts are plain text (no
        control tokens: code quoting "<|fim_suffix|>" stays code), as llama.cpp's server encodes
        its infill's. With max_tokens, TooManyTokens as soon as the whole is certainly longer."""
        if self.fim_ids is None:
            raise TokenizerError("this model has no fill-in-the-middle tokens (" + ", ".join(FIM_TEXTS.values()) + ")")
        left = None if max_tokens is None else max_tokens - 3  # ids the two texts may take
        ids = [self.fim_ids["prefix"]]
        for text, marker in ((prefix, "suffix"), (suffix, "middle")):
            try:
                part = self.encode(text, False) if left is None else self.encode_bounded(text, left, False)
            except TooManyTokens as e:  # counted against the whole prompt, markers included
                raise TooManyTokens(len(ids) + e.n_tokens + 1, max_tokens) from None
            ids += [*part, self.fim_ids[marker]]
            left = None if left is None else left - len(part)
        return ids

    def _split_specials(self, text: str) -> list[str]:
        """[text, special, text, special, ..., text]: the control tokens' texts split out, longest first."""
        if self._special_re is None:
            alts = sorted(self._special_id, key=len, reverse=True)
            self._special_re = re.compile("(" + "|".join(re.escape(a) for a in alts) + ")")
        return self._special_re.split(text)


class StreamDecoder:
    """Incremental detokenizer: push ids, get text once its UTF-8 bytes are complete."""

    def __init__(self, tok: Tokenizer, skip_special: bool = False):
        self.tok, self.skip_special = tok, skip_special
        self._pending = b""

    def push(self, token_id: int) -> str:
        if self.skip_special and token_id in self.tok.control_ids:
            return ""
        buf = self._pending + self.tok.token_bytes(token_id)
        # A character may be split across tokens: hold back an incomplete UTF-8 tail
        # (at most 3 bytes) until the next token completes it.
        cut = _complete_prefix_len(buf)
        self._pending = buf[cut:]
        return buf[:cut].decode("utf-8", errors="replace")

    def flush(self) -> str:
        out, self._pending = self._pending.decode("utf-8", errors="replace"), b""
        return out


def _complete_prefix_len(buf: bytes) -> int:
    """Length of buf without a trailing, possibly-incomplete UTF-8 sequence."""
    for back in range(1, min(4, len(buf)) + 1):
        b = buf[-back]
        if b & 0xC0 != 0x80:             # a lead byte (or ASCII)
            need = 1 if b < 0x80 else 2 if b >> 5 == 0b110 else 3 if b >> 4 == 0b1110 else 4 if b >> 3 == 0b11110 else 1
            return len(buf) if back >= need else len(buf) - back
    return len(buf)  # only continuation bytes: invalid anyway, let decode replace them


def _raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    # transformers overrides jinja2's tojson, which would HTML-escape <, >, & and '.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


_TEMPLATE_CACHE: dict[str, jinja2.Template] = {}


def _compile_template(source: str) -> jinja2.Template:
    # ref: transformers utils/chat_template_utils.py _compile_jinja_template
    t = _TEMPLATE_CACHE.get(source)
    if t is None:
        env = jinja2.sandbox.ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise_exception
        t = _TEMPLATE_CACHE[source] = env.from_string(source)
    return t
