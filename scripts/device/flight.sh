#!/usr/bin/env bash
# The flight recorder on a one-GPU machine under MPS: what it costs, and what it tells.
#   1. cost: bench rounds alternating the recorder off (IPCREDUCE_FLIGHT=0), on (default) and
#      identities only (IPCREDUCE_FLIGHT_TIMES=0); host backend 8 B-64 KiB (2 ranks, the quiet
#      cores of this machine) and cuda 8 B-1 MiB (2 ranks on the GPU); per size the median of
#      the rounds' times and on/off, ids/off ratios -> cost-host.txt, cost-cuda.txt.
#   2. dumps: the cuda fault scenarios mismatch-count and kill (4 ranks): every surviving
#      rank's error must name a flight record, and `ipcreduce trace summarize` on them must
#      name call #1 and rank 3 -> faults-*.log, summary-*.txt, summary-*.json.
#   3. trace: a cuda bench at 2 ranks with IPCREDUCE_TRACE and IPCREDUCE_TIMELINE=1, exported
#      as a Chrome/Perfetto trace with a device track, checked (every rank has host and device
#      slices, each device span after its host call's start, in order; the kernels' phase
#      slices on block tracks, in order per block, inside their call's device span), summarized
#      (with the phase breakdown and waits per peer) and drawn
#      (`trace plot`, its last 16 calls) -> trace.json, trace-check.txt, trace-summary.txt,
#      trace-bench.png; then `overlap` (2 ranks, 64 MiB of gradients in 16 MiB buckets, 20
#      steps) traced the same way -> trace-overlap.json, trace-overlap-summary.txt,
#      trace-overlap.png (under 150 s: PARTS=trace runs it alone).
#   The cuda cost rounds include the device timeline on (tl/off); with LIB_TESTS, the
#   timeline's own host cost per call (flight::timeline's ignored GPU test).
# Builds nothing: expects target/release/ipcreduce.
# Usage: scripts/device/flight.sh OUT_DIR
# Knobs: ROUNDS=5 BUDGET=540 LIB_TESTS=PATH PARTS=cost,dumps,trace
set -u
OUT=${1:?usage: flight.sh OUT_DIR}
BIN=${IPCREDUCE_BIN:-target/release/ipcreduce}
ROUNDS=${ROUNDS:-5}
BUDGET=${BUDGET:-540}
PARTS=${PARTS:-cost,dumps,trace}
part() { case ",$PARTS," in *",$1,"*) return 0 ;; esac; return 1; }
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
SUMMARY="$OUT/summary.txt"
: >"$SUMMARY"
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
export NCCL_NVLS_ENABLE=0
# shellcheck source=lib/steps.sh source-path=SCRIPTDIR
. "$(dirname "$0")/lib/steps.sh" || exit 2
NGPU=1
env_txt "flight recorder: cost (rounds $ROUNDS) and dumps"
mps_on || exit 1
status=0

# bench_rounds BACKEND MAXBYTES: ROUNDS rounds of off/on/ids (and tl, the device timeline on,
# on cuda), JSON per run.
bench_rounds() {
  local backend=$1 max=$2 r mode modes="off on ids"
  [ "$backend" = cuda ] && modes="off on ids tl"
  for r in $(seq 1 "$ROUNDS"); do
    for mode in $modes; do
      budget_allows 60 || return 0
      case $mode in
        off) env IPCREDUCE_FLIGHT=0 "$BIN" bench --backend "$backend" --ranks 2 -b 8 -e "$max" -f 8 \
               -a oneshot --json "$OUT/bench-$backend-$mode-$r.json" ;;
        on) env -u IPCREDUCE_FLIGHT -u IPCREDUCE_FLIGHT_TIMES "$BIN" bench --backend "$backend" --ranks 2 \
              -b 8 -e "$max" -f 8 -a oneshot --json "$OUT/bench-$backend-$mode-$r.json" ;;
        ids) env IPCREDUCE_FLIGHT_TIMES=0 "$BIN" bench --backend "$backend" --ranks 2 -b 8 -e "$max" -f 8 \
               -a oneshot --json "$OUT/bench-$backend-$mode-$r.json" ;;
        tl) env -u IPCREDUCE_FLIGHT IPCREDUCE_TIMELINE=1 "$BIN" bench --backend "$backend" --ranks 2 \
              -b 8 -e "$max" -f 8 -a oneshot --json "$OUT/bench-$backend-$mode-$r.json" ;;
      esac >>"$OUT/bench-$backend.log" 2>&1 || echo "bench $backend $mode round $r failed"
    done
  done
}

