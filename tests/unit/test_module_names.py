"""No two modules share a name, so a file name says where a thing is (issue 51 item 4).

Exempt: `__init__.py`, `conftest.py`, and each service's entry point `services/<service>/handler.py`
(the one name the hosts and the Cloudflare generator look up, like __init__.py).
"""
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TOPS = ("benchmarks", "common", "deploy", "scripts", "services", "tests")  # the project's Python; not .venv
EXEMPT = {"__init__.py", "conftest.py"}
SKIPPED_DIRS = {"node_modules", "__pycache__"}


def exempt(path: Path, root: Path) -> bool:
    rel = path.relative_to(root).parts
    return path.name in EXEMPT or (path.name == "handler.py" and len(rel) == 3 and rel[0] == "services")


def modules_by_name(root: Path = ROOT) -> dict[str, list[str]]:
    by_name = defaultdict(list)
    for top in TOPS:
        for path in sorted((root / top).rglob("*.py")):
            if SKIPPED_DIRS.isdisjoint(path.relative_to(root).parts) and not exempt(path, root):
                by_name[path.name].append(path.relative_to(root).as_posix())
    for path in sorted(root.glob("*.py")):  # setup.py
        by_name[path.name].append(path.name)
    return by_name


def test_every_module_name_is_unique():
    by_name = modules_by_name()
    assert len(by_name) > 100 and "coordinator.py" in by_name and "cluster_engine.py" in by_name, sorted(by_name)
    repeated = {name: paths for name, paths in by_name.items() if len(paths) > 1}
    assert not repeated, "modules sharing a name (rename one so the name says where it is):\n" + "\n".join(
        f"  {name}: {', '.join(paths)}" for name, paths in sorted(repeated.items()))


def test_the_check_sees_a_repeated_name(tmp_path):
    for rel in ("common/layout.py", "deploy/local/layout.py", "services/station/handler.py",
                "services/shard/handler.py", "common/__init__.py", "deploy/local/__init__.py",
                "tests/unit/conftest.py", "tests/conftest.py"):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text("")
    by_name = modules_by_name(tmp_path)
    assert {n: p for n, p in by_name.items() if len(p) > 1} == {
        "layout.py": ["common/layout.py", "deploy/local/layout.py"]}
