"""`knot bench`'s table: ratios and formatting, no servers."""
from __future__ import annotations

import pytest

from deploy.commands.bench import (Figure, build_figures, copy_gb_s, describe_fluid, draft_share, fluid_rates,
                                   format_value, goal_rows, llama_build, per_token, ratio, render_goals, render_table,
                                   speculation_figures)


def test_ratio_is_ours_over_llama_and_missing_sides_give_none():
    assert ratio(30.0, 45.0) == 30.0 / 45.0
    assert ratio(None, 45.0) is None
    assert ratio(30.0, None) is None
    assert ratio(30.0, 0.0) is None


def test_format_value_by_unit():
    assert format_value(None, "tok/s") == "-"
    assert format_value(28.64, "tok/s") == "28.6 tok/s"
    assert format_value(0.5649, "tok/s") == "0.56 tok/s" and format_value(9.876, "tok/s") == "9.88 tok/s"
    assert format_value(68.7, "ms") == "69 ms"
    assert format_value(1234567, "B") == "1,234,567 B"
    assert format_value(248 * 2**20, "MiB") == "248 MiB"
    assert format_value(0.6543, "x") == "0.65x"


def test_render_table_has_the_header_and_one_row_per_figure_with_the_ratio():
    text = render_table([Figure("decode", 22.5, 45.0, "tok/s"), Figure("ttft", 69.0, None, "ms")])
    lines = text.splitlines()
    assert [c.strip() for c in lines[0].strip("|").split("|")] == ["figure", "ours", "llama.cpp",
                                                                  "ratio (ours / llama.cpp)"]
    assert set(lines[1]) <= {"|", "-"}
    decode = [c.strip() for c in lines[2].strip("|").split("|")]
    assert decode == ["decode", "22.5 tok/s", "45.0 tok/s", "0.50"]
    ttft = [c.strip() for c in lines[3].strip("|").split("|")]
    assert ttft == ["ttft", "69 ms", "-", "-"]
    assert len({len(line) for line in lines}) == 1  # columns aligned


def test_per_token_sums_the_deltas():
    assert per_token({"a": 10, "b": 5}, {"a": 30, "b": 25}, 4) == 10.0
    assert per_token({}, {"a": 8}, 2) == 4.0
    assert per_token({"a": 1}, {"a": 2}, 0) is None


def test_build_figures_names_the_required_rows():
    cl = {"decode_tok_s": 28.0, "prefill_tok_s": 135.0, "ttft_ms": 69.0, "aggregate": {1: 27.0, 4: 31.0, 8: 31.0},
          "r2_bytes_per_token": 0.0, "peak_rss": {"station-0": 2**28}}
    fluid = {"decode_tok_s": 1.5, "warden_bytes_per_token": 12.0}
    figs = build_figures(cl, {"decode_tok_s": 50.0}, {"decode_tok_s": 45.0, "prefill_tok_s": 220.0}, [1, 4, 8],
                         fluid, 134217728)
    names = [f.name for f in figs]
    for want in ("decode", "prefill", "single-process decode", "ttft", "aggregate tok/s @1", "aggregate tok/s @4",
                 "aggregate tok/s @8", "R2 bytes per token", "peak RSS station-0"):
        assert want in names
    by = {f.name: f for f in figs}
    assert by["fluid (128 MiB stations) decode"].ours == 1.5  # the fluid run's, not the resident run's
    assert by["fluid (128 MiB stations) warden bytes per token"].ours == 12.0
    assert by["cluster / single-process decode"].ours == 28.0 / 50.0
    assert ratio(by["decode"].ours, by["decode"].llama) == 28.0 / 45.0
    assert by["aggregate tok/s @4"].llama == 45.0  # against one llama.cpp stream: the run's first,
    beside = build_figures({**cl, "aggregate_llama": {4: 40.0}}, None, {"decode_tok_s": 45.0}, [4], None, 1)
    assert next(f for f in beside if f.name == "aggregate tok/s @4").llama == 40.0  # or the one measured right after
    # nothing measured: every cell renders, no crash
    assert "decode" in render_table(build_figures(None, None, None, [1], None, 134217728))
    # --no-fluid: no fluid row, so llama.cpp's decode is not shown against an empty fluid cell
    no_fluid = build_figures(cl, None, {"decode_tok_s": 45.0}, [1], None, 134217728)
    assert not any(f.name.startswith("fluid") for f in no_fluid)
    # --fluid-model: the row names the model and has no llama.cpp cell (llama.cpp ran --model)
    other = build_figures(cl, None, {"decode_tok_s": 45.0}, [1], {**fluid, "model": "qwen7b-synth.knot"}, 134217728)
    by = {f.name: f for f in other}
    row = by["fluid (128 MiB stations, qwen7b-synth.knot) decode"]
    assert (row.ours, row.llama) == (1.5, None)


