"""Tiny synthetic qwen2 models written as real GGUF files with gguf-py, and knot edits (tests only)."""
from __future__ import annotations

import json
import struct
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType, GGUFWriter, TokenType
from gguf.quants import quantize

from common import knot
from common.tokenizer import bytes_to_unicode


SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
FIM_SPECIALS = ["<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>"]
CHAT_TEMPLATE = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


# Byte offsets of the f16 scale fields in one block, for types gguf-py cannot quantize.
# ref: ggml-common.h block_q4_K / block_q5_K (d, dmin first), block_q6_K (d last),
# block_q2_K (scales 16 | qs 64 | d | dmin), block_q3_K (hmask 32 | qs 64 | scales 12 | d)
K_SCALE_FIELDS = {
    GGMLQuantizationType.Q2_K: (80, 82),
    GGMLQuantizationType.Q3_K: (108,),
    GGMLQuantizationType.Q4_K: (0, 2),
    GGMLQuantizationType.Q5_K: (0, 2),
    GGMLQuantizationType.Q6_K: (208,),
}


def random_k_blocks(qtype: GGMLQuantizationType, shape: tuple[int, ...], rng) -> np.ndarray:
    """Random but valid K-quant blocks: random bits, finite small f16 scales. -> uint8 (rows, row_bytes)."""
    from gguf.constants import GGML_QUANT_SIZES

    block_elems, block_bytes = GGML_QUANT_SIZES[qtype]
    n_rows, ne0 = int(np.prod(shape[:-1])), shape[-1]
    blocks = rng.integers(0, 256, (n_rows * ne0 // block_elems, block_bytes), dtype=np.uint8)
    for off in K_SCALE_FIELDS[qtype]:
        scale = (rng.uniform(0.5, 1.5, len(blocks)) * 2e-3).astype(np.float16)
        blocks[:, off:off + 2] = scale.view(np.uint8).reshape(-1, 2)
    return blocks.reshape(n_rows, ne0 // block_elems * block_bytes)


def tiny_tokenizer(fim: bool = False) -> dict:
    """256 byte tokens, a few merges, then the special tokens (ids 256+len(merges)...); with fim,
    Qwen2.5-Coder's fill-in-the-middle markers after them."""
    b2u = bytes_to_unicode()
    tokens = [b2u[b] for b in range(256)]
    merges = []
    for a, b in [("Ġ", "t"), ("h", "e"), ("Ġt", "he"), ("i", "n"), ("Ġ", "a"), ("d", "e"), ("Ġ", "d"),
                 ("e", "f"), ("Ġd", "ef"), ("r", "e"), ("t", "u")]:
        merges.append(f"{a} {b}")
        tokens.append(a + b)
    types = [TokenType.NORMAL] * len(tokens)
    for s in SPECIALS + (FIM_SPECIALS if fim else []):
        tokens.append(s)
        types.append(TokenType.CONTROL)
    return {"tokens": tokens, "merges": merges, "types": types}


@dataclass
class TinySpec:
    arch: str = "qwen2"
    n_layers: int = 2
    hidden: int = 256
    ffn: int = 512
    n_head: int = 4
    n_kv_head: int = 2
    context: int = 256
    rope_base: float = 1_000_000.0
    eps: float = 1e-6
    tied: bool = False
    matrix_type: GGMLQuantizationType = GGMLQuantizationType.Q8_0
    # name suffix -> type override, e.g. {"ffn_down.weight": Q6_K}
    overrides: dict = field(default_factory=dict)
    seed: int = 0
    fim: bool = False  # the tokenizer also has the fill-in-the-middle markers (after the three specials)


def tensor_plan(spec: TinySpec, vocab: int) -> list[tuple[str, tuple[int, ...], GGMLQuantizationType]]:
    """(name, numpy shape (ne1, ne0), type) in the order they are written."""
    hd = spec.hidden // spec.n_head
    F32 = GGMLQuantizationType.F32
    m = spec.matrix_type
    plan = [("token_embd.weight", (vocab, spec.hidden), m)]
    if not spec.tied:
        plan.append(("output.weight", (vocab, spec.hidden), m))
    plan.append(("output_norm.weight", (spec.hidden,), F32))
    for l in range(spec.n_layers):
        p = f"blk.{l}."
        plan += [
            (p + "attn_norm.weight", (spec.hidden,), F32),
            (p + "attn_q.weight", (spec.hidden, spec.hidden), m),
            (p + "attn_q.bias", (spec.hidden,), F32),
            (p + "attn_k.weight", (spec.n_kv_head * hd, spec.hidden), m),
            (p + "attn_k.bias", (spec.n_kv_head * hd,), F32),
            (p + "attn_v.weight", (spec.n_kv_head * hd, spec.hidden), m),
            (p + "attn_v.bias", (spec.n_kv_head * hd,), F32),
            (p + "attn_output.weight", (spec.hidden, spec.hidden), m),
            (p + "ffn_norm.weight", (spec.hidden,), F32),
            (p + "ffn_gate.weight", (spec.ffn, spec.hidden), m),
            (p + "ffn_up.weight", (spec.ffn, spec.hidden), m),
            (p + "ffn_down.weight", (spec.hidden, spec.ffn), m),
        ]
    out = []
    for name, shape, qtype in plan:
        for suffix, t in spec.overrides.items():
            if name.endswith(suffix):
                qtype = t
        out.append((name, shape, qtype))
    return out


def tiny_knot(directory: str | Path, spec: TinySpec | None = None, name: str = "tiny") -> Path:
    """A tiny model as a .knot in directory (its GGUF beside it): <name>.gguf encoded to <name>.knot."""
    from deploy.encoder import encode

    directory = Path(directory)
    out = directory / f"{name}.knot"
    encode(write_tiny_gguf(directory / f"{name}.gguf", spec), out, progress=False)
    return out


def write_tiny_gguf(path: str | Path, spec: TinySpec | None = None) -> Path:
    spec = spec or TinySpec()
    path = Path(path)
    tok = tiny_tokenizer(spec.fim)
    vocab = len(tok["tokens"])
    eot, im_end = tok["tokens"].index("<|endoftext|>"), tok["tokens"].index("<|im_end|>")
    rng = np.random.default_rng(spec.seed)
    w = GGUFWriter(str(path), spec.arch)
    w.add_name(f"tiny-{spec.arch}")
    w.add_block_count(spec.n_layers)
    w.add_context_length(spec.context)
    w.add_embedding_length(spec.hidden)
    w.add_feed_forward_length(spec.ffn)
    w.add_head_count(spec.n_head)
    w.add_head_count_kv(spec.n_kv_head)
    w.add_rope_freq_base(spec.rope_base)
    w.add_layer_norm_rms_eps(spec.eps)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2")
    w.add_token_list(tok["tokens"])
    w.add_token_merges(tok["merges"])
    w.add_token_types(tok["types"])
    w.add_bos_token_id(eot)
    w.add_eos_token_id(im_end)
    w.add_pad_token_id(eot)
    w.add_add_bos_token(False)
    w.add_chat_template(CHAT_TEMPLATE)
    for name, shape, qtype in tensor_plan(spec, vocab):
        if name.endswith("norm.weight"):
            x = (1.0 + 0.1 * rng.standard_normal(shape)).astype(np.float32)
        else:
            x = (rng.standard_normal(shape) / np.sqrt(shape[-1])).astype(np.float32)
        if qtype == GGMLQuantizationType.F32:
            w.add_tensor(name, x)
        else:
            q = random_k_blocks(qtype, shape, rng) if qtype in K_SCALE_FIELDS else quantize(x, qtype)
            w.add_tensor(name, q, raw_shape=q.shape, raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def rewrite_metadata(src: Path, dst: Path, edit) -> Path:
    """Copy a knot with its header metadata edited by edit(meta) (the payload is untouched)."""
    buf = Path(src).read_bytes()
    h = knot.parse_header(buf)
    meta = json.loads(json.dumps(h.metadata))
    edit(meta)
    Path(dst).write_bytes(knot.pack_header(meta) + buf[h.payload_offset:])
    return Path(dst)


def as_version_1(src: Path, dst: Path, crc32: bool = True) -> Path:
    """Copy a knot as format version 1 wrote it: no chunk digests (with crc32=False, no crc32 either,
    as before per-tensor checksums). The payload is untouched."""
    buf = Path(src).read_bytes()
    h = knot.parse_header(buf)
    meta = json.loads(json.dumps(h.metadata))
    meta["version"] = 1
    del meta["chunk_bytes"]
    for entry in (*meta["tensors"].values(), *meta["blobs"].values()):
        del entry["chunks"]
        if not crc32:
            del entry["crc32"]
    head = bytearray(knot.pack_header(meta))
    struct.pack_into("<H", head, 4, 1)  # the preamble's version
    Path(dst).write_bytes(bytes(head) + buf[h.payload_offset:])
    return Path(dst)
