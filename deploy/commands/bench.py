"""`knot bench [--model NAME|PATH]`: the cluster and llama.cpp side by side, in one run, one table.

Measures (issue 7's benchmark):
    decode / prefill / ttft           the cluster's POST /generate timings (prefill: a ~512-token
                                      prompt's tokens over its time to first token)
    single-process decode             deploy.engine_local.LocalEngine on the same file
    aggregate tok/s @C                C threads posting /generate at once: completion tokens / wall time
    R2 bytes per token                sum of the r2_bytes_read deltas over the stations and shards
                                      during the decode run, over its generated tokens (the wardens'
                                      /stats are per identity, so a plain GET does not count them)
    profiles                          the figures above come from the resident profile: stations
                                      with --budget-bytes (default 1 GiB) keep their layers; then a
                                      second cluster runs the fluid profile (--fluid-budget-bytes,
                                      default 128 MiB, a Worker's memory): its decode tok/s, the
                                      bytes per token the stations pulled from their LayerWardens, and
                                      per station those bytes over its layer loop's time (GB/s) set
                                      against np.copyto of a phase's bytes (the machine's copy speed);
                                      --fluid-model runs it on another model, e.g. the seed's 7B shape
                                      from `knot synth` (its row then has no llama.cpp cell)
    peak RSS <service>                VmHWM of each service process at the end (a station's counts the
                                      LayerWarden's shared blocks it has mapped: deploy/local/shm.py)
    speculation                       greedy decode of a code prompt (HumanEval-style), a chat
                                      prompt and a code edit (chat), with speculation off and with each source (prompt
                                      lookup; the draft model with --draft-model): tok/s, acceptance
                                      (accepted / drafted), tokens per trip, and whether the tokens
                                      equal speculation off's; best of --spec-repeats runs each; the
                                      time to first token with speculation off and with the draft
                                      model (which reads the prompt too, beside the stations), and
                                      the draft model's share of decode time spent drafting
    prompt caching, JSON schema       (deploy/feature_bench.py; --no-features skips them) time to first
                                      token of a --cache-context-tokens chat context re-sent with its answer
                                      and a new question, cached against cache_prompt false (equal answers
                                      required); decode tok/s with a JSON schema against without; each the
                                      median of --feature-rounds
    long prompts (--long-prompts)     optional: prefill tok/s of prompts of N tokens (e.g. 2048,8192,30000)
                                      through the cluster (POST /generate, 1 token: N over the time to
                                      first token) and through llama.cpp (one eval of the N tokens, in its
                                      n_batch steps); they run before the peak RSS is read
llama.cpp (llama-cpp-python, when installed) runs on the same GGUF with the same thread count:
decode = N greedy tokens after a short prompt (the eval loop timed), prefill = one 512-token eval.
Its decode is measured again right after each of our decode figures (the cluster's, the single
process's, each speculation run), on the model opened once, and each ratio is against the
measurement beside its figure (best against best for the speculation rows' repeats): on a VM whose
speed drifts by a quarter within minutes, a ratio against one measurement at the start moved with
the drift. --llama-once measures it once, at the start.

The machine (deploy.machine: the CPU, its family and model, the vector features the kernels and
llama.cpp choose by, the CPUs this process may use, memory and what it reads a second on them all,
the kernel, and the matmul kernels chosen) is printed first and above the table: a ratio belongs to
the machine it was measured on.
--json FILE appends the table to FILE as records (deploy/records.py), each with that machine and the
command, e.g. to benchmarks/results/<machine class>.jsonl.

Benchmarks are records, never tests: nothing here asserts a speed.
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

NAME = "bench"
HELP = "benchmark the cluster against llama.cpp on the same GGUF and print one table with the ratios"

SHORT_PROMPT = "def fibonacci(n):"
RESIDENT_BUDGET_BYTES = 128 << 20  # --profile resident: each station's layers + this (KV caches, activations)
FLUID_BUDGET_BYTES = 128 << 20   # --profile worker: a Worker's memory, the seed's fluid-memory profile
# Speculation prompts: code repeats its names (prompt lookup's case), chat mostly does not.
SPEC_PROMPTS = {
    "code": {"prompt": 'from typing import List\n\n\ndef has_close_elements(numbers: List[float], threshold: float) '
                       '-> bool:\n    """ Check if in given list of numbers, are any two numbers closer to each '
                       'other than\n    given threshold.\n    >>> has_close_elements([1.0, 2.0, 3.0], 0.5)\n    '
                       'False\n    >>> has_close_elements([1.0, 2.8, 3.0, 4.0, 5.0, 2.0], 0.3)\n    True\n    """\n'},
    "chat": {"messages": [{"role": "user", "content": "Explain what a Python list comprehension is, "
                                                      "with one short example."}]},
    # an edit: the answer copies most of the prompt, prompt lookup's best case
    "code edit": {"messages": [{"role": "user", "content": (
        "Add type hints to this function and change nothing else:\n```python\n"
        "def moving_average(values, window):\n    if window <= 0:\n        raise ValueError(\"window must be "
        "positive\")\n    out = []\n    total = 0.0\n    for i, v in enumerate(values):\n        total += v\n"
        "        if i >= window:\n            total -= values[i - window]\n        if i >= window - 1:\n"
        "            out.append(total / window)\n    return out\n```")}]},
}


# ---------------------------------------------------------------------------------------------
# the table (pure: unit tested in tests/unit/test_bench.py)

@dataclass(frozen=True)
class Figure:
    name: str
    ours: float | None
    llama: float | None = None
    unit: str = ""          # "tok/s" | "ms" | "B" | "MiB" (value in bytes) | "x" (a ratio) | ""


def format_value(v: float | None, unit: str) -> str:
    if v is None:
        return "-"
    if unit == "tok/s":  # under 10, two places: the 7B shape's fluid decode is ~0.5, its goal 0.5
        return f"{v:.2f} tok/s" if v < 10 else f"{v:.1f} tok/s"
    if unit == "ms":
        return f"{v:.0f} ms"
    if unit == "B":
        return f"{v:,.0f} B"
    if unit == "MiB":
        return f"{v / 2**20:.0f} MiB"
    if unit == "x":
        return f"{v:.2f}x"
    if unit == "%":
        return f"{v * 100:.0f}%"
    if unit == "GB/s":
        return f"{v:.2f} GB/s"
    return f"{v:g}"


