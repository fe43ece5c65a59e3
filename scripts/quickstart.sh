#!/usr/bin/env bash
# README command 1: set up, then bring up the local cluster with the default model
# (fetched, encoded to a .knot and uploaded to the bucket on first start), and print a curl line.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
model="${KNOT_MODEL:-qwen2.5-coder-0.5b}"
.venv/bin/knot fetch-model --encode "$model" >/dev/null
url="$(.venv/bin/knot cluster up --model "$model" | tail -n 1)"
cat <<MSG

The cluster is up: coordinator at $url (logs in .knot-run/logs/).
Open $url/ in a browser to watch it: topology, live figures, a playground, each request's trace.
Or try:

  curl -s $url/v1/chat/completions -H 'Content-Type: application/json' \\
       -d '{"max_tokens": 64, "messages": [{"role": "user", "content": "Write a Python function that reverses a string."}]}'

  curl -s $url/generate -H 'Content-Type: application/json' \\
       -d '{"prompt": "def fibonacci(n):", "max_tokens": 32}'

More examples: docs/api.md.

Stop it with: .venv/bin/knot cluster down
MSG
