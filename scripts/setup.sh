#!/usr/bin/env bash
# Create .venv (Python >= 3.11) and install the project into it, editable.
#   scripts/setup.sh            the handlers' needs and the host's (the `host` extra): the runtime
#   scripts/setup.sh dev,oracle with the test tools and the llama.cpp oracle
# The oracle extra builds llama.cpp from source the first time (about 10 minutes on 2 cores);
# pip caches the built wheel, so later runs take seconds.
set -euo pipefail
cd "$(dirname "$0")/.."
extras="${1:-}"
new_enough() { command -v "$1" >/dev/null && "$1" -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null; }
if [ ! -x .venv/bin/python ]; then
  # The distribution's interpreter first: Debian builds it with PGO and LTO and links libpython
  # into the executable, where the pyenv build on these machines has neither and calls a shared
  # libpython through the PLT. A cluster's processes each run their per-call Python between the
  # others' weight streams, so the faster build decodes faster (docs/performance.md, "Levers tried").
  cands="${PYTHON:-/usr/bin/python3.13 /usr/bin/python3.12 /usr/bin/python3.11 /usr/bin/python3 python3.13 python3.12 python3.11 python3}"
  made=""
  for cand in $cands; do
    new_enough "$cand" || continue
    echo "setup: creating .venv with $cand ($("$cand" --version))" >&2
    # A distribution may ship its interpreter without venv's ensurepip (Debian: python3-venv).
    if "$cand" -m venv .venv; then made="$cand"; break; fi
    rm -rf .venv
  done
  [ -n "$made" ] || { echo "setup: need Python >= 3.11 with venv (set PYTHON=...)" >&2; exit 1; }
elif [ -z "${PYTHON:-}" ] && ! grep -q '^home = /usr/bin$' .venv/pyvenv.cfg 2>/dev/null && new_enough /usr/bin/python3; then
  echo "setup: .venv runs $(sed -n 's/^executable = //p' .venv/pyvenv.cfg); the distribution's python3 is faster" \
       "for the cluster (docs/performance.md). To move: rm -rf .venv, then run this again." >&2
fi
spec=".[host${extras:+,$extras}]"
echo "setup: pip install -e '$spec'" >&2
.venv/bin/python -m pip install --disable-pip-version-check -q -e "$spec"
# The browser tests (tests/browser) drive Debian's chromium through Playwright's Python package, never
# a browser Playwright downloads (that fails offline).
if [[ ",$extras," == *,dev,* ]] && ! command -v chromium >/dev/null; then
  echo "setup: installing chromium (Debian) for the browser tests" >&2
  apt-get update -q >/dev/null
  DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium >/dev/null
fi
