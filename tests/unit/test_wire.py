"""Tensor frames and batches: decode(encode(x)) == x; every corruption names what is wrong."""
import struct

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from common import wire
from common.wire import TensorFrame

frames = st.builds(
    TensorFrame,
    name=st.text(min_size=0, max_size=40),
    ggml_type=st.sampled_from(["F32", "F16", "Q4_K", "Q6_K", "Q8_0"]),
    shape=st.lists(st.integers(0, 2**40), max_size=4).map(tuple),
    payload=st.binary(max_size=300),
    row_start=st.integers(0, 2**63),
)


@settings(max_examples=200, deadline=None)
@given(frames)
def test_tensor_roundtrip(frame):
    assert wire.decode_tensor(wire.encode_tensor(frame)) == frame


@settings(max_examples=100, deadline=None)
@given(st.lists(frames, max_size=6))
def test_batch_roundtrip(batch):
    assert wire.decode_batch(wire.encode_batch(batch)) == batch


FRAME = TensorFrame("blk.0.attn_q.weight", "Q8_0", (32, 2), bytes(range(68)), row_start=3)


def _known(buf: bytes, sizes: list[int]) -> dict[int, tuple[int, int]]:
    """What a binding that copied each frame (of these encoded sizes, after the batch header) reports."""
    from common.integrity import crc32
    out, at = {}, 12
    for n in sizes:
        out[at] = (n, crc32(buf[at:at + n]))
        at += n
    return out


@settings(max_examples=100, deadline=None)
@given(st.lists(frames, min_size=1, max_size=6), st.data())
def test_crc32s_known_from_the_copy_give_the_same_frames(batch, data):
    """A frame whose whole crc32 the binding computed as it copied it is not hashed again: the
    frames, payload_crc32 included, equal a full decode's; a flipped byte is still caught."""
    sizes = [len(wire.encode_tensor(f)) for f in batch]
    buf = wire.encode_batch(batch)
    got = wire.decode_batch(buf, _known(buf, sizes))
    full = wire.decode_batch(buf)
    assert got == full and [f.payload_crc32 for f in got] == [f.payload_crc32 for f in full]
    bad = bytearray(buf)
    i = data.draw(st.integers(12, len(buf) - 1))
    bad[i] ^= data.draw(st.integers(1, 255))
    with pytest.raises(wire.WireError):
        wire.decode_batch(bytes(bad), _known(bytes(bad), sizes))  # the crc32s of the changed bytes


@settings(max_examples=150, deadline=None)
@given(st.lists(frames, max_size=6), st.data())
def test_a_batch_in_parts_decodes_as_the_joined_batch(batch, data):
    """decode_batch over the buffers a body concatenates (Response.parts), cut anywhere: the same
    frames as the joined body, errors included; a frame inside one part is a view of that part
    (a LayerWarden's large frame, read in place from its block), not a copy."""
    import numpy as np

    buf = wire.encode_batch(batch)
    cuts = sorted(data.draw(st.lists(st.integers(0, len(buf)), max_size=5)))
    parts = [buf[a:b] for a, b in zip([0, *cuts], [*cuts, len(buf)])]
    assert wire.decode_batch(parts) == batch
    sizes = [len(wire.encode_tensor(f)) for f in batch]
    whole = [np.frombuffer(buf[a - n:a], np.uint8) for a, n in zip(np.cumsum([12, *sizes])[1:], sizes)]
    framed = [buf[:12], *(memoryview(w) for w in whole)]  # each frame its own part, as blocks come
    got = wire.decode_batch(framed)
    assert got == batch
    for f, w in zip(got, whole):
        assert not f.payload or np.shares_memory(np.frombuffer(f.payload, np.uint8), w), "read in place"
    if batch:  # one byte short, the cut kept: the last frame's crc32 is truncated
        short = [p for p in parts if p]
        short[-1] = short[-1][:-1]
        with pytest.raises(wire.TruncatedFrame):
            wire.decode_batch(short)


def test_a_known_crc32_is_used_only_for_exactly_its_frame():
    buf = wire.encode_batch([FRAME, FRAME])
    n = len(wire.encode_tensor(FRAME))
    with pytest.raises(wire.ChecksumMismatch, match="do not match its crc32 .* as they were copied"):
        wire.decode_batch(buf, {12: (n, 0x12345678)})
    assert wire.decode_batch(buf, {12: (n - 1, 0x12345678), 13: (n, 0)}) == [FRAME, FRAME], "not this frame's range"


