"""The settings table (common/settings.py): one declaration per environment variable, one parser, one
error type; docs/configuration.md is generated from it, and no code reads a variable around it."""
from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

from common import settings
from common.runtime import Env, ServiceUnavailable, status_for
from common.settings import ConfigError, read
from common.topology import ClusterLayout, Knob
from deploy.launcher import default_layout, plan

ROOT = Path(__file__).resolve().parents[2]
CONFIG_DOC = ROOT / "docs" / "configuration.md"
VAR_NAME = re.compile(r"^[A-Z][A-Z0-9_]*$")


def test_configuration_doc_is_generated_from_the_table():
    assert CONFIG_DOC.read_text() == settings.markdown(), \
        "docs/configuration.md is stale: run `knot settings > docs/configuration.md`"
    doc = CONFIG_DOC.read_text()
    for name in ("KNOT_MAX_BODY_BYTES", "KNOT_THREADS", "SESSION_TTL_S"):
        assert f"| `{name}` |" in doc


def test_each_variable_is_declared_once_with_known_readers_and_types():
    names = [s.name for s in settings.SETTINGS]
    assert len(names) == len(set(names))
    for s in settings.SETTINGS:
        assert s.type in settings.TYPES and s.readers and set(s.readers) <= set(settings.READERS), s
        assert s.meaning and "\n" not in s.meaning, s.name
        assert set(s.reader_defaults) <= set(s.readers), s.name
        for d in (s.default, *s.reader_defaults.values()):  # every default parses as its own type
            if isinstance(d, str) and d and s.type != "binding":
                s.parse(d)


def test_read_parses_defaults_and_names_the_variable():
    assert read({}, "SESSION_TTL_S", "station") == 600.0
    assert read({"SESSION_TTL_S": ""}, "SESSION_TTL_S", "station") == 600.0  # empty is unset
    assert read({"MAX_BATCH": "4"}, "MAX_BATCH", "station") == 4
    assert read({}, "MEMORY_BUDGET_BYTES", "layer_warden") == 1 << 30  # a reader's own default
    assert read({}, "MEMORY_BUDGET_BYTES", "station") == 128 << 20
    assert read({"STATIONS": "A, B,"}, "STATIONS", "coordinator") == ("A", "B")
    assert read({}, "MODEL_NAME", "coordinator") is None
    assert read(Env({"STATION_3": "svc"}), "STATION_3", "coordinator") == "svc"  # a family of names
    for env, name, reader, message in [
        ({}, "KNOT_KEY", "station", "Config 'KNOT_KEY' is missing, and has no default."),
        ({"MAX_BATCH": "x"}, "MAX_BATCH", "station", "Config 'MAX_BATCH' must be an integer, got 'x'"),
        ({"MAX_BATCH": "0"}, "MAX_BATCH", "station", "Config 'MAX_BATCH' must be >= 1, got '0'"),
        ({"SHARD_TIMEOUT_S": "0"}, "SHARD_TIMEOUT_S", "coordinator", "Config 'SHARD_TIMEOUT_S' must be > 0"),
        ({"KNOT_THREADS": "999"}, "KNOT_THREADS", "kernels", "Config 'KNOT_THREADS' must be <= 256"),
        ({"SPECIALIZATION_ROLE": "side"}, "SPECIALIZATION_ROLE", "station",
         "Config 'SPECIALIZATION_ROLE' must be one of entry, middle, exit, solo, got 'side'"),
    ]:
        with pytest.raises(ConfigError) as e:
            read(env, name, reader)
        assert str(e.value).startswith(message) and e.value.name == name
    # One error type: a handler answers 503 with it, the host and the CLI treat it as a ValueError.
    assert issubclass(ConfigError, ServiceUnavailable) and issubclass(ConfigError, ValueError)
    assert status_for(ConfigError("x")) == 503
    with pytest.raises(LookupError, match="shard reads SESSION_TTL_S, but common/settings.py lists only station"):
        read({}, "SESSION_TTL_S", "shard")
    with pytest.raises(KeyError, match="NOT_A_SETTING is not in the settings table"):
        read({}, "NOT_A_SETTING", "station")


