#!/usr/bin/env bash
# The host-staged copy-engine path (two ranks, IPCREDUCE_TRANSPORT=host) on ONE GPU under MPS:
# its tests, its correctness at scale, and its speed beside the staged kernels in the same run.
# Builds nothing: expects target/release/ipcreduce and target/gpu-tests/gpu (IPCREDUCE_BIN).
# Usage: scripts/device/ce-staged.sh OUT_DIR
#
# In this order, every step under `timeout`, none past BUDGET seconds (a step that no longer
# fits is reported SKIP, never PASS):
#   gputests  scripts/device/gpu-tests.sh with the tests of both copy-engine paths and of the
#             host-staged graphs (OUT/gputests/).
#   check     `check` at world 2, host transport, CASES cases up to 256 MiB: the copy-engine
#             path from 64 KiB in 64 KiB chunks (many chunks a call), then from 1 byte in its
#             own chunks (smaller at both ends of a call: plan::ce_staged_pieces), then the
#             default knobs.
#   bench     world 2, bf16 sum, 64 KiB - MAX by 4x, eager and graph, every call checked:
#             -a oneshot,twoshot,auto with the path off (IPCREDUCE_CE_STAGED_MIN=0: the staged
#             kernels) and on from 1 byte (=1: every call above the LL limit), then the default
#             knobs from 8 B (auto against both). ROUNDS rounds of these in turns (files
#             NAME-rN); with BASE_BIN, each round also runs the copy-engine path of that build
#             (bench-ce-base), right after ours.
#   chunks    the copy-engine path at 4 MiB - MAX with IPCREDUCE_STAGED_CHUNK = each of CHUNKS.
#   tune      `tune` at world 2 on this transport, bf16, 1 MiB - TUNE_MAX by 2 (OUT/tune-staged.txt:
#             FAIL unless its key says p2p no, the host-staged transport's key), then
#             -a auto,oneshot,twoshot with that table (bench-tuned), eager and graph.
# Then OUT/compare.txt: per mode and size the staged kernels' best, the copy-engine path, auto
# with the defaults, their ratios, and busbw against BOUND (GB/s, the link's bound measured by
# scripts/device/pcie-link.sh); with several rounds, each figure is the median of the rounds
# and the copy-engine path's spread (min-max busbw) follows; with BASE_BIN, the base build's
# copy-engine path and ours over it (time ratio, > 1: ours faster); with tune, auto with the
# table against the faster of one-shot and two-shot in the same run. summary.txt:
# PASS/FAIL/SKIP per step; a row with wrong elements fails.
# Knobs: CASES (2000), MAX (256M), CHUNKS ("1M 2M 4M 8M 16M"), ITERS (8), BOUND (24.49),
#   PHASES ("gputests check bench chunks tune"), BUDGET (540), ROUNDS (1), BASE_BIN (none),
#   TUNE_MAX (32M).
set -u
# shellcheck source=lib/steps.sh source-path=SCRIPTDIR
. "$(dirname "$0")/lib/steps.sh" || exit 2
OUT=${1:?usage: ce-staged.sh OUT_DIR}
BIN=${IPCREDUCE_BIN:-target/release/ipcreduce}
CASES=${CASES:-2000}
MAX=${MAX:-256M}
CHUNKS=${CHUNKS-1M 2M 4M 8M 16M}
ITERS=${ITERS:-8}
BOUND=${BOUND:-24.49}
PHASES=" ${PHASES:-gputests check bench chunks tune} "
TUNE_MAX=${TUNE_MAX:-32M}
BUDGET=${BUDGET:-540}
ROUNDS=${ROUNDS:-1}
BASE_BIN=${BASE_BIN:-}
gpu_run_setup
mkdir -p "$OUT/json"
unset IPCREDUCE_TOPOLOGY IPCREDUCE_DENY_PEER IPCREDUCE_BLOCKS IPCREDUCE_SLOT_BYTES \
  IPCREDUCE_STAGED_CHUNK IPCREDUCE_STAGED_CTAS IPCREDUCE_STAGED_ROUND IPCREDUCE_ALGO \
  IPCREDUCE_CE_STAGED_MIN
export CUDA_VISIBLE_DEVICES=0
env_txt "CASES=$CASES MAX=$MAX CHUNKS=$CHUNKS ITERS=$ITERS BOUND=$BOUND PHASES=$PHASES BUDGET=$BUDGET
ROUNDS=$ROUNDS BASE_BIN=$BASE_BIN TUNE_MAX=$TUNE_MAX
bin: $("$BIN" --version 2>&1) base: $([ -z "$BASE_BIN" ] || "$BASE_BIN" --version 2>&1)
tests=$(cat target/gpu-tests/gpu.commit 2>/dev/null)"
has() { [[ $PHASES == *" $1 "* ]]; }

