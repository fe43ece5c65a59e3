#!/usr/bin/env bash
# README command 1: set up, fetch the default model, encode it to a knot and inspect it.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
model="${KNOT_MODEL:-qwen2.5-coder-0.5b}"
knot_path="$(.venv/bin/knot fetch-model --encode "$model")"
.venv/bin/knot inspect --tensors 12 "$knot_path"
echo
echo "Next: .venv/bin/knot generate $knot_path --chat \"Write a Python function that reverses a string.\""
