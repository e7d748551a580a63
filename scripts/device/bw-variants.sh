#!/usr/bin/env bash
# The zero-copy and LL kernel variants side by side, and their correctness. Builds nothing:
# expects target/release/ipcreduce (and, for the GPU tests, target/gpu-tests/gpu from
# scripts/build-gpu-tests.sh).
#
# Usage: scripts/device/bw-variants.sh OUT_DIR
#   two GPUs (nvidia-h200-x2), one call: PHASES=bench (the default there). bf16 sum, 8 B - 1 GiB,
#     eager and CUDA graph, plain and registered buffers, every call checked:
#       new      the defaults (deep zero-copy kernels, LL up to 1 MiB at two ranks, zero-copy
#                two-shot above 4 MiB), every algorithm and NCCL beside;
#       old      the previous kernels and rules: IPCREDUCE_REG_LOADS=8 IPCREDUCE_LL_MAX=65536 and
#                one-shot at every size (IPCREDUCE_REG_ONESHOT_MAX=1 TiB), auto only;
#       shallow  the 8-packs zero-copy kernels under the new rules, one-shot and two-shot, 2 MiB on;
#       noll     LL off (IPCREDUCE_LL_MAX=0): one-shot and two-shot, 32 KiB - 2 MiB, what LL
#                replaces there;
#       blocksN  the deep zero-copy kernels with N CTAs (IPCREDUCE_BLOCKS), 4 MiB - 1 GiB;
#       ce       the copy-engine path from 32 MiB (IPCREDUCE_CE_MIN=33554432): two ranks,
#                registered buffers, out of place, so its registered rows (the plain ones run
#                the SM kernels), 32 MiB - 1 GiB, auto only;
#       llblocksN  LL one-shot with at most N CTAs (default: one thread per 16 bytes, at most
#                64), 64 KiB - 1 MiB;
#       ll12     LL with 12 data bytes per line (IPCREDUCE_LL_DATA=12), 8 B - 1 MiB.
#     Then side-by-side.md: per size the graph time of each variant's best path and NCCL's.
#   one GPU (nvidia-h200), one call: PHASES="checks gputests" (the default there), ranks under
#     MPS: `check` 2000 cases at world 2, 4 and 8, plain and registered buffers (and 300 up to
#     1 MiB with LL12 lines), then the library GPU tests (scripts/device/gpu-tests.sh into
#     OUT_DIR/gpu-tests).
# Every step runs under `timeout`; a step that no longer fits BUDGET seconds is skipped and
# reported. summary.txt: one line per step (PASS/FAIL/SKIP and its last line).
# Knobs: PHASES, BUDGET=540, CASES=2000, WORLDS="2 4 8", BENCH_MAX=1G, BLOCKS_SWEEP="16 32 64 128".
set -u
# step (budget, summary lines), summary_json, mps_on/mps_off.
# shellcheck source=lib/steps.sh source-path=SCRIPTDIR
. "$(dirname "$0")/lib/steps.sh" || exit 2
OUT=${1:?usage: bw-variants.sh OUT_DIR}
BIN=${IPCREDUCE_BIN:-target/release/ipcreduce}
BUDGET=${BUDGET:-540}
CASES=${CASES:-2000}
BENCH_MAX=${BENCH_MAX:-1G}
BLOCKS_SWEEP=${BLOCKS_SWEEP:-16 32 64 128}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
# Never NVLink multicast.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
# The built-in rules, not a tuning table left on the machine.
export IPCREDUCE_TUNE_FILE="$OUT/no-tune.json"
NGPU=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)
if [ "${NGPU:-0}" -ge 2 ]; then PHASES=${PHASES:-bench}; else PHASES=${PHASES:-checks gputests}; fi
SUMMARY="$OUT/summary.txt"
: >"$SUMMARY"
status=0

env_txt "GPUs: $NGPU PHASES=$PHASES BUDGET=$BUDGET CASES=$CASES BENCH_MAX=$BENCH_MAX"

# The registers the driver reports for the loaded kernels (bf16 sum) of world-size class 2 (two
# ranks: on one GPU only under MPS, where both ranks' kernels run at once).
resources() {
  IPCREDUCE_LOG=info timeout 120 "$BIN" check --backend cuda --ranks 2 --cases 1 >"$OUT/resources.log" 2>&1
  grep -h -E "kernels for world class" "$OUT/resources.log" | head -n 1 | tee "$OUT/resources.txt"
}

# --- two GPUs: the variants side by side -----------------------------------------------------
# bench NAME ALGOS MIN MAX ITERS WARMUP GRAPH [VAR=VALUE...]: one bf16 run (eager and graph,
# plain and registered buffers) into bench-NAME.{log,json}.
bench() {
  local name=$1 algos=$2 lo=$3 hi=$4 n=$5 w=$6 g=$7
  shift 7
  step "bench-$name" 240 env "$@" "$BIN" bench --backend cuda --ranks 2 -a "$algos" -d bfloat16 \
    -b "$lo" -e "$hi" -f 2 -n "$n" -w "$w" -G "$g" --registered --json "$OUT/bench-$name.json"
}
# The same over 8 B - BENCH_MAX in three ranges (iterations fall as sizes grow: 1 GiB calls take
# milliseconds and every output is read back and checked).
bench_all() {
  local name=$1 algos=$2
  shift 2
  bench "$name-small" "$algos" 8 1M 100 20 10 "$@"
  bench "$name-mid" "$algos" 2M 32M 40 10 10 "$@"
  bench "$name-large" "$algos" 64M "$BENCH_MAX" 10 3 5 "$@"
}
if [[ " $PHASES " == *" bench "* ]]; then
  resources
  bench_all new all
  bench_all old auto IPCREDUCE_REG_LOADS=8 IPCREDUCE_LL_MAX=65536 IPCREDUCE_REG_ONESHOT_MAX=1099511627776
  bench noll oneshot,twoshot 32K 2M 100 20 10 IPCREDUCE_LL_MAX=0
  bench shallow oneshot,twoshot 2M "$BENCH_MAX" 10 3 5 IPCREDUCE_REG_LOADS=8
  for b in $BLOCKS_SWEEP; do
    bench "blocks$b" oneshot,twoshot 4M "$BENCH_MAX" 10 3 5 IPCREDUCE_BLOCKS="$b"
  done
  bench ce auto 32M "$BENCH_MAX" 10 3 5 IPCREDUCE_CE_MIN=33554432
  for b in 32 128; do
    bench "llblocks$b" oneshot 64K 1M 100 20 10 IPCREDUCE_BLOCKS="$b"
  done
  bench ll12 oneshot 8 1M 100 20 10 IPCREDUCE_LL_DATA=12
  # Per size, the graph time of every (variant, algorithm, path, CTAs, registration), NCCL
  # beside, and each variant's best; then the goals table of the new defaults.
  python3 - "$OUT" >"$OUT/side-by-side.md" <<'EOF' || status=1