def test_fluid_rates_are_bytes_over_the_layer_loops_time_against_the_copy_speed():
    before = {"station-0": {"forward_s": 1.0, "forwards": 3, "warden_bytes": 100, "r2_bytes": 0, "load_wait_s": 0.5,
                            "prefetched_phases": 4, "phase_bytes": 50_000_000}}
    after = {"station-0": {"forward_s": 3.0, "forwards": 5, "warden_bytes": 4_000_000_100, "r2_bytes": 0,
                           "load_wait_s": 1.0, "prefetched_phases": 10, "phase_bytes": 50_000_000}}
    r = fluid_rates(before, after)["station-0"]
    assert r["gb_s"] == 2.0 and r["load_wait_share"] == 0.25 and r["bytes_per_forward"] == 2e9
    assert r["ms_per_forward"] == 1000.0 and r["prefetched_phases"] == 6
    line, = describe_fluid({"station-0": r}, 8.0)
    assert "2.00 GB/s (0.25x the 8.00 GB/s np.copyto of a 50 MB phase)" in line and "25% of it waiting" in line
    figs = {f.name: f for f in build_figures(None, None, None, [], {"rates": {"station-0": r}, "copy_gb_s": 8.0}, 1)}
    assert figs["fluid: station-0 GB/s from its warden"].ours == 2.0
    assert figs["fluid: station-0 / np.copyto of a phase"].ours == 0.25
    assert format_value(figs["fluid: np.copyto of a phase (the machine's copy speed)"].ours, "GB/s") == "8.00 GB/s"
    assert copy_gb_s(1 << 20, reps=3) > 0
    resident = fluid_rates(before, {"station-0": {**before["station-0"], "forward_s": 2.0, "forwards": 4}})
    assert resident["station-0"]["gb_s"] is None and describe_fluid(resident, 8.0) == []  # nothing streamed


def test_speculation_rows_carry_the_llama_decode_and_the_acceptance():
    spec = {"code/off": {"decode_tok_s": 20.0, "acceptance": None, "tokens_per_trip": 1.0},
            "code/prompt_lookup": {"decode_tok_s": 40.0, "acceptance": 0.75, "tokens_per_trip": 2.345},
            "code/draft_model": {"decode_tok_s": 60.0, "acceptance": 0.9, "tokens_per_trip": 7.0, "ttft_ms": 900.0,
                                 "draft_share": draft_share({"decode_ms": 800.0, "hops": {"draft": {"total_ms": 360.0}}})}}
    by = {f.name: f for f in speculation_figures(spec, 50.0)}
    assert ratio(by["decode, code prompt, speculation off"].ours, by["decode, code prompt, speculation off"].llama) == 0.4
    assert by["decode, code prompt, prompt lookup"].llama == 50.0
    assert format_value(by["acceptance, code prompt, prompt lookup"].ours, "%") == "75%"
    assert by["tokens per trip, code prompt, prompt lookup"].ours == 2.35
    assert "acceptance, code prompt, speculation off" not in by
    # the draft model's prompt read shows in its time to first token; the off row has none recorded here
    assert by["ttft, code prompt, draft model"].ours == 900.0 and "ttft, code prompt, speculation off" not in by
    assert "ttft, code prompt, prompt lookup" not in by
    # how much of a drafted decode the drafter's calls took (timings.hops.draft over decode_ms)
    assert format_value(by["drafting share of decode, code prompt, draft model"].ours, "%") == "45%"
    assert "drafting share of decode, code prompt, prompt lookup" not in by
    assert draft_share({"decode_ms": 800.0, "hops": {"station_0": {"total_ms": 1.0}}}) is None
    figs = build_figures({"speculation": spec}, None, {"decode_tok_s": 50.0}, [], None, 1)
    assert "decode, code prompt, prompt lookup" in [f.name for f in figs]


