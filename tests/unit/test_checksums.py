"""Checksums of weight bytes: the knot's per-tensor crc32 and chunk digests (version 1 refused), crc32_combine,
the seals of cache entries, the tensor frame's payload crc32, and the KV row value format."""
from __future__ import annotations

import hashlib
import zlib

import isal.isal_zlib
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from common import integrity, knot, wire
from common.integrity import CacheKey, crc32_combine, seal
from deploy.cli import main
from deploy.knotfile import open_model
from services.embed_cache import decode_row, encode_row
from tests.tiny_gguf import as_version_1, rewrite_metadata

KEY = CacheKey("the-clusters-internal-secret-of-43-characters")


@given(st.binary(max_size=300), st.binary(max_size=300))
@settings(max_examples=200, deadline=None)
def test_crc32_combine_equals_the_crc_of_the_concatenation(a, b):
    assert crc32_combine(zlib.crc32(a), zlib.crc32(b), len(b)) == zlib.crc32(a + b)


def test_crc32_combine_on_long_inputs():
    rng = np.random.default_rng(0)
    a, b = rng.bytes(5000), rng.bytes((1 << 20) + 7)
    assert crc32_combine(zlib.crc32(a), zlib.crc32(b), len(b)) == zlib.crc32(a + b)


def test_the_one_crc32_is_isals_and_agrees_with_zlibs_on_awkward_buffers():
    # isal is a base dependency: a failed import would silently fall back to zlib's (10x slower)
    assert integrity.crc32 is isal.isal_zlib.crc32
    rng = np.random.default_rng(1)
    big = rng.bytes((3 << 20) + 5)  # several MiB, odd length
    for n in (0, 1, 7, 15, 16, 17, 63, 4097, 65537, len(big)):
        assert integrity.crc32(big[:n]) == zlib.crc32(big[:n]), n
        assert integrity.crc32(big[:n], 0xDEADBEEF) == zlib.crc32(big[:n], 0xDEADBEEF), n  # a running value
    view = memoryview(big)
    for a, b in ((1, 4098), (3, 3 + 7), (5, len(big) - 11), (4096, 4096)):
        assert integrity.crc32(view[a:b]) == zlib.crc32(view[a:b]), (a, b)  # unaligned slices of one buffer
    words = np.frombuffer(big[:4 * 1001], dtype=np.float32).reshape(7, 143)
    for arr in (words, words[2:5], words[3], words.T.copy()):  # numpy buffers, C-contiguous
        assert integrity.crc32(arr) == zlib.crc32(arr.tobytes())
    for strided in (view[::2], words[:, 1:3], words.T):  # not contiguous: both refuse, neither guesses
        with pytest.raises((BufferError, TypeError, ValueError)):
            integrity.crc32(strided)
        with pytest.raises((BufferError, TypeError, ValueError)):
            zlib.crc32(strided)


def test_seal_holds_only_for_the_same_version_and_bytes():
    data = np.arange(64, dtype=np.float32)
    s = seal("v1", data)
    assert s.nbytes == 256 and s.problem("v1", data) is None
    assert "version" in s.problem("v2", data)
    bad = data.copy()
    bad[3] += 1
    assert "crc32" in s.problem("v1", bad)
    assert "bytes" in s.problem("v1", data[:-1])


def test_frame_carries_its_payload_crc_and_a_false_one_is_caught():
    payload = bytes(range(200))
    frame = wire.TensorFrame("t", "F32", (50, 1), payload, 3)
    assert wire.decode_tensor(wire.encode_tensor(frame)).payload_crc32 == zlib.crc32(payload)
    # An encoder handed the crc of other bytes (a cache entry changed since it was sealed):
    stale = wire.TensorFrame("t", "F32", (50, 1), payload, 3, payload_crc32=zlib.crc32(payload[::-1]))
    with pytest.raises(wire.ChecksumMismatch):
        wire.decode_tensor(wire.encode_tensor(stale))


def test_kv_row_value_is_checked_for_version_row_length_and_content():
    vec = np.linspace(-1, 1, 16, dtype=np.float32)
    value = encode_row(KEY, "k7", "etag-a", 7, vec)
    np.testing.assert_array_equal(decode_row(KEY, "k7", value, "etag-a", 7, 16), vec)
    assert "version" in decode_row(KEY, "k7", value, "etag-b", 7, 16)
    assert "row 7" in decode_row(KEY, "k7", value, "etag-a", 8, 16)
    assert "payload of 64 bytes" in decode_row(KEY, "k7", value, "etag-a", 7, 8)
    flipped = bytearray(value)
    flipped[-5] ^= 0x40  # the right length, the wrong content
    assert "crc32" in decode_row(KEY, "k7", bytes(flipped), "etag-a", 7, 16)
    assert "magic" in decode_row(KEY, "k7", vec.tobytes(), "etag-a", 7, 16)  # a value in the old, unchecked layout
    assert "shorter" in decode_row(KEY, "k7", b"\x00" * 5, "etag-a", 7, 16)


# ------------------------------------------------------------ the knot's checksums


