#!/usr/bin/env bash
# Before / after of the fused all-reduce + residual add + RMSNorm kernels on one GPU (ranks
# under MPS): `ipcreduce fused-bench` of two builds in turns (old, new at world 2, then at
# world 4, ...; ROUNDS times), so that drift of the machine falls on both alike. bf16, hidden
# 4096/8192/16384 x tokens 1/8/32/128/512, graph replay, every result checked.
# Builds nothing: OLD_BIN and NEW_BIN are `ipcreduce` binaries built here (carry them).
# Usage: OLD_BIN=... NEW_BIN=... scripts/device/fused-ab.sh OUT_DIR
# Writes OUT/bench-w<W>-<old|new>-r<R>.{log,json}, warm-<old|new>.log (the kernels compiled
# into the cache before the first timing), summary.txt, and table.md (lib/fused_ab_table.py:
# the medians and the range of new/old over the rounds; any wrong element fails the run).
# Knobs: ROUNDS=2, WORLDS="2 4", TOKENS=1,8,32,128,512, HIDDEN=4096,8192,16384, BUDGET=200.
set -u
# shellcheck source=lib/steps.sh source-path=SCRIPTDIR
. "$(dirname "$0")/lib/steps.sh" || exit 2
OUT=${1:?usage: OLD_BIN=... NEW_BIN=... fused-ab.sh OUT_DIR}
OLD_BIN=${OLD_BIN:?OLD_BIN: the ipcreduce binary before the change}
NEW_BIN=${NEW_BIN:?NEW_BIN: the ipcreduce binary after the change}
BUDGET=${BUDGET:-200}
ROUNDS=${ROUNDS:-2}
WORLDS=${WORLDS:-2 4}
TOKENS=${TOKENS:-1,8,32,128,512}
HIDDEN=${HIDDEN:-4096,8192,16384}
gpu_run_setup
{
  for b in "$OLD_BIN" "$NEW_BIN"; do echo "$b: $("$b" --version 2>&1)"; done
  nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
} >"$OUT/env.txt" 2>&1
cat "$OUT/env.txt"
# The first start of a build compiles its kernels: not inside a timing.
step warm-old 90 "$OLD_BIN" warmup --world 8 --only fused,staged,zerocopy16
step warm-new 90 "$NEW_BIN" warmup --world 8 --only fused,staged,zerocopy16
MPS_ENV="$OUT/mps.txt" mps_on || {
  echo "FAIL mps: the MPS control daemon did not start" | tee -a "$SUMMARY"
  exit 1
}
for r in $(seq 1 "$ROUNDS"); do
  for w in $WORLDS; do
    for v in old new; do
      bin=$OLD_BIN
      [ $v = new ] && bin=$NEW_BIN
      name="bench-w$w-$v-r$r"
      step "$name" 40 "$bin" fused-bench --backend cuda --ranks "$w" --hidden "$HIDDEN" \
        --tokens "$TOKENS" --dtype bf16 -G 20 --rounds 3 --json "$OUT/$name.json"
    done
  done
done
mps_off
python3 "$(dirname "$0")/lib/fused_ab_table.py" "$OUT" >"$OUT/table.md" || status=1
cat "$OUT/table.md"
echo "== summary"
cat "$SUMMARY"
exit $status
