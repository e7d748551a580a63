#!/usr/bin/env bash
# What tracing costs, on one GPU (ranks under MPS): the bench of bf16 sum at two ranks, 16 B -
# 256 MiB, eager and CUDA graph (-G 20), every call checked, run by the configurations of
# CONFIGS in turns for REPEAT rounds (a drift of the machine hits them alike):
#   CONFIGS="before=PATH off=PATH on=PATH"   NAME=BINARY each; the ratios are to the first
#   ENV_<NAME>="VAR=VALUE ..."               the environment of that configuration's runs;
#                                            @TRACE@ in a value becomes a folder of its own
#                                            per round (OUT/trace-NAME-ROUND)
# Default: before = target/baseline/ipcreduce (a build without the change), off and on =
# target/release/ipcreduce, `on` with IPCREDUCE_TRACE and IPCREDUCE_TIMELINE=1 (every call's
# identity, device span and, where the kernels stamp their phases, the stamps).
# Two benches per round: 16 B - 64 KiB with 300 calls per size, 256 KiB - 256 MiB with 30.
# Builds nothing (scripts/build-gpu-tests.sh leaves target/release/ipcreduce).
# Usage: scripts/device/trace-cost.sh OUT_DIR
# Writes OUT/cost.md (scripts/device/lib/bench_table.py: medians of the rounds, [min-max],
# ratios of the medians and of the fastest rounds; with `off` and `on` among CONFIGS and `off`
# not first, also OUT/cost-on-off.md: on against off), the bench JSON and logs, summary.txt and
# env.txt. Knobs: REPEAT=3, BUDGET=540.
set -u
# shellcheck source=lib/steps.sh source-path=SCRIPTDIR
. "$(dirname "$0")/lib/steps.sh" || exit 2
OUT=${1:?usage: trace-cost.sh OUT_DIR}
BIN=${IPCREDUCE_BIN:-target/release/ipcreduce}
BASE_BIN=${BASE_BIN:-target/baseline/ipcreduce}
CONFIGS=${CONFIGS:-before=$BASE_BIN off=$BIN on=$BIN}
ENV_on=${ENV_on-IPCREDUCE_TRACE=@TRACE@ IPCREDUCE_TIMELINE=1}
REPEAT=${REPEAT:-3}
BUDGET=${BUDGET:-540}
gpu_run_setup
described=""
for cb in $CONFIGS; do
  name=${cb%%=*}
  envvar="ENV_$name"
  v=missing
  [ -x "${cb#*=}" ] && v=$("${cb#*=}" --version 2>&1)
  described="$described; $name: $v, env: ${!envvar:-}"
done
env_txt "GPUs: $NGPU REPEAT=$REPEAT BUDGET=$BUDGET$described"
if [ "${NGPU:-0}" -lt 2 ] && ! mps_on; then
  echo "FAIL mps: the MPS control daemon did not start" | tee -a "$SUMMARY"
  exit 1
fi
for cb in $CONFIGS; do
  if [ ! -x "${cb#*=}" ]; then
    echo "FAIL $cb: no binary there" | tee -a "$SUMMARY"
    exit 1
  fi
done
for i in $(seq 1 "$REPEAT"); do
  for cb in $CONFIGS; do
    name=${cb%%=*}
    envvar="ENV_$name"
    vars=()
    for kv in ${!envvar:-}; do
      vars+=("${kv//@TRACE@/$OUT/trace-$name-$i}")
    done
    step "bench-$name-$i-small" 150 env "${vars[@]}" "${cb#*=}" bench --backend cuda --ranks 2 \
      -a auto -d bfloat16 -b 16 -e 64K -f 4 -n 300 -w 50 -G 20 --json "$OUT/bench-$name-$i-small.json"
    step "bench-$name-$i-large" 150 env "${vars[@]}" "${cb#*=}" bench --backend cuda --ranks 2 \
      -a auto -d bfloat16 -b 256K -e 256M -f 4 -n 30 -w 5 -G 20 --json "$OUT/bench-$name-$i-large.json"
  done
done
# shellcheck disable=SC2086 # one argument per configuration
python3 "$(dirname "$0")/lib/bench_table.py" "$OUT" $CONFIGS >"$OUT/cost.md" || status=1
cat "$OUT/cost.md"
# The trace's own cost, on against off of the same build, when both ran and off is not first.
names=" $(for cb in $CONFIGS; do printf '%s ' "${cb%%=*}"; done)"
if [[ $names == *" off "* && $names == *" on "* && $names != " off "* ]]; then
  python3 "$(dirname "$0")/lib/bench_table.py" "$OUT" off on >"$OUT/cost-on-off.md" || status=1
  cat "$OUT/cost-on-off.md"
fi
summary_json "$SUMMARY" >"$OUT/summary.json"
cat "$SUMMARY"
exit $status