def test_check_reads_every_setting_of_a_reader():
    env = Env({"KNOT_BUCKET": object()}, {"KNOT_KEY": "k", "SPECIALIZATION_START_LAYER": "0",
                                          "SPECIALIZATION_END_LAYER": "2", "SPECIALIZATION_ROLE": "entry"})
    got = settings.check(env, "station")
    assert got["MAX_BATCH"] == 16 and got["LAYER_WARDEN"] is None and got["SPECIALIZATION_END_LAYER"] == 2
    with pytest.raises(ConfigError, match="LAYER_WARDEN"):  # the warden's own namespace is required
        settings.check(Env({"KNOT_BUCKET": object()}), "layer_warden")


def test_a_misconfigured_service_fails_at_start_naming_the_variable(tmp_path):
    env = {"KNOT_SERVICE": "services.station", "KNOT_SERVICE_NAME": "station-9", "PORT": "1",
           "KNOT_BINDINGS": "KNOT_BUCKET", "KNOT_BUCKET": f"dir:{tmp_path}",
           "KNOT_VARS": "KNOT_KEY,SPECIALIZATION_START_LAYER,SPECIALIZATION_END_LAYER,SPECIALIZATION_ROLE",
           "KNOT_KEY": "k.knot", "SPECIALIZATION_START_LAYER": "0", "SPECIALIZATION_END_LAYER": "2",
           "SPECIALIZATION_ROLE": "sideways", "KNOT_KERNELS": "off", "PATH": "/usr/bin:/bin"}
    p = subprocess.run([sys.executable, "-m", "deploy.cli", "serve"], env=env, cwd=ROOT, capture_output=True,
                       text=True, timeout=60)
    assert p.returncode == 1, p.stderr
    assert ("knot serve: error: station-9: Config 'SPECIALIZATION_ROLE' must be one of entry, middle, exit, solo, "
            "got 'sideways'") in p.stderr
    assert "Traceback" not in p.stderr


def test_a_misspelt_knot_variable_is_named_with_its_likely_setting():
    env = {"KNOT_PROFLE": "device", "KNOT_THREADS": "2", "KNOT_NO_SUCH_THING": "1", "STATION_7": "x",
           "PROFLE": "device", "KNOT_KEY": "k.knot"}
    assert settings.unknown_knot_names(env) == [("KNOT_NO_SUCH_THING", None), ("KNOT_PROFLE", "KNOT_PROFILE")]
    assert settings.unknown_knot_names({"KNOT_THREADS": "2"}) == []
    # Every `knot` command says so once at its start, and goes on: the variable is ignored, not fatal.
    p = subprocess.run([sys.executable, "-m", "deploy.cli", "settings"], cwd=ROOT, capture_output=True, text=True,
                       env={"PATH": "/usr/bin:/bin", "KNOT_PROFLE": "device", "KNOT_KERNELS": "off"}, timeout=60)
    assert p.returncode == 0, p.stderr
    assert ("KNOT_PROFLE is set but is not a setting (did you mean KNOT_PROFILE?), so it is ignored "
            "(docs/configuration.md lists them)") in p.stderr
    assert p.stdout == CONFIG_DOC.read_text()


@pytest.mark.parametrize("counts", [(2, 8), (1, 1), (3, 3)])
def test_every_variable_a_deployment_sets_is_declared_for_its_readers(counts):
    """docker-compose.yml (the layout's rendering) sets only declared variables, each for a reader of
    it: a handler var for that handler, the rest for the host, the kernels, the runtime or init."""
    layout = default_layout() if counts == (2, 8) else ClusterLayout.build({"block_count": 4, "vocab_size": 99},
                                                                          *counts)
    process_readers = {"host", "kernels", "runtime"}
    for spec in plan(layout, {"KNOT_REDIS_PASSWORD": "generated", "KNOT_INTERNAL_SECRET": "k" * 43,
                          "MINIO_ROOT_USER": "bucket-key", "MINIO_ROOT_PASSWORD": "bucket-secret-key"}):
        service = layout.service(spec.name)
        if not service.is_worker and service.role != "init":
            continue  # MinIO's and Redis's own variables
        readers = {service.role} | process_readers if service.is_worker else {"init"} | process_readers | {"models"}
        for name in spec.environment:
            s = settings.lookup(name)
            assert readers & set(s.readers), f"{spec.name} sets {name}, which the table says only " \
                                             f"{', '.join(s.readers)} read"
        for name in service.vars:
            assert service.role in settings.lookup(name).readers or service.role == "init", (spec.name, name)
        for b in service.bindings:
            assert settings.lookup(b.name).type == "binding" and service.role in settings.lookup(b.name).readers \
                or service.role == "init"
    knobs = {v.name for s in layout.services for v in s.vars.values() if isinstance(v, Knob)}
    from deploy.compose_writer import CONTAINERS, knot_env

    knobs |= {v.name for c in CONTAINERS.values() for v in (*c.environment.values(), c.published_port)
              if isinstance(v, Knob)}
    knobs |= {v.name for v in knot_env(layout).values() if isinstance(v, Knob)}
    for name in knobs:
        assert "compose" in settings.lookup(name).readers, name


