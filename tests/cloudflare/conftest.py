"""The Cloudflare layer's tests: the CPython doubles of Pyodide and workerd are installed before
anything imports the real workers-runtime-sdk (fetched and hash-checked by tools.py)."""
from __future__ import annotations

import sys

import pytest

from tests.cloudflare import fakejs, tools

fakejs.install()
_sdk = str(tools.workers_sdk())
if _sdk not in sys.path:
    sys.path.append(_sdk)  # after site-packages: it only adds `workers` (and its `asgi`)


def pytest_collection_modifyitems(items):
    for item in items:
        if "tests/cloudflare/" in str(item.fspath):
            item.add_marker(pytest.mark.cloudflare)
