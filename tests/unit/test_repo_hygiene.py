"""Habits of this repository that a test can hold (CONTRIBUTING.md):

- no code comment or docstring quotes a dated timing: a date next to a measured figure, or a CPU
  model next to one. Figures rot with the machine; a comment keeps the reason and names the
  benchmark, and the figures live in benchmarks/results and docs/lab;
- every relative link in the docs resolves, to a file and to a heading."""
from __future__ import annotations

import ast
import io
import re
import tokenize
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CODE_DIRS = ("common", "services", "deploy", "benchmarks", "tests", "scripts", ".ci")
DATE = re.compile(r"\b20\d\d-\d\d-\d\d\b")
LAB_PATH = re.compile(r"docs/lab/\S+")  # a lab note's name carries its date; naming one is the point
FIGURE = re.compile(r"\d(?:[\d,.]*\d)?\s*(?:ms|us|µs|ns|s|tok/s|GB/s|MB/s|GHz|%|x)(?![\w/])")
CPU = re.compile(r"EPYC|Xeon|\bZen ?\d|Sapphire Rapids|Ryzen|\bCore i\d")


def comment_blocks_py(text: str) -> list[tuple[int, list[str]]]:
    """(first line, lines) of each run of # comments and of each docstring."""
    blocks: list[tuple[int, list[str]]] = []
    last = -2
    for tok in tokenize.generate_tokens(io.StringIO(text).readline):
        if tok.type == tokenize.COMMENT:
            row = tok.start[0]
            if row == last + 1:
                blocks[-1][1].append(tok.string)
            else:
                blocks.append((row, [tok.string]))
            last = row
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            doc = node.body[0]
            if isinstance(doc, ast.Expr) and isinstance(doc.value, ast.Constant) and isinstance(doc.value.value, str):
                blocks.append((doc.lineno, doc.value.value.splitlines()))
    return blocks


def comment_blocks_c(text: str) -> list[tuple[int, list[str]]]:
    return [(text.count("\n", 0, m.start()) + 1, m.group(0).splitlines())
            for m in re.finditer(r"/\*.*?\*/|//[^\n]*", text, re.S)]


def comment_blocks_sh(text: str) -> list[tuple[int, list[str]]]:
    """(first line, lines) of each run of # comments (a trailing one included)."""
    blocks: list[tuple[int, list[str]]] = []
    last = -2
    for i, line in enumerate(text.splitlines()):
        if line.lstrip().startswith("#") or " # " in line:
            comment = line[line.index("#"):]
            if i == last + 1:
                blocks[-1][1].append(comment)
            else:
                blocks.append((i + 1, [comment]))
            last = i
    return blocks


def dated_timings(blocks: list[tuple[int, list[str]]]) -> list[tuple[int, str]]:
    """(line, text) of each comment line that quotes a dated timing: a date in a block that states a
    figure with a unit, or a CPU model within a line of such a figure."""
    out = []
    for first, lines in blocks:
        lines = [LAB_PATH.sub("", line) for line in lines]
        dated = any(DATE.search(line) for line in lines)
        for k, line in enumerate(lines):
            near = " ".join(lines[max(0, k - 1):k + 2])
            if (dated and FIGURE.search(line)) or (CPU.search(line) and FIGURE.search(near)) \
                    or (DATE.search(line) and FIGURE.search(" ".join(lines))):
                out.append((first + k, line.strip()))
    return out


def blocks_of(path: Path) -> list[tuple[int, list[str]]]:
    text = path.read_text()
    if path.suffix == ".py":
        return comment_blocks_py(text)
    if path.suffix in (".c", ".h"):
        return comment_blocks_c(text)
    return comment_blocks_sh(text)


def code_files() -> list[Path]:
    files = []
    for d in CODE_DIRS:
        for p in sorted((ROOT / d).rglob("*")):
            if p.is_file() and "__pycache__" not in p.parts and (
                    p.suffix in (".py", ".c", ".h", ".sh") or (p.suffix == "" and d == ".ci")):
                files.append(p)
    return files


@pytest.mark.parametrize("text, flagged", [
    ("# 8, seven rounds on an AMD EPYC (2026-12-04): code 17.2-29.6 tok/s\nX = 1\n", True),
    ('def f():\n    """Why: faster (knot bench, 0.5B\n    cluster, 2026-12-01): 0.60x against 0.65x."""\n', True),
    ("# a float64 exp over the slice: ~150 us of 19k ids on a Zen 1 core\n", True),
    ("# (benchmarks/hop_client.py: 422 against 710 us on a\n# 2 GHz Xeon)\n", True),
    ("# python_workers with a date after 2026-09-08 implies python_workers_314\n", False),
    ("# the reason, and the note: docs/lab/2026-12-05-internal-hops-lean-http-server.md (3x faster)\n", False),
    ("# a 30 s timeout on a Zen 4 or anywhere else\n", True),
    ("# on a CPU whose 256-bit ops are two 128-bit uops, these kernels are compute-bound\n", False),
])
def test_the_check_flags_dated_and_machine_timings_only(text, flagged):
    assert bool(dated_timings(comment_blocks_py(text))) == flagged


def test_shell_comments_are_read_as_blocks():
    text = "  # on the distribution's build a cluster decoded 1.04x as fast\n  # (measured 2026-12-05).\nx=1\n"
    assert [n for n, _ in dated_timings(comment_blocks_sh(text))] == [1, 2]


def test_no_code_comment_quotes_a_dated_timing():
    found = [f"{p.relative_to(ROOT)}:{n}: {line}" for p in code_files() for n, line in dated_timings(blocks_of(p))]
    assert not found, ("comments quote dated or machine-specific timings; keep the reason in a line and name "
                       "the benchmark (the figures go to benchmarks/results, the story to docs/lab):\n"
                       + "\n".join(found))


def heading_anchors(path: Path) -> set[str]:
    """GitHub's anchors of a Markdown file's headings: lower case, punctuation dropped, spaces to -."""
    out = set()
    for line in path.read_text().splitlines():
        if line.startswith("#"):
            title = line.lstrip("#").strip().lower()
            out.add(re.sub(r"[^\w\- ]", "", title).replace(" ", "-"))
    return out


def test_every_relative_link_in_the_docs_resolves():
    docs = [ROOT / "README.md", ROOT / "CONTRIBUTING.md", *sorted((ROOT / "docs").rglob("*.md")),
            *sorted((ROOT / "benchmarks").rglob("*.md"))]
    broken = []
    for doc in (d for d in docs if d.is_file()):
        for m in re.finditer(r"\]\(([^)\s]+)\)", doc.read_text()):
            link = m.group(1)
            if re.match(r"[a-z]+:", link):
                continue
            target_name, _, anchor = link.partition("#")
            target = (doc.parent / target_name).resolve() if target_name else doc
            if not target.exists():
                broken.append(f"{doc.relative_to(ROOT)}: {link} (no such file)")
            elif anchor and target.suffix == ".md" and anchor not in heading_anchors(target):
                broken.append(f"{doc.relative_to(ROOT)}: {link} (no such heading)")
    assert not broken, "\n".join(broken)
