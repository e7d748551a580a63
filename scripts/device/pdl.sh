#!/usr/bin/env bash
# Programmatic dependent launch (IPCREDUCE_PDL) side by side, and its correctness. Builds
# nothing: expects target/release/ipcreduce (and target/gpu-tests/gpu for the GPU tests).
#
# Usage: scripts/device/pdl.sh OUT_DIR
#   bench   bf16 sum at two ranks, 8 B - 4 MiB, eager and CUDA graph, plain and registered
#           buffers, every call checked, five variants in turn:
#             off       IPCREDUCE_PDL=0: every kernel launched after the previous one completed;
#             default   eager calls with programmatic dependent launch, graphs without;
#             on        IPCREDUCE_PDL=1: every call with it (our kernels may start while the
#                       refresh before them finishes);
#             producer  on, and the refresh lets the next kernel launch at once
#                       (`bench --pdl-producer`), as PDL-aware producers do;
#             chain     producer, the refresh also launched with PDL (`--pdl-consumer`) and the
#                       LL kernels letting it launch at once (IPCREDUCE_PDL_TRIGGER=1, forced on
#                       one GPU, where it is off by default; there only up to 64 KiB, whose
#                       small grids leave room for the early successors).
#           NCCL beside when two GPUs are visible (on one GPU NCCL cannot share it without
#           sockets). Then pdl.md: per size and mode the time of each variant and the ratios.
#   checks  `check` at worlds 2, 4 and 8 (ranks under MPS on one GPU), plain and registered;
#           then at worlds 2 and 4 with IPCREDUCE_PDL=1 IPCREDUCE_PDL_TRIGGER=1 up to 1 MiB (the
#           LL kernels' early trigger, forced).
#   gputests  scripts/device/gpu-tests.sh into OUT_DIR/gpu-tests (PDL on, the default).
# Every step runs under `timeout`; a step that no longer fits BUDGET seconds is skipped and
# reported. summary.txt: one line per step (PASS/FAIL/SKIP and its last line).
# Knobs: PHASES="bench checks gputests", BUDGET=540, CASES=500, WORLDS="2 4 8", BENCH_MAX=4M,
# REPEAT=1 (rounds of the bench variants, in turn; pdl.md takes the median).
set -u
# step (budget, summary lines), mps_on/mps_off.
# shellcheck source=lib/steps.sh source-path=SCRIPTDIR
. "$(dirname "$0")/lib/steps.sh" || exit 2
OUT=${1:?usage: pdl.sh OUT_DIR}
BIN=${IPCREDUCE_BIN:-target/release/ipcreduce}
BUDGET=${BUDGET:-540}
CASES=${CASES:-500}
BENCH_MAX=${BENCH_MAX:-4M}
REPEAT=${REPEAT:-1}
PHASES=${PHASES:-bench checks gputests}
gpu_run_setup

env_txt "GPUs: $NGPU PHASES=$PHASES BUDGET=$BUDGET CASES=$CASES BENCH_MAX=$BENCH_MAX"

has() { [[ " $PHASES " == *" $1 "* ]]; }

# Ranks share the GPU when there is only one: MPS lets their kernels run at once.
if [ "${NGPU:-0}" -lt 2 ]; then mps_on; fi

if has bench; then
  algos=auto
  [ "${NGPU:-0}" -ge 2 ] && algos=auto,nccl
  # The variants take turns, REPEAT rounds, so a drift of the machine hits each alike.
  for i in $(seq 1 "$REPEAT"); do
  for v in off default on producer chain; do
    extra=()
    envs=()
    max=$BENCH_MAX
    case $v in
      off) envs=(IPCREDUCE_PDL=0) ;;
      on) envs=(IPCREDUCE_PDL=1) ;;
      producer) envs=(IPCREDUCE_PDL=1) extra=(--pdl-producer) ;;
      chain)
        envs=(IPCREDUCE_PDL=1 IPCREDUCE_PDL_TRIGGER=1) extra=(--pdl-producer --pdl-consumer)
        [ "${NGPU:-0}" -lt 2 ] && max=64K
        ;;
    esac
    step "bench-$v-$i" 150 env "${envs[@]}" "$BIN" bench --backend cuda --ranks 2 -a "$algos" \
      -d bfloat16 -b 8 -e "$max" -f 2 -n 200 -w 50 -G 20 --registered "${extra[@]}" \
      --json "$OUT/bench-$v-$i.json"
  done
  done
  python3 - "$OUT" >"$OUT/pdl.md" <<'EOF' || status=1
