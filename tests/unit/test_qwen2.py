"""Qwen2 engine on a tiny random model: math against plain formulas, split/chunk/KV
equivalences, the missing-tensor trap, the tied head, and a golden greedy generation."""
from __future__ import annotations

import json

import gguf
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from common.kvcache import PREFILL_CHUNK_TOKENS, KVCache, prefill_chunks
from common.layers import forward_range
from common.models import qwen2
from common.models.qwen2 import MissingTensorError, Qwen2, Qwen2Config, phase_tensors
from common.ops import Ops, rope_neox, to_f16
from common.quant import QTensor

# A tiny Qwen2: GQA with 2 query heads per kv head; Q8_0 needs ne0 % 32 == 0.
HP = dict(block_count=3, embedding_length=64, feed_forward_length=96, head_count=4, head_count_kv=2,
          rope_freq_base=10000.0, rms_eps=1e-6, context_length=256, vocab_size=262)
CFG = Qwen2Config.from_hparams(HP)
MODEL = Qwen2(CFG)
# One of each storage type on the matmul path.
WEIGHT_TYPES = {"attn_q": "Q8_0", "attn_k": "F16", "attn_v": "Q8_0", "attn_output": "F32",
                "ffn_gate": "Q8_0", "ffn_up": "F16", "ffn_down": "Q8_0",
                "token_embd": "Q8_0", "output": "F16"}


def qtensor(name: str, a: np.ndarray, ggml_type: str) -> QTensor:
    """numpy (ne1, ne0) or (ne0,) float -> QTensor of ggml_type (GGUF shape is reversed)."""
    a = np.asarray(a, np.float32)
    if ggml_type == "F32":
        raw = a.reshape(-1).view(np.uint8)
    elif ggml_type == "F16":
        raw = a.astype(np.float16).reshape(-1).view(np.uint8)
    else:
        raw = gguf.quants.quantize(a, gguf.GGMLQuantizationType[ggml_type]).reshape(-1)
    return QTensor(name, ggml_type, tuple(reversed(a.shape)), raw)


def tiny_weights(seed: int = 0, tied: bool = False) -> dict[str, np.ndarray]:
    """GGUF name -> float array in numpy order (ne1, ne0)."""
    rng = np.random.default_rng(seed)
    d, f, hd = CFG.dim, CFG.ffn_dim, CFG.head_dim
    kvd = CFG.n_kv_head * hd
    w = {"token_embd.weight": rng.normal(0, 1.0, (CFG.vocab_size, d)),
         "output_norm.weight": 1 + 0.1 * rng.normal(size=d)}
    if not tied:
        w["output.weight"] = rng.normal(0, 0.2, (CFG.vocab_size, d))
    for l in range(CFG.n_layer):
        p = f"blk.{l}."
        w |= {p + "attn_norm.weight": 1 + 0.1 * rng.normal(size=d),
              p + "attn_q.weight": rng.normal(0, d ** -0.5, (d, d)), p + "attn_q.bias": rng.normal(0, 0.5, d),
              p + "attn_k.weight": rng.normal(0, d ** -0.5, (kvd, d)), p + "attn_k.bias": rng.normal(0, 0.5, kvd),
              p + "attn_v.weight": rng.normal(0, d ** -0.5, (kvd, d)), p + "attn_v.bias": rng.normal(0, 0.1, kvd),
              p + "attn_output.weight": rng.normal(0, d ** -0.5, (d, d)),
              p + "ffn_norm.weight": 1 + 0.1 * rng.normal(size=d),
              p + "ffn_gate.weight": rng.normal(0, d ** -0.5, (f, d)),
              p + "ffn_up.weight": rng.normal(0, d ** -0.5, (f, d)),
              p + "ffn_down.weight": rng.normal(0, f ** -0.5, (d, f))}
    return {k: np.asarray(v, np.float32) for k, v in w.items()}


def _type_of(name: str) -> str:
    key = name.split(".")[-2] if name.startswith("blk.") else name.split(".")[0]
    return WEIGHT_TYPES.get(key, "F32") if name.endswith(".weight") and "norm" not in name else "F32"


