"""The import rule (docs/architecture.md), checked by parsing every module's imports.

- common/ imports nothing from services/ or deploy/;
- services/ imports nothing from deploy/;
- only deploy/ may import aiohttp, boto3, botocore or redis (handlers must run under Pyodide);
- common/ and services/ open no sockets and spawn no processes.
"""
import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
HOST_ONLY = {"aiohttp", "boto3", "botocore", "redis"}
NO_IO = {"socket", "subprocess"}
RULES = {
    "common": {"services", "deploy"} | HOST_ONLY | NO_IO,
    "services": {"deploy"} | HOST_ONLY | NO_IO,
}


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


@pytest.mark.parametrize("top", sorted(RULES))
def test_import_rule(top):
    assert files(top), f"no modules under {top}/"
    bad = []
    for path in files(top):
        for mod in imported_modules(path):
            if mod.split(".")[0] in RULES[top]:
                bad.append(f"{path.relative_to(ROOT)} imports {mod}")
    assert not bad, "\n".join(bad)


def test_the_checker_sees_relative_and_from_imports(tmp_path):
    probe = tmp_path / "common" / "probe.py"
    probe.parent.mkdir()
    probe.write_text("from ..deploy import cli\nimport redis.asyncio\nfrom aiohttp import web\nfrom . import quant\n")
    assert imported_modules(probe, tmp_path) == {"deploy", "redis.asyncio", "aiohttp", "common"}
