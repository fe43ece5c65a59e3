"""llama.cpp is the oracle: our tokenizer ids, greedy tokens and logits against llama-cpp-python's.

Acceptance (issue 3), per model and prompt:
  * token ids of the prompt equal llama.cpp's (tokenize with special=True, no BOS);
  * the argmax at the last prompt position is the same;
  * greedy generation gives the same N_GEN ids, except where llama.cpp's own top-2 gap at the
    divergent step is within llama.cpp's spread: how far its top-2 margin moves between its own
    configurations (flash attention on/off, the prefix token by token instead of one batch, one
    thread instead of two), teacher-forced on the same prompts and measured on the machine at
    hand, and never below SPREAD_FLOOR, the largest self-flip measured on the classes met
    (docs/fidelity.md). A wrong head row or a swapped phase is not excused (test_the_rule_catches_*);
  * at every step compared (same context on both sides), the logits of llama.cpp's top 10
    tokens are within TOP10_TOL of ours, or, past it, within llama.cpp's own difference between
    its flash-attention kernels on the same prompts (measured on the machine, as for the greedy ids).
llama.cpp runs with flash attention off and n_threads=2; it evaluates the prompt as one batch and
then one token at a time, as its generation does. We prefill in the default chunks (PREFILL_CHUNK_TOKENS).

Run as a script to print the markdown table recorded in docs/fidelity.md:
    .venv/bin/python tests/oracle/test_llamacpp.py [model names...]
"""
from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from deploy.llamacpp import open_llama

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

N_GEN = 32
NEAR_TIE = 0.1  # the table's "near tie" column only; the greedy rule uses the measured spread
# llama.cpp parted from itself at gaps up to 0.24 (1.5B, HumanEval, its prefix batched against token
# by token, on an AVX2-only Zen 3); data and the machines in docs/fidelity.md, "The greedy rule".
SPREAD_FLOOR = 0.25
TOP10_TOL = 0.5
MODELS = ("qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b")

# (name, text, chat): chat=True wraps text as the user turn of the model's chat template.
PROMPTS = [
    ("py-fib", "def fibonacci(n):", False),
    ("py-softmax", "import numpy as np\n\n\ndef softmax(x):\n    \"\"\"Numerically stable softmax.\"\"\"\n", False),
    ("c-list", "// Reverse a singly linked list in C.\nstruct Node {\n    int value;\n    struct Node *next;\n};\n\n", False),
    ("sql", "-- top 5 customers by total order value\nSELECT c.name, SUM(o.total) AS", False),
    ("fim", "<|fim_prefix|>def add(a, b):\n    <|fim_suffix|>\n    return result<|fim_middle|>", False),
    ("text-fox", "The quick brown fox jumps over the lazy dog. This sentence is famous because", False),
    ("text-unicode", "Le café coûte 3,50 € — 日本語のテキストも少し。 Numbers: 1234567 and 3.14159;", False),
    ("chat-palindrome", "Write a Python function that checks whether a string is a palindrome.", True),
    ("chat-thread", "Explain the difference between a process and a thread in two sentences.", True),
    ("chat-math", "What is 17 * 23? Answer with just the number.", True),
]

# Qwen2.5-Coder's fill-in-the-middle prompt; PROMPTS' "fim" is one, so greedy FIM is compared too
FIM_MARKED = "<|fim_prefix|>{prefix}<|fim_suffix|>{suffix}<|fim_middle|>"

TRICKY_STRINGS = [
    "Hello world", "  leading and trailing  ", "tabs\tand\nnewlines\r\n\r\nCRLF", " \n \n\n   \t\t  x",
    "12345678901234567890", "3.14159e-10 + 0x1F - 1_000_000", "don't I'll we've THEY'RE she'S",
    "def f(x):\n    return {'a': [1, 2, 3]}  # comment\n\n\n", "if (a<=b && c!=d) { return a->b; }",
    "日本語のテキスト、中文文本。한국어", "emoji 🤖👍🏽 and ZWJ 👨‍👩‍👧", "Ünïcödé ñ ß ø å ç", "\u00a0nbsp\u2003emspace",
    "<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>user\nhi<|im_end|>",
    "<|endoftext|><|fim_prefix|>x<|fim_suffix|>y<|fim_middle|>", "<tool_call>{\"a\": 1}</tool_call>",
    "<|im_start|", "    ", "\n", "a" * 50, "....!!!???", "$$\\frac{1}{2}$$",
]