def to_qtensors(w: dict[str, np.ndarray]) -> dict[str, QTensor]:
    return {n: qtensor(n, a, _type_of(n)) for n, a in w.items()}


W = to_qtensors(tiny_weights())


def load_from(ws):
    return lambda layer, phase: {n: ws[n] for n in phase_tensors(layer, phase) if n in ws}


def run_model(tokens, ws=W, layer_splits=((0, CFG.n_layer),), vocab_slices=((0, CFG.vocab_size),),
              chunk_size: int | None = 10 ** 9) -> np.ndarray:
    """Whole-model logits (T, vocab), with the layers split over 'stations' (one KV cache each),
    the vocab split over 'shards', and the prompt prefilled in chunks. The model computes with the
    installed ops (numpy's under the numpy_matmul fixture)."""
    model = Qwen2(CFG)
    tokens = np.asarray(tokens)
    emb = ws["token_embd.weight"]
    head = ws[model.head_tensor(lambda n: n in ws)]
    x = sum(qwen2.embed(tokens, emb.rows(a, b), a, b) for a, b in vocab_slices)   # (T, dim)
    kvs = [KVCache(CFG.n_kv_head, CFG.head_dim) for _ in layer_splits]
    outs = []
    for a, b in prefill_chunks(len(tokens), chunk_size):
        h = x[a:b]
        for (s, e), kv in zip(layer_splits, kvs):
            h = forward_range(model, h, s, e, load_from(ws), kv, np.arange(a, b))
        outs.append(h)
    h = qwen2.output_norm(model.ops, CFG, np.concatenate(outs), ws["output_norm.weight"])
    return np.concatenate([qwen2.lm_head(model.ops, h, head.rows(a, b)) for a, b in vocab_slices], axis=1)


TOKENS = [5, 200, 17, 17, 99, 3, 261, 0, 42, 128, 7]


# ------------------------------------------------------------------ math against plain formulas

def test_config_from_hparams():
    assert (CFG.n_layer, CFG.dim, CFG.n_head, CFG.n_kv_head, CFG.head_dim) == (3, 64, 4, 2, 16)
    with pytest.raises(ValueError, match="head_dim"):
        Qwen2Config.from_hparams(HP | {"head_count": 5})


def test_rmsnorm_formula():
    rng = np.random.default_rng(1)
    x, w = rng.normal(size=(3, 64)).astype(np.float32), rng.normal(size=64).astype(np.float32)
    want = x / np.sqrt((x.astype(np.float64) ** 2).mean(-1, keepdims=True) + 1e-6) * w
    np.testing.assert_allclose(Ops().rmsnorm(x, w, 1e-6), want, rtol=1e-6)