import glob, json, os, statistics, sys
out = sys.argv[1]
runs = {}
for v in ("off", "default", "on", "producer", "chain"):
    for f in sorted(glob.glob(os.path.join(out, f"bench-{v}-*.json"))):
        runs.setdefault(v, []).extend(json.load(open(f))["rows"])
# The median over the rounds.
def t(v, b, mode, reg, algo="auto"):
    c = [r["time_us"] for r in runs.get(v, []) if r["bytes"] == b and r["mode"] == mode
         and r["registered"] == reg and r["algo"] == algo]
    return statistics.median(c) if c else None
f = lambda x: "-" if x is None else f"{x:.2f}"
ratio = lambda a, b: "-" if a is None or b is None else f"{a / b:.2f}x"
sizes = sorted({r["bytes"] for rows in runs.values() for r in rows})
print("# bf16 sum, two ranks, us per call (slowest rank, median of the rounds); off = IPCREDUCE_PDL=0,")
print("# default = eager calls only, on = IPCREDUCE_PDL=1, producer = on with a refresh that lets the next")
print("# kernel launch at once, chain = producer with a refresh launched with PDL and LL kernels that let")
print("# it launch at once; off/X > 1: X faster than off")
for mode in ("graph", "eager"):
    for reg in (True, False):
        print()
        print(f"## {mode}, {'registered' if reg else 'plain'} buffers")
        print()
        print("| size | off | default | on | producer | chain | off/default | off/on | off/producer | off/chain | NCCL (default run) |")
        print("|---|---|---|---|---|---|---|---|---|---|---|")
        for b in sizes:
            a, d = t("off", b, mode, reg), t("default", b, mode, reg)
            o, p, c = t("on", b, mode, reg), t("producer", b, mode, reg), t("chain", b, mode, reg)
            n = t("default", b, mode, False, "nccl")
            print(f"| {b} | {f(a)} | {f(d)} | {f(o)} | {f(p)} | {f(c)} | {ratio(a, d)} | {ratio(a, o)} "
                  f"| {ratio(a, p)} | {ratio(a, c)} | {f(n)} |")
wrong = sum(r["wrong"] for rows in runs.values() for r in rows)
print()
print(f"wrong elements over every row: {wrong}")
EOF
  cat "$OUT/pdl.md"
fi

if has checks; then
  for w in ${WORLDS:-2 4 8}; do
    step "check-w$w" 120 "$BIN" check --backend cuda --ranks "$w" --cases "$CASES" --seed "$((w + 30))"
    step "check-w$w-registered" 120 "$BIN" check --backend cuda --ranks "$w" --cases "$CASES" \
      --seed $((w + 40)) --registered
  done
  for w in 2 4; do
    step "check-w$w-trigger" 120 env IPCREDUCE_PDL=1 IPCREDUCE_PDL_TRIGGER=1 "$BIN" check \
      --backend cuda --ranks "$w" --cases "$CASES" --max-bytes 1M --seed $((w + 50))
  done
fi

if has gputests; then
  # gpu-tests.sh starts MPS itself (and stops it): stop ours first.
  if [ -n "${MPS_ON:-}" ]; then
    mps_off # returns once the daemon no longer answers
    unset CUDA_MPS_PIPE_DIRECTORY CUDA_MPS_LOG_DIRECTORY
  fi
  step gpu-tests 330 scripts/device/gpu-tests.sh "$OUT/gpu-tests"
fi

echo "== [$SECONDS s] summary"
cat "$SUMMARY"
exit $status