def ratio(ours: float | None, llama: float | None) -> float | None:
    """ours / llama.cpp; None when either side is missing or llama.cpp's is 0."""
    if ours is None or llama is None or llama == 0:
        return None
    return ours / llama


def table_rows(figures: list[Figure]) -> list[tuple[str, str, str, str]]:
    out = []
    for f in figures:
        r = ratio(f.ours, f.llama)
        out.append((f.name, format_value(f.ours, f.unit), format_value(f.llama, f.unit),
                    "-" if r is None else f"{r:.2f}"))
    return out


def render_table(figures: list[Figure]) -> str:
    """A Markdown table: figure | ours | llama.cpp | ratio (ours / llama.cpp)."""
    header = ("figure", "ours", "llama.cpp", "ratio (ours / llama.cpp)")
    rows = [header] + table_rows(figures)
    widths = [max(len(r[i]) for r in rows) for i in range(4)]

    def line(r):
        return "| " + " | ".join(c.ljust(w) for c, w in zip(r, widths)) + " |"

    sep = "|" + "|".join("-" * (w + 2) for w in widths) + "|"
    return "\n".join([line(rows[0]), sep] + [line(r) for r in rows[1:]])


# Issue 54's goals, per model: (what, the figure, at least this). A figure with a llama.cpp side is
# held by its ratio, a ratio figure ("x") by its value; the aggregate by one llama.cpp stream.
COMMON_GOALS = (("cluster decode >= 1.0x llama.cpp", "decode", 1.0),
                ("single-process decode >= 1.1x", "single-process decode", 1.1),
                ("prefill of 512 tokens >= 1.0x", "prefill", 1.0),
                ("prefill of 8,192 tokens >= 0.9x", "prefill, 8192-token prompt", 0.9))
GOALS = {
    "qwen2.5-coder-0.5b": COMMON_GOALS + (
        ("cluster / single process >= 0.85", "cluster / single-process decode", 0.85),
        ("aggregate of 8 streams >= 2.5x one llama.cpp stream", "aggregate tok/s @8", 2.5)),
    "qwen2.5-coder-1.5b": COMMON_GOALS + (
        ("cluster / single process >= 0.9", "cluster / single-process decode", 0.9),
        ("aggregate of 8 streams >= 2x one llama.cpp stream", "aggregate tok/s @8", 2.0),
        ("code with the 0.5B drafting >= 1.5x", "decode, code prompt, draft model", 1.5)),
}
NEVER_BELOW = ("decode, code prompt, draft model", "decode, code prompt, speculation off")
# The goals set against llama.cpp's decode: each figure's llama.cpp side is the decode measured
# beside it, one of the run's decode_runs.
DECODE_GOALS = ("decode", "single-process decode", "aggregate tok/s @8", "decode, code prompt, draft model")


def goal_rows(figures: list[Figure], model: str, llama_runs: list[float] | None = None) -> list[tuple[str, str, str]]:
    """(goal, measured, holds: yes | no | not measured) of issue 54's goals for model's run. With the
    run's llama.cpp decode measurements (llama_runs), a decode goal met against the measurement beside
    it but not against the run's fastest says both. Why: on a VM whose speed drifts within a
    run, a goal met by a hair against a slow llama.cpp figure is not met
    (docs/lab/2026-12-07-avx2-builds-and-token-pointers.md)."""
    by = {f.name: f for f in figures}
    fastest = max(llama_runs) if llama_runs else None
    out = []
    for what, name, least in GOALS.get(model, COMMON_GOALS):
        f = by.get(name)
        v = None if f is None else (f.ours if f.unit == "x" else ratio(f.ours, f.llama))
        holds = "not measured" if v is None else ("yes" if v >= least else "no")
        if holds == "yes" and fastest and name in DECODE_GOALS and f.ours / fastest < least:
            holds = f"beside its llama.cpp figure; not against the run's fastest ({f.ours / fastest:.2f})"
        out.append((what, "-" if v is None else f"{v:.2f}", holds))
    drafted, off = by.get(NEVER_BELOW[0]), by.get(NEVER_BELOW[1])
    if drafted is not None and off is not None and drafted.ours is not None and off.ours:
        v = drafted.ours / off.ours
        out.append(("code with the 0.5B drafting never below speculation off", f"{v:.2f}", "yes" if v >= 1 else "no"))
    return out


def render_goals(figures: list[Figure], model: str, machine_class: str, llama_runs: list[float] | None = None) -> str:
    """The goals table knot bench prints after its figures."""
    rows = [("goal", "measured", f"holds on this {machine_class}")] + goal_rows(figures, model, llama_runs)
    widths = [max(len(r[i]) for r in rows) for i in range(3)]

    def line(r):
        return "| " + " | ".join(c.ljust(w) for c, w in zip(r, widths)) + " |"

    return "\n".join([line(rows[0]), "|" + "|".join("-" * (w + 2) for w in widths) + "|"] + [line(r) for r in rows[1:]])


# The settings that change what a bench measures: a record's command carries those that were set.
MEASURED_ENV = ("KNOT_LAYER_WARDEN_BUDGET_BYTES", "KNOT_KERNELS", "KNOT_THREADS", "KNOT_SPIN_US", "KNOT_SHARD_THREADS",
                "KNOT_HTTP_SERVER", "KNOT_SHM_DIR", "KNOT_PREFETCH", "KNOT_WARM_WARDEN", "KNOT_INTERLEAVE_ROWS")


