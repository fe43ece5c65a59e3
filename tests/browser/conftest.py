"""The browser tests' fixtures: the integration tests' real servers and cluster, and Debian's chromium
driven through Playwright (its Python package and driver; never a browser it downloads)."""
from __future__ import annotations

import shutil

import pytest

from tests.integration.conftest import (cluster_env, knot, procs, redis_server, run_dir,  # noqa: F401 - fixtures
                                        s3_server, s3_settings, upload)
from tests.integration.test_pipeline_cluster import cluster, engine  # noqa: F401 - the same real cluster

CHROMIUM = "chromium"  # Debian's package (scripts/setup.sh installs it with the dev extra)


def pytest_collection_modifyitems(items):
    for item in items:
        if "tests/browser/" in str(item.fspath):
            item.add_marker(pytest.mark.browser)
            item.add_marker(pytest.mark.integration)


@pytest.fixture(scope="module")
def browser():
    sync_api = pytest.importorskip("playwright.sync_api", reason="the playwright package (the dev extra)")
    executable = shutil.which(CHROMIUM)
    if executable is None:
        pytest.skip("Debian's chromium is not installed (scripts/setup.sh dev installs it)")
    with sync_api.sync_playwright() as p:
        b = p.chromium.launch(executable_path=executable, args=["--disable-gpu", "--disable-dev-shm-usage"])
        try:
            yield b
        finally:
            b.close()


@pytest.fixture
def page(browser):
    context = browser.new_context(viewport={"width": 1280, "height": 1000})
    p = context.new_page()
    p.set_default_timeout(60_000)
    errors = []
    p.on("pageerror", lambda e: errors.append(str(e)))
    yield p
    context.close()
    assert not errors, f"the page's script failed: {errors}"