def test_build_figures_adds_the_long_prompt_rows_with_their_ratio():
    cl = {"long_prompts": {2048: {"prefill_tok_s": 100.0}, 30000: {"error": "HTTP 400: ..."}}}
    ll = {"long_prefill_tok_s": {2048: 200.0, 30000: 80.0}}
    by = {f.name: f for f in build_figures(cl, None, ll, [1], None, 134217728)}
    assert ratio(by["prefill, 2048-token prompt"].ours, by["prefill, 2048-token prompt"].llama) == 0.5
    assert by["prefill, 30000-token prompt"].ours is None and by["prefill, 30000-token prompt"].llama == 80.0
    assert not any(n.startswith("prefill, ") for n in (f.name for f in build_figures({}, None, {}, [1], None, 1)))


def test_long_prompt_ids_are_exactly_n():
    from deploy.commands.bench import long_prompt_ids
    from tests.unit.test_tokenizer import TOK

    for n in (1, 100, 3000):
        assert len(long_prompt_ids(TOK, n)) == n


def test_each_decode_figure_is_set_against_the_llama_decode_measured_beside_it():
    """knot bench measures llama.cpp's decode again right after each decode figure of ours; a ratio
    is against that measurement, and falls back to the run's first only where none was taken."""
    spec = {"code/off": {"decode_tok_s": 8.0, "acceptance": None, "tokens_per_trip": 1.0, "llama_decode_tok_s": 8.0},
            "code/draft_model": {"decode_tok_s": 11.0, "acceptance": 0.9, "tokens_per_trip": 6.0,
                                 "llama_decode_tok_s": 10.0},
            "chat/off": {"decode_tok_s": 9.0, "acceptance": None, "tokens_per_trip": 1.0, "llama_decode_tok_s": None}}
    cl = {"decode_tok_s": 7.0, "llama_decode_tok_s": 7.5, "speculation": spec}
    local = {"decode_tok_s": 12.0, "llama_decode_tok_s": 11.0}
    by = {f.name: f for f in build_figures(cl, local, {"decode_tok_s": 9.5}, [], None, 1)}
    assert by["decode"].llama == 7.5
    assert by["single-process decode"].llama == 11.0
    assert ratio(by["decode, code prompt, draft model"].ours, by["decode, code prompt, draft model"].llama) == 1.1
    assert by["decode, code prompt, speculation off"].llama == 8.0
    assert by["decode, chat prompt, speculation off"].llama == 9.5  # none beside it: the run's first
    assert by["prefill"].llama is None  # --llama-once or not, prefill is measured once
    # --llama-once: no measurement beside any figure, every ratio against the first
    once = {f.name: f for f in build_figures({"decode_tok_s": 7.0}, {"decode_tok_s": 12.0}, {"decode_tok_s": 9.5},
                                             [], None, 1)}
    assert once["decode"].llama == once["single-process decode"].llama == 9.5