import glob, json, os, sys
out = sys.argv[1]
rows = []
for f in sorted(glob.glob(os.path.join(out, "bench-*.json"))):
    variant = os.path.basename(f)[len("bench-"):-len(".json")]
    for part in ("-small", "-mid", "-large"):
        if variant.endswith(part):
            variant = variant[: -len(part)]
    for r in json.load(open(f))["rows"]:
        if r["mode"] == "graph":
            rows.append((variant, r))
sizes = sorted({r["bytes"] for _, r in rows})
print("# bf16 sum, CUDA graph, us per call (slowest rank); NCCL from the `new` run")
print()
print("| size | NCCL | new auto (path, CTAs) | old auto (path, CTAs) | best registered (variant path CTAs) | best plain | new/NCCL reg | new/NCCL plain |")
print("|---|---|---|---|---|---|---|---|")
def fmt(r):
    return "-" if r is None else f"{r['time_us']:.1f} ({r['path']}, {r['ctas']})"
for b in sizes:
    at = [(v, r) for v, r in rows if r["bytes"] == b]
    nccl = min((r["time_us"] for v, r in at if r["algo"] == "nccl"), default=None)
    def pick(var, algo, reg):
        c = [r for v, r in at if v == var and r["algo"] == algo and r["registered"] == reg]
        return min(c, key=lambda r: r["time_us"]) if c else None
    best = lambda reg: min(((v, r) for v, r in at if r["algo"] != "nccl" and r["registered"] == reg),
                           key=lambda x: x[1]["time_us"], default=(None, None))
    bv, br = best(True)
    pv, pr = best(False)
    new_reg, new_plain = pick("new", "auto", True), pick("new", "auto", False)
    ratio = lambda r: "-" if r is None or nccl is None else f"{nccl / r['time_us']:.2f}x"
    print(f"| {b} | {nccl if nccl is None else round(nccl, 1)} | reg {fmt(new_reg)}, plain {fmt(new_plain)} "
          f"| reg {fmt(pick('old', 'auto', True))}, plain {fmt(pick('old', 'auto', False))} "
          f"| {bv} {fmt(br)} | {pv} {fmt(pr)} | {ratio(new_reg)} | {ratio(new_plain)} |")
wrong = sum(r["wrong"] for _, r in rows)
print()
print(f"wrong elements over every graph row: {wrong}")
EOF
  cat "$OUT/side-by-side.md"
  shopt -s nullglob
  "$BIN" report "$OUT"/bench-new-*.json >"$OUT/goals-new.md" 2>&1 || status=1
  "$BIN" report "$OUT"/bench-old-*.json >"$OUT/goals-old.md" 2>&1 || status=1
  "$BIN" plot "$OUT"/bench-new-*.json "$OUT"/bench-old-*.json -d bf16 -o "$OUT/new-old-bf16.png" \
    >/dev/null 2>&1 || status=1
  shopt -u nullglob
fi

# --- one GPU, ranks under MPS: correctness ---------------------------------------------------
if [[ " $PHASES " == *" checks "* ]]; then
  mps_on || exit 1
  resources
  for w in ${WORLDS:-2 4 8}; do
    step "check-w$w" 150 "$BIN" check --backend cuda --ranks "$w" --cases "$CASES" --seed "$w"
    step "check-w$w-registered" 150 "$BIN" check --backend cuda --ranks "$w" --cases "$CASES" \
      --seed $((w + 10)) --registered
    grep -h "^# paths run" "$OUT/check-w$w.log" "$OUT/check-w$w-registered.log" 2>/dev/null
  done
fi
if [[ " $PHASES " == *" gputests "* ]]; then
  # gpu-tests.sh starts MPS itself (and stops it): stop ours first.
  if [ -n "${MPS_ON:-}" ]; then
    mps_off # returns once the daemon no longer answers
  fi
  step gpu-tests 300 scripts/device/gpu-tests.sh "$OUT/gpu-tests"
fi
# Last, as time allows: the opt-in LL12 lines.
if [[ " $PHASES " == *" checks "* ]]; then
  [ -n "${MPS_ON:-}" ] || mps_on || exit 1
  for w in ${WORLDS:-2 4 8}; do
    step "check-w$w-ll12" 60 env IPCREDUCE_LL_DATA=12 "$BIN" check --backend cuda --ranks "$w" \
      --cases 300 --max-bytes 1M --seed $((w + 20))
  done
fi

# Machine-readable: every step and its outcome.
summary_json "$SUMMARY" >"$OUT/summary.json" || true
echo "== [$SECONDS s] summary"
cat "$SUMMARY"
exit $status
