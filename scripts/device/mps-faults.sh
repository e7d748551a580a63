#!/usr/bin/env bash
# One call on a one-GPU machine under MPS: the cuda backend's fault tests (mismatched calls,
# timeout, a rank killed mid-collective, 1,000 create/destroy cycles) and the soak (100,000
# checked all-reduces in one communicator). Builds nothing: expects target/release/ipcreduce.
# Usage: scripts/device/mps-faults.sh OUT_DIR   Knobs: SOAK_CASES=100000 CYCLES=1000
set -u
OUT=${1:?usage: mps-faults.sh OUT_DIR}
BIN=${IPCREDUCE_BIN:-target/release/ipcreduce}
SOAK_CASES=${SOAK_CASES:-100000}
CYCLES=${CYCLES:-1000}
mkdir -p "$OUT"
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
export NCCL_NVLS_ENABLE=0
# MPS, checked: the daemon must answer (lib/steps.sh).
# shellcheck source=lib/steps.sh source-path=SCRIPTDIR
. "$(dirname "$0")/lib/steps.sh" || exit 2
mps_on || exit 1

status=0
LOG="$OUT/faults.log"
# expect_pass SCENARIO RANKS WANT [extra args]: WANT ranks must print PASS and none FAIL.
expect_pass() {
  local scenario=$1 ranks=$2 want=$3; shift 3
  local out
  out=$(timeout 300 "$BIN" faults --backend cuda --ranks "$ranks" --scenario "$scenario" "$@" 2>&1)
  echo "$out" >>"$LOG"
  local pass fail
  pass=$(grep -c "^PASS $scenario" <<<"$out")
  fail=$(grep -c "^FAIL" <<<"$out")
  if [ "$pass" -eq "$want" ] && [ "$fail" -eq 0 ]; then
    echo "ok   $scenario (ranks $ranks): $pass PASS"
  else
    echo "FAIL $scenario (ranks $ranks): $pass PASS, $fail FAIL (want $want PASS)"
    status=1
  fi
  grep -E "^(PASS|FAIL)" <<<"$out" | head -n 4
}
for algo in oneshot twoshot; do
  expect_pass mismatch-count 4 4 -a $algo
  expect_pass mismatch-dtype 4 4 -a $algo
done
expect_pass timeout 4 4 --timeout-ms 1000
expect_pass kill 4 3
expect_pass cycles 2 2 --cycles "$CYCLES"

echo "== soak: $SOAK_CASES checked all-reduces in one communicator (world 2)"
timeout 400 "$BIN" check --backend cuda --ranks 2 --cases "$SOAK_CASES" --max-bytes 256K --seed 42 \
  >"$OUT/soak.log" 2>&1 || status=1
tail -n 2 "$OUT/soak.log"
exit $status
