"""The .knot container: layout byte for byte, the two-fetch reader, and the stale-knot guard."""
from __future__ import annotations

import asyncio
import hashlib
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
    table, payload, checksums = [], b"", {knot.TOKENIZER_BLOB: knot.checksum(blob)}
    for name, t, shape in tensors:
        n = tensor_nbytes(t, shape)
        table.append((name + name_pad, t, shape, n))
        data = rng.integers(0, 255, n, dtype=np.uint8).tobytes()
        checksums[name + name_pad] = knot.checksum(data)
        payload += data
    blobs = [(knot.TOKENIZER_BLOB, len(blob), knot.TOKENIZER_ENCODING)] if blob else []
    meta = knot.build_metadata("qwen2", HP, table, blobs, checksums=checksums)
    return knot.pack_header(meta) + payload + blob, meta


def prefix_knot(meta: dict, payload: bytes) -> bytes:
    """The PRE-2026-04-25 encoder: JSON padded with spaces, padded length written to metaLen."""
    js = json.dumps(meta, separators=(",", ":")).encode()
    while (10 + len(js)) % 4 != 3:
        js += b" "
    return knot.PREAMBLE.pack(knot.MAGIC, knot.VERSION, len(js)) + js + bytes([knot.MARKER]) + payload


@given(st.text(alphabet="abcxyz", max_size=11))
@settings(max_examples=40, deadline=None)
def test_layout_byte_for_byte(pad):
    buf, meta = make_knot(pad)
    magic, version, meta_len = struct.unpack_from("<4sHI", buf)
    assert (magic, version) == (b"KNOT", knot.VERSION)
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


# ------------------------------------------------------------ version 2: chunk digests and the digest

def chunked_knot(chunk_bytes: int = 256) -> tuple[bytes, knot.KnotHeader]:
    """A knot whose chunks are small (the reader takes the header's chunk_bytes), so that a few rows
    span several: a.weight 512 B (2 chunks), b.weight 68 B x 40 rows = 2,720 B (11, the last shorter)."""
    buf, meta = make_knot(tensors=[("a.weight", "F32", (32, 4)), ("b.weight", "Q8_0", (64, 40))],
                          blob=b"tokenizer bytes " * 30)
    h = knot.parse_header(buf)
    meta["chunk_bytes"] = chunk_bytes
    for name in [*meta["tensors"], *meta["blobs"]]:
        e = meta["tensors"].get(name) or meta["blobs"][name]
        a = h.payload_offset + e["offset"]
        hasher = knot.EntryHasher(chunk_bytes)
        for i in range(a, a + e["length"], 37):  # fed in pieces that straddle the chunks
            hasher.update(buf[i:min(i + 37, a + e["length"])])
        e["chunks"] = hasher.result().chunks
    out = knot.pack_header(meta) + buf[h.payload_offset:]
    return out, knot.parse_header(out, len(out))


def test_version_2_round_trip_carries_chunk_digests_and_the_digest():
    buf, h = chunked_knot()
    assert h.version == knot.VERSION == 2 and h.chunk_bytes == 256
    assert h.digest == hashlib.sha256(buf[:h.payload_offset]).hexdigest()
    for name in ("a.weight", "b.weight", knot.TOKENIZER_BLOB):
        a, b = h.entry_range(name)
        e = h.tensors.get(name) or h.blobs[name]
        assert e.chunks == b"".join(hashlib.sha256(buf[i:min(i + 256, b)]).digest()[:8] for i in range(a, b, 256))
        h.verify(name, buf[a:b])
    # the writers' default: 64 KiB chunks, from one call or from pieces
    data = np.random.default_rng(2).bytes(3 * knot.CHUNK_BYTES + 5)
    hasher = knot.EntryHasher()
    for i in range(0, len(data), 10_000):
        hasher.update(np.frombuffer(data[i:i + 10_000], np.uint8))
    assert hasher.result() == knot.checksum(data) and len(knot.checksum(data).chunks) == 4 * 16
    assert knot.checksum(b"") == knot.EntryChecksum(0, "")


def test_the_digest_changes_with_any_header_byte_and_not_with_the_payload():
    buf, h = chunked_knot()
    other, h2 = chunked_knot(chunk_bytes=512)
    assert h2.digest != h.digest
    flipped = bytearray(buf)
    flipped[-1] ^= 1
    assert knot.parse_header(bytes(flipped)).digest == h.digest  # a payload edit: the chunks catch it


@pytest.mark.parametrize("rel, want", [
    ((0, 0), (0, 0)), ((0, 1), (0, 256)), ((255, 257), (0, 512)), ((256, 512), (256, 512)),
    ((300, 2720), (256, 2720)), ((2600, 2719), (2560, 2720)), ((68, 136), (0, 256)),
])
def test_chunk_span_widens_to_chunk_edges(rel, want):
    _, h = chunked_knot()
    assert h.chunk_span("b.weight", *rel) == want
    with pytest.raises(knot.KnotError, match="out of range"):
        h.chunk_span("b.weight", 0, 2721)


@pytest.mark.parametrize("rows", [(0, 1), (3, 4), (3, 9), (37, 40), (0, 40)])
def test_a_flipped_byte_in_any_chunk_of_a_partial_read_is_caught(rows):
    buf, h = chunked_knot()
    base = h.tensor_range("b.weight")[0]
    r0, r1 = h.row_range("b.weight", *rows)
    a, b = h.chunk_span("b.weight", r0 - base, r1 - base)
    h.verify_range("b.weight", a, b, buf[base + a:base + b])  # intact
    for i in range(a, b):  # every byte of the span, rows and the widening alike
        bad = bytearray(buf[base + a:base + b])
        bad[i - a] ^= 0x10
        chunk = i // 256
        with pytest.raises(knot.CorruptKnot, match=rf"tensor b.weight: chunk {chunk} \(bytes {chunk * 256}:"
                                                   rf"{min(chunk * 256 + 256, 2720)} of the tensor\)"):
            h.verify_range("b.weight", a, b, bytes(bad))
    with pytest.raises(knot.CorruptKnot, match="bytes read for bytes"):
        h.verify_range("b.weight", a, b, buf[base + a:base + b - 1])
    if (a, b) != (r0 - base, r1 - base):
        with pytest.raises(knot.KnotError, match="not whole chunks"):
            h.verify_range("b.weight", r0 - base, r1 - base, buf[r0:r1])


def test_a_version_1_knot_is_refused_naming_the_cure():
    buf, meta = make_knot()
    h = knot.parse_header(buf)
    meta["version"] = 1
    v1 = knot.PREAMBLE.pack(knot.MAGIC, 1, 0)  # any metaLen: the version is read first
    for head in (v1, bytes(buf[:4]) + struct.pack("<H", 1) + bytes(buf[6:h.payload_offset])):
        with pytest.raises(knot.OldKnotVersion, match=r"version 1 has no per-chunk checksums.*`knot encode"):
            knot.parse_header(head + buf[h.payload_offset:])
    with pytest.raises(knot.KnotError, match="metadata says version 1, the preamble 2"):
        knot.parse_header(knot.pack_header(meta) + buf[h.payload_offset:])


def test_a_writer_must_give_every_entry_its_checksums():
    with pytest.raises(knot.KnotError, match="b.weight: no checksum given"):
        knot.build_metadata("qwen2", HP, [("b.weight", "Q8_0", (32, 2), 68)], checksums={})
