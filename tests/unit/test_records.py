"""deploy/records.py: the shape of a benchmark record, and every committed record in that shape."""
from __future__ import annotations

from pathlib import Path

import pytest

from deploy import records

ROOT = Path(__file__).resolve().parents[2]
ZEN4 = {"cpu": "AMD EPYC", "family": 25, "model": 17, "isa": ["AVX2", "AVX-512F", "AVX-512 VNNI"]}
GOOD = {"date": "2026-12-05", "machine": ZEN4, "command": "knot bench", "metric": "decode", "value": 42.8,
        "unit": "tok/s", "note": ""}


def test_every_committed_record_has_the_schema():
    files = sorted((ROOT / "benchmarks" / "results").glob("*.jsonl"))
    assert files, "benchmarks/results holds the records docs/performance.md quotes"
    for f in files:
        assert records.read(f), f"{f} is empty"


@pytest.mark.parametrize("change, needle", [
    ({"date": "2026-12-5"}, "YYYY-MM-DD"),
    ({"value": "42.8"}, "expected a number"),
    ({"value": True}, "expected a number"),
    ({"machine": {"cpu": "AMD EPYC"}}, "expected an object with"),
    ({"machine": {**ZEN4, "family": "25"}}, "integer or null"),
    ({"metric": ""}, "must not be empty"),
    ({"speed": 1}, "unknown fields"),
])
def test_a_bad_record_is_refused_naming_the_field(change, needle):
    with pytest.raises(records.RecordError, match=needle):
        records.check({**GOOD, **change})


def test_a_missing_field_is_named():
    bad = dict(GOOD)
    del bad["note"]
    with pytest.raises(records.RecordError, match="lacks note"):
        records.check(bad)


def test_read_names_the_bad_line(tmp_path):
    records.append(tmp_path / "r.jsonl", [GOOD])
    with (tmp_path / "r.jsonl").open("a") as f:
        f.write('{"date": "2026-12-05"}\n')
    with pytest.raises(records.RecordError, match=r"r.jsonl:2: record lacks"):
        records.read(tmp_path / "r.jsonl")


@pytest.mark.parametrize("cpu, family, model, isa, want", [
    ("AMD EPYC 7551 32-Core Processor", 23, 1, ["AVX2"], "Zen 1"),
    ("AMD EPYC 7B13", 25, 1, ["AVX2"], "Zen 3"),
    ("AMD EPYC", 25, 17, ["AVX2", "AVX-512F", "AVX-512 VNNI"], "Zen 4"),
    ("AMD EPYC", 26, 2, ["AVX2", "AVX-512F", "AVX-512 VNNI"], "Zen 5"),
    ("Intel(R) Xeon(R) Platinum 8481C CPU @ 2.70GHz", 6, 143, ["AVX2", "AVX-512F", "AMX"], "Intel AVX-512"),
    ("Intel(R) Core(TM) i7", 6, 158, ["AVX2"], "AVX2"),
])
def test_machine_class(cpu, family, model, isa, want):
    assert records.machine_class({"cpu": cpu, "family": family, "model": model, "isa": isa}) == want


@pytest.mark.parametrize("kernels, llama, want", [
    ("avx512 kernels, 2 threads", "AVX2 AVX512 AVX512_VNNI", "Zen 4"),
    ("avx2 kernels, 2 threads", "AVX AVX2 F16C FMA BMI2 LLAMAFILE (from /x/lib)", "Zen 4, AVX2 builds"),
    ("avx2 kernels, 2 threads", "AVX2 AVX512 AVX512_VNNI", "Zen 4, AVX2 kernels"),
    ("avx2 kernels, 2 threads", None, "Zen 4, AVX2 kernels"),
])
def test_kernels_held_to_avx2_on_an_avx512_cpu_are_a_class_of_their_own(kernels, llama, want):
    m = {"cpu": "AMD EPYC", "family": 25, "model": 17, "isa": ["AVX2", "AVX-512F", "AVX-512 VNNI"],
         "kernels": kernels, **({"llama_cpp": llama} if llama else {})}
    assert records.machine_class(m) == want
    # an AVX2-only CPU is its own class whatever the kernels say
    zen3 = {"cpu": "AMD EPYC 7B13", "family": 25, "model": 1, "isa": ["AVX2"], "kernels": kernels}
    assert records.machine_class(zen3) == "Zen 3"