# ---------------------------------------------------------------- nothing reads around the table

SCANNED = ["common", "services", "deploy", "benchmarks", "tests"]
TABLE_MODULES = ("common/settings.py", "deploy/deploy_settings.py")  # where the rows are declared
EXEMPT = {
    "common/settings.py": "the table's own parser",
    "setup.py": "runs before the package is importable; KNOT_KERNELS_MARCH is declared in the table",
}
READ_FUNCS = {"read": 2, "default": 1}  # name -> index of the reader argument


def _is_environ(node: ast.AST) -> bool:
    return (isinstance(node, ast.Attribute) and node.attr == "environ") or \
        (isinstance(node, ast.Name) and node.id == "environ")


def _env_like(node: ast.AST) -> bool:
    name = node.attr if isinstance(node, ast.Attribute) else node.id if isinstance(node, ast.Name) else ""
    return name in ("env", "environ", "environment", "base_env") or name.endswith("_env")


def _literal(node: ast.AST) -> str | None:
    return node.value if isinstance(node, ast.Constant) and isinstance(node.value, str) else None


def bypasses(tree: ast.AST, strict: bool) -> list[tuple[int, str]]:
    """(line, why) for every read of a variable that does not go through common/settings.py.

    Always: os.environ.get / os.environ[...] / os.getenv. strict (everything but tests): also
    env.get("NAME") / env["NAME"] on any env-like mapping, and env.NAME of an undeclared name."""
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            f = node.func
            if f.attr == "getenv" or (f.attr in ("get", "__getitem__") and _is_environ(f.value)):
                out.append((node.lineno, f"os.environ read: {ast.unparse(node)}"))
            elif strict and f.attr == "get" and _env_like(f.value) and node.args and \
                    VAR_NAME.match(_literal(node.args[0]) or ""):
                out.append((node.lineno, f"env read around the table: {ast.unparse(node)}"))
        elif isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Load):
            key = _literal(node.slice)
            if _is_environ(node.value) or (strict and _env_like(node.value) and VAR_NAME.match(key or "")):
                out.append((node.lineno, f"env read around the table: {ast.unparse(node)}"))
        elif strict and isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Load) and \
                _env_like(node.value) and VAR_NAME.match(node.attr):
            try:
                settings.lookup(node.attr)
            except KeyError:
                out.append((node.lineno, f"binding {node.attr} is not declared in common/settings.py"))
    return out


def table_reads(tree: ast.AST) -> list[tuple[int, str]]:
    """read(env, "NAME", "reader") / default("NAME", "reader") calls whose NAME or reader the table lacks."""
    out = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        fname = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
        if fname not in READ_FUNCS or len(node.args) <= READ_FUNCS[fname]:
            continue
        name, reader = _literal(node.args[READ_FUNCS[fname] - 1]), _literal(node.args[READ_FUNCS[fname]])
        if name is None or reader is None or not VAR_NAME.match(name):
            continue
        try:
            s = settings.lookup(name)
        except KeyError:
            out.append((node.lineno, f"{name} is not in the settings table"))
            continue
        if reader not in s.readers:
            out.append((node.lineno, f"{reader} reads {name}, but the table lists only {', '.join(s.readers)}"))
    return out


