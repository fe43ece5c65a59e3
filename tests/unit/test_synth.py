"""`knot synth`: a small synthetic knot parses, its sizes add up, its tensors dequantize finite,
its tokenizer loads and its types follow the Q4_K_M pattern."""
from __future__ import annotations

import numpy as np

from common.knot import TOKENIZER_BLOB, decode_tokenizer_blob, parse_header
from common.quant import dequantize, tensor_nbytes
from common.tokenizer import Tokenizer
from deploy.cli import main
from deploy.commands.synth import tensor_plan, use_more_bits, write_synth

DIMS = dict(layers=4, hidden=256, ffn=512, heads=4, kv_heads=2, vocab=400)


def test_synth_knot_parses_sizes_add_up_and_tensors_are_finite(tmp_path):
    out = tmp_path / "new-dir" / "tiny.knot"  # its directory made as on a fresh machine
    header = write_synth(out, **DIMS, context=256)
    raw = out.read_bytes()
    h = parse_header(raw, file_size=len(raw))  # the stale guard: size == payloadOffset + payload
    assert h.expected_file_size == len(raw) == header.expected_file_size
    assert h.hparams["vocab_size"] == 400 and h.hparams["block_count"] == 4
    assert len(h.tensors) == 3 + 12 * 4
    assert sum(t.length for t in h.tensors.values()) + h.blobs[TOKENIZER_BLOB].length == h.payload_nbytes
    for t in h.tensors.values():
        assert t.length == tensor_nbytes(t.ggml_type, t.shape)
    for name in ("output.weight", "token_embd.weight", "blk.0.ffn_down.weight", "blk.1.attn_q.weight",
                 "blk.2.attn_norm.weight"):
        a, b = h.tensor_range(name)
        t = h.tensors[name]
        x = dequantize(np.frombuffer(raw[a:b], np.uint8), t.ggml_type, t.shape, name)
        assert x.shape == tuple(reversed(t.shape))
        assert np.isfinite(x).all() and np.abs(x).max() < 1e3, name
    a, b = h.blob_range(TOKENIZER_BLOB)
    tok = Tokenizer(decode_tokenizer_blob(raw[a:b]))
    assert tok.vocab_size == 400
    assert tok.decode(tok.encode("def the(x): pass")) == "def the(x): pass"
    assert tok.eos_id == 399 and tok.encode("<|im_start|>") == [398]


def test_q4_k_m_type_pattern():
    plan = {n: t for n, t, _ in tensor_plan(28, 3584, 18944, 28, 4, 152064)}
    assert plan["token_embd.weight"] == "Q4_K" and plan["output.weight"] == "Q6_K"
    assert plan["blk.5.attn_q.weight"] == plan["blk.5.ffn_gate.weight"] == "Q4_K"
    assert plan["blk.5.attn_norm.weight"] == plan["blk.5.attn_q.bias"] == "F32"
    more = [i for i in range(28) if use_more_bits(i, 28)]
    assert more[:3] == [0, 1, 2] and more[-3:] == [25, 26, 27] and 5 in more and 4 not in more
    for i in range(28):
        want = "Q6_K" if i in more else "Q4_K"
        assert plan[f"blk.{i}.attn_v.weight"] == plan[f"blk.{i}.ffn_down.weight"] == want
    total = sum(tensor_nbytes(t, s) for _, t, s in tensor_plan(28, 3584, 18944, 28, 4, 152064))
    assert 4.2e9 < total < 5.0e9  # the 7B Q4_K_M GGUF is ~4.7 GB


def test_cli_writes_the_knot(tmp_path, capsys):
    out = tmp_path / "cli.knot"
    assert main(["synth", str(out), "--layers", "2", "--hidden", "256", "--ffn", "512", "--heads", "4",
                 "--kv-heads", "2", "--vocab", "300", "--no-progress"]) == 0
    raw = out.read_bytes()
    parse_header(raw, file_size=len(raw))
    assert "cli.knot" in capsys.readouterr().out


def test_the_single_process_engine_runs_a_synth_knot(tmp_path):
    from common.sampling import SamplingParams
    from deploy.engine_local import LocalEngine

    out = tmp_path / "run.knot"
    write_synth(out, **DIMS, context=256)
    engine = LocalEngine.open(out)
    g = engine.generate(engine.tokenizer.encode("def the"), SamplingParams(), max_tokens=3)
    assert len(g.token_ids) == 3 and all(0 <= t < 400 for t in g.token_ids)