if has gputests && budget_fits 200; then
  GPU_TESTS_FILTER="host_staged_copy_engine registered_buffers_through_the_copy_engine host_staged_graph_replays" \
    step gputests "$T" bash "$(dirname "$0")/gpu-tests.sh" "$OUT/gputests"
fi

export IPCREDUCE_TRANSPORT=host
MPS_ENV="$OUT/env.txt" mps_on || exit 1
step warmup 60 "$BIN" warmup --world 2

# check NAME LIMIT ARGS...: PASS only with "N passed, 0 failed" and, where
# IPCREDUCE_CE_STAGED_MIN turns it on, the copy-engine path run (the default knobs leave it off).
check() {
  local name=$1 limit=$2
  shift 2
  step "$name" "$limit" "$BIN" check --backend cuda --ranks 2 --max-bytes 256M "$@" || return
  if ! grep -qE "^[0-9]+ passed, 0 failed$" "$OUT/$name.log"; then
    echo "FAIL $name: no '0 failed' summary line" | tee -a "$SUMMARY"
    status=1
  elif [ "${IPCREDUCE_CE_STAGED_MIN:-0}" != 0 ] && ! grep -q "ce-staged" "$OUT/$name.log"; then
    echo "FAIL $name: the copy-engine path did not run (# paths run)" | tee -a "$SUMMARY"
    status=1
  fi
}
if has check; then
  IPCREDUCE_CE_STAGED_MIN=65536 IPCREDUCE_STAGED_CHUNK=65536 check check-ce64K 120 \
    --cases "$CASES" --seed 41
  IPCREDUCE_CE_STAGED_MIN=1 check check-ce 120 --cases "$CASES" --seed 43
  check check-default 120 --cases "$CASES" --seed 42
fi

# bench NAME LIMIT ARGS...: world-2 bf16 into OUT/NAME.log and OUT/json/NAME.json (with the
# binary in $B, ours unless set).
bench() {
  local name=$1 limit=$2
  shift 2
  step "$name" "$limit" "${B:-$BIN}" bench --backend cuda --ranks 2 -d bfloat16 -f 4 -n "$ITERS" \
    -w 2 --json "$OUT/json/$name.json" "$@"
}
if has bench; then
  for r in $(seq 1 "$ROUNDS"); do
    sfx=""
    [ "$ROUNDS" = 1 ] || sfx="-r$r"
    IPCREDUCE_CE_STAGED_MIN=0 bench "bench-kernels$sfx" 90 -a oneshot,twoshot,auto -b 64K -e "$MAX" -G 5
    IPCREDUCE_CE_STAGED_MIN=1 bench "bench-ce$sfx" 90 -a auto -b 64K -e "$MAX" -G 5
    if [ -n "$BASE_BIN" ]; then
      B=$BASE_BIN IPCREDUCE_CE_STAGED_MIN=1 bench "bench-ce-base$sfx" 90 -a auto -b 64K -e "$MAX" -G 5
    fi
    bench "bench-default$sfx" 90 -a auto,oneshot,twoshot -b 8 -e "$MAX" -G 5
  done
fi
if has chunks; then
  for c in $CHUNKS; do
    IPCREDUCE_CE_STAGED_MIN=1 IPCREDUCE_STAGED_CHUNK=$(numfmt --from=iec "$c") \
      bench "chunk-$c" 40 -a auto -b 4M -e "$MAX" -G 0
  done
fi
if has tune; then
  table="$OUT/tune-staged.txt"
  if step tune 120 "$BIN" tune --backend cuda --ranks 2 -d bf16 --ctas "" -b 1M -e "$TUNE_MAX" \
    -f 2 -o "$table" --json "$OUT/tune-samples.json"; then
    if grep -qx "p2p no" "$table"; then
      IPCREDUCE_TUNE_FILE=$table bench bench-tuned 90 -a auto,oneshot,twoshot -b 1M -e "$TUNE_MAX" \
        -f 2 -G 5
    else
      echo "FAIL tune: $table lacks 'p2p no' (the host-staged transport's key)" | tee -a "$SUMMARY"
      status=1
    fi
  fi
fi
mps_off