# ratios BACKEND: per size the median over rounds of each mode's time, and the ratios.
ratios() {
  python3 - "$OUT" "$1" <<'EOF'
import glob, json, statistics, sys
out, backend = sys.argv[1], sys.argv[2]
times = {}
MODES = ("off", "on", "ids", "tl")
for mode in MODES:
    for f in sorted(glob.glob(f"{out}/bench-{backend}-{mode}-*.json")):
        for row in json.load(open(f))["rows"]:
            times.setdefault((row["bytes"], mode), []).append(row["time_us"])
sizes = sorted({b for b, _ in times})
if not sizes:
    sys.exit("no bench rows")
print(f"{backend}: median over rounds of the time per call (us); on/off, ids/off, tl/off "
      "(tl: the device timeline on)")
print(f"{'bytes':>9} {'off':>9} {'on':>9} {'ids':>9} {'tl':>9} {'on/off':>7} {'ids/off':>7} "
      f"{'tl/off':>7} rounds")
for b in sizes:
    med = {m: statistics.median(times[(b, m)]) for m in MODES if (b, m) in times}
    off = med.get("off")
    r = lambda m: f"{med[m] / off:7.3f}" if off and m in med else "      -"
    cell = lambda m: f"{med[m]:9.2f}" if m in med else "        -"
    print(f"{b:>9} {cell('off')} {cell('on')} {cell('ids')} {cell('tl')} {r('on')} {r('ids')} "
          f"{r('tl')} {len(times.get((b, 'off'), []))}")
EOF
}

# The recorder alone (CPU time per recorded call), when the library's unit-test executable is
# given: LIB_TESTS=target/release/deps/ipcreduce-HASH (cargo test --release -p ipcreduce --lib
# --no-run prints its path).
if [ -n "${LIB_TESTS:-}" ] && [ -x "$LIB_TESTS" ]; then
  "$LIB_TESTS" flight::tests::cost --ignored --nocapture 2>&1 | grep "ns per call" | tee "$OUT/cost-recorder.txt"
  # The device timeline on a GPU: its spans checked, and its host cost per call on and off.
  if timeout 60 "$LIB_TESTS" flight::timeline --ignored --nocapture >"$OUT/timeline-unit.log" 2>&1; then
    echo "PASS timeline unit: $(grep 'ns per call' "$OUT/timeline-unit.log")" | tee -a "$SUMMARY"
  else
    echo "FAIL timeline unit: $(grep -E 'panicked|FAIL' "$OUT/timeline-unit.log" | head -n 2)" | tee -a "$SUMMARY"
    status=1
  fi
fi
if part cost; then
  echo "== [$SECONDS s] cost: host backend"
  bench_rounds host 64K
  ratios host | tee "$OUT/cost-host.txt"
  echo "== [$SECONDS s] cost: cuda backend"
  bench_rounds cuda 1M
  ratios cuda | tee "$OUT/cost-cuda.txt"
fi

# dumps SCENARIO SURVIVORS: the fault scenario with flight records into OUT/flight-SCENARIO.
dumps() {
  local scenario=$1 want=$2 dir="$OUT/flight-$1"
  mkdir -p "$dir"
  budget_fits 120 || { echo "SKIP dumps $scenario: out of time" | tee -a "$SUMMARY"; status=1; return; }
  IPCREDUCE_FLIGHT_DIR=$dir timeout "$T" "$BIN" faults --backend cuda --ranks 4 --scenario "$scenario" \
    >"$OUT/faults-$scenario.log" 2>&1
  local named
  named=$(grep -c "^PASS .*(flight record: $dir/ipcreduce-flight-" "$OUT/faults-$scenario.log")
  "$BIN" trace summarize "$dir" >"$OUT/summary-$scenario.txt" 2>&1
  "$BIN" trace summarize --json "$dir" >"$OUT/summary-$scenario.json" 2>&1
  if [ "$named" -eq "$want" ] && grep -q "first divergence: call #1" "$OUT/summary-$scenario.txt" \
    && grep -q "look at rank 3" "$OUT/summary-$scenario.txt"; then
    echo "PASS dumps $scenario: $named ranks name their flight record; summary names call #1, rank 3" | tee -a "$SUMMARY"
  else
    echo "FAIL dumps $scenario: $named of $want ranks name a flight record, or the summary misses call #1 / rank 3" | tee -a "$SUMMARY"
    status=1
  fi
  sed -n 1,8p "$OUT/summary-$scenario.txt"
}
if part dumps; then
  dumps mismatch-count 4
  dumps kill 3