def _sources():
    for top in SCANNED:
        for path in sorted((ROOT / top).rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            if rel not in EXEMPT and rel != "tests/unit/test_settings.py":
                yield rel, ast.parse(path.read_text(), rel)


def test_no_code_reads_a_variable_around_the_table():
    found = []
    for rel, tree in _sources():
        found += [f"{rel}:{line}: {why}" for line, why in bypasses(tree, strict=not rel.startswith("tests/"))]
        found += [f"{rel}:{line}: {why}" for line, why in table_reads(tree)]
    assert not found, "\n".join(found)


def test_the_scan_catches_each_kind_of_bypass():
    src = '''
import os
a = os.environ.get("KNOT_THREADS")
b = os.environ["HOME"]
c = os.getenv("X")
d = env.get("MAX_BATCH")
e = self.env["KNOT_KEY"]
f = env.NOT_DECLARED
g = read(env, "MAX_BATCH", "shard")
h = default("NOPE", "station")
ok1 = env.KNOT_BUCKET
ok2 = read(env, "MAX_BATCH", "station")
ok3 = Settings.from_env(os.environ)
ok4 = env.get(name)
'''
    tree = ast.parse(src)
    lines = sorted(line for line, _ in bypasses(tree, strict=True) + table_reads(tree))
    assert lines == [3, 4, 5, 6, 7, 8, 9, 10]
    assert [line for line, _ in bypasses(tree, strict=False)] == [3, 4, 5]


def test_every_declared_variable_is_used_somewhere():
    """No dead rows: each name (or family prefix) appears in the code, setup.py, the scripts or a deployment file."""
    from deploy.compose_writer import render_text

    text = render_text(default_layout()) + (ROOT / "setup.py").read_text()
    text += "".join(p.read_text() for p in (ROOT / "scripts").glob("*.sh"))
    text += "".join(p.read_text() for top in SCANNED for p in (ROOT / top).rglob("*.py")
                    if p.relative_to(ROOT).as_posix() not in TABLE_MODULES)
    for s in settings.SETTINGS:
        assert re.search(re.escape(s.name).replace("<i>", r"\d*"), text), \
            f"{s.name} is declared but nothing reads or sets it"


# ---------------------------------------------------------------- where the rows live

def test_common_declares_only_what_the_services_and_hosts_read():
    """common/ (which runs under Pyodide) holds no row of the deployment tools: those come with deploy/."""
    code = ("from common import settings; print(sorted({r for s in settings.SETTINGS for r in s.readers})); "
            "print(sum(1 for s in settings.SETTINGS if s.mirror_of))")
    p = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60,
                       env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT)})
    readers, mirrors = p.stdout.split("\n")[:2]
    tools = {"docker", "build", "tests", "bench", "deploy", "runtime"}
    assert p.returncode == 0 and not tools & set(eval(readers)) and mirrors == "0", p.stdout + p.stderr
    assert {s.name for s in settings.SETTINGS} >= {"KNOT_DOCKER_OFFLINE", "CI", "KNOT_KERNELS_MARCH", "KNOT_PROFILE"}


def test_a_compose_mirror_is_its_handler_rows_type_bounds_and_default():
    from deploy.deploy_settings import MIRRORS

    assert {m.name for m in MIRRORS} >= {"STATION_MEMORY_BUDGET_BYTES", "KNOT_PROFILE", "KNOT_PREFETCH"}
    for m in MIRRORS:
        role, var = m.mirror_of.split()
        src = settings.lookup(var)
        assert (m.type, m.choices, m.minimum, m.maximum, m.positive) == \
            (src.type, src.choices, src.minimum, src.maximum, src.positive), m.name
        assert "compose" in m.readers and m.meaning.startswith(f"every {role.replace('_', ' ')}'s {var}"), m.name
    profile = settings.lookup("KNOT_PROFILE")
    assert profile.default == settings.lookup("MEMORY_PROFILE").default_for("station") == "worker"
    assert settings.lookup("KNOT_LAYER_WARDEN_BUDGET_BYTES").default == str(1 << 30)  # the warden's own default
    with pytest.raises(ConfigError, match="KNOT_PROFILE' must be one of worker, resident"):
        read({"KNOT_PROFILE": "device"}, "KNOT_PROFILE", "compose")
    made = settings.mirror("X_MIRROR", "station", "INTERLEAVE_ROWS")
    assert (made.default, made.minimum, made.mirror_of) == ("64", 0, "station INTERLEAVE_ROWS")