python3 - "$OUT" "$BOUND" <<'PY' | tee "$OUT/compare.txt"
import glob, json, os, re, statistics, sys
out, bound = sys.argv[1], float(sys.argv[2])
# runs[name] = rows of every round of that run (files NAME.json or NAME-rN.json).
runs, wrong, rounds = {}, 0, set()
for f in sorted(glob.glob(os.path.join(out, "json", "*.json"))):
    try:
        rows = json.load(open(f)).get("rows", [])
    except (OSError, ValueError) as e:
        print(f"# {os.path.basename(f)}: unreadable ({e})")
        continue
    m = re.fullmatch(r"(.*?)(?:-r(\d+))?", os.path.basename(f)[:-5])
    rounds.add(m.group(2))
    runs.setdefault(m.group(1), []).extend(rows)
    wrong += sum(r.get("wrong", 0) for r in rows)
def med(rows):
    """One row per (mode, bytes): the median time of the rounds, its busbw, the path seen and
    the rounds' busbw range."""
    got = {}
    for key in {(r["mode"], r["bytes"]) for r in rows}:
        rs = [r for r in rows if (r["mode"], r["bytes"]) == key]
        t = statistics.median(r["time_us"] for r in rs)
        bw = [r["busbw_gbps"] for r in rs]
        got[key] = {"time_us": t, "busbw_gbps": statistics.median(bw), "lo": min(bw),
                    "hi": max(bw), "path": "/".join(sorted({str(r.get("path")) for r in rs}))}
    return got
def pick(run, algo=None):
    return med([r for r in runs.get(run, []) if algo is None or r["algo"] == algo])
kernels = {}
for algo in ("oneshot", "twoshot"):
    for key, r in pick("bench-kernels", algo).items():
        if key not in kernels or r["time_us"] < kernels[key]["time_us"]:
            kernels[key] = r
ce = pick("bench-ce", "auto")
base = pick("bench-ce-base", "auto")
auto = pick("bench-default", "auto")
print(f"# busbw GB/s, median of {len(rounds)} round(s); bound {bound} GB/s (both directions of the link busy, copy engines)")
print("# mode bytes kernels_best(path) ce-path[min-max] auto_default(path) ce/kernels auto/best ce_of_bound"
      + (" ce-base ce/base" if base else ""))
for key in sorted(set(kernels) | set(ce) | set(auto), key=lambda k: (k[0], k[1])):
    k, c, a, b = kernels.get(key), ce.get(key), auto.get(key), base.get(key)
    fmt = lambda r: "-" if r is None else "%.2f(%s)" % (r["busbw_gbps"], r.get("path"))
    fce = "-" if c is None else "%.2f[%.2f-%.2f]" % (c["busbw_gbps"], c["lo"], c["hi"])
    ratio = "-" if not (k and c) else "%.3f" % (k["time_us"] / c["time_us"])
    best = min((r["time_us"] for r in (k, c) if r), default=None)
    auto_vs = "-" if not (a and best) else "%.3f" % (best / a["time_us"])
    of_bound = "-" if not c else "%.0f%%" % (100 * c["busbw_gbps"] / bound)
    line = [key[0], key[1], fmt(k), fce, fmt(a), ratio, auto_vs, of_bound]
    if base:
        line += ["-" if b is None else "%.2f[%.2f-%.2f]" % (b["busbw_gbps"], b["lo"], b["hi"]),
                 "-" if not (b and c) else "%.3f" % (b["time_us"] / c["time_us"])]
    print(*line)
tuned = {a: pick("bench-tuned", a) for a in ("auto", "oneshot", "twoshot")}
if tuned["auto"]:
    print("# auto with the tuned table against the faster path in the same run (>= 0.95: within 5 %)")
    print("# mode bytes auto(path) oneshot twoshot best/auto")
    for key in sorted(tuned["auto"], key=lambda k: (k[0], k[1])):
        a = tuned["auto"][key]
        paths = [tuned[p].get(key) for p in ("oneshot", "twoshot")]
        best = min((r["time_us"] for r in paths if r), default=None)
        print(key[0], key[1], "%.2f(%s)" % (a["busbw_gbps"], a["path"]),
              *("-" if r is None else "%.2f" % r["busbw_gbps"] for r in paths),
              "-" if best is None else "%.3f" % (best / a["time_us"]))
print("# chunk sweep (eager busbw of the copy-engine path)")
for run in sorted(r for r in runs if r.startswith("chunk-")):
    print(run, " ".join("%d:%.2f" % (r["bytes"] >> 20, r["busbw_gbps"]) for r in runs[run]))
print(f"# rows with wrong elements: {wrong}")
sys.exit(1 if wrong else 0)
PY
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1
echo "== [$SECONDS s] done"
cat "$SUMMARY"
exit $status