def _import_llama():
    try:
        import llama_cpp
    except ImportError as e:
        pytest.skip(f"llama-cpp-python is not installed ({e}); install the oracle extra: pip install -e '.[oracle]'",
                    allow_module_level=True)
    return llama_cpp


def _model_path(name: str) -> Path:
    try:
        from deploy.models import model_path
        return model_path(name)
    except Exception as e:  # deploy.models missing, or the model is not fetched yet
        pytest.skip(f"{name} is not available ({e}); run `knot fetch-model {name}`")


@dataclass
class PromptResult:
    name: str
    n_prompt: int
    ids_equal: bool
    last_argmax_equal: bool
    n_same: int                     # leading generated ids equal to llama.cpp's
    diverged_at: int | None         # first differing step, None if all N_GEN equal
    gap_at_divergence: float | None  # llama.cpp's top-2 gap at that step
    min_gap: float                  # smallest llama.cpp top-2 gap over the compared steps (to divergence)
    top10_max: float                # max |ours - llama| over llama's top-10, all compared steps
    top10_mean: float
    ours_text: str = ""
    llama_text: str = ""

    @property
    def greedy_ok(self) -> bool:
        """Within the floor of the greedy rule (the test widens it to the spread it measures)."""
        return self.diverged_at is None or self.gap_at_divergence <= SPREAD_FLOOR

    @property
    def accepted(self) -> bool:
        return self.ids_equal and self.last_argmax_equal and self.greedy_ok and self.top10_max <= TOP10_TOL


def _gap(logits: np.ndarray) -> float:
    a, b = np.partition(logits, -2)[-2:]
    return float(abs(b - a))


def llama_greedy(llm, ids: list[int], n_gen: int) -> tuple[list[np.ndarray], list[int]]:
    """llama.cpp: the prompt as one batch, then greedy one token at a time -> per-step logits, ids."""
    llm.reset()
    llm.eval(ids)
    logits, gen = [], []
    for _ in range(n_gen):
        lg = np.array(llm.scores[llm.n_tokens - 1], dtype=np.float32)
        logits.append(lg)
        gen.append(int(np.argmax(lg)))
        llm.eval([gen[-1]])
    return logits, gen


def follow(ref_logits: list[np.ndarray], ref_gen: list[int], first: np.ndarray, step) -> dict:
    """Greedy from `first` logits with step(token, i) -> next logits, compared with the reference
    step by step until the first differing id (after it the contexts differ)."""
    lg, gen, diffs, diverged = first, [], [], None
    for i in range(len(ref_gen)):
        top = np.argsort(-ref_logits[i])[:10]
        diffs.append(np.abs(lg[top] - ref_logits[i][top]))
        gen.append(int(np.argmax(lg)))
        if gen[-1] != ref_gen[i]:
            diverged = i
            break
        if i + 1 < len(ref_gen):
            lg = step(gen[-1], i)
    gaps = [_gap(l) for l in ref_logits[:len(diffs)]]
    d = np.stack(diffs)
    return dict(gen=gen, n_same=len(diffs) - (diverged is not None), diverged_at=diverged,
                gap_at_divergence=None if diverged is None else gaps[diverged], min_gap=min(gaps),
                top10_max=float(d.max()), top10_mean=float(d.mean()))


def compare_prompt(llm, engine, name: str, text: str, chat: bool, n_gen: int = N_GEN) -> PromptResult:
    tok = engine.tokenizer
    if chat:
        text = tok.render_chat([{"role": "user", "content": text}], add_generation_prompt=True)
    ids = tok.encode(text)
    ref_ids = llm.tokenize(text.encode("utf-8"), add_bos=False, special=True)
    ref_logits, ref_gen = llama_greedy(llm, ref_ids, n_gen)
    kv = engine.new_kv()
    first = engine.prefill(ids, kv)  # default chunks: PREFILL_CHUNK_TOKENS
    f = follow(ref_logits, ref_gen, first, lambda t, i: engine.decode(t, kv, len(ids) + i))
    gen = f.pop("gen")
    return PromptResult(name=name, n_prompt=len(ids), ids_equal=ids == ref_ids,
                        last_argmax_equal=gen[0] == ref_gen[0], **f,
                        ours_text=tok.decode(gen, skip_special=True),
                        llama_text=tok.decode(ref_gen, skip_special=True))