def test_rope_neox_pairs_i_with_i_plus_half():
    rng = np.random.default_rng(2)
    hd, pos = 16, np.array([0, 1, 7, 1000])
    x = rng.normal(size=(4, 2, hd)).astype(np.float32)
    cos, sin = qwen2.rope_cos_sin(pos, hd, 10000.0)
    got = rope_neox(x, cos, sin)
    want = np.empty_like(x, dtype=np.float64)
    for t, p in enumerate(pos):
        for i in range(hd // 2):
            th = p * 10000.0 ** (-2 * i / hd)
            a, b = x[t, :, i].astype(np.float64), x[t, :, i + hd // 2].astype(np.float64)
            want[t, :, i], want[t, :, i + hd // 2] = a * np.cos(th) - b * np.sin(th), a * np.sin(th) + b * np.cos(th)
    np.testing.assert_allclose(got, want, atol=1e-4)  # float32 angles, as ggml computes them
    np.testing.assert_array_equal(got[0], x[0])  # position 0 is the identity


def test_attention_gqa_causal_against_loops():
    rng = np.random.default_rng(3)
    T, n_head, n_kv, hd = 5, 4, 2, 8
    q = rng.normal(size=(T, n_head, hd)).astype(np.float32)
    k = to_f16(rng.normal(size=(T, n_kv, hd)).astype(np.float32))  # as attn_phase caches them
    v = to_f16(rng.normal(size=(T, n_kv, hd)).astype(np.float32))
    pos = np.arange(T)
    got = Ops().attend(q, k, v, pos, pos).reshape(T, n_head, hd)
    f16 = lambda x: x.astype(np.float16).astype(np.float64)  # llama.cpp's roundings: q, k, v, p
    for t in range(T):
        for h in range(n_head):
            kh = h // (n_head // n_kv)  # consecutive query heads share a kv head
            s = f16(k[: t + 1, kh]) @ f16(q[t, h]) / np.sqrt(hd)
            p = np.exp(s - s.max())
            np.testing.assert_allclose(got[t, h], f16(p / p.sum()) @ f16(v[: t + 1, kh]), rtol=1e-5, atol=1e-6)


# ------------------------------------------------------------------ phases and the fluid-memory contract

def test_phase_tensors_are_exact_gguf_names():
    assert phase_tensors(4, "attn") == [
        "blk.4.attn_norm.weight", "blk.4.attn_q.weight", "blk.4.attn_q.bias", "blk.4.attn_k.weight",
        "blk.4.attn_k.bias", "blk.4.attn_v.weight", "blk.4.attn_v.bias", "blk.4.attn_output.weight"]
    assert phase_tensors(0, "ffn_gate") == ["blk.0.ffn_norm.weight", "blk.0.ffn_gate.weight"]
    assert phase_tensors(0, "ffn_up") == ["blk.0.ffn_up.weight"]
    assert phase_tensors(0, "ffn_down") == ["blk.0.ffn_down.weight"]
    with pytest.raises(ValueError):
        phase_tensors(0, "ffn")


def test_one_phase_resident_at_a_time():
    resident: set[str] = set()
    log = []

    def load(layer, phase):
        assert not resident, f"{phase} of {layer} loaded while {resident} resident"
        names = phase_tensors(layer, phase)
        resident.update(names)
        log.append((layer, phase))
        return {n: W[n] for n in names}

    def release(names):
        assert set(names) == resident
        resident.clear()

    x = qwen2.embed(TOKENS[:4], W["token_embd.weight"], 0, CFG.vocab_size)
    kv = KVCache(CFG.n_kv_head, CFG.head_dim)
    forward_range(MODEL, x, 1, 3, load, kv, np.arange(4), release)
    assert log == [(l, p) for l in (1, 2) for p in qwen2.PHASES]
    assert not resident


@pytest.mark.parametrize("layer,phase,tensor", [(1, "ffn_up", "blk.1.ffn_up.weight"),
                                                (2, "attn", "blk.2.attn_k.bias"),
                                                (0, "ffn_gate", "blk.0.ffn_norm.weight")])
def test_missing_tensor_names_phase_layer_tensor(layer, phase, tensor):
    ws = {n: t for n, t in W.items() if n != tensor}
    with pytest.raises(MissingTensorError) as ei:
        run_model(TOKENS[:3], ws)
    e = ei.value
    assert (e.phase, e.layer, e.tensor) == (phase, layer, tensor)
    assert str(e) == f"phase {phase} of layer {layer}: missing tensor {tensor}"


# ------------------------------------------------------------------ equivalences

REF = run_model(TOKENS)


def test_reference_is_sane():
    assert REF.shape == (len(TOKENS), CFG.vocab_size) and np.isfinite(REF).all()
    assert REF.std() > 0.1  # not the near-uniform output of zero embeddings (seed section 8)


@settings(max_examples=25, deadline=None)
@given(cuts=st.sets(st.integers(1, CFG.n_layer - 1)), vcuts=st.sets(st.integers(1, CFG.vocab_size - 1), max_size=7))
def test_any_layer_and_vocab_split_equals_whole(cuts, vcuts):
    lb = [0, *sorted(cuts), CFG.n_layer]
    vb = [0, *sorted(vcuts), CFG.vocab_size]
    got = run_model(TOKENS, layer_splits=list(zip(lb, lb[1:])), vocab_slices=list(zip(vb, vb[1:])))
    np.testing.assert_allclose(got, REF, rtol=1e-5, atol=1e-5 * np.abs(REF).max())


def test_layer_split_is_exact():
    np.testing.assert_array_equal(run_model(TOKENS, layer_splits=[(0, 1), (1, 3)]), REF)


def test_embed_slices_sum_to_full_lookup_exactly():
    emb = W["token_embd.weight"]
    full = qwen2.embed(TOKENS, emb, 0, CFG.vocab_size)
    np.testing.assert_array_equal(full, emb.dequantize()[TOKENS])
    parts = [qwen2.embed(TOKENS, emb.rows(a, b), a, b) for a, b in [(0, 100), (100, 101), (101, 262)]]
    np.testing.assert_array_equal(sum(parts), full)
    # Each token is non-zero in exactly one slice.
    assert [sum(bool(p[i].any()) for p in parts) for i in range(len(TOKENS))] == [1] * len(TOKENS)
    with pytest.raises(ValueError, match="rows"):
        qwen2.embed(TOKENS, emb.rows(0, 10), 0, 11)


@pytest.mark.parametrize("chunk", [PREFILL_CHUNK_TOKENS, 1, 3, 5])
def test_chunked_prefill_equals_unchunked(chunk):
    np.testing.assert_allclose(run_model(TOKENS, chunk_size=chunk), REF, rtol=1e-5, atol=1e-5 * np.abs(REF).max())


def test_prefill_chunks_have_a_fixed_maximum_size():
    """Not half the prompt: a 30k-token prompt enters in chunks of PREFILL_CHUNK_TOKENS, and the
    boundaries depend on the length alone (a replay cuts where the first run did)."""
    n = PREFILL_CHUNK_TOKENS
    assert prefill_chunks(2 * n + 7) == [(0, n), (n, 2 * n), (2 * n, 2 * n + 7)]
    assert prefill_chunks(30_000) == prefill_chunks(30_000)
    assert max(b - a for a, b in prefill_chunks(30_000)) == n
    assert prefill_chunks(1) == [(0, 1)]
    assert prefill_chunks(5, 10) == [(0, 5)]
    assert prefill_chunks(7, 3) == [(0, 3), (3, 6), (6, 7)]


def test_decode_with_kv_cache_equals_full_recompute():
    """Prefill 4 tokens, then decode the rest one at a time; each step's logits equal the
    full forward's at that position."""
    emb, head = W["token_embd.weight"], W["output.weight"]
    kv = KVCache(CFG.n_kv_head, CFG.head_dim)

    def step(toks, start):
        x = qwen2.embed(toks, emb, 0, CFG.vocab_size)
        h = forward_range(MODEL, x, 0, CFG.n_layer, load_from(W), kv, np.arange(start, start + len(toks)))
        return qwen2.lm_head(MODEL.ops, qwen2.output_norm(MODEL.ops, CFG, h[-1:], W["output_norm.weight"]), head)[0]

    got = [step(TOKENS[:4], 0)] + [step(TOKENS[i:i + 1], i) for i in range(4, len(TOKENS))]
    np.testing.assert_allclose(np.stack(got), REF[3:], rtol=1e-5, atol=1e-5 * np.abs(REF).max())
    assert kv.n_tokens(0) == len(TOKENS)


def test_batched_attn_phase_equals_each_sequence_alone():
    """Batched decode: three sequences at different lengths share one attn phase; every row and
    every KV cache equals the one its sequence gets alone (the weight products are row-wise)."""
    rng = np.random.default_rng(7)
    ws = W
    lens = [(5, 1), (2, 1), (9, 3)]  # (already cached, new rows) per sequence
    alone_kv, batch_kv, xs, poss = [], [], [], []
    for n_old, n_new in lens:
        old = rng.normal(size=(n_old, CFG.dim)).astype(np.float32)
        a, b = KVCache(CFG.n_kv_head, CFG.head_dim), KVCache(CFG.n_kv_head, CFG.head_dim)
        for kv in (a, b):
            qwen2.attn_phase(MODEL.ops, CFG, 0, old, ws, kv, np.arange(n_old))
        alone_kv.append(a), batch_kv.append(b)
        xs.append(rng.normal(size=(n_new, CFG.dim)).astype(np.float32))
        poss.append(np.arange(n_old, n_old + n_new))
    alone = [qwen2.attn_phase(MODEL.ops, CFG, 0, x, ws, kv, p) for x, kv, p in zip(xs, alone_kv, poss)]
    batched = qwen2.attn_phase_batch(MODEL.ops, CFG, 0, np.concatenate(xs), ws, list(zip(batch_kv, poss)))
    np.testing.assert_allclose(batched, np.concatenate(alone), rtol=0, atol=1e-6)
    empty = np.zeros((0, CFG.n_kv_head, CFG.head_dim), np.float32)
    for a, b in zip(alone_kv, batch_kv):
        ka, va, pa = a.append(0, empty, empty, np.zeros(0, np.int64))
        kb, vb, pb = b.append(0, empty, empty, np.zeros(0, np.int64))
        np.testing.assert_array_equal(pa, pb)
        # F16/F32 weights go through BLAS, whose sums may group differently for 1 row and for
        # N rows (an ulp); the quantized kernels are row-wise exact (test_kernels: ..._batch_agree_bit_for_bit).
        np.testing.assert_allclose(ka, kb, rtol=0, atol=1e-6)
        np.testing.assert_allclose(va, vb, rtol=0, atol=1e-6)


def test_kvcache_grows_and_truncates():
    kv = KVCache(2, 4)
    rng = np.random.default_rng(0)
    ks = rng.normal(size=(40, 2, 4)).astype(np.float16).astype(np.float32)  # f16 numbers, as the attn phase appends
    for i in range(40):
        k, v, pos = kv.append(0, ks[i:i + 1], -ks[i:i + 1], np.array([i]))
    np.testing.assert_array_equal(k, ks)
    np.testing.assert_array_equal(v, -ks)
    np.testing.assert_array_equal(pos, np.arange(40))
    kv.truncate(10)
    k, _, pos = kv.append(0, ks[:1], ks[:1], np.array([10]))
    assert k.shape == (11, 2, 4) and pos[-1] == 10 and kv.n_tokens(1) == 0


def test_kvcache_nbytes_counts_every_array_as_it_grows():
    kv = KVCache(2, 4)
    rng = np.random.default_rng(1)
    for i in range(70):
        for layer in (3, 5):
            x = rng.normal(size=(i % 3 + 1, 2, 4)).astype(np.float32)
            kv.append(layer, x, x, np.arange(x.shape[0]))
            arrays = [d[l] for d in (kv._k, kv._v, kv._pos) for l in d]
            assert kv.nbytes == sum(a.nbytes for a in arrays) > 0


def test_tied_head_falls_back_to_token_embd(numpy_matmul):
    assert MODEL.head_tensor(lambda n: False) == "token_embd.weight"
    assert MODEL.head_tensor(lambda n: n == "output.weight") == "output.weight"
    ws = to_qtensors(tiny_weights(tied=True))
    assert "output.weight" not in ws
    logits = run_model(TOKENS[:3], ws)
    # The head is token_embd itself: a token's own embedding row scores it.
    x = qwen2.embed(TOKENS[:3], ws["token_embd.weight"], 0, CFG.vocab_size)
    kv = KVCache(CFG.n_kv_head, CFG.head_dim)
    numpy = Qwen2(CFG)  # built under numpy_matmul: numpy's ops
    hid = qwen2.output_norm(numpy.ops, CFG, forward_range(numpy, x, 0, 3, load_from(ws), kv, np.arange(3)),
                            ws["output_norm.weight"])
    np.testing.assert_allclose(logits, hid @ ws["token_embd.weight"].dequantize().T, rtol=1e-5, atol=1e-4)


# ------------------------------------------------------------------ the engine on a tiny GGUF, golden ids

def _byte_tokens() -> list[str]:
    from common.tokenizer import bytes_to_unicode
    return [c for _, c in sorted(bytes_to_unicode().items())]


def write_tiny_gguf(path, tied: bool = False, seed: int = 0) -> None:
    """A complete tiny qwen2 GGUF: the random weights above and a byte-level BPE tokenizer."""
    tokens = _byte_tokens() + ["Ġt", "he", "Ġthe", "in", "<|endoftext|>", "<|im_start|>"]
    assert len(tokens) == CFG.vocab_size
    types = [1] * (len(tokens) - 2) + [3, 3]
    wr = gguf.GGUFWriter(str(path), "qwen2")
    wr.add_block_count(CFG.n_layer)
    wr.add_context_length(CFG.context_length)
    wr.add_embedding_length(CFG.dim)
    wr.add_feed_forward_length(CFG.ffn_dim)
    wr.add_head_count(CFG.n_head)
    wr.add_head_count_kv(CFG.n_kv_head)
    wr.add_rope_freq_base(CFG.rope_base)
    wr.add_layer_norm_rms_eps(CFG.norm_eps)
    wr.add_tokenizer_model("gpt2")
    wr.add_tokenizer_pre("qwen2")
    wr.add_token_list(tokens)
    wr.add_token_types(types)
    wr.add_token_merges(["Ġ t", "h e", "Ġt he", "i n"])
    wr.add_eos_token_id(CFG.vocab_size - 2)
    wr.add_bos_token_id(CFG.vocab_size - 2)
    wr.add_add_bos_token(False)
    for name, a in tiny_weights(seed, tied).items():
        t = qtensor(name, a, _type_of(name))
        data = np.asarray(t.data).reshape(a.shape[0], -1) if a.ndim == 2 else np.asarray(t.data)
        wr.add_tensor(name, data, raw_dtype=gguf.GGMLQuantizationType[t.ggml_type])
    wr.write_header_to_file()
    wr.write_kv_data_to_file()
    wr.write_tensors_to_file()
    wr.close()


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny") / "tiny-qwen2.gguf"
    write_tiny_gguf(path)
    return path


GOLDEN_PROMPT = "the cat in the hat"
GOLDEN = [198, 194, 259, 243, 44, 235, 118, 67, 228, 55, 224, 30]


def test_engine_matches_phase_code_and_golden(tiny_gguf, numpy_matmul):
    """The golden ids are the numpy reference path's."""
    from common.sampling import SamplingParams
    from deploy.engine_local import LocalEngine

    eng = LocalEngine.open(tiny_gguf, cache_f32=False)
    ids = eng.tokenizer.encode(GOLDEN_PROMPT)
    assert ids == [116, 257, 32, 99, 97, 116, 32, 259, 258, 32, 104, 97, 116]
    np.testing.assert_allclose(eng.prefill(ids, eng.new_kv(), all_logits=True), run_model(ids),
                               rtol=1e-5, atol=1e-5)
    gen = eng.generate(ids, SamplingParams(), max_tokens=12)
    # Greedy by hand through the same math.
    seq = list(ids)
    for _ in range(len(gen.token_ids)):
        seq.append(int(np.argmax(run_model(seq)[-1])))
    assert gen.token_ids == seq[len(ids):]
    assert gen.token_ids == GOLDEN, repr(gen.token_ids)
    # The float32 weight cache changes nothing but speed.
    cached = LocalEngine.open(tiny_gguf, cache_f32=True).generate(ids, SamplingParams(), max_tokens=12)
    assert cached.token_ids == GOLDEN



def test_an_engine_computes_with_the_ops_it_was_given(tiny_gguf):
    """Ops passed at construction are the engine's, whatever the process installed (the C kernels
    here): numpy's reference gives the numpy path's float32 cache and golden ids."""
    from common.sampling import SamplingParams
    from deploy.engine_local import LocalEngine
    from deploy.knotfile import open_model

    eng = LocalEngine(open_model(tiny_gguf), cache_f32=False, ops=Ops())
    assert type(eng.arch.ops) is Ops and eng.new_kv().dtype == np.float32
    ids = eng.tokenizer.encode(GOLDEN_PROMPT)
    assert eng.generate(ids, SamplingParams(), max_tokens=12).token_ids == GOLDEN


def test_engine_copies_the_kernels_weights_into_one_arena_and_computes_the_same(tiny_gguf):
    """copy_weights: the weights the C kernels take leave the file's map for one arena (on huge
    pages); the logits are the map's bit for bit."""
    from deploy.engine_local import LocalEngine

    mapped = LocalEngine.open(tiny_gguf, cache_f32=False, copy_weights=False)
    copied = LocalEngine.open(tiny_gguf, cache_f32=False, copy_weights=True)
    names = [n for n in copied._matmul_weight_names() if copied.weight(n).ggml_type in copied.arch.ops.quantized_types]
    assert names
    arena = copied.weight(names[0]).data.base
    for n in names:
        m, c = mapped.weight(n), copied.weight(n)
        assert c.data.tobytes() == m.data.tobytes() and not c.data.flags.writeable
        assert c.data.base is arena and not np.shares_memory(c.data, m.data)
    ids = [116, 257, 32, 99, 97, 116]
    kv_m, kv_c = mapped.new_kv(), copied.new_kv()
    np.testing.assert_array_equal(copied.prefill(ids, kv_c, all_logits=True), mapped.prefill(ids, kv_m, all_logits=True))
    np.testing.assert_array_equal(copied.decode(259, kv_c, len(ids)), mapped.decode(259, kv_m, len(ids)))


def test_engine_tied_gguf(tmp_path):
    from deploy.engine_local import LocalEngine

    path = tmp_path / "tied.gguf"
    write_tiny_gguf(path, tied=True)
    eng = LocalEngine.open(path)
    assert eng.head_name == "token_embd.weight"
    ws = to_qtensors(tiny_weights(tied=True))
    np.testing.assert_allclose(eng.prefill([1, 2, 3], eng.new_kv(), all_logits=True), run_model([1, 2, 3], ws),
                               rtol=1e-5, atol=1e-5)


def test_engine_rejects_out_of_vocab_ids(tiny_gguf):
    from deploy.engine_local import LocalEngine

    eng = LocalEngine.open(tiny_gguf, cache_f32=False)
    with pytest.raises(ValueError, match=r"\[262\] outside the vocabulary \[0, 262\)"):
        eng.prefill([1, 262], eng.new_kv())


def test_generate_stops_at_stop_string_and_streams(tiny_gguf):
    from common.sampling import SamplingParams
    from deploy.engine_local import LocalEngine

    eng = LocalEngine.open(tiny_gguf)
    ids = eng.tokenizer.encode(GOLDEN_PROMPT)
    full = eng.generate(ids, SamplingParams(), max_tokens=12)
    assert full.finish_reason in ("length", "eos")
    text = full.text
    assert len(text) >= 3, text
    stop = text[2:4]
    pieces = []
    cut = eng.generate(ids, SamplingParams(), max_tokens=12, stop=[stop], on_text=pieces.append)
    assert cut.finish_reason == "stop"
    assert cut.text == text[:text.find(stop)] == "".join(pieces)


@pytest.mark.parametrize("flags,needle", [
    (["--max-tokens", "0"], "--max-tokens: max_tokens must be >= 1, got 0"),
    (["--temperature", "-1"], "--temperature: temperature must be >= 0, got -1.0"),
    (["--top-p", "2"], "--top-p: top_p must be <= 1, got 2.0"),
    (["--repeat-penalty", "0"], "--repeat-penalty: repetition_penalty must be >="),
    (["--stop", "x" * 1025], "--stop: a stop string takes at most 1024 characters"),
    (["--system", "be brief"], "--system is a chat's system message: add --chat"),  # it was ignored
    (["--suffix", "x", "--chat"], "--suffix fills in the middle of a plain-text prompt: drop --chat"),
    (["--suffix", "x"], "--suffix: this model has no fill-in-the-middle tokens"),
    (["--logit-bias", "5=500"], "--logit-bias: logit_bias['5'] must be a number in [-100, 100], got 500.0"),
    (["--logit-bias", "5=lots"], "--logit-bias: logit_bias['5'] must be a number in [-100, 100], got 'lots'"),
    (["--logit-bias", "5"], "--logit-bias: logit_bias['5'] must be a number in [-100, 100], got None"),
    (["--logit-bias", "x=1"], "--logit-bias: logit_bias: 'x' is not a token id"),
    (["--logit-bias", "5=1", "--logit-bias", "5=2"], "--logit-bias: token 5 is given twice"),
    (["--logit-bias", "9999=1"], "--logit-bias: token 9999 is outside the vocabulary [0, "),
])
def test_cli_generate_refuses_what_the_api_refuses(tiny_gguf, capsys, flags, needle):
    # It printed nothing for --max-tokens 0 and ran --top-p 2 as if it were 1.
    from deploy.cli import main

    assert main(["generate", str(tiny_gguf), GOLDEN_PROMPT, *flags]) == 1
    assert f"knot generate: error: {needle}" in capsys.readouterr().err


def test_cli_generate_refuses_a_prompt_that_fills_the_context(tiny_gguf, capsys):
    from deploy.cli import main
    from deploy.engine_local import LocalEngine

    n_ctx = LocalEngine.open(tiny_gguf).cfg.context_length
    assert main(["generate", str(tiny_gguf), "the " * n_ctx]) == 1
    assert f"tokens and the context length {n_ctx}: no room for a completion" in capsys.readouterr().err


def test_cli_generate_logit_bias(tiny_gguf, capsys):
    from common.sampling import SamplingParams
    from deploy.cli import main
    from deploy.engine_local import LocalEngine

    eng = LocalEngine.open(tiny_gguf)
    ids = eng.tokenizer.encode(GOLDEN_PROMPT)
    first = eng.generate(ids, SamplingParams(), max_tokens=1).token_ids[0]
    assert main(["generate", str(tiny_gguf), GOLDEN_PROMPT, "--max-tokens", "4", "--json",
                 "--logit-bias", f"{first}=-100", "--logit-bias", " 3 = 2.5"]) == 0
    out = json.loads(capsys.readouterr().out)
    want = eng.generate(ids, SamplingParams(logit_bias=((3, 2.5), (first, -100.0))), max_tokens=4).token_ids
    assert out["token_ids"] == want and want[0] != first


def test_cli_generate_fills_in_the_middle(tmp_path, capsys):
    from common.sampling import SamplingParams
    from deploy.cli import main
    from deploy.engine_local import LocalEngine
    from tests.tiny_gguf import TinySpec, write_tiny_gguf

    gguf = write_tiny_gguf(tmp_path / "fim.gguf", TinySpec(fim=True))
    assert main(["generate", str(gguf), "def the", "--suffix", " in", "--max-tokens", "6", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    eng = LocalEngine.open(gguf)
    ids = eng.tokenizer.encode_fim("def the", " in")
    assert out["prompt_token_ids"] == ids and out["token_ids"] == eng.generate(ids, SamplingParams(),
                                                                                max_tokens=6).token_ids


def test_cli_generate_json(tiny_gguf, capsys, numpy_matmul, monkeypatch):
    monkeypatch.setenv("KNOT_KERNELS", "off")  # the golden ids are the numpy reference path's
    from deploy.cli import main

    assert main(["generate", str(tiny_gguf), GOLDEN_PROMPT, "--max-tokens", "12", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["prompt_token_ids"] == [116, 257, 32, 99, 97, 116, 32, 259, 258, 32, 104, 97, 116]
    assert out["token_ids"] == GOLDEN
    assert set(out["timings"]) >= {"prefill_s", "decode_s", "decode_tok_s"}
