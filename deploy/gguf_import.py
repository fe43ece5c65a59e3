"""Read a GGUF file with the `gguf` package: architecture, hparams, tensor table, tokenizer data."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGUFReader, GGUFValueType

from common.models import ARCHITECTURES
from common.quant import QUANT_TYPES, type_name

# Architectures whose GGUF key layout this importer knows: every one the model registry runs
# (common/models/), and llama (tinyllama and kin), which shares the key names and is encoded
# (for the format's tests) although no engine here runs it.
SUPPORTED_ARCHITECTURES = tuple(sorted({*ARCHITECTURES, "llama"}))

# knot hparam name -> GGUF key suffix after "{arch}."
HPARAM_GGUF_KEYS = {
    "block_count": "block_count",
    "embedding_length": "embedding_length",
    "feed_forward_length": "feed_forward_length",
    "head_count": "attention.head_count",
    "head_count_kv": "attention.head_count_kv",
    "rope_freq_base": "rope.freq_base",
    "rms_eps": "attention.layer_norm_rms_epsilon",
    "context_length": "context_length",
}
# Optional keys carried when present.
OPTIONAL_GGUF_KEYS = {
    "rope_dimension_count": "rope.dimension_count",
    "key_length": "attention.key_length",
    "value_length": "attention.value_length",
}
# Defaults llama.cpp applies when the key is absent.
HPARAM_DEFAULTS = {"rope_freq_base": 10000.0, "head_count_kv": None}


class GgufImportError(ValueError):
    pass


@dataclass(frozen=True)
class GgufTensor:
    name: str
    ggml_type: str
    shape: tuple[int, ...]  # GGUF order
    file_offset: int  # absolute, in the GGUF
    length: int


@dataclass
class GgufModel:
    path: Path
    architecture: str
    name: str
    hparams: dict[str, Any]
    tensors: list[GgufTensor]
    tokenizer: dict[str, Any]
    reader: GGUFReader

    def raw(self, t: GgufTensor) -> np.ndarray:
        """The tensor's bytes, a zero-copy uint8 view of the mmap."""
        return self.reader.data[t.file_offset:t.file_offset + t.length]


def _field(reader: GGUFReader, key: str, default: Any = ...) -> Any:
    f = reader.fields.get(key)
    if f is None:
        if default is ...:
            raise GgufImportError(f"GGUF {reader.data.filename if hasattr(reader.data, 'filename') else ''} "
                                  f"lacks the key {key!r}")
        return default
    return f.contents()


def read_gguf(path: str | Path) -> GgufModel:
    path = Path(path)
    try:
        reader = GGUFReader(path, "r")
    except (ValueError, OSError) as e:
        raise GgufImportError(f"{path}: not a readable GGUF file ({e})") from None
    arch = _field(reader, "general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise GgufImportError(f"{path}: architecture {arch!r} is not supported "
                              f"(supported: {', '.join(SUPPORTED_ARCHITECTURES)})")

    hparams: dict[str, Any] = {}
    for knot_key, suffix in HPARAM_GGUF_KEYS.items():
        default = HPARAM_DEFAULTS.get(knot_key, ...)
        hparams[knot_key] = _field(reader, f"{arch}.{suffix}", default)
    if hparams["head_count_kv"] is None:  # MHA models omit it
        hparams["head_count_kv"] = hparams["head_count"]
    for knot_key, suffix in OPTIONAL_GGUF_KEYS.items():
        value = _field(reader, f"{arch}.{suffix}", None)
        if value is not None:
            hparams[knot_key] = value
    hparams["rope_freq_base"] = float(hparams["rope_freq_base"])
    hparams["rms_eps"] = float(hparams["rms_eps"])

    tokenizer = _read_tokenizer(reader)
    hparams["vocab_size"] = _field(reader, f"{arch}.vocab_size", len(tokenizer["tokens"]))

    tensors = []
    for t in reader.tensors:
        ggml_type = type_name(int(t.tensor_type))
        if ggml_type not in QUANT_TYPES:
            raise GgufImportError(f"tensor {t.name}: ggml type {t.tensor_type.name} is not supported")
        tensors.append(GgufTensor(t.name, ggml_type, tuple(int(d) for d in t.shape),
                                  int(t.data_offset), int(t.n_bytes)))
    return GgufModel(path, arch, str(_field(reader, "general.name", path.stem)), hparams, tensors,
                     tokenizer, reader)


def _read_tokenizer(reader: GGUFReader) -> dict[str, Any]:
    tokens = _field(reader, "tokenizer.ggml.tokens")
    types = _field(reader, "tokenizer.ggml.token_type", None)
    merges = _field(reader, "tokenizer.ggml.merges", [])
    if reader.fields.get("tokenizer.ggml.token_type") is not None:
        assert reader.fields["tokenizer.ggml.token_type"].types[-1] == GGUFValueType.INT32
    return {
        "model": _field(reader, "tokenizer.ggml.model"),
        "pre": _field(reader, "tokenizer.ggml.pre", None),
        "tokens": list(tokens),
        "merges": list(merges),
        "token_types": [int(x) for x in types] if types is not None else None,
        "bos_token_id": _field(reader, "tokenizer.ggml.bos_token_id", None),
        "eos_token_id": _field(reader, "tokenizer.ggml.eos_token_id", None),
        "padding_token_id": _field(reader, "tokenizer.ggml.padding_token_id", None),
        "add_bos_token": bool(_field(reader, "tokenizer.ggml.add_bos_token", False)),
        "chat_template": _field(reader, "tokenizer.chat_template", None),
    }