def llama_vs_itself(llm, llm_other, ids: list[int], n_gen: int = N_GEN) -> dict:
    """The same comparison between two llama.cpp configurations: its own noise floor."""
    ref_logits, ref_gen = llama_greedy(llm, ids, n_gen)
    llm_other.reset()
    llm_other.eval(ids)

    def step(t, i):
        llm_other.eval([t])
        return np.array(llm_other.scores[llm_other.n_tokens - 1], dtype=np.float32)

    first = np.array(llm_other.scores[llm_other.n_tokens - 1], dtype=np.float32)
    return follow(ref_logits, ref_gen, first, step)


# llama.cpp's configurations other than the reference (flash attention off, the prefix as one batch,
# 2 threads): (name, open_llama overrides, prefix token by token)
ALTERNATES = (
    ("flash attention on", {"flash_attn": True}, False),
    ("prefix token by token", {}, True),
    ("1 thread", {"n_threads": 1, "n_threads_batch": 1}, False),
)


def margin_drift(ref_logits: list[np.ndarray], ref_gen: list[int], llm_other, ids: list[int],
                 token_by_token: bool) -> dict:
    """Teacher-forced on the reference's ids: at each step, how far another llama.cpp configuration
    moves the reference's top-2 margin (logit of its top token minus its runner-up), and the first
    step where that configuration's argmax differs (with the reference's gap there)."""
    llm_other.reset()
    for t in ([[i] for i in ids] if token_by_token else [ids]):
        llm_other.eval(t)
    drift, flip = [], None
    for i, ref in enumerate(ref_logits):
        lg = np.array(llm_other.scores[llm_other.n_tokens - 1], dtype=np.float32)
        b, a = np.argsort(ref)[-2:]  # a: the reference's top token, b: its runner-up
        drift.append(abs(float(ref[a] - ref[b]) - float(lg[a] - lg[b])))
        if flip is None and int(np.argmax(lg)) != ref_gen[i]:
            flip = (i, _gap(ref))
        if i + 1 < len(ref_gen):
            llm_other.eval([ref_gen[i]])
    return {"max_drift": max(drift), "flip": flip}


def llama_spread(name: str, llm, texts: list[str]) -> dict:
    """llama.cpp's own spread on this machine: the largest drift of its top-2 margin between its
    reference configuration and each alternate, over the texts (and each alternate's self-flips)."""
    refs = []
    for text in texts:
        ids = llm.tokenize(text.encode("utf-8"), add_bos=False, special=True)
        refs.append((ids, *llama_greedy(llm, ids, N_GEN)))
    out = {}
    for label, overrides, token_by_token in ALTERNATES:
        kw = dict(n_ctx=1024, n_threads=2, n_threads_batch=2, logits_all=True, flash_attn=False,
                  verbose=False, seed=0)
        kw.update(overrides)
        other = open_llama(_model_path(name), **kw) if overrides else llm
        try:
            runs = [margin_drift(lg, gen, other, ids, token_by_token) for ids, lg, gen in refs]
        finally:
            if other is not llm:
                other.close()
        out[label] = {"max_drift": max(r["max_drift"] for r in runs),
                      "flips": [r["flip"] for r in runs if r["flip"] is not None]}
    return {"by_config": out, "spread": max(c["max_drift"] for c in out.values())}


def prompt_texts(engine) -> list[str]:
    """PROMPTS as llama.cpp is given them (chat prompts rendered by the model's template)."""
    tok = engine.tokenizer
    return [tok.render_chat([{"role": "user", "content": t}], add_generation_prompt=True) if chat else t
            for _, t, chat in PROMPTS]


def unexcused(results: list["PromptResult"], bound: float) -> list[tuple]:
    """The greedy rule: divergences at a step where llama.cpp's gap exceeds `bound`."""
    return [(r.name, r.diverged_at, round(r.gap_at_divergence, 3)) for r in results
            if r.diverged_at is not None and r.gap_at_divergence > bound]


def open_pair(name: str):
    _import_llama()
    from deploy.engine_local import LocalEngine

    path = _model_path(name)
    llm = open_llama(path, n_ctx=1024, n_threads=2, n_threads_batch=2, logits_all=True,
                     flash_attn=False, verbose=False, seed=0)
    return llm, LocalEngine.open(path)


