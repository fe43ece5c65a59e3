"""Benchmark records: one JSON object per measurement, one per line (`benchmarks/results/*.jsonl`).

    {"date": "YYYY-MM-DD", "machine": {"cpu": "<model name>", "family": 25, "model": 17,
     "isa": ["AVX2", "AVX-512F", "AVX-512 VNNI"]}, "command": "knot bench --model ...",
     "metric": "decode", "value": 42.8, "unit": "tok/s", "note": "..."}

Required: date (YYYY-MM-DD, UTC), machine (cpu, family, model, isa; family/model may be null where the
CPU was not read), command (what reproduces it), metric, value (a number), unit ("" for a plain count),
note (a string, may be empty). Optional: "model" (the model measured), "commit". `knot bench --json FILE`
appends records of this shape; benchmarks/results/README.md shows the same schema to a reader.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

REQUIRED = ("date", "machine", "command", "metric", "value", "unit", "note")
OPTIONAL = ("model", "commit")
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
    "Intel AVX-512", "AVX2" (other CPUs, by their widest vector ISA)."""
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