def _rec(date, metric, value, model="qwen2.5-coder-0.5b", machine=ZEN4):
    return {**GOOD, "date": date, "metric": metric, "value": value, "model": model, "machine": machine}


def test_the_table_takes_each_figure_from_its_latest_day_as_a_range():
    r = ", ours / llama.cpp"
    intel = {"cpu": "Intel Xeon", "family": 6, "model": 167, "isa": ["AVX2", "AVX-512F"]}
    recs = [_rec("2026-12-04", "decode" + r, 0.66), _rec("2026-12-05", "decode" + r, 0.91),
            _rec("2026-12-05", "decode" + r, 0.90), _rec("2026-12-04", "single-process decode" + r, 1.2),
            {**_rec("2026-12-05", "decode" + r, 0.5), "superseded": "the code changed since"},  # left out
            _rec("2026-12-02", "decode, code prompt, speculation off" + r, 0.64, machine=intel)]
    rows = {line.split(" | ")[0].strip("| "): line for line in records.latest_table(recs).splitlines()}
    assert rows[""].startswith("|  | Zen 4 | Intel AVX-512 |")  # classes in CLASSES' order
    assert rows["0.5B cluster decode"] == "| 0.5B cluster decode | 0.90-0.91 | 0.64 (code prompt) |"
    assert rows["0.5B single process"] == "| 0.5B single process | 1.20 | - |"
    assert rows["latest record"] == "| latest record | 2026-12-05 | 2026-12-02 |"
    assert rows["memory read, all CPUs (GB/s)"] == "| memory read, all CPUs (GB/s) | - | - |", "none recorded"


def test_the_table_shows_the_memory_read_speed_of_each_classs_latest_day_that_has_it():
    r = ", ours / llama.cpp"
    recs = [_rec("2026-12-06", "decode" + r, 0.8, machine={**ZEN4, "memory_read_gb_s": 20.0}),
            _rec("2026-12-07", "decode" + r, 0.8, machine={**ZEN4, "memory_read_gb_s": 32.9}),
            _rec("2026-12-07", "prefill" + r, 0.9, machine={**ZEN4, "memory_read_gb_s": 31.5}),
            _rec("2026-12-08", "decode" + r, 0.8)]  # a later run that did not measure it
    rows = {line.split(" | ")[0].strip("| "): line for line in records.latest_table(recs).splitlines()}
    assert rows["memory read, all CPUs (GB/s)"] == "| memory read, all CPUs (GB/s) | 31.5-32.9 |"


def test_performance_md_shows_the_latest_records():
    doc = (ROOT / "docs" / "performance.md").read_text()
    recs = [r for f in sorted((ROOT / "benchmarks" / "results").glob("*.jsonl")) for r in records.read(f)]
    assert doc == records.with_table(doc, records.latest_table(recs)), (
        "docs/performance.md's table is stale: run `python -m deploy.records --write docs/performance.md`")


def test_a_run_held_to_avx2_is_its_own_column_and_says_so():
    held = {**ZEN4, "kernels": "avx2 kernels, 2 threads", "llama_cpp": "AVX AVX2 F16C FMA"}
    r = ", ours / llama.cpp"
    table = records.latest_table([_rec("2026-12-07", "decode" + r, 0.85),
                                  _rec("2026-12-07", "decode" + r, 0.82, machine=held)])
    head, _, _, isa = table.splitlines()[:4]
    assert head.split("|")[2:4] == [" Zen 4 ", " Zen 4, AVX2 builds "]
    assert isa.split("|")[2:4] == [" AVX2 AVX-512F AVX-512 VNNI ",
                                   " AVX2 AVX-512F AVX-512 VNNI (both sides held to AVX2) "]
    assert "| 0.85 | 0.82 |" in table