# ------------------------------------------------------------------ pytest

pytestmark = [pytest.mark.oracle, pytest.mark.realmodel]


@pytest.fixture(scope="module", params=MODELS)
def pair(request):
    llm, engine = open_pair(request.param)
    yield request.param, llm, engine
    llm.close()


@pytest.fixture(scope="module")
def results(pair):
    name, llm, engine = pair
    return [compare_prompt(llm, engine, *p) for p in PROMPTS]


def test_tokenizer_ids_equal_llamacpp(pair):
    _, llm, engine = pair
    for s in TRICKY_STRINGS + [p[1] for p in PROMPTS]:
        assert engine.tokenizer.encode(s) == llm.tokenize(s.encode("utf-8"), add_bos=False, special=True), repr(s)
        assert engine.tokenizer.decode(engine.tokenizer.encode(s)) == s


def test_end_of_generation_and_fim_tokens_equal_llamacpp(pair):
    """Where a generation ends, and the fill-in-the-middle prompt, as llama.cpp reads the model.
    One documented difference (common/tokenizer.py, _EOG_TEXTS; docs/fidelity.md): llama.cpp also
    ends at "</s>", a normal token of Qwen's vocabulary that it re-types control."""
    llama_cpp = _import_llama()
    _, llm, engine = pair
    tok = engine.tokenizer
    vocab = llama_cpp.llama_model_get_vocab(llm.model)
    llama_eog = {i for i in range(llm.n_vocab()) if llama_cpp.llama_vocab_is_eog(vocab, i)}
    text_eog = {i for i in llama_eog if tok.tokens[i] == "</s>" and i not in tok.control_ids}
    assert len(text_eog) == 1 and tok.eog_ids == llama_eog - text_eog
    assert tok.fim_ids == {"prefix": llama_cpp.llama_vocab_fim_pre(vocab),
                           "suffix": llama_cpp.llama_vocab_fim_suf(vocab),
                           "middle": llama_cpp.llama_vocab_fim_mid(vocab)}
    for prefix, suffix in [("def add(a, b):\n    ", "\n    return result"), ("", "x = 1\n"), ("import os\n", ""),
                           ('  s = """', '"""\n')]:
        marked = FIM_MARKED.format(prefix=prefix, suffix=suffix).encode()
        assert tok.encode_fim(prefix, suffix) == llm.tokenize(marked, add_bos=False, special=True), (prefix, suffix)
    # a prefix quoting a marker: llama.cpp's infill encodes its texts with parse_special off, as we do
    quoted = 'm = "<|fim_middle|>"'
    assert tok.encode_fim(quoted, "")[1:-2] == llm.tokenize(quoted.encode(), add_bos=False, special=False)


def test_last_prompt_argmax_equal(results):
    assert [r.name for r in results if not r.last_argmax_equal] == []


@pytest.fixture(scope="module")
def spread(pair):
    """llama.cpp's spread on this machine for this model (measured once, only where a test needs it)."""
    name, llm, engine = pair
    cache = {}

    def get() -> dict:
        if not cache:
            cache.update(llama_spread(name, llm, prompt_texts(engine)))
            print(f"\n{name}: llama.cpp's top-2 margin drift between its configurations: "
                  + ", ".join(f"{k} {v['max_drift']:.3f}" for k, v in cache["by_config"].items()))
        return cache
    return get


def test_greedy_ids_equal_except_within_llamacpps_own_spread(pair, results, spread):
    """Equal greedy ids, except at a step where llama.cpp's top-2 gap is within its own spread: how
    far its configurations move that margin on this machine (measured here when needed), and never
    below SPREAD_FLOOR. A bound grounded in llama.cpp's noise, not in one of its kernels' choices."""
    if not unexcused(results, SPREAD_FLOOR):
        return
    measured = spread()
    bound = max(SPREAD_FLOOR, measured["spread"])
    assert unexcused(results, bound) == [], f"(prompt, step, llama.cpp's gap there) past {bound:.3f}: {measured}"