@pytest.mark.parametrize("argv,needle", [
    (["--tokens", "0"], "--tokens: expected an integer >= 1, got 0"),
    (["--spec-repeats", "-1"], "--spec-repeats: expected an integer >= 1, got -1"),
    (["--concurrency", "1,0"], "--concurrency: expected an integer >= 1, got 0"),
    (["--long-prompts", "2048,x"], "--long-prompts: expected an integer, got 'x'"),
    (["--llama-lib", "/nonexistent/lib"], "--llama-lib: /nonexistent/lib holds no libllama.so"),
])
def test_bench_refuses_bad_counts_before_it_starts_anything(argv, needle, capsys):
    # --tokens 0 started the cluster and llama.cpp, then ended in a traceback on the coordinator's 400.
    from deploy.cli import build_parser

    with pytest.raises(SystemExit) as e:
        build_parser().parse_args(["bench", *argv])
    assert e.value.code == 2 and needle in capsys.readouterr().err
    args = build_parser().parse_args(["bench", "--concurrency", "", "--long-prompts", "2048, 8192"])
    assert args.concurrency == [] and args.long_prompts == [2048, 8192] and args.tokens == 64
    assert build_parser().parse_args(["bench"]).concurrency == [1, 4, 8]


def test_bench_records_parse_as_records_with_the_machine_command_and_ratios(tmp_path):
    from deploy import records
    from deploy.commands.bench import bench_records

    described = {"cpu": "AMD EPYC", "family": 25, "model": 17, "features": ["AVX2", "AVX-512F"], "cpus": 2,
                 "mem_total_bytes": 2**34, "system": "Linux 6", "kernels": "avx512 kernels, 2 threads",
                 "memory_read_gb_s": 32.9}
    figs = [Figure("decode", 42.8, 47.0, "tok/s"), Figure("ttft", 55.0, None, "ms"),
            Figure("acceptance, code prompt, prompt lookup", 0.13, None, "%"),
            Figure("peak RSS station-0", 300 * 2**20, None, "MiB"), Figure("R2 bytes per token", None, None, "B")]
    recs = bench_records(figs, records.machine_of(described), "knot bench --tokens 64", "2026-12-06",
                         "qwen2.5-coder-0.5b", "64 tokens")
    path = tmp_path / "results" / "zen4.jsonl"
    records.append(path, recs)
    records.append(path, recs[:1])  # appends, never overwrites
    back = records.read(path)
    assert len(back) == len(recs) + 1 and back[:len(recs)] == recs
    by = {r["metric"]: r for r in back}
    assert set(by) == {"decode", "decode, llama.cpp", "decode, ours / llama.cpp", "ttft",
                       "acceptance, code prompt, prompt lookup", "peak RSS station-0"}  # no row without a value
    assert (by["decode"]["value"], by["decode"]["unit"]) == (42.8, "tok/s")
    assert by["decode, ours / llama.cpp"]["value"] == round(42.8 / 47.0, 4) and by["decode, ours / llama.cpp"]["unit"] == "x"
    assert (by["acceptance, code prompt, prompt lookup"]["value"], by["peak RSS station-0"]["unit"]) == (13.0, "B")
    r = by["ttft"]
    assert (r["date"], r["command"], r["model"], r["note"]) == ("2026-12-06", "knot bench --tokens 64",
                                                                "qwen2.5-coder-0.5b", "64 tokens")
    assert r["machine"]["isa"] == ["AVX2", "AVX-512F"] and (r["machine"]["family"], r["machine"]["model"]) == (25, 17)
    assert records.machine_class(r["machine"]) == "Zen 4" and r["machine"]["memory_read_gb_s"] == 32.9


