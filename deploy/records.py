"""Benchmark records: one JSON object per measurement, one per line (`benchmarks/results/*.jsonl`).

    {"date": "YYYY-MM-DD", "machine": {"cpu": "<model name>", "family": 25, "model": 17,
     "isa": ["AVX2", "AVX-512F", "AVX-512 VNNI"]}, "command": "knot bench --model ...",
     "metric": "decode", "value": 42.8, "unit": "tok/s", "note": "..."}

Required: date (YYYY-MM-DD, UTC), machine (cpu, family, model, isa; family/model may be null where the
CPU was not read), command (what reproduces it), metric, value (a number), unit ("" for a plain count),
note (a string, may be empty). Optional: "model" (the model measured), "commit", "superseded" (what
changed in the code since, which the record no longer measures: docs/performance.md leaves it out).
`knot bench --json FILE` appends records of this shape; benchmarks/results/README.md shows the same
schema to a reader.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

REQUIRED = ("date", "machine", "command", "metric", "value", "unit", "note")
OPTIONAL = ("model", "commit", "superseded")
MACHINE_REQUIRED = ("cpu", "family", "model", "isa")
DATE = re.compile(r"^\d{4}-\d{2}-\d{2}$")


class RecordError(ValueError):
    pass


def machine_of(described: dict) -> dict:
    """deploy.machine.describe()'s dict -> a record's machine: cpu, family, model, isa (the vector
    features), plus the rest of what was described (cpus, memory, kernels) as it was."""
    m = {"cpu": described.get("cpu"), "family": described.get("family"), "model": described.get("model"),
         "isa": list(described.get("features") or [])}
    m.update({k: v for k, v in described.items() if k not in ("cpu", "family", "model", "features")})
    return m


def machine_class(machine: dict) -> str:
    """A record's machine -> the class docs/performance.md groups figures by, e.g. "Zen 4",
    "Intel AVX-512", "AVX2" (other CPUs, by their widest vector ISA). A CPU with AVX-512 whose run
    held our kernels to AVX2 (KNOT_KERNELS=avx2) is a class of its own: "Zen 4, AVX2 builds" when
    llama.cpp's build was held to AVX2 too (scripts/llama-isa.sh), else "Zen 4, AVX2 kernels"."""
    base = cpu_class(machine)
    if "AVX-512F" in (machine.get("isa") or []) and str(machine.get("kernels") or "").startswith("avx2 "):
        llama = machine.get("llama_cpp")
        return f"{base}, AVX2 builds" if llama and "AVX512" not in llama.split() else f"{base}, AVX2 kernels"
    return base


def cpu_class(machine: dict) -> str:
    """The CPU's class alone (machine_class without the kernels' ISA)."""
    cpu, family, model = machine.get("cpu") or "", machine.get("family"), machine.get("model")
    isa = machine.get("isa") or []
    if "AMD" in cpu:
        m = model or 0
        if family == 23:
            return "Zen 2" if m >= 0x30 else "Zen 1"
        if family == 25:  # Zen 4: models 0x10-0x1f, 0x60-0x7f, 0xa0-0xaf; the rest Zen 3
            return "Zen 4" if 0x10 <= m < 0x20 or 0x60 <= m < 0x80 or 0xa0 <= m < 0xb0 else "Zen 3"
        if family == 26:
            return "Zen 5"
    if "Intel" in cpu and "AVX-512F" in isa:
        return "Intel AVX-512"
    return "AVX-512" if "AVX-512F" in isa else "AVX2" if "AVX2" in isa else "no AVX2"


def record(date: str, machine: dict, command: str, metric: str, value: float, unit: str, note: str = "",
           **optional) -> dict:
    """One record, checked (RecordError naming the field)."""
    r = {"date": date, "machine": machine, "command": command, "metric": metric, "value": value,
         "unit": unit, "note": note, **optional}
    check(r)
    return r


def check(r: object) -> None:
    """Raise RecordError unless r is a record of the schema above."""
    if not isinstance(r, dict):
        raise RecordError(f"a record is a JSON object, got {type(r).__name__}")
    missing = [k for k in REQUIRED if k not in r]
    if missing:
        raise RecordError(f"record lacks {', '.join(missing)}: {r}")
    unknown = sorted(set(r) - set(REQUIRED) - set(OPTIONAL))
    if unknown:
        raise RecordError(f"record has unknown fields {unknown} (known: {REQUIRED + OPTIONAL})")
    if not isinstance(r["date"], str) or not DATE.match(r["date"]):
        raise RecordError(f"date {r['date']!r}: expected YYYY-MM-DD")
    m = r["machine"]
    if not isinstance(m, dict) or [k for k in MACHINE_REQUIRED if k not in m]:
        raise RecordError(f"machine {m!r}: expected an object with {', '.join(MACHINE_REQUIRED)}")
    if not isinstance(m["cpu"], str) or not m["cpu"] or not isinstance(m["isa"], list):
        raise RecordError(f"machine {m!r}: cpu is a name, isa a list")
    for k in ("family", "model"):
        if m[k] is not None and not isinstance(m[k], int):
            raise RecordError(f"machine {k} {m[k]!r}: expected an integer or null")
    for k in ("command", "metric", "unit", "note"):
        if not isinstance(r[k], str):
            raise RecordError(f"{k} {r[k]!r}: expected a string")
    if not r["command"] or not r["metric"]:
        raise RecordError(f"command and metric must not be empty: {r}")
    if isinstance(r["value"], bool) or not isinstance(r["value"], (int, float)):
        raise RecordError(f"value {r['value']!r} of {r['metric']!r}: expected a number")