def test_top10_logits_within_tolerance(pair, results):
    """Within TOP10_TOL, or, past it, within what llama.cpp's own kernels differ by on this machine:
    llama.cpp with flash attention on against itself with it off, over the same prompts (measured,
    not assumed). Why: llama.cpp's x86 paths differ from each other. On an AVX2-only Zen 1 its own
    two kernels differed by up to 0.580 on the 1.5B, and we by 0.563 from it, where the AVX-512
    machines gave 0.472 and 0.475 (docs/fidelity.md). Our kernels give the same bits on every ISA."""
    worst = max(r.top10_max for r in results)
    if worst <= TOP10_TOL:
        return
    name, llm, engine = pair
    llm_fa = open_llama(_model_path(name), n_ctx=1024, n_threads=2, n_threads_batch=2,
                        logits_all=True, flash_attn=True, verbose=False, seed=0)
    try:
        own = []
        for _, text, chat in PROMPTS:
            if chat:
                text = engine.tokenizer.render_chat([{"role": "user", "content": text}], add_generation_prompt=True)
            own.append(llama_vs_itself(llm, llm_fa, llm.tokenize(text.encode("utf-8"), add_bos=False,
                                                                special=True))["top10_max"])
    finally:
        llm_fa.close()
    print(f"\n{name}: top-10 max {worst:.3f} past {TOP10_TOL}; llama.cpp FA on vs off: {max(own):.3f}")
    assert worst <= max(own), ([(r.name, round(r.top10_max, 3)) for r in results], [round(x, 3) for x in own])


class _HeadRowSwapped:
    """An engine whose LM head gives token `x` the logit of row `y`: a wrong row in one shard's slice."""

    def __init__(self, engine, x: int, y: int):
        self.engine, self.x, self.y = engine, x, y
        self.tokenizer = engine.tokenizer

    def _wrong(self, lg: np.ndarray) -> np.ndarray:
        lg = np.array(lg, copy=True)
        lg[self.x] = lg[self.y]
        return lg

    def new_kv(self):
        return self.engine.new_kv()

    def prefill(self, ids, kv):
        return self._wrong(self.engine.prefill(ids, kv))

    def decode(self, t, kv, pos):
        return self._wrong(self.engine.decode(t, kv, pos))


def _first_confident_step(llm, text: str, min_gap: float) -> tuple[int, int]:
    """(step, token): the first step of llama.cpp's greedy run whose token is new and chosen by more
    than min_gap, so that losing that token's logit must change the greedy ids there."""
    ids = llm.tokenize(text.encode("utf-8"), add_bos=False, special=True)
    logits, gen = llama_greedy(llm, ids, N_GEN)
    for i, (lg, t) in enumerate(zip(logits, gen)):
        if t not in gen[:i] and _gap(lg) > min_gap:
            return i, t
    raise AssertionError(f"no step of {text!r} is chosen by more than {min_gap}")


# on the small model only: the rule is the same for both
@pytest.mark.parametrize("pair", [MODELS[0]], indirect=True)
def test_the_rule_catches_a_wrong_row_in_a_shards_head_slice(pair, spread):
    """One head row wrong (the slot of a token llama.cpp picks gets another token's product): the
    greedy rule must fail it, with the bound as wide as this machine's measured spread."""
    name, llm, engine = pair
    bound = max(SPREAD_FLOOR, spread()["spread"])
    _, text, _ = PROMPTS[0]
    step, x = _first_confident_step(llm, text, 2 * bound)
    bad = compare_prompt(llm, _HeadRowSwapped(engine, x, y=0), *PROMPTS[0])
    assert bad.diverged_at is not None and bad.diverged_at <= step
    assert unexcused([bad], bound) != [], (bad, bound)


# on the small model only: the rule is the same for both
@pytest.mark.parametrize("pair", [MODELS[0]], indirect=True)
def test_the_rule_catches_a_swapped_phase(pair, spread, monkeypatch):
    """RoPE's rotation with cos and sin swapped (a swapped phase): caught by the greedy rule or,
    where the ids still agree, by the top-10 logits tolerance."""
    name, llm, engine = pair
    from common.models import qwen2

    table = qwen2.rope_cos_sin  # feeds both the kernels' rope_qkv and numpy's rope_neox
    monkeypatch.setattr(qwen2, "rope_cos_sin", lambda positions, hd, base: table(positions, hd, base)[::-1])
    bound = max(SPREAD_FLOOR, spread()["spread"])
    bad = [compare_prompt(llm, engine, *p) for p in PROMPTS[:3]]
    assert unexcused(bad, bound) != [] or max(r.top10_max for r in bad) > TOP10_TOL, (bad, bound)