def test_a_records_command_carries_the_settings_that_change_the_measurement():
    from deploy.commands.bench import command_line

    argv = ["bench", "--model", "qwen2.5-coder-0.5b", "--concurrency", ""]
    assert command_line(argv, {}) == "knot bench --model qwen2.5-coder-0.5b --concurrency ''"
    env = {"KNOT_LAYER_WARDEN_BUDGET_BYTES": "5000000000", "KNOT_API_KEY": "secret", "HOME": "/root"}
    assert command_line(argv, env) == ("KNOT_LAYER_WARDEN_BUDGET_BYTES=5000000000 knot bench --model "
                                       "qwen2.5-coder-0.5b --concurrency ''")
    assert command_line(None, {}) == "knot bench"


def test_the_goals_table_says_which_of_issue_54s_goals_hold():
    figs = [Figure("decode", 50.0, 45.0, "tok/s"), Figure("single-process decode", 60.0, 50.0, "tok/s"),
            Figure("cluster / single-process decode", 0.8, None, "x"), Figure("aggregate tok/s @8", 90.0, 45.0, "tok/s"),
            Figure("decode, code prompt, draft model", 30.0, 20.0, "tok/s"),
            Figure("decode, code prompt, speculation off", 33.0, 20.0, "tok/s")]
    rows = {g: (v, holds) for g, v, holds in goal_rows(figs, "qwen2.5-coder-1.5b")}
    assert rows["cluster decode >= 1.0x llama.cpp"] == ("1.11", "yes")
    assert rows["single-process decode >= 1.1x"] == ("1.20", "yes")
    assert rows["cluster / single process >= 0.9"] == ("0.80", "no")
    assert rows["aggregate of 8 streams >= 2x one llama.cpp stream"] == ("2.00", "yes")
    assert rows["code with the 0.5B drafting >= 1.5x"] == ("1.50", "yes")
    assert rows["code with the 0.5B drafting never below speculation off"] == ("0.91", "no")
    assert rows["prefill of 512 tokens >= 1.0x"] == ("-", "not measured")
    assert "| goal" in render_goals(figs, "qwen2.5-coder-0.5b", "Zen 4") and "Zen 4" in render_goals(figs, "x", "Zen 4")
    # against the run's fastest llama.cpp decode (50 tok/s) the aggregate is 1.80x and the drafted
    # decode 0.60x: met only beside their own figures; decode (1.00x) and single process (1.20x) hold
    rows = {g: holds for g, _, holds in goal_rows(figs, "qwen2.5-coder-1.5b", [45.0, 50.0, 20.0])}
    assert rows["aggregate of 8 streams >= 2x one llama.cpp stream"] == (
        "beside its llama.cpp figure; not against the run's fastest (1.80)")
    assert rows["code with the 0.5B drafting >= 1.5x"].endswith("(0.60)")
    assert rows["cluster decode >= 1.0x llama.cpp"] == "yes" and rows["single-process decode >= 1.1x"] == "yes"
    assert rows["cluster / single process >= 0.9"] == "no"


class _FakeLlama:
    """llama_cpp's module as llama_build reads it: its system info line."""

    def __init__(self, info: str):
        self.info = info

    def llama_print_system_info(self) -> bytes:
        return self.info.encode()


def test_llama_build_names_the_cpu_features_its_build_runs(monkeypatch):
    avx2 = _FakeLlama("CPU : SSE3 = 1 | SSSE3 = 1 | AVX = 1 | AVX2 = 1 | F16C = 1 | FMA = 1 | BMI2 = 1 | "
                      "AVX512 = 0 | LLAMAFILE = 1 | OPENMP = 1 | REPACK = 1 | ")
    assert llama_build(avx2) == "SSE3 SSSE3 AVX AVX2 F16C FMA BMI2 LLAMAFILE OPENMP REPACK"
    assert llama_build(avx2, "/opt/llama-avx2/lib").endswith("REPACK (from /opt/llama-avx2/lib)")
    monkeypatch.setenv("HOME", "/home/u")
    assert llama_build(avx2, "/home/u/.cache/knot/llama-avx2/llama_cpp/lib").endswith(
        "(from ~/.cache/knot/llama-avx2/llama_cpp/lib)")
