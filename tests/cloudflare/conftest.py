"""The Cloudflare layer's tests: the CPython doubles of Pyodide and workerd are installed before
anything imports the real workers-runtime-sdk (fetched and hash-checked by cloudflare_tools.py)."""
from __future__ import annotations

import sys

import pytest

from tests.cloudflare import cloudflare_tools, fakejs

fakejs.install()
_sdk = str(cloudflare_tools.workers_sdk())
if _sdk not in sys.path:
    sys.path.append(_sdk)  # after site-packages: it only adds `workers` (and its `asgi`)


def pytest_collection_modifyitems(items):
    for item in items:
        if "tests/cloudflare/" in str(item.fspath):
            item.add_marker(pytest.mark.cloudflare)
