#!/usr/bin/env bash
# The call identity, the LL lines and the errors every rank sees, on one GPU (ranks under MPS).
# Builds nothing: expects target/release/ipcreduce, target/gpu-tests/ (scripts/build-gpu-tests.sh)
# and, for the latency comparison, a binary of the commit before the change at $BASE_BIN.
#
# Usage: scripts/device/identity.sh OUT_DIR
#   latency   small-message latency before/after: bf16 sum, two ranks, 8 B - 64 KiB, eager and
#             CUDA graph (-G 20), plain buffers, every call checked; the binaries of VERSIONS
#             take turns for REPEAT rounds so a drift of the machine hits all alike; latency.md
#             has the median of the rounds, their spread (min-max) and the ratios to the first
#             of the medians and of the fastest rounds.
#   checks    `check` CASES cases at worlds 2, 4 and 8, plain and registered buffers.
#   gputests  scripts/device/gpu-tests.sh into OUT_DIR/gpu-tests (the whole GPU suite, the
#             hostile-call roles included).
# summary.txt: one line per step (PASS/FAIL/SKIP and its last line); env.txt: GPU, driver and
# both binaries' versions (the commit each was built from).
# Knobs: PHASES="latency checks gputests", BUDGET=540, CASES=2000, WORLDS="2 4 8", REPEAT=3,
# BASE_BIN=target/baseline/ipcreduce, VERSIONS="before=$BASE_BIN after=$BIN" (NAME=PATH ...).
set -u
# shellcheck source=lib/steps.sh source-path=SCRIPTDIR
. "$(dirname "$0")/lib/steps.sh" || exit 2
OUT=${1:?usage: identity.sh OUT_DIR}
BIN=${IPCREDUCE_BIN:-target/release/ipcreduce}
BASE_BIN=${BASE_BIN:-target/baseline/ipcreduce}
# The binaries the latency phase compares, NAME=PATH each, in turns; ratios are to the first.
VERSIONS=${VERSIONS:-before=$BASE_BIN after=$BIN}
BUDGET=${BUDGET:-540}
CASES=${CASES:-2000}
REPEAT=${REPEAT:-3}
PHASES=${PHASES:-latency checks gputests}
gpu_run_setup

versions=""
for vb in $VERSIONS; do
  v=missing
  [ -x "${vb#*=}" ] && v=$("${vb#*=}" --version 2>&1)
  versions="$versions; ${vb%%=*}: $v"
done
env_txt "GPUs: $NGPU PHASES=$PHASES BUDGET=$BUDGET CASES=$CASES REPEAT=$REPEAT$versions"

has() { [[ " $PHASES " == *" $1 "* ]]; }

if [ "${NGPU:-0}" -lt 2 ]; then
  if ! mps_on; then
    echo "FAIL mps: the MPS control daemon did not start" | tee -a "$SUMMARY"
    exit 1
  fi
fi

if has latency; then
  missing=""
  for vb in $VERSIONS; do [ -x "${vb#*=}" ] || missing="$missing ${vb#*=}"; done
  if [ -n "$missing" ]; then
    echo "SKIP latency: no binary at$missing" | tee -a "$SUMMARY"
    status=1
  else
    for i in $(seq 1 "$REPEAT"); do
      for vb in $VERSIONS; do
        step "bench-${vb%%=*}-$i" 150 "${vb#*=}" bench --backend cuda --ranks 2 -a auto -d bfloat16 \
          -b 8 -e 64K -f 2 -n 300 -w 50 -G 20 --json "$OUT/bench-${vb%%=*}-$i.json"
      done
    done
    # shellcheck disable=SC2086 # one argument per version
    python3 "$(dirname "$0")/lib/bench_table.py" "$OUT" $VERSIONS >"$OUT/latency.md" || status=1
    cat "$OUT/latency.md"
  fi
fi

if has checks; then
  for w in ${WORLDS:-2 4 8}; do
    step "check-w$w" 150 "$BIN" check --backend cuda --ranks "$w" --cases "$CASES" --seed "$((w + 60))"
    step "check-w$w-registered" 150 "$BIN" check --backend cuda --ranks "$w" --cases "$CASES" \
      --seed $((w + 70)) --registered
  done
fi

if has gputests; then
  # gpu-tests.sh starts MPS itself (and stops it): stop ours first.
  if [ -n "${MPS_ON:-}" ]; then
    mps_off
    unset CUDA_MPS_PIPE_DIRECTORY CUDA_MPS_LOG_DIRECTORY
    sleep 2
  fi
  step gpu-tests "$(budget_left)" scripts/device/gpu-tests.sh "$OUT/gpu-tests"
fi

summary_json "$SUMMARY" >"$OUT/summary.json"
cat "$SUMMARY"
exit $status
