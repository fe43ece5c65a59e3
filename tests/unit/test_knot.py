"""The .knot container: layout byte for byte, the two-fetch reader, and the stale-knot guard."""
from __future__ import annotations

import asyncio
import json
import struct

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from common import knot
from common.quant import tensor_nbytes

HP = {"block_count": 1, "embedding_length": 32, "feed_forward_length": 64, "head_count": 2,
      "head_count_kv": 1, "rope_freq_base": 10000.0, "rms_eps": 1e-6, "context_length": 64, "vocab_size": 4}


def make_knot(name_pad: str = "", tensors=None, blob: bytes = b"") -> tuple[bytes, dict]:
    """A small valid knot: returns (file bytes, metadata)."""
    tensors = tensors or [("a.weight", "F32", (32, 4)), ("b.weight", "Q8_0", (32, 2))]
    rng = np.random.default_rng(1)
    table, payload = [], b""
    for name, t, shape in tensors:
        n = tensor_nbytes(t, shape)
        table.append((name + name_pad, t, shape, n))
        payload += rng.integers(0, 255, n, dtype=np.uint8).tobytes()
    blobs = [(knot.TOKENIZER_BLOB, len(blob), knot.TOKENIZER_ENCODING)] if blob else []
    meta = knot.build_metadata("qwen2", HP, table, blobs)
    return knot.pack_header(meta) + payload + blob, meta


def prefix_knot(meta: dict, payload: bytes) -> bytes:
    """The PRE-2026-04-25 encoder: JSON padded with spaces, padded length written to metaLen."""
    js = json.dumps(meta, separators=(",", ":")).encode()
    while (10 + len(js)) % 4 != 3:
        js += b" "
    return knot.PREAMBLE.pack(knot.MAGIC, 1, len(js)) + js + bytes([knot.MARKER]) + payload


@given(st.text(alphabet="abcxyz", max_size=11))
@settings(max_examples=40, deadline=None)
def test_layout_byte_for_byte(pad):
    buf, meta = make_knot(pad)
    magic, version, meta_len = struct.unpack_from("<4sHI", buf)
    assert (magic, version) == (b"KNOT", 1)
    js = json.dumps(meta, separators=(",", ":")).encode()
    assert meta_len == len(js)  # UNPADDED
    assert buf[10:10 + meta_len] == js
    align = (10 + meta_len + 3) & ~3
    assert buf[10 + meta_len:align] == b"\x00" * (align - 10 - meta_len)
    assert buf[align] == 0x40
    h = knot.parse_header(buf, file_size=len(buf))
    assert h.payload_offset == align + 1
    assert len(buf) == h.payload_offset + h.payload_nbytes
    # tensors lie contiguous in metadata order
    entries = list(h.tensors.values())
    assert entries[0].offset == 0 and entries[1].offset == entries[0].length


def test_tensor_and_row_ranges():
    buf, _ = make_knot()
    h = knot.parse_header(buf, len(buf))
    a, b = h.tensor_range("b.weight")
    assert b - a == 2 * 34
    ra, rb = h.row_range("b.weight", 1, 2)
    assert (ra, rb) == (a + 34, a + 68)
    with pytest.raises(knot.KnotError, match="out of range"):
        h.row_range("b.weight", 1, 3)
    with pytest.raises(knot.UnknownTensor, match="unknown tensor 'nope'"):
        h.tensor_range("nope")


def test_tensor_type_alias_is_accepted():
    buf, meta = make_knot()
    for t in meta["tensors"].values():
        t["tensor_type"] = t.pop("type")
    payload = buf[knot.parse_header(buf).payload_offset:]
    buf2 = knot.pack_header(meta) + payload
    h = knot.parse_header(buf2, len(buf2))
    assert h.tensors["b.weight"].ggml_type == "Q8_0"


def test_missing_type_field_is_an_error():
    buf, meta = make_knot()
    del meta["tensors"]["a.weight"]["type"]
    with pytest.raises(knot.KnotError, match="neither \"type\" nor \"tensor_type\""):
        knot.parse_header(knot.pack_header(meta))


