#!/usr/bin/env bash
# Create .venv (Python >= 3.11) and install the project into it, editable.
#   scripts/setup.sh            the handlers' needs and the host's (the `host` extra): the runtime
#   scripts/setup.sh dev,oracle with the test tools and the llama.cpp oracle
# The oracle extra builds llama.cpp from source the first time (about 10 minutes on 2 cores);
# pip caches the built wheel, so later runs take seconds.
set -euo pipefail
cd "$(dirname "$0")/.."
extras="${1:-}"
if [ ! -x .venv/bin/python ]; then
  py="${PYTHON:-}"
  if [ -z "$py" ]; then
    for cand in python3.13 python3.12 python3.11 python3; do
      if command -v "$cand" >/dev/null && "$cand" -c 'import sys; sys.exit(sys.version_info < (3, 11))'; then
        py="$cand"; break
      fi
    done
  fi
  [ -n "$py" ] || { echo "setup: need Python >= 3.11 (set PYTHON=...)" >&2; exit 1; }
  echo "setup: creating .venv with $("$py" --version)" >&2
  "$py" -m venv .venv
fi
spec=".[host${extras:+,$extras}]"
echo "setup: pip install -e '$spec'" >&2
.venv/bin/python -m pip install --disable-pip-version-check -q -e "$spec"