fi

# trace: a whole cuda bench traced with its device timeline, exported and checked.
trace_run() {
  local dir="$OUT/trace"
  rm -rf "$dir"; mkdir -p "$dir"
  budget_fits 120 40 || { echo "SKIP trace: out of time" | tee -a "$SUMMARY"; status=1; return; }
  echo "== [$SECONDS s] trace: cuda bench, 2 ranks, IPCREDUCE_TRACE + IPCREDUCE_TIMELINE=1"
  # --trace DIR: IPCREDUCE_TRACE=DIR for the ranks (and the kernels' phase stamps).
  IPCREDUCE_TIMELINE=1 IPCREDUCE_FLIGHT=4096 timeout "$T" "$BIN" bench --trace "$dir" \
    --backend cuda --ranks 2 -b 8 -e 16M -f 4 -a auto,oneshot,twoshot -n 10 -w 3 \
    --json "$OUT/trace-bench.json" >"$OUT/trace-bench.log" 2>&1 \
    || echo "trace bench failed (exit $?): $(tail -n 2 "$OUT/trace-bench.log")"
  ls "$dir" >"$OUT/trace-files.txt"
  "$BIN" trace export --format perfetto -o "$OUT/trace.json" "$dir" >"$OUT/trace-export.log" 2>&1
  "$BIN" trace summarize "$dir" >"$OUT/trace-summary.txt" 2>&1
  "$BIN" trace summarize --json "$dir" >"$OUT/trace-summary.json" 2>&1
  if python3 "$(dirname "$0")/lib/trace_check.py" "$OUT/trace.json" >"$OUT/trace-check.txt" 2>&1; then
    echo "PASS trace: $(head -n 1 "$OUT/trace-check.txt"); trace.json opens in Perfetto" | tee -a "$SUMMARY"
  else
    echo "FAIL trace: $(head -n 2 "$OUT/trace-check.txt" | tr '\n' ' ')" | tee -a "$SUMMARY"
    status=1
  fi
  cat "$OUT/trace-check.txt"
  sed -n 1,12p "$OUT/trace-summary.txt"
  if "$BIN" trace plot -o "$OUT/trace-bench.png" "$dir" >"$OUT/trace-plot.log" 2>&1; then
    echo "PASS trace plot: $(tail -n 1 "$OUT/trace-plot.log")" | tee -a "$SUMMARY"
  else
    echo "FAIL trace plot: $(tail -n 1 "$OUT/trace-plot.log")" | tee -a "$SUMMARY"
    status=1
  fi
  # A training loop's calls among its compute: overlap, traced the same way.
  local odir="$OUT/trace-overlap"
  rm -rf "$odir"; mkdir -p "$odir"
  budget_fits 60 20 || { echo "SKIP trace overlap: out of time" | tee -a "$SUMMARY"; status=1; return; }
  IPCREDUCE_TRACE=$odir IPCREDUCE_TIMELINE=1 timeout "$T" "$BIN" overlap --backend cuda --ranks 2 \
    --steps 20 --warmup 5 --grad-bytes 64M --bucket-bytes 16M -a auto \
    --json "$OUT/trace-overlap-run.json" >"$OUT/trace-overlap.log" 2>&1 \
    || echo "trace overlap failed (exit $?): $(tail -n 2 "$OUT/trace-overlap.log")"
  "$BIN" trace export --format perfetto -o "$OUT/trace-overlap.json" "$odir" >>"$OUT/trace-export.log" 2>&1
  "$BIN" trace summarize "$odir" >"$OUT/trace-overlap-summary.txt" 2>&1
  if "$BIN" trace plot -o "$OUT/trace-overlap.png" "$odir" >>"$OUT/trace-plot.log" 2>&1; then
    echo "PASS trace overlap plot: $(tail -n 1 "$OUT/trace-plot.log")" | tee -a "$SUMMARY"
  else
    echo "FAIL trace overlap plot: $(tail -n 1 "$OUT/trace-plot.log")" | tee -a "$SUMMARY"
    status=1
  fi
}
part trace && trace_run

cat "$SUMMARY"
exit $status