def read(path: Path) -> list[dict]:
    """Every record of a .jsonl file, checked; a bad line raises RecordError naming its line."""
    out = []
    for n, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            r = json.loads(line)
            check(r)
        except (json.JSONDecodeError, RecordError) as e:
            raise RecordError(f"{path}:{n}: {e}") from None
        out.append(r)
    return out


def append(path: Path, records: list[dict]) -> None:
    """Append records to a .jsonl file, one line each (the file and its directory made if absent)."""
    for r in records:
        check(r)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as f:
        for r in records:
            f.write(json.dumps(r, sort_keys=False) + "\n")


# ---------------------------------------------------------------------------------------------
# the latest figures per machine class: docs/performance.md's table, rendered from the records

CLASSES = ("Zen 1", "Zen 2", "Zen 3", "Zen 4", "Zen 5", "Intel AVX-512", "AVX-512", "AVX2", "no AVX2")
M05, M15, M7B = "qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b", "7B shape (knot synth)"
RATIO = ", ours / llama.cpp"
# (row, model, metric, fallback metric): each cell the range of the class's latest day's values
RATIO_ROWS = (
    ("0.5B cluster decode", M05, "decode" + RATIO, "decode, code prompt, speculation off" + RATIO),
    ("0.5B single process", M05, "single-process decode" + RATIO, None),
    ("0.5B code edit, prompt lookup", M05, "decode, code edit prompt, prompt lookup" + RATIO, None),
    ("1.5B cluster decode", M15, "decode" + RATIO, "decode, code prompt, speculation off" + RATIO),
    ("1.5B single process", M15, "single-process decode" + RATIO, None),
    ("1.5B code, 0.5B drafting", M15, "decode, code prompt, draft model" + RATIO, None),
    # issue 54: eight streams at once against one llama.cpp stream (its goals: deploy/commands/bench.py GOALS)
    ("0.5B aggregate of 8 streams / one llama.cpp stream", M05, "aggregate tok/s @8" + RATIO, None),
    ("1.5B aggregate of 8 streams / one llama.cpp stream", M15, "aggregate tok/s @8" + RATIO, None),
    ("prefill, 512 tokens, 0.5B", M05, "prefill" + RATIO, None),
    ("prefill, 512 tokens, 1.5B", M15, "prefill" + RATIO, None),
    # issue 50: time to first token of a re-sent context, cached / cold (goal <= 0.1), and decode under
    # a JSON schema / without (goal >= 0.9): ours against ours (deploy/feature_bench.py)
    ("re-sent 4,000-token context, ttft cached / cold, 0.5B", M05, "ttft, re-sent 4000-token context, cached / cold",
     None),
    ("re-sent 4,000-token context, ttft cached / cold, 1.5B", M15, "ttft, re-sent 4000-token context, cached / cold",
     None),
    ("JSON schema decode / none, 0.5B", M05, "decode, JSON schema / none", None),
    ("JSON schema decode / none, 1.5B", M15, "decode, JSON schema / none", None),
)
FLUID = "fluid (128 MiB stations, qwen7b-synth.knot) decode"
SWARM = "Swarm of 3 nodes, 2 replicas, 4 shards"  # scripts/test-swarm.sh's lab (benchmarks/replicas.py --label)
BEGIN, END = "<!-- records: begin (python -m deploy.records --write docs/performance.md) -->", "<!-- records: end -->"


def _on_latest_day(hits: list[dict]) -> list[dict]:
    """The records of hits dated the latest day among them."""
    day = max((r["date"] for r in hits), default=None)
    return [r for r in hits if r["date"] == day]


def _latest(recs: list[dict], model: str, metric: str) -> list[float]:
    """The values of `metric` for `model` on the latest day that has any, superseded records left out."""
    hits = [r for r in recs if r.get("model") == model and r["metric"] == metric and not r.get("superseded")]
    return [r["value"] for r in _on_latest_day(hits)]


def _memory_reads(recs: list[dict]) -> list[float]:
    """The machine's read speed (GB/s, deploy.machine.memory_read_gb_s) as recorded on the latest day
    that has it, one value a bench run."""
    hits = [r for r in recs if r["machine"].get("memory_read_gb_s")]
    return sorted({r["machine"]["memory_read_gb_s"] for r in _on_latest_day(hits)})


def _span(values: list[float], fmt: str = "{:.2f}") -> str:
    if not values:
        return "-"
    lo, hi = fmt.format(min(values)), fmt.format(max(values))
    return lo if lo == hi else f"{lo}-{hi}"


