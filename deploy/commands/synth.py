"""`knot synth OUT.knot`: a qwen2 knot of random but valid blocks, 7B-shaped by default.

The default dimensions are qwen2.5-coder-7b's (28 layers, hidden 3,584, FFN 18,944, 28 heads, 4 KV
heads, vocabulary 152,064): about 4.7 GB, streamed to disk tensor by tensor in chunks of rows, so
memory stays at one chunk (<= 16 MiB) whatever the shape.

Types follow Q4_K_M (llama.cpp's llama_model_quantize for LLAMA_FTYPE_MOSTLY_Q4_K_M):
    attn_q, attn_k, attn_output, ffn_gate, ffn_up, token_embd   Q4_K
    attn_v, ffn_down   Q6_K in the "more bits" layers (the first and last eighth, and every third layer
                       in between: llama.cpp's use_more_bits(i, n)), Q4_K elsewhere
    output             Q6_K
    norms, biases      F32
Blocks: random bits with finite, small f16 super-scales (Q4_K d and dmin, Q6_K d), so every
tensor dequantizes to finite values; norms are 1 + small noise, biases small noise.

Tokenizer blob: 256 byte-level tokens, a few merges, "[PADn]" unused tokens up to the vocabulary,
then <|endoftext|> <|im_start|> <|im_end|> as control tokens (bos = pad = <|endoftext|>,
eos = <|im_end|>), and a ChatML template. The text it generates is noise; the point is the shape.
"""
from __future__ import annotations

import argparse
import os
from pathlib import Path

import numpy as np

NAME = "synth"
HELP = "write a qwen2 knot of random but valid Q4_K_M-patterned blocks (7B-shaped by default)"

CHUNK_BYTES = 16 << 20
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
TOKEN_NORMAL, TOKEN_CONTROL, TOKEN_UNUSED = 1, 3, 5
CHAT_TEMPLATE = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
MERGES = [("Ġ", "t"), ("h", "e"), ("Ġt", "he"), ("i", "n"), ("Ġ", "a"), ("d", "e"), ("Ġ", "d"),
          ("e", "f"), ("Ġd", "ef"), ("r", "e"), ("t", "u")]
# Byte offsets of the f16 super-scales in one block (ggml-common.h: block_q4_K d, dmin first;
# block_q6_K d last).
SCALE_FIELDS = {"Q4_K": (0, 2), "Q6_K": (208,)}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("out", help="the .knot to write")
    p.add_argument("--layers", type=int, default=28)
    p.add_argument("--hidden", type=int, default=3584)
    p.add_argument("--ffn", type=int, default=18944)
    p.add_argument("--heads", type=int, default=28)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--vocab", type=int, default=152064)
    p.add_argument("--context", type=int, default=32768)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def use_more_bits(i: int, n: int) -> bool:
    """llama.cpp's Q4_K_M rule for attn_v / ffn_down: Q6_K in these layers."""
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