def command_line(argv: list[str] | None, variables: dict[str, str]) -> str:
    """What reproduces a run: the MEASURED_ENV settings among `variables` (as set, sorted), then `knot`
    and its arguments. The values are echoed, not parsed: the services read them (common/settings.py)."""
    env = [f"{k}={shlex.quote(v)}" for k, v in sorted(variables.items()) if k in MEASURED_ENV]
    return " ".join(env + ["knot", shlex.join(argv) if argv else "bench"])


def bench_records(figures: list[Figure], machine: dict, command: str, date: str, model: str,
                  note: str = "") -> list[dict]:
    """The table as records (deploy/records.py): per figure ours, llama.cpp's ("<name>, llama.cpp") and
    their ratio ("<name>, ours / llama.cpp", unit "x"), each where measured. MiB figures are stored
    in bytes ("B") and shares in percent ("%")."""
    from deploy import records

    def one(metric: str, value: float, unit: str) -> dict:
        if unit == "MiB":
            unit = "B"  # Figure keeps bytes and prints MiB
        elif unit == "%":
            value = round(value * 100, 3)
        return records.record(date, machine, command, metric, value, unit, note, model=model)

    out = []
    for f in figures:
        if f.ours is not None:
            out.append(one(f.name, f.ours, f.unit))
        if f.llama is not None:
            out.append(one(f"{f.name}, llama.cpp", f.llama, f.unit))
        r = ratio(f.ours, f.llama)
        if r is not None:
            out.append(one(f"{f.name}, ours / llama.cpp", round(r, 4), "x"))
    return out


def per_token(before: dict[str, int], after: dict[str, int], tokens: int) -> float | None:
    """Sum of the counters' deltas over the tokens generated between the two readings."""
    if tokens <= 0:
        return None
    return sum(after.get(k, 0) - before.get(k, 0) for k in after) / tokens


# ---------------------------------------------------------------------------------------------
# measurements

def progress(msg: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def positive_int(text: str) -> int:
    """An argparse type: an integer >= 1, refused before anything starts (a bench of --tokens 0 ran the
    cluster up and llama.cpp first, then ended in a traceback)."""
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {n}")
    return n


def llama_lib_dir(text: str) -> str:
    """An argparse type: a directory holding llama.cpp's libllama.so, as an absolute path (refused
    before anything starts: llama_cpp's import would end in a traceback)."""
    d = Path(text).expanduser().resolve()
    if not (d / "libllama.so").exists():
        raise argparse.ArgumentTypeError(f"{d} holds no libllama.so (scripts/llama-isa.sh builds one; "
                                         f"its lib directory is <DIR>/llama_cpp/lib)")
    return str(d)


def positive_ints(text: str) -> list[int]:
    """An argparse type: comma-separated integers >= 1 (empty: none)."""
    return [positive_int(c.strip()) for c in text.split(",") if c.strip()]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="model name known to `knot fetch-model`, or a .gguf path "
                   "(default: the project's default model)")
    p.add_argument("--tokens", type=positive_int, default=64, metavar="N",
                   help="tokens generated per decode run (default 64)")
    p.add_argument("--prompt-tokens", type=positive_int, default=512, metavar="N",
                   help="prompt length of the prefill figure (default 512)")
    p.add_argument("--concurrency", type=positive_ints, default="1,4,8",
                   help="comma-separated concurrent request counts (default 1,4,8)")
    p.add_argument("--threads", type=positive_int, default=2, help="llama.cpp threads (default 2, like the kernels)")
    p.add_argument("--budget-bytes", type=positive_int, default=RESIDENT_BUDGET_BYTES,
                   help="STATION_MEMORY_BUDGET_BYTES of the main cluster run, which runs `--profile resident` "
                   "(each station's budget: its layers + this; default 128 MiB)")
    p.add_argument("--fluid-budget-bytes", type=positive_int, default=FLUID_BUDGET_BYTES,
                   help="STATION_MEMORY_BUDGET_BYTES of the fluid run, `--profile worker` (default 128 MiB)")
    p.add_argument("--fluid-tokens", type=positive_int, default=16, metavar="N",
                   help="tokens generated in the fluid run (default 16)")
    p.add_argument("--no-fluid", action="store_true", help="skip the fluid run")
    p.add_argument("--fluid-model", default=None, metavar="MODEL",
                   help="the fluid run's model, if not --model: a name, or a .gguf or .knot path, e.g. the seed's "
                   "7B shape from `knot synth` (set KNOT_LAYER_WARDEN_BUDGET_BYTES to hold it: 5000000000); its "
                   "row has no llama.cpp cell")
    p.add_argument("--run-dir", default=None, help="cluster run directory (default: $TMPDIR/knot-bench; "
                   "the bucket survives, so later runs skip the upload)")
    p.add_argument("--no-llama", action="store_true", help="skip llama.cpp")
    p.add_argument("--llama-lib", type=llama_lib_dir, default=None, metavar="DIR",
                   help="load llama.cpp's shared libraries from DIR (LLAMA_CPP_LIB_PATH), e.g. a build for a "
                        "narrower ISA from scripts/llama-isa.sh, to set against KNOT_KERNELS of the same ISA")
    p.add_argument("--llama-once", action="store_true", help="measure llama.cpp's decode once, at the start, "
                   "not again beside each decode figure (faster; the ratios then carry the machine's drift)")
    p.add_argument("--no-cluster", action="store_true", help="skip the cluster (single process and llama.cpp only)")
    p.add_argument("--draft-model", default=None, help="also run the cluster with this draft model (name or "
                   "path, same vocabulary) and measure the speculation source draft_model")
    p.add_argument("--spec-repeats", type=positive_int, default=2, metavar="N",
                   help="runs of each speculation measurement; the best is reported (default 2)")
    p.add_argument("--no-features", action="store_true", help="skip prompt caching and the JSON schema decode")
    p.add_argument("--cache-context-tokens", type=positive_int, default=4000, metavar="N",
                   help="prompt caching: the re-sent context's length (default 4000)")
    p.add_argument("--feature-rounds", type=positive_int, default=2, metavar="N",
                   help="rounds of the prompt caching and JSON schema measurements (default 2)")
    p.add_argument("--json", default=None, metavar="FILE",
                   help="also append the figures to FILE as records, one JSON object a line (deploy/records.py; "
                   "benchmarks/results/README.md)")
    p.add_argument("--long-prompts", type=positive_ints, default="", metavar="N,N",
                   help="also measure the prefill of prompts of these token counts, e.g. 2048,8192,30000 "
                        "(the cluster's stations need the budget for their KV caches)")


