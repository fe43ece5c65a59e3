"""knot encode / inspect / dump on a tiny GGUF written by gguf-py; every error is one line, exit 1."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys

import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from gguf import GGUFReader
from gguf.quants import dequantize as gguf_dequantize

from common import knot
from deploy.cli import main
from deploy.encoder import encode
from deploy.knotfile import open_model
from tests.tiny_gguf import TinySpec, write_tiny_gguf

MIXED = TinySpec(matrix_type=Q.Q5_0, overrides={"ffn_down.weight": Q.Q6_K, "ffn_up.weight": Q.Q4_K,
                                                "attn_v.weight": Q.Q8_0, "output.weight": Q.Q6_K,
                                                "attn_k.weight": Q.F16})


@pytest.fixture(scope="module")
def mixed(tmp_path_factory):
    d = tmp_path_factory.mktemp("mixed")
    g = write_tiny_gguf(d / "mixed.gguf", MIXED)
    k = d / "mixed.knot"
    encode(g, k, progress=False)
    return g, k


def run_cli(capsys, *argv):
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_encode_copies_every_tensor_verbatim(mixed):
    g, k = mixed
    reader = GGUFReader(g)
    model = open_model(k)
    assert list(model.header.tensors) == [t.name for t in reader.tensors]
    for t in reader.tensors:
        ours = model.tensor(t.name)
        assert ours.ggml_type == t.tensor_type.name
        assert list(ours.shape) == [int(d) for d in t.shape]
        raw = reader.data[t.data_offset:t.data_offset + t.n_bytes]
        assert np.array_equal(ours.data, raw), t.name
    assert k.stat().st_size == model.header.expected_file_size


def test_encode_carries_hparams_and_tokenizer(mixed):
    g, k = mixed
    model = open_model(k)
    hp = model.header.hparams
    assert (hp["block_count"], hp["embedding_length"], hp["head_count"], hp["head_count_kv"]) == (2, 256, 4, 2)
    assert hp["vocab_size"] == len(model.tokenizer_data()["tokens"])
    tok = model.tokenizer_data()
    assert tok == open_model(g).tokenizer_data()
    assert tok["tokens"][-2] == "<|im_start|>" and tok["token_types"][-2] == 3
    assert tok["chat_template"].startswith("{% for message in messages %}")
    assert tok["eos_token_id"] == len(tok["tokens"]) - 1 and tok["add_bos_token"] is False
    # the header stays small: the tokenizer is a blob, not header JSON
    assert "merges" not in json.dumps(model.header.metadata)


def test_dump_is_bit_exact_with_gguf(mixed, tmp_path, capsys):
    g, k = mixed
    reader = GGUFReader(g)
    seen = set()
    for t in reader.tensors:
        if t.tensor_type in seen and not t.name.startswith("output"):
            continue
        seen.add(t.tensor_type)
        out = tmp_path / "t.npy"
        code, _, err = run_cli(capsys, "dump", k, t.name, "-o", out)
        assert code == 0, err
        want = gguf_dequantize(reader.data[t.data_offset:t.data_offset + t.n_bytes], t.tensor_type)
        want = want.reshape(tuple(int(d) for d in reversed(t.shape)))
        np.testing.assert_array_equal(np.load(out), want)
    assert {Q.Q5_0, Q.Q6_K, Q.Q4_K, Q.Q8_0, Q.F16, Q.F32} <= seen


def test_dump_rows_reads_only_those_rows(mixed, tmp_path, capsys):
    g, k = mixed
    whole, part = tmp_path / "w.npy", tmp_path / "p.npy"
    assert run_cli(capsys, "dump", k, "token_embd.weight", "-o", whole)[0] == 0
    assert run_cli(capsys, "dump", k, "token_embd.weight", "--rows", "7:19", "-o", part)[0] == 0
    np.testing.assert_array_equal(np.load(part), np.load(whole)[7:19])


def test_inspect_prints_table_and_stale_check(mixed, capsys):
    _, k = mixed
    code, out, _ = run_cli(capsys, "inspect", k)
    assert code == 0
    h = open_model(k).header
    assert f"payloadOffset {h.payload_offset}" in out and "stale check     OK" in out
    assert "blk.1.ffn_down.weight" in out and "Q6_K" in out and "embedding_length" in out
    code, out, _ = run_cli(capsys, "inspect", "--json", k)
    assert json.loads(out)["hparams"]["block_count"] == 2


def _one_line_error(code, err, *needles):
    assert code == 1
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    for n in needles:
        assert n in lines[0], lines[0]


def test_errors_are_one_line(mixed, tmp_path, capsys):
    g, k = mixed
    _one_line_error(*run_cli(capsys, "inspect", g)[::2], "a GGUF, not a knot")
    junk = tmp_path / "junk.knot"
    junk.write_bytes(b"hello world, not a knot at all")
    _one_line_error(*run_cli(capsys, "inspect", junk)[::2], "neither a knot nor a GGUF")
    cut = tmp_path / "cut.knot"
    cut.write_bytes(k.read_bytes()[:-100])
    _one_line_error(*run_cli(capsys, "inspect", cut)[::2], "cut short", "re-encode")
    head = tmp_path / "head.knot"
    head.write_bytes(k.read_bytes()[:50])
    _one_line_error(*run_cli(capsys, "inspect", head)[::2], "truncated")
    _one_line_error(*run_cli(capsys, "dump", k, "blk.9.nope", "-o", tmp_path / "x.npy")[::2],
                    "unknown tensor 'blk.9.nope'")
    _one_line_error(*run_cli(capsys, "dump", k, "token_embd.weight", "--rows", "5:100000",
                             "-o", tmp_path / "x.npy")[::2], "out of range")
    _one_line_error(*run_cli(capsys, "dump", k, "token_embd.weight", "--rows", "five",
                             "-o", tmp_path / "x.npy")[::2], "expected A:B")
    _one_line_error(*run_cli(capsys, "inspect", tmp_path / "missing.knot")[::2], "no such model file")


def test_stale_knot_is_refused_by_every_reader(mixed, tmp_path, capsys):
    """A pre-fix knot: JSON padded with spaces inside metaLen. No path may read it."""
    _, k = mixed
    buf = k.read_bytes()
    h = knot.parse_header(buf)
    js = json.dumps(h.metadata, separators=(",", ":"), ensure_ascii=False).encode()
    while (10 + len(js)) % 4 != 3:
        js += b" "
    stale = tmp_path / "stale.knot"
    stale.write_bytes(knot.PREAMBLE.pack(knot.MAGIC, knot.VERSION, len(js)) + js + bytes([knot.MARKER])
                      + buf[h.payload_offset:])
    with pytest.raises(knot.StaleKnotError):
        open_model(stale)
    _one_line_error(*run_cli(capsys, "inspect", stale)[::2], "one byte before payloadOffset", "re-encode")
    _one_line_error(*run_cli(capsys, "dump", stale, "output_norm.weight", "-o", tmp_path / "x.npy")[::2],
                    "stale")


def test_unsupported_type_is_named_not_zeroed(mixed, tmp_path, capsys):
    _, k = mixed
    buf = k.read_bytes()
    h = knot.parse_header(buf)
    meta = json.loads(json.dumps(h.metadata))
    meta["tensors"]["output_norm.weight"]["type"] = "IQ2_XXS"
    odd = tmp_path / "odd.knot"
    odd.write_bytes(knot.pack_header(meta) + buf[h.payload_offset:])
    _one_line_error(*run_cli(capsys, "dump", odd, "output_norm.weight", "-o", tmp_path / "x.npy")[::2],
                    "output_norm.weight", "IQ2_XXS")


def test_unsupported_architecture(tmp_path, capsys):
    g = write_tiny_gguf(tmp_path / "bert.gguf", TinySpec(arch="bert"))
    _one_line_error(*run_cli(capsys, "encode", g, tmp_path / "out.knot")[::2], "architecture 'bert'",
                    "not supported")
    assert not (tmp_path / "out.knot").exists()


def test_llama_family_encodes(tmp_path):
    g = write_tiny_gguf(tmp_path / "llama.gguf", TinySpec(arch="llama"))
    h = encode(g, tmp_path / "llama.knot", progress=False)
    assert h.architecture == "llama" and h.hparams["block_count"] == 2


def test_console_script_help():
    exe = shutil.which("knot", path=str(__import__("pathlib").Path(sys.executable).parent))
    assert exe, "the knot console script is installed"
    out = subprocess.run([exe, "--help"], capture_output=True, text=True, check=True).stdout
    for cmd in ("fetch-model", "encode", "inspect", "dump", "generate"):
        assert cmd in out