# ------------------------------------------------------------------ script: the table for docs/fidelity.md

def fa_div(f: dict) -> str:
    return "" if f["diverged_at"] is None else f" ({f['gap_at_divergence']:.3f})"


def main(argv: list[str]) -> int:
    import llama_cpp

    from deploy import kernels

    # The matmul path the services run (`knot` installs it too); KNOT_KERNELS=off: the numpy reference.
    print(f"matmul: {', '.join(kernels.install()) or 'numpy'} ({kernels.describe()})")

    for name in argv or MODELS:
        t0 = time.perf_counter()
        llm, engine = open_pair(name)
        tok_ok = all(engine.tokenizer.encode(s) == llm.tokenize(s.encode(), add_bos=False, special=True)
                     for s in TRICKY_STRINGS)
        rs = [compare_prompt(llm, engine, *p) for p in PROMPTS]
        # llama.cpp's own noise floor: flash attention on against off, same prompts.
        llm_fa = open_llama(_model_path(name), n_ctx=1024, n_threads=2, n_threads_batch=2,
                            logits_all=True, flash_attn=True, verbose=False, seed=0)
        fa = []
        for _, text, chat in PROMPTS:
            if chat:
                text = engine.tokenizer.render_chat([{"role": "user", "content": text}])
            fa.append(llama_vs_itself(llm, llm_fa, llm.tokenize(text.encode(), add_bos=False, special=True)))
        llm_fa.close()
        print(f"\n### {name}  (llama-cpp-python {llama_cpp.__version__}, {time.perf_counter() - t0:.0f} s)\n")
        print(f"Tokenizer ids equal on {len(TRICKY_STRINGS)} tricky strings and the prompts: {tok_ok}\n")
        print("| prompt | P | ids = | argmax@P = | same greedy ids | diverged at (llama gap there) "
              "| min llama gap | top-10 max abs | top-10 mean abs | ok | llama.cpp FA on vs off: same ids (gap), top-10 max / mean |")
        print("|---|---|---|---|---|---|---|---|---|---|---|")
        for r, f in zip(rs, fa):
            div = "-" if r.diverged_at is None else f"{r.diverged_at} ({r.gap_at_divergence:.3f})"
            print(f"| {r.name} | {r.n_prompt} | {r.ids_equal} | {r.last_argmax_equal} | {r.n_same}/{N_GEN} | {div} "
                  f"| {r.min_gap:.3f} | {r.top10_max:.3f} | {r.top10_mean:.3f} "
                  f"| {'yes' if r.accepted else 'NO'} "
                  f"| {f['n_same']}/{N_GEN}{fa_div(f)}, {f['top10_max']:.3f} / {f['top10_mean']:.3f} |")
        sp = llama_spread(name, llm, prompt_texts(engine))
        print(f"\nllama.cpp's top-2 margin drift against its reference configuration (teacher-forced, "
              f"{len(PROMPTS)} prompts x {N_GEN} steps): spread {sp['spread']:.3f}\n")
        print("| configuration | max drift | its own flips (step, gap) |")
        print("|---|---|---|")
        for label, c in sp["by_config"].items():
            flips = ", ".join(f"{i} ({g:.3f})" for i, g in c["flips"]) or "none"
            print(f"| {label} | {c['max_drift']:.3f} | {flips} |")
        print(f"\ngreedy rule's bound here: max(SPREAD_FLOOR {SPREAD_FLOOR}, spread) = "
              f"{max(SPREAD_FLOOR, sp['spread']):.3f}; largest gap at our divergences: "
              f"{max([r.gap_at_divergence for r in rs if r.diverged_at is not None], default=0.0):.3f}")
        print(f"\nmean of top-10 mean abs: ours {np.mean([r.top10_mean for r in rs]):.3f}, "
              f"llama.cpp FA on vs off {np.mean([f['top10_mean'] for f in fa]):.3f}")
        for r in rs:
            if r.diverged_at is not None:
                print(f"\n{r.name}: ours  {r.ours_text!r}\n{' ' * len(r.name)}  llama {r.llama_text!r}")
        llm.close()
        del llm, engine
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