def http_json(method: str, url: str, body: dict | None = None, timeout_s: float = 1800.0,
              headers: dict[str, str] | None = None) -> dict:
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, method=method,
                                 headers={"content-type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as r:
            return json.loads(r.read())
    except urllib.error.HTTPError as e:
        raise RuntimeError(f"{method} {url}: HTTP {e.code}: {e.read()[:300]!r}") from None


def long_prompt_ids(tokenizer, n: int) -> list[int]:
    """About n tokens of plausible Python (repeated functions), cut to exactly n ids."""
    k = 8
    while True:  # doubling the functions: O(n log n) tokenizing, not O(n^2)
        ids = tokenizer.encode("".join(
            f"def function_{i}(values, scale={i}):\n    total = 0\n    for v in values:\n"
            f"        total += v * scale - {i}\n    return total / max(1, len(values))\n\n" for i in range(k)))
        if len(ids) >= n:
            return ids[:n]
        k *= 2


def llama_build(llama_cpp, lib: str | None = None) -> str:
    """The CPU features llama.cpp's loaded build runs, from its system info: e.g. "AVX2 FMA F16C"
    (the "= 1" entries of its CPU backend; the rest of the line is dropped), and the directory it
    was loaded from when not the package's own (--llama-lib)."""
    info = llama_cpp.llama_print_system_info().decode(errors="replace")
    cpu = info.split("CPU :", 1)[1].split("|") if "CPU :" in info else info.split("|")
    feats = [k.strip() for k, _, v in (f.partition("=") for f in cpu) if v.strip() == "1"]
    home = str(Path.home())
    if lib and (lib == home or lib.startswith(home + os.sep)):
        lib = "~" + lib[len(home):]  # a record names the build, not this machine's home
    return " ".join(feats) + (f" (from {lib})" if lib else "")


class LlamaDecode:
    """llama.cpp on a model opened once. Each call times its decode, `tokens` greedy tokens after
    short_ids (the eval loop), and returns tok/s, so that it can be measured again beside each of
    our decode figures (runs: every measurement, in order); prefill_tok_s times one prompt's eval."""

    def __init__(self, gguf: Path, threads: int, tokens: int, short_ids: list[int], n_ctx: int):
        from deploy.llamacpp import open_llama

        self.llm = open_llama(gguf, n_ctx=max(1024, n_ctx, len(short_ids) + tokens + 16), n_batch=512,
                              n_threads=threads, n_threads_batch=threads, flash_attn=False, verbose=False)
        if self.llm.amx_denied:
            progress("llama.cpp: AMX refused (it faults on these VMs; deploy/llamacpp.py)")
        self.tokens, self.short_ids = tokens, short_ids
        self.runs: list[float] = []

    def __call__(self) -> float:
        import numpy as np

        llm = self.llm
        llm.reset(); llm.eval(self.short_ids)
        tok = int(np.argmax(llm.scores[llm.n_tokens - 1]))
        t0 = time.perf_counter()
        for _ in range(self.tokens):
            llm.eval([tok])
            tok = int(np.argmax(llm.scores[llm.n_tokens - 1]))
        self.runs.append(self.tokens / (time.perf_counter() - t0))
        return self.runs[-1]

    def prefill_tok_s(self, ids: list[int]) -> float:
        """One eval of ids (after a warm-up eval of their first 16)."""
        llm = self.llm
        llm.reset(); llm.eval(ids[:16])
        llm.reset()
        t0 = time.perf_counter(); llm.eval(ids); dt = time.perf_counter() - t0
        return len(ids) / dt

    def close(self) -> None:
        del self.llm


def measure_llama_prefill(gguf: Path, threads: int, ids: list[int]) -> float:
    """llama.cpp's prefill tok/s of one prompt: a context of its length, one eval in n_batch steps."""
    llm = LlamaDecode(gguf, threads, 0, [], len(ids) + 16)
    try:
        return llm.prefill_tok_s(ids)
    finally:
        llm.close()


def measure_llama(ref: LlamaDecode, long_ids: list[int]) -> dict:
    """prefill: one eval of the long prompt; decode: ref's first measurement."""
    return {"prefill_tok_s": ref.prefill_tok_s(long_ids), "decode_tok_s": ref()}


# llama.cpp's decode measured beside one of ours (LlamaDecode), or None
Beside = Callable[[], float] | None


def measure_local(path: Path, tokens: int, short_ids: list[int], beside: Beside = None) -> dict:
    from common.sampling import SamplingParams
    from deploy.engine_local import LocalEngine

    engine = LocalEngine.open(path, copy_weights=True)  # as knot generate runs it
    engine.generate(short_ids, SamplingParams(), max_tokens=2)  # warm-up
    g = engine.generate(short_ids, SamplingParams(), max_tokens=tokens)
    del engine  # its weights' pages, before llama.cpp's run beside it
    return {"decode_tok_s": g.decode_tok_s, "tokens": len(g.token_ids), "prefill_tok_s": g.prefill_tok_s,
            "llama_decode_tok_s": beside() if beside else None}


def _stats(cluster, r) -> dict:
    """A service's /stats, signed with the cluster's secret as its peers' calls are."""
    return http_json("GET", r.url + "/stats", timeout_s=30, headers=cluster.signed("GET", r.url + "/stats"))


def _counters(cluster, running: dict, key: str) -> dict[str, int]:
    out = {}
    for name, r in running.items():
        if r.kind != "process" or not r.url or name == "coordinator":
            continue
        try:
            s = _stats(cluster, r)
        except Exception:
            continue
        if key in s:
            out[name] = int(s[key])
    return out


def peak_rss_bytes(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def start_cluster(model: str | None, args, budget_bytes: int, profile: str, draft_model: str | None = None):
    from deploy import launcher, servers

    run_dir = Path(args.run_dir) if args.run_dir else Path(tempfile.gettempdir()) / "knot-bench"
    env = {**os.environ, "KNOT_PORT": str(servers.free_ports(1)[0]),
           "STATION_MEMORY_BUDGET_BYTES": str(budget_bytes)}
    env.pop("KNOT_KEY", None)
    cluster = launcher.Cluster(run_dir)
    progress(f"starting the cluster in {run_dir} (profile {profile}, STATION_MEMORY_BUDGET_BYTES {budget_bytes:,})")
    running = cluster.up(model=model, env=env, profile=profile, draft_model=draft_model)
    for line in cluster.memory_lines(running):
        progress(line)
    return cluster, {r.name: r for r in running}


def stations_stats(cluster, running: dict) -> dict[str, dict]:
    """Every station's /stats (signed with the cluster's secret), by name."""
    return {n: _stats(cluster, r) for n, r in sorted(running.items()) if n.startswith("station")}


def _station_stats(cluster, running: dict) -> dict:
    """The stations' memory and byte counters, for the bench's record."""
    return {n: {k: s.get(k) for k in ("peak_accounted_bytes", "budget_bytes", "warden_bytes", "r2_bytes")}
            for n, s in stations_stats(cluster, running).items()}


def copy_gb_s(nbytes: int, reps: int = 9) -> float:
    """The machine's copy speed for a buffer of nbytes (a fluid phase): np.copyto, median of reps, GB/s."""
    import numpy as np

    src = np.random.default_rng(0).integers(0, 255, max(nbytes, 1), dtype=np.uint8)
    dst = np.empty_like(src)
    np.copyto(dst, src)  # the pages of dst exist before the timing
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        np.copyto(dst, src)
        times.append(time.perf_counter() - t0)
    return src.nbytes / sorted(times)[reps // 2] / 1e9


def fluid_rates(before: dict[str, dict], after: dict[str, dict]) -> dict[str, dict]:
    """Per station, between two /stats readings: bytes from its LayerWarden over the time in its
    layer loop (GB/s), that loop's share spent waiting for tensors, and bytes per forward."""
    out = {}
    for name, b in after.items():
        a = before[name]
        forward_s, forwards = b["forward_s"] - a["forward_s"], b["forwards"] - a["forwards"]
        moved = b["warden_bytes"] - a["warden_bytes"] + b["r2_bytes"] - a["r2_bytes"]
        out[name] = {"gb_s": moved / forward_s / 1e9 if forward_s > 0 and moved else None,  # None: nothing streamed
                     "load_wait_share": (b["load_wait_s"] - a["load_wait_s"]) / forward_s if forward_s > 0 else None,
                     "bytes_per_forward": moved / forwards if forwards else None,
                     "ms_per_forward": forward_s / forwards * 1e3 if forwards else None,
                     "prefetched_phases": b["prefetched_phases"] - a["prefetched_phases"],
                     "phase_bytes": b["phase_bytes"]}
    return out


def describe_fluid(rates: dict[str, dict], copy: float) -> list[str]:
    """One line per station: GB/s moved, against the copy speed, and where its forward's time went."""
    lines = []
    for name, r in rates.items():
        if r["gb_s"] is None:
            continue
        lines.append(f"{name}: {r['bytes_per_forward'] / 1e9:.3f} GB per forward in {r['ms_per_forward']:.0f} ms: "
                     f"{r['gb_s']:.2f} GB/s ({r['gb_s'] / copy:.2f}x the {copy:.2f} GB/s np.copyto of a "
                     f"{r['phase_bytes'] / 1e6:.0f} MB phase); {r['load_wait_share']:.0%} of it waiting for tensors, "
                     f"{r['prefetched_phases']} phases prefetched")
    return lines


def measure_fluid(model: str | None, args) -> dict:
    """Decode only, with Worker-sized stations: tok/s and the bytes pulled from the LayerWardens."""
    cluster, running = start_cluster(model, args, args.fluid_budget_bytes, "worker")
    try:
        url = running["coordinator"].url + "/generate"
        http_json("POST", url, {"prompt": SHORT_PROMPT, "max_tokens": 2, "temperature": 0})
        w0, s0 = _counters(cluster, running, "warden_bytes"), stations_stats(cluster, running)
        progress(f"fluid decode: {args.fluid_tokens} tokens")
        # speculation off, as the decode row: one forward per token, so the bytes per token are a forward's
        body = http_json("POST", url, {"prompt": SHORT_PROMPT, "max_tokens": args.fluid_tokens, "temperature": 0,
                                       "speculation": "off"})
        n = body["usage"]["completion_tokens"]
        rates = fluid_rates(s0, stations_stats(cluster, running))
        return {"decode_tok_s": body["timings"]["decode_tok_s"], "tokens": n,
                "warden_bytes_per_token": per_token(w0, _counters(cluster, running, "warden_bytes"), n),
                "rates": rates, "copy_gb_s": copy_gb_s(max(r["phase_bytes"] for r in rates.values())),
                "station_stats": _station_stats(cluster, running)}
    finally:
        progress("stopping the fluid cluster")
        cluster.down()


def measure_long_prompts(gen, texts: dict[int, str]) -> dict[int, dict]:
    """N -> the cluster's prefill of an N-token prompt: tok/s, or the error that refused it."""
    out = {}
    for n, text in texts.items():
        progress(f"cluster prefill: a {n}-token prompt")
        try:
            body = gen(text, 1)
        except RuntimeError as e:  # e.g. 400: the stations' budgets cannot hold that many tokens' KV
            progress(f"  refused: {e}")
            out[n] = {"error": str(e)}
            continue
        ttft_s = body["timings"]["time_to_first_token_ms"] / 1e3
        out[n] = {"prompt_tokens": body["usage"]["prompt_tokens"], "ttft_s": ttft_s,
                  "prefill_tok_s": body["usage"]["prompt_tokens"] / ttft_s}
        progress(f"  {out[n]['prefill_tok_s']:.1f} tok/s over {ttft_s:.0f} s")
    return out


def measure_cluster(model: str | None, args, tokens: int, long_text: str, concurrency: list[int],
                    long_texts: dict[int, str] | None = None, beside: Beside = None) -> dict:
    from deploy import servers

    cluster, running = start_cluster(model, args, args.budget_bytes, "resident", args.draft_model)
    out: dict = {"services": sorted(running)}
    try:
        url = running["coordinator"].url + "/generate"
        # speculation off: the plain decode (the speculation rows below measure it on and off)
        gen = lambda prompt, n: http_json("POST", url, {"prompt": prompt, "max_tokens": n, "temperature": 0,
                                                        "speculation": "off"})
        progress("cluster warm-up")
        gen(SHORT_PROMPT, 4)

        r2_0, w_0 = _counters(cluster, running, "r2_bytes_read"), _counters(cluster, running, "warden_bytes")
        generated = 0
        progress(f"cluster decode: {tokens} tokens")
        body = gen(SHORT_PROMPT, tokens)
        out["decode_tok_s"] = body["timings"]["decode_tok_s"]
        out["decode_tokens"] = body["usage"]["completion_tokens"]
        out["hops"] = body["timings"].get("hops")
        generated += body["usage"]["completion_tokens"]
        out["llama_decode_tok_s"] = beside() if beside else None
        r2_1, w_1 = _counters(cluster, running, "r2_bytes_read"), _counters(cluster, running, "warden_bytes")
        out["r2_bytes_per_token"] = per_token(r2_0, r2_1, generated)
        out["warden_bytes_per_token"] = per_token(w_0, w_1, generated)
        out["r2_by_service"] = {k: r2_1.get(k, 0) - r2_0.get(k, 0) for k in r2_1}
        out["warden_by_station"] = {k: w_1.get(k, 0) - w_0.get(k, 0) for k in w_1}

        progress("cluster prefill: the long prompt")
        body = gen(long_text, 1)
        n_prompt = body["usage"]["prompt_tokens"]
        ttft_s = body["timings"]["time_to_first_token_ms"] / 1e3
        out["prefill_prompt_tokens"] = n_prompt
        out["prefill_tok_s"] = n_prompt / ttft_s
        out["prefill_ttft_ms"] = ttft_s * 1e3
        body = gen(SHORT_PROMPT, 1)
        out["ttft_ms"] = body["timings"]["time_to_first_token_ms"]
        out["ttft_prompt_tokens"] = body["usage"]["prompt_tokens"]

        sources = ["off", "prompt_lookup"] + (["draft_model"] if args.draft_model else [])
        out["speculation"] = measure_speculation(url, tokens, sources, args.spec_repeats, beside)

        if not args.no_features:
            from deploy import feature_bench

            base = running["coordinator"].url
            progress(f"cluster prompt caching: a {args.cache_context_tokens}-token context re-sent, cached "
                     f"against cold")
            out["prompt_cache"] = feature_bench.prompt_cache(base, args.cache_context_tokens, args.feature_rounds,
                                                             progress=progress)
            progress("cluster decode with a JSON schema against without")
            out["json_schema"] = feature_bench.json_schema_decode(base, tokens, args.feature_rounds)

        out["aggregate"] = {}
        for c in concurrency:
            progress(f"cluster aggregate: {c} concurrent requests of {tokens} tokens")
            results: list = [None] * c
            errors: list = []

            def worker(i):
                try:
                    results[i] = gen(SHORT_PROMPT, tokens)
                except Exception as e:  # noqa: BLE001 - reported below
                    errors.append(e)

            threads = [threading.Thread(target=worker, args=(i,)) for i in range(c)]
            t0 = time.perf_counter()
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            wall = time.perf_counter() - t0
            if errors:
                progress(f"  {len(errors)} of {c} requests failed: {errors[0]}")
            done = sum(r["usage"]["completion_tokens"] for r in results if r)
            out["aggregate"][c] = done / wall if done else None
            out.setdefault("aggregate_llama", {})[c] = beside() if beside else None  # one stream, right after

        if long_texts:
            out["long_prompts"] = measure_long_prompts(gen, long_texts)
        out["peak_rss"] = {n: peak_rss_bytes(r.pid) for n, r in running.items()
                           if r.kind == "process" and servers.pid_alive(r.pid)}
        out["station_stats"] = _station_stats(cluster, running)
    finally:
        progress("stopping the cluster")
        cluster.down()
    return out


def measure_speculation(url: str, tokens: int, sources: list[str], repeats: int, beside: Beside = None) -> dict:
    """"<kind>/<source>" -> the best decode tok/s of `repeats` greedy runs, the speculation record,
    whether the tokens equal speculation off's, and the best of llama.cpp's decodes measured right
    after each run (beside)."""
    out: dict = {}
    for kind, body in SPEC_PROMPTS.items():
        plain = None
        for src in sources:
            best, llama = None, []
            for _ in range(max(1, repeats)):
                progress(f"speculation: {kind} prompt, {src}, {tokens} tokens")
                r = http_json("POST", url, {**body, "max_tokens": tokens, "temperature": 0, "speculation": src})
                if best is None or (r["timings"]["decode_tok_s"] or 0) > (best["timings"]["decode_tok_s"] or 0):
                    best = r
                if beside:
                    llama.append(beside())
            if src == "off":
                plain = best["tokens"]
            s = best["timings"]["speculation"]
            out[f"{kind}/{src}"] = {"decode_tok_s": best["timings"]["decode_tok_s"], "tokens": len(best["tokens"]),
                                    "ttft_ms": best["timings"]["time_to_first_token_ms"],
                                    "acceptance": s["acceptance"], "tokens_per_trip": s["tokens_per_trip"],
                                    "drafted": s["drafted"], "accepted": s["accepted"],
                                    "same_tokens_as_off": None if plain is None else best["tokens"] == plain,
                                    "shard_sampling": best["timings"].get("shard_sampling"),
                                    "draft_share": draft_share(best["timings"]),
                                    "llama_decode_tok_s": max(llama) if llama else None}
    return out


SOURCE_NAMES = {"off": "speculation off", "prompt_lookup": "prompt lookup", "draft_model": "draft model"}


def draft_share(timings: dict) -> float | None:
    """The share of decode time spent in the drafter's calls (timings.hops.draft), None without any."""
    draft_ms, decode_ms = timings.get("hops", {}).get("draft", {}).get("total_ms"), timings.get("decode_ms")
    return draft_ms / decode_ms if draft_ms is not None and decode_ms else None


def beside_or(m: dict, llama_decode: float | None) -> float | None:
    """The llama.cpp decode measured beside a figure (m's llama_decode_tok_s), else the run's first."""
    b = m.get("llama_decode_tok_s")
    return llama_decode if b is None else b


def speculation_figures(spec: dict, llama_decode: float | None) -> list[Figure]:
    figs = []
    for key, m in spec.items():
        kind, src = key.split("/")
        label = f"{kind} prompt, {SOURCE_NAMES.get(src, src)}"
        figs.append(Figure(f"decode, {label}", m["decode_tok_s"], beside_or(m, llama_decode), "tok/s"))
        if src in ("off", "draft_model") and m.get("ttft_ms") is not None:
            # the draft model reads the prompt too (while the target does): its cost shows here
            figs.append(Figure(f"ttft, {label}", m["ttft_ms"], None, "ms"))
        if src != "off":
            figs.append(Figure(f"acceptance, {label}", m["acceptance"], None, "%"))
            tpt = m["tokens_per_trip"]
            figs.append(Figure(f"tokens per trip, {label}", None if tpt is None else round(tpt, 2), None, ""))
        if src == "draft_model":  # the rest of a trip is its verify through the stations and shards
            figs.append(Figure(f"drafting share of decode, {label}", m.get("draft_share"), None, "%"))
    return figs


def build_figures(cl: dict | None, local: dict | None, ll: dict | None, concurrency: list[int],
                  fluid: dict | None, fluid_budget_bytes: int) -> list[Figure]:
    cl, ll, fluid = cl or {}, ll or {}, fluid or {}
    long_ns = sorted(set(cl.get("long_prompts", {})) | set(ll.get("long_prefill_tok_s", {})))
    figs = [
        Figure("decode", cl.get("decode_tok_s"), beside_or(cl, ll.get("decode_tok_s")), "tok/s"),
        Figure("prefill", cl.get("prefill_tok_s"), ll.get("prefill_tok_s"), "tok/s"),
        Figure("single-process decode", (local or {}).get("decode_tok_s"), beside_or(local or {}, ll.get("decode_tok_s")),
               "tok/s"),
        # issue 7: the cluster's decode overhead against the single process (goal: >= 0.85)
        Figure("cluster / single-process decode", ratio(cl.get("decode_tok_s"), (local or {}).get("decode_tok_s")),
               None, "x"),
        Figure("ttft", cl.get("ttft_ms"), None, "ms"),
    ]
    figs += speculation_figures(cl.get("speculation", {}), ll.get("decode_tok_s"))
    for c in concurrency:  # against one llama.cpp stream (llama-cpp-python serves one), measured right after
        one = cl.get("aggregate_llama", {}).get(c)
        figs.append(Figure(f"aggregate tok/s @{c}", cl.get("aggregate", {}).get(c),
                           ll.get("decode_tok_s") if one is None else one, "tok/s"))
    for n in long_ns:
        figs.append(Figure(f"prefill, {n}-token prompt", cl.get("long_prompts", {}).get(n, {}).get("prefill_tok_s"),
                           ll.get("long_prefill_tok_s", {}).get(n), "tok/s"))
    if "prompt_cache" in cl:  # goal: cached / cold <= 0.1
        from deploy.feature_bench import cache_ratio_metric

        pc = cl["prompt_cache"]
        what = cache_ratio_metric(pc["context_tokens"])
        figs += [Figure(what.replace("cached / cold", "cold"), pc["cold_ttft_s"] * 1e3, None, "ms"),
                 Figure(what.replace("cached / cold", "cached"), pc["cached_ttft_s"] * 1e3, None, "ms"),
                 Figure(what, round(pc["ratio"], 3), None, "x")]
    if "json_schema" in cl:  # goal: >= 0.9
        from deploy.feature_bench import SCHEMA_RATIO

        js = cl["json_schema"]
        figs += [Figure("decode, JSON schema", js["schema_tok_s"], None, "tok/s"),
                 Figure(SCHEMA_RATIO, round(js["ratio"], 3), None, "x")]
    figs.append(Figure("R2 bytes per token", cl.get("r2_bytes_per_token"), None, "B"))
    mib = fluid_budget_bytes / 2**20
    # The fluid run of another model (--fluid-model) is set against nothing: llama.cpp ran --model.
    other = fluid.get("model")
    where = f"{mib:g} MiB stations" + (f", {other}" if other else "")
    if fluid:  # with --no-fluid no row: llama.cpp's decode must not stand in a fluid row alone
        figs.append(Figure(f"fluid ({where}) decode", fluid.get("decode_tok_s"),
                           None if other else ll.get("decode_tok_s"), "tok/s"))
        figs.append(Figure(f"fluid ({where}) warden bytes per token",
                           fluid.get("warden_bytes_per_token"), None, "B"))
    copy = fluid.get("copy_gb_s")
    for name, r in (fluid.get("rates") or {}).items():
        figs.append(Figure(f"fluid: {name} GB/s from its warden", r["gb_s"], None, "GB/s"))
        figs.append(Figure(f"fluid: {name} / np.copyto of a phase", ratio(r["gb_s"], copy), None, "x"))
    if fluid:
        figs.append(Figure("fluid: np.copyto of a phase (the machine's copy speed)", copy, None, "GB/s"))
    for n, b in sorted(cl.get("peak_rss", {}).items()):
        figs.append(Figure(f"peak RSS {n}", b, None, "MiB"))
    return figs


def run(args: argparse.Namespace) -> int:
    from deploy import machine, models

    host = machine.describe()
    host["memory_read_gb_s"] = round(machine.memory_read_gb_s(), 1)
    progress(f"machine: {machine.one_line(host)}")
    concurrency = args.concurrency
    model = args.model or models.DEFAULT_MODEL
    progress(f"model {model}: fetching / encoding if needed")
    knot = models.ensure_knot(model)
    gguf = models.model_path(model)
    if gguf.suffix != ".gguf":
        progress(f"{gguf} is not a GGUF: llama.cpp is skipped")
        args.no_llama = True

    from deploy.engine_local import LocalEngine

    tok = LocalEngine.open(knot).tokenizer
    short_ids = ([tok.bos_id] if tok.add_bos and tok.bos_id is not None else []) + tok.encode(SHORT_PROMPT)
    long_ids = long_prompt_ids(tok, args.prompt_tokens)
    long_text = tok.decode(long_ids)
    long_ns = args.long_prompts
    long_sets = {n: long_prompt_ids(tok, n) for n in long_ns}

    ll = ref = None
    if not args.no_llama:
        if args.llama_lib:  # llama-cpp-python's own variable, read once, when llama_cpp is first imported
            os.environ["LLAMA_CPP_LIB_PATH"] = args.llama_lib
        try:
            import llama_cpp
        except ImportError:
            progress("llama-cpp-python is not installed: llama.cpp column left empty")
        else:
            host["llama_cpp"] = llama_build(llama_cpp, args.llama_lib)
            progress(f"llama.cpp build: {host['llama_cpp']}")
            progress(f"llama.cpp: prefill {len(long_ids)} tokens, decode {args.tokens} tokens, {args.threads} threads")
            ref = LlamaDecode(gguf, args.threads, args.tokens, short_ids, len(long_ids) + 16)
            ll = measure_llama(ref, long_ids)
            ll["long_prefill_tok_s"] = {}
            for n, ids in long_sets.items():
                progress(f"llama.cpp: prefill of a {n}-token prompt")
                ll["long_prefill_tok_s"][n] = measure_llama_prefill(gguf, args.threads, ids)

    def beside() -> float:
        progress(f"llama.cpp beside it: decode {args.tokens} tokens")
        return ref()

    paired = beside if ref is not None and not args.llama_once else None
    progress(f"single process: decode {args.tokens} tokens")
    local = measure_local(knot, args.tokens, short_ids, paired)
    cl = fluid = None
    if not args.no_cluster:
        cl = measure_cluster(args.model, args, args.tokens, long_text, concurrency,
                             {n: tok.decode(ids) for n, ids in long_sets.items()}, paired)
        if not args.no_fluid:
            fluid = measure_fluid(args.fluid_model or args.model, args)
            if args.fluid_model:
                fluid["model"] = Path(args.fluid_model).name

    if ref is not None:
        ll["decode_runs"] = list(ref.runs)
        ref.close()
    figures = build_figures(cl, local, ll, concurrency, fluid, args.fluid_budget_bytes)
    print(f"knot bench: {model} ({gguf.name}), {args.tokens} tokens, prompt {len(long_ids)} tokens, "
          f"llama.cpp {args.threads} threads, stations --profile resident (layers + {args.budget_bytes:,} B; "
          f"fluid run: --profile worker, {args.fluid_budget_bytes:,} B)")
    print(f"machine: {machine.one_line(host)}")
    print(render_table(figures))
    from deploy import records

    print(f"\nissue 54's goals ({records.machine_class(records.machine_of(host))}, {host['cpus']} CPUs, memory read "
          f"{host['memory_read_gb_s']:.1f} GB/s; the aggregate rows are set against one llama.cpp stream):")
    runs = (ll or {}).get("decode_runs") or []
    print(render_goals(figures, model, records.machine_class(records.machine_of(host)), runs))
    if len(runs) > 1:
        print(f"\nllama.cpp decode, measured {len(runs)} times (at the start, then right after each decode figure of "
              f"ours, whose ratio is against it): {min(runs):.2f} to {max(runs):.2f} tok/s")
    if cl:
        print(f"\nprefill prompt: {cl.get('prefill_prompt_tokens')} tokens; ttft prompt: "
              f"{cl.get('ttft_prompt_tokens')} tokens; decode run: {cl.get('decode_tokens')} tokens")
        print(f"R2 bytes by service during the decode run: {cl.get('r2_by_service')}")
        print(f"warden bytes by station during the decode run: {cl.get('warden_by_station')}")
        print(f"station stats: {json.dumps(cl.get('station_stats'))}")
        for key, m in (cl.get("speculation") or {}).items():
            print(f"speculation {key}: {m['tokens']} tokens, drafted {m['drafted']}, accepted {m['accepted']}, "
                  f"same tokens as off: {m['same_tokens_as_off']}, shard sampling {m['shard_sampling']}")
        for n, r in (cl.get("long_prompts") or {}).items():
            print(f"{n}-token prompt: {r}")
    if fluid:
        of = f" of {fluid['model']}" if fluid.get("model") else ""
        print(f"fluid run{of}: {fluid['tokens']} tokens; station stats: {json.dumps(fluid['station_stats'])}")
        for line in describe_fluid(fluid["rates"], fluid["copy_gb_s"]):
            print(f"fluid {line}")
    if args.json:
        command = command_line(getattr(args, "argv", None), dict(os.environ))
        note = (f"{args.tokens} tokens, prompt {len(long_ids)} tokens"
                + (f", llama.cpp {args.threads} threads" if ll else "")
                + ("" if not runs else f", llama.cpp decode {min(runs):.2f}-{max(runs):.2f} tok/s over the run"))
        recs = bench_records(figures, records.machine_of(host), command, time.strftime("%Y-%m-%d", time.gmtime()),
                             model, note)
        records.append(Path(args.json), recs)
        progress(f"{len(recs)} records appended to {args.json}")
    return 0