def tensor_plan(layers: int, hidden: int, ffn: int, heads: int, kv_heads: int,
                vocab: int) -> list[tuple[str, str, tuple[int, ...]]]:
    """(name, ggml type, shape in GGUF order [ne0, ne1]) in file order."""
    if hidden % heads or heads % kv_heads:
        raise ValueError(f"hidden {hidden} must divide by heads {heads}, heads by kv-heads {kv_heads}")
    if hidden % 256 or ffn % 256:
        raise ValueError(f"hidden {hidden} and ffn {ffn} must be multiples of 256 (K-quant blocks)")
    kv = kv_heads * (hidden // heads)
    plan = [("output.weight", "Q6_K", (hidden, vocab)), ("token_embd.weight", "Q4_K", (hidden, vocab)),
            ("output_norm.weight", "F32", (hidden,))]
    for i in range(layers):
        p, more = f"blk.{i}.", use_more_bits(i, layers)
        plan += [
            (p + "attn_norm.weight", "F32", (hidden,)),
            (p + "attn_q.weight", "Q4_K", (hidden, hidden)),
            (p + "attn_q.bias", "F32", (hidden,)),
            (p + "attn_k.weight", "Q4_K", (hidden, kv)),
            (p + "attn_k.bias", "F32", (kv,)),
            (p + "attn_v.weight", "Q6_K" if more else "Q4_K", (hidden, kv)),
            (p + "attn_v.bias", "F32", (kv,)),
            (p + "attn_output.weight", "Q4_K", (hidden, hidden)),
            (p + "ffn_norm.weight", "F32", (hidden,)),
            (p + "ffn_gate.weight", "Q4_K", (hidden, ffn)),
            (p + "ffn_up.weight", "Q4_K", (hidden, ffn)),
            (p + "ffn_down.weight", "Q6_K" if more else "Q4_K", (ffn, hidden)),
        ]
    return plan


def synth_tokenizer(vocab: int) -> dict:
    from common.tokenizer import bytes_to_unicode

    b2u = bytes_to_unicode()
    tokens = [b2u[b] for b in range(256)] + [a + b for a, b in MERGES]
    n_pad = vocab - len(tokens) - len(SPECIALS)
    if n_pad < 0:
        raise ValueError(f"vocab {vocab} is below the {len(tokens) + len(SPECIALS)} tokens the tokenizer needs")
    types = [TOKEN_NORMAL] * len(tokens) + [TOKEN_UNUSED] * n_pad + [TOKEN_CONTROL] * len(SPECIALS)
    tokens += [f"[PAD{i}]" for i in range(len(tokens), len(tokens) + n_pad)] + SPECIALS
    eot, im_end = vocab - 3, vocab - 1
    return {"model": "gpt2", "pre": "qwen2", "tokens": tokens, "merges": [f"{a} {b}" for a, b in MERGES],
            "token_types": types, "bos_token_id": eot, "eos_token_id": im_end, "padding_token_id": eot,
            "add_bos_token": False, "chat_template": CHAT_TEMPLATE}


def tensor_chunks(name: str, ggml_type: str, shape: tuple[int, ...], rng):
    """The tensor's bytes, in chunks of whole rows of at most CHUNK_BYTES."""
    from common.quant import QUANT_TYPES, row_nbytes

    if ggml_type == "F32":
        n = int(np.prod(shape))
        x = (1.0 + 0.1 * rng.standard_normal(n)) if name.endswith("norm.weight") else 0.02 * rng.standard_normal(n)
        yield x.astype(np.float32).tobytes()
        return
    qt = QUANT_TYPES[ggml_type]
    ne0, n_rows = shape[0], int(np.prod(shape[1:]))
    rb = row_nbytes(ggml_type, ne0, name)
    rows_per_chunk = max(1, CHUNK_BYTES // rb)
    for a in range(0, n_rows, rows_per_chunk):
        n_blocks = (min(n_rows, a + rows_per_chunk) - a) * (ne0 // qt.block_elems)
        blocks = rng.integers(0, 256, (n_blocks, qt.block_bytes), dtype=np.uint8)
        for off in SCALE_FIELDS[ggml_type]:
            scale = (rng.uniform(0.5, 1.5, n_blocks) * 2e-3).astype(np.float16)
            blocks[:, off:off + 2] = scale.view(np.uint8).reshape(-1, 2)
        yield blocks.tobytes()


def write_synth(out: str | Path, *, layers=28, hidden=3584, ffn=18944, heads=28, kv_heads=4, vocab=152064,
                context=32768, seed=0, progress=False):
    """Write the knot (to OUT.partial, then renamed); return its parsed header."""
    from tqdm import tqdm

    from common import knot
    from common.quant import tensor_nbytes

    plan = tensor_plan(layers, hidden, ffn, heads, kv_heads, vocab)
    tok_blob = knot.encode_tokenizer_blob(synth_tokenizer(vocab))
    hd = hidden // heads
    hparams = {"block_count": layers, "embedding_length": hidden, "feed_forward_length": ffn,
               "head_count": heads, "head_count_kv": kv_heads, "rope_freq_base": 1_000_000.0,
               "rms_eps": 1e-6, "context_length": context, "vocab_size": vocab,
               "rope_dimension_count": hd, "key_length": hd, "value_length": hd}
    # The header (written first) carries each tensor's crc32: a first pass draws the same bytes from
    # the same seed to compute them.
    rng = np.random.default_rng(seed)
    checksums = {knot.TOKENIZER_BLOB: knot.checksum(tok_blob)}
    for name, t, shape in plan:
        h = knot.EntryHasher()
        for chunk in tensor_chunks(name, t, shape, rng):
            h.update(chunk)
        checksums[name] = h.result()
    metadata = knot.build_metadata(
        "qwen2", hparams, [(n, t, s, tensor_nbytes(t, s)) for n, t, s in plan],
        blobs=[(knot.TOKENIZER_BLOB, len(tok_blob), knot.TOKENIZER_ENCODING)],
        extra={"name": f"synthetic qwen2 {layers}x{hidden} (random Q4_K_M-patterned blocks)",
               "source": "knot synth", "synthetic": True},
        checksums=checksums)
    head = knot.pack_header(metadata)
    header = knot.parse_header(head)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)  # `knot synth /tmp/new-dir/x.knot` on a fresh machine
    tmp = out.with_name(out.name + ".partial")
    rng = np.random.default_rng(seed)
    with open(tmp, "wb") as f, tqdm(total=header.payload_nbytes, unit="B", unit_scale=True, unit_divisor=1024,
                                    desc=f"synth {out.name}", disable=not progress) as bar:
        f.write(head)
        for name, t, shape in plan:
            for chunk in tensor_chunks(name, t, shape, rng):
                f.write(chunk)
                bar.update(len(chunk))
        f.write(tok_blob)
        bar.update(len(tok_blob))
    header.check_size(tmp.stat().st_size)
    os.replace(tmp, out)
    return header


def run(args: argparse.Namespace) -> int:
    header = write_synth(args.out, layers=args.layers, hidden=args.hidden, ffn=args.ffn, heads=args.heads,
                         kv_heads=args.kv_heads, vocab=args.vocab, context=args.context, seed=args.seed,
                         progress=not args.no_progress)
    size = header.expected_file_size
    print(f"{args.out}: {len(header.tensors)} tensors, {size:,} bytes ({size / 2**30:.2f} GiB)")
    return 0