def test_wrong_length_is_an_error():
    buf, meta = make_knot()
    meta["tensors"]["b.weight"]["length"] = 67
    with pytest.raises(knot.KnotError, match="length 67 bytes, expected 68"):
        knot.parse_header(knot.pack_header(meta))


def test_stale_prefix_knot_guard_fires():
    buf, meta = make_knot()
    good = knot.parse_header(buf)
    payload = buf[good.payload_offset:]
    stale = prefix_knot(meta, payload)
    # The reader's payloadOffset is one byte past the real payload start, so the size
    # no longer adds up: the guard names both numbers.
    with pytest.raises(knot.StaleKnotError) as e:
        knot.parse_header(stale, file_size=len(stale))
    msg = str(e.value)
    po = len(stale) - len(payload) + 1  # one byte past where the pre-fix encoder put the payload
    assert f"file size {len(stale)} bytes != payloadOffset {po}" in msg, msg
    assert "re-encode" in msg and "one byte before payloadOffset" in msg
    # Without the size, the misplaced codec marker is a second symptom.
    with pytest.raises(knot.StaleKnotError, match="expected the codec marker 0x40"):
        knot.parse_header(stale)


def test_stale_guard_fires_even_when_marker_looks_right():
    buf, meta = make_knot()
    good = knot.parse_header(buf)
    payload = bytearray(buf[good.payload_offset:])
    payload[0] = knot.MARKER  # the byte the reader mistakes for the marker... is the payload's first
    stale = prefix_knot(meta, bytes(payload))
    with pytest.raises(knot.StaleKnotError, match=r"file size \d+ bytes != payloadOffset"):
        knot.parse_header(stale, file_size=len(stale))


def test_truncated_and_not_a_knot():
    buf, _ = make_knot()
    with pytest.raises(knot.StaleKnotError, match="cut short"):
        knot.parse_header(buf, file_size=len(buf) - 5)
    with pytest.raises(knot.TruncatedKnot, match="header truncated"):
        knot.parse_header(buf[:40])
    with pytest.raises(knot.TruncatedKnot):
        knot.parse_header(buf[:6])
    with pytest.raises(knot.NotAKnot, match="magic"):
        knot.parse_header(b"GGUF" + buf[4:])


def test_two_fetch_reader():
    buf, _ = make_knot("x" * 300)
    calls = []

    async def read_range(a, b):
        calls.append((a, b))
        return buf[a:b]

    h = asyncio.run(knot.read_header(read_range, file_size=len(buf), probe_bytes=64))
    assert calls == [(0, 64), (64, h.payload_offset)]
    assert h.tensors == knot.parse_header(buf).tensors
    calls.clear()
    asyncio.run(knot.read_header(read_range, probe_bytes=1 << 16))
    assert len(calls) == 1
    # sync variant, same contract
    h2 = knot.read_header_sync(lambda a, b: buf[a:b], file_size=len(buf), probe_bytes=16)
    assert h2.payload_offset == h.payload_offset


def test_two_fetch_reader_truncated_object():
    buf, _ = make_knot("x" * 300)

    async def read_range(a, b):
        return buf[: min(b, 100)][a:]

    with pytest.raises(knot.TruncatedKnot):
        asyncio.run(knot.read_header(read_range, probe_bytes=200))


def test_tokenizer_blob_roundtrip_and_corruption():
    data = {"tokens": ["a", "ü", "<|im_start|>"], "merges": ["a b"], "chat_template": "{{x}}"}
    blob = knot.encode_tokenizer_blob(data)
    buf, _ = make_knot(blob=blob)
    h = knot.parse_header(buf, len(buf))
    a, b = h.blob_range(knot.TOKENIZER_BLOB)
    assert knot.decode_tokenizer_blob(buf[a:b]) == data
    assert len(h.metadata["blobs"]) == 1 and "tokens" not in json.dumps(h.metadata)
    with pytest.raises(knot.KnotError, match="corrupt"):
        knot.decode_tokenizer_blob(buf[a:b - 3])
