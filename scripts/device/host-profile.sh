#!/usr/bin/env bash
# Where an eager call's host time goes, on one GPU (two ranks under MPS): `bench` eager only
# (bf16 sum, 8 B - 64 KiB, every call checked) with IPCREDUCE_HOST_PROFILE=1, in each of MODES
# in turns, REPEAT rounds:
#   pdl      programmatic dependent launch, as by default (IPCREDUCE_PDL=eager)
#   nopdl    IPCREDUCE_PDL=0
#   traced   the defaults with the trace on (IPCREDUCE_TRACE=OUT/trace-ROUND,
#            IPCREDUCE_TIMELINE=1): what tracing adds to a call's host time
# Every rank prints its per-phase means when its communicator is dropped (README, knobs).
# Builds nothing: expects target/release/ipcreduce.
#
# Usage: scripts/device/host-profile.sh OUT_DIR
# Writes: bench-MODE-ROUND.json / .log, profile.txt (every rank's profile line per run),
# summary.txt (PASS/FAIL per run), env.txt. Knobs: REPEAT=2, MODES="pdl nopdl" (or for
# example MODES="pdl traced").
set -u
# shellcheck source=lib/steps.sh source-path=SCRIPTDIR
. "$(dirname "$0")/lib/steps.sh" || exit 2
OUT=${1:?usage: host-profile.sh OUT_DIR}
BIN=${IPCREDUCE_BIN:-target/release/ipcreduce}
REPEAT=${REPEAT:-2}
MODES=${MODES:-pdl nopdl}
BUDGET=${BUDGET:-400}
gpu_run_setup
env_txt "GPUs: $NGPU REPEAT=$REPEAT MODES=$MODES"
if [ "${NGPU:-0}" -lt 2 ]; then
  if ! mps_on; then
    echo "FAIL mps: the MPS control daemon did not start" | tee -a "$SUMMARY"
    exit 1
  fi
fi
: >"$OUT/profile.txt"
for i in $(seq 1 "$REPEAT"); do
  for mode in $MODES; do
    case $mode in
      pdl) vars=(IPCREDUCE_PDL=eager) ;;
      nopdl) vars=(IPCREDUCE_PDL=0) ;;
      traced) vars=(IPCREDUCE_TRACE="$OUT/trace-$i" IPCREDUCE_TIMELINE=1) ;;
      *)
        echo "FAIL mode $mode: not pdl, nopdl or traced" | tee -a "$SUMMARY"
        exit 1
        ;;
    esac
    step "bench-$mode-$i" 150 env "${vars[@]}" IPCREDUCE_HOST_PROFILE=1 "$BIN" bench \
      --backend cuda --ranks 2 -a auto -d bfloat16 -b 8 -e 64K -f 2 -n 300 -w 50 \
      --json "$OUT/bench-$mode-$i.json" || status=1
    grep -h "host profile" "$OUT/bench-$mode-$i.log" | sed "s/^/$mode round $i: /" \
      >>"$OUT/profile.txt"
  done
done
cat "$OUT/profile.txt"
exit $status