def test_layout_of_the_fixed_header():
    buf = wire.encode_tensor(FRAME)
    magic, version, flags, name_len, type_len, ndim, _, row_start, payload_len = struct.unpack_from(
        "<4sBBHBBHQQ", buf)
    assert (magic, version, flags) == (b"KTNS", 1, 0)
    assert (name_len, type_len, ndim, row_start, payload_len) == (19, 4, 2, 3, 68)
    assert len(buf) == 28 + 19 + 4 + 16 + 68 + 4


@settings(max_examples=200, deadline=None)
@given(st.data())
def test_any_single_flipped_byte_is_detected(data):
    buf = bytearray(wire.encode_tensor(FRAME))
    i = data.draw(st.integers(0, len(buf) - 1))
    buf[i] ^= data.draw(st.integers(1, 255))
    with pytest.raises(wire.WireError):
        wire.decode_tensor(bytes(buf))


def test_errors_name_the_problem():
    buf = wire.encode_tensor(FRAME)
    with pytest.raises(wire.BadMagic, match="magic b'XTNS'"):
        wire.decode_tensor(b"X" + buf[1:])
    with pytest.raises(wire.UnsupportedVersion, match="version 9"):
        wire.decode_tensor(buf[:4] + b"\x09" + buf[5:])
    with pytest.raises(wire.TruncatedFrame, match="payload of blk.0.attn_q.weight needs 68 bytes"):
        wire.decode_tensor(buf[:80])
    corrupt = bytearray(buf)
    corrupt[80] ^= 1  # inside the payload
    with pytest.raises(wire.ChecksumMismatch, match="68 payload bytes"):
        wire.decode_tensor(bytes(corrupt))
    with pytest.raises(wire.MalformedFrame, match="3 trailing bytes"):
        wire.decode_tensor(buf + b"abc")
    batch = wire.encode_batch([FRAME, FRAME])
    with pytest.raises(wire.TruncatedFrame, match="frame 1 of 2"):
        wire.decode_batch(batch[:-10])
    with pytest.raises(wire.BadMagic):
        wire.decode_batch(buf)


def test_warden_request_bodies_round_trip_and_refuse_what_they_cannot_carry():
    names = ["blk.0.attn_q.weight", "output_norm.weight", "blk.1.ffn_up.weight"]
    assert wire.decode_names(wire.encode_names(names)) == names
    with pytest.raises(ValueError, match="no newline"):
        wire.encode_names(["a\nb"])
    with pytest.raises(wire.WireError, match="non-empty"):
        wire.decode_names(b"")
    rows = [0, 5, 151935, 5]
    assert wire.decode_rows(wire.encode_rows(rows)) == rows
    assert wire.encode_rows([1]) == b"\x01\x00\x00\x00"  # int32 little-endian
    with pytest.raises(wire.WireError, match="multiple of 4"):
        wire.decode_rows(b"\x00" * 6)


# ---------------------------------------------------------------- bundles


def test_a_bundle_round_trips_its_parts_and_statuses():
    parts = [(0, wire.encode_envelope(wire.Envelope("r1", "decode", 3, 4, np.ones((1, 4), np.float32)))),
             (409, b'{"error": "UnknownSession", "message": "gone"}'), (200, b"")]
    got = wire.decode_bundle(wire.encode_bundle(parts))
    assert [(s, bytes(b)) for s, b in got] == parts
    assert wire.decode_envelope(got[0][1]).request_id == "r1"


@pytest.mark.parametrize("damage, needle", [
    (lambda b: b"KXXX" + b[4:], "magic"),
    (lambda b: b[:4] + bytes([2]) + b[5:], "version"),
    (lambda b: b[:5] + bytes([1]) + b[6:], "flags"),
    (lambda b: b[:-1], "part 1 \\(4 bytes\\) needs 4 bytes"),
    (lambda b: b + b"x", "trailing"),
    (lambda b: b[:8] + bytes([b[8] ^ 1]) + b[9:], "crc32"),
    (lambda b: b[:6] + b"\x00\x00" + b[8:], "0 parts"),
], ids=["magic", "version", "flags", "truncated", "trailing", "table crc", "no parts"])
def test_a_damaged_bundle_is_refused_naming_what(damage, needle):
    body = wire.encode_bundle([(0, b"abc"), (0, b"defg")])
    with pytest.raises(wire.WireError, match=needle):
        wire.decode_bundle(damage(body))


def test_a_bundle_holds_one_to_max_parts():
    with pytest.raises(ValueError, match="parts"):
        wire.encode_bundle([])
    with pytest.raises(ValueError, match="parts"):
        wire.encode_bundle([(0, b"")] * (wire.MAX_BUNDLE + 1))