def test_encoder_writes_a_crc32_and_chunk_digests_for_every_tensor_and_blob_and_they_hold(tiny_knot):
    data = tiny_knot.read_bytes()
    h = knot.parse_header(data, len(data))
    assert h.chunk_bytes == knot.CHUNK_BYTES
    for name in [*h.tensors, *h.blobs]:
        a, b = h.entry_range(name)
        e = h.tensors.get(name) or h.blobs[name]
        assert e.crc32 == zlib.crc32(data[a:b])
        assert e.chunks == b"".join(hashlib.sha256(data[i:min(i + knot.CHUNK_BYTES, b)]).digest()[:8]
                                    for i in range(a, b, knot.CHUNK_BYTES))
        h.verify(name, data[a:b])
    a, b = h.tensor_range("blk.0.attn_q.weight")
    bad = bytearray(data[a:b])
    bad[10] ^= 1
    with pytest.raises(knot.CorruptKnot, match="blk.0.attn_q.weight: crc32 .* the knot header says"):
        h.verify("blk.0.attn_q.weight", bytes(bad))


@pytest.mark.parametrize("crc32", [True, False])
def test_a_version_1_knot_is_refused_with_the_hint_to_re_encode(tiny_knot, tmp_path, crc32):
    old = as_version_1(tiny_knot, tmp_path / "old.knot", crc32=crc32)
    with pytest.raises(knot.OldKnotVersion, match=r"version 1 .* re-encode it with `knot encode"):
        open_model(old)


@pytest.mark.parametrize("crc", [-1, 1 << 32, "0xdead", 1.5, True])
def test_a_malformed_crc32_field_is_refused(tiny_knot, tmp_path, crc):
    def edit(meta):
        meta["tensors"]["output_norm.weight"]["crc32"] = crc

    with pytest.raises(knot.KnotError, match="output_norm.weight: crc32 .* unsigned 32-bit"):
        open_model(rewrite_metadata(tiny_knot, tmp_path / "bad.knot", edit))


@pytest.mark.parametrize("edit, match", [
    (lambda e: e.pop("chunks"), "chunks is None, expected 48"),
    (lambda e: e.update(chunks=e["chunks"][:-16]), "chunks is 32 hex digits, expected 48"),
    (lambda e: e.update(chunks=e["chunks"] + "00"), "chunks is 50 hex digits, expected 48"),
    (lambda e: e.update(chunks="zz" + e["chunks"][2:]), "chunks is not 48 hexadecimal digits"),
    (lambda e: e.update(chunks=" " + e["chunks"][1:]), "chunks is not 48 hexadecimal digits"),
    (lambda e: e.update(chunks=7), "chunks is 7, expected 48"),
])
def test_a_malformed_chunks_field_is_refused(tiny_knot, tmp_path, edit, match):
    def apply(meta):
        # 512 rows of 256 Q8_0 = 139,264 bytes: 3 chunks of 64 KiB (the last shorter), 48 hex digits
        assert meta["tensors"]["blk.0.ffn_up.weight"]["length"] == 139264
        edit(meta["tensors"]["blk.0.ffn_up.weight"])

    with pytest.raises(knot.KnotError, match="blk.0.ffn_up.weight: " + match):
        open_model(rewrite_metadata(tiny_knot, tmp_path / "bad.knot", apply))


@pytest.mark.parametrize("chunk_bytes", [0, -1, "65536", 1.5, None, 1 << 31])
def test_a_malformed_chunk_bytes_is_refused(tiny_knot, tmp_path, chunk_bytes):
    def edit(meta):
        meta["chunk_bytes"] = chunk_bytes

    with pytest.raises(knot.KnotError, match="chunk_bytes .* is not an integer"):
        open_model(rewrite_metadata(tiny_knot, tmp_path / "bad.knot", edit))


def run_inspect(capsys, *argv):
    code = main(["inspect", *map(str, argv)])
    return code, capsys.readouterr().out


def test_inspect_reports_checksums_and_verify_finds_corrupt_bytes(tiny_knot, tmp_path, capsys):
    code, out = run_inspect(capsys, tiny_knot, "--tensors", "0")
    assert code == 0 and "crc32 and SHA-256 of 64 KiB chunks on 28 tensors and blobs" in out and "not verified" in out
    assert f"digest          {knot.parse_header(tiny_knot.read_bytes()).digest}" in out
    code, out = run_inspect(capsys, tiny_knot, "--verify", "--tensors", "0")
    assert code == 0 and "verified: all valid" in out

    data = bytearray(tiny_knot.read_bytes())
    h = knot.parse_header(bytes(data))
    a, _ = h.tensor_range("blk.1.ffn_up.weight")
    data[a + 100] ^= 0xFF  # same size, one byte changed: the stale guard cannot see it
    corrupt = tmp_path / "corrupt.knot"
    corrupt.write_bytes(bytes(data))
    code, out = run_inspect(capsys, corrupt, "--tensors", "0")
    assert code == 0 and "not verified" in out
    code, out = run_inspect(capsys, corrupt, "--verify", "--tensors", "0")
    assert code == 1 and "verified: 1 MISMATCHED" in out
    assert "CORRUPT         tensor blk.1.ffn_up.weight: crc32" in out



def test_init_replaces_a_version_1_bucket_knot_once(tiny_knot, tmp_path):
    from deploy.local.init import upload_dir

    bucket = tmp_path / "bucket"
    bucket.mkdir()
    as_version_1(tiny_knot, bucket / "m.knot")  # what an older encoder uploaded
    assert upload_dir(bucket, "m.knot", str(tiny_knot)).startswith("copied")
    assert (bucket / "m.knot").read_bytes() == tiny_knot.read_bytes()
    assert upload_dir(bucket, "m.knot", str(tiny_knot)).endswith("already present, not copying")