def latest_table(recs: list[dict]) -> str:
    """A Markdown table: per machine class (a column), its CPU, ISA, latest day and memory read speed,
    llama.cpp's decode, the ratios of RATIO_ROWS and the 7B shape's fluid run, each from that class's
    latest day."""
    by_class: dict[str, list[dict]] = {}
    for r in recs:
        by_class.setdefault(machine_class(r["machine"]), []).append(r)
    classes = sorted(by_class, key=lambda c: CLASSES.index(c) if c in CLASSES else len(CLASSES))

    def machine_cell(c: str) -> tuple[str, str]:
        m = max(by_class[c], key=lambda r: r["date"])["machine"]
        fam = "" if m["family"] is None else f", family {m['family']}" + ("" if m["model"] is None else f" model {m['model']}")
        held = " (both sides held to AVX2)" if c.endswith(", AVX2 builds") else \
            " (our kernels held to AVX2)" if c.endswith(", AVX2 kernels") else ""
        return m["cpu"] + fam, (" ".join(m["isa"]) or "no AVX2") + held

    rows = [["CPU (/proc/cpuinfo)"] + [machine_cell(c)[0] for c in classes],
            ["ISA"] + [machine_cell(c)[1] for c in classes],
            ["latest record"] + [max(r["date"] for r in by_class[c]) for c in classes],
            ["memory read, all CPUs (GB/s)"] + [_span(_memory_reads(by_class[c]), "{:.1f}") for c in classes],
            ["llama.cpp decode, 0.5B / 1.5B (tok/s)"]
            + [f"{_span(_latest(by_class[c], M05, 'decode, llama.cpp'), '{:.1f}')} / "
               f"{_span(_latest(by_class[c], M15, 'decode, llama.cpp'), '{:.1f}')}" for c in classes]]
    for name, model, metric, fallback in RATIO_ROWS:
        cells = []
        for c in classes:
            v = _latest(by_class[c], model, metric)
            if not v and fallback:
                v = _latest(by_class[c], model, fallback)
                cells.append(_span(v) + (" (code prompt)" if v else ""))
            else:
                cells.append(_span(v))
        rows.append([name] + cells)
    fluid = []
    for c in classes:
        tok_s = _latest(by_class[c], M7B, FLUID)
        gb_s = [v for k in (0, 1) for v in _latest(by_class[c], M7B, f"fluid: station-{k} GB/s from its warden")]
        fluid.append("-" if not tok_s else f"{_span(tok_s)} tok/s, {_span(gb_s, '{:.1f}')} GB/s")
    rows.append(["7B shape, fluid (128 MiB stations)"] + fluid)
    # issue 56: replicas (benchmarks/replicas.py): what they cost per stream and the stall a replica's death makes
    for n in (1, 8, 32):
        rows.append([f"0.5B aggregate decode, {n} concurrent, 1 / 2 replicas (tok/s)"] + [
            " / ".join(_span(_latest(by_class[c], M05, f"aggregate decode, {n} concurrent, {r} replica(s)"), "{:.1f}")
                       for r in (1, 2)) for c in classes])
    rows.append(["0.5B failover, kill -9 of a station / shard replica to the next token (s)"] + [
        " / ".join(_span(_latest(by_class[c], M05, f"failover, kill -9 of a {what} replica to the next token"),
                         "{:.3f}") for what in ("station", "shard")) for c in classes])
    rows.append(["0.5B on a 3-node Swarm, aggregate decode, 1 / 8 / 32 concurrent (tok/s)"] + [
        " / ".join(_span(_latest(by_class[c], M05, f"aggregate decode, {n} concurrent, {SWARM}"), "{:.1f}")
                   for n in (1, 8, 32)) for c in classes])
    rows.append(["0.5B on a 3-node Swarm, docker stop of a node to the next token (s)"] + [
        _span(_latest(by_class[c], M05, "Swarm failover, docker stop of a node to the next token"), "{:.2f}")
        for c in classes])
    head = ["", *classes]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


def with_table(doc: str, table: str) -> str:
    """doc with the text between BEGIN and END replaced by table (ValueError without the markers)."""
    if BEGIN not in doc or END not in doc:
        raise ValueError(f"the document lacks the markers {BEGIN} ... {END}")
    head, rest = doc.split(BEGIN, 1)
    return head + BEGIN + "\n" + table + "\n" + END + rest.split(END, 1)[1]


def main(argv: list[str] | None = None) -> int:
    import argparse

    root = Path(__file__).resolve().parents[1]
    p = argparse.ArgumentParser(prog="python -m deploy.records",
                                description="the latest figures per machine class, from benchmark records")
    p.add_argument("files", nargs="*", type=Path, help="records (default: benchmarks/results/*.jsonl)")
    p.add_argument("--write", type=Path, metavar="DOC", help="replace the table between the markers in DOC")
    args = p.parse_args(argv)
    recs = [r for f in (args.files or sorted((root / "benchmarks" / "results").glob("*.jsonl"))) for r in read(f)]
    table = latest_table(recs)
    if args.write:
        args.write.write_text(with_table(args.write.read_text(), table))
    else:
        print(table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
