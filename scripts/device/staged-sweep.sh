#!/usr/bin/env bash
# The host-staged transport's knobs, measured in one run on ONE GPU under MPS (every rank's
# traffic crosses the GPU's one PCIe link to host memory and back; IPCREDUCE_TRANSPORT=host
# forces the transport), and its correctness at worlds 2/4/8.
# Builds nothing: expects target/release/ipcreduce (IPCREDUCE_BIN).
# Usage: scripts/device/staged-sweep.sh OUT_DIR
#
# In this order, every step under `timeout`, none past BUDGET seconds (a step that no longer
# fits is reported SKIP, never PASS):
#   warmup   `ipcreduce warmup --world 8`: the kernel cache filled first, so no rank waits for
#            a peer's first compile inside a timed or checked call.
#   check    `check` at WORLDS_CHECK (2 4 8), CASES (2000) cases each, host transport, up to
#            MAX_BYTES (256M), default knobs; then world 2 with 64 KiB chunks (CASES_SMALL,
#            many chunks per call: the pipeline's slot reuse), also when WORLDS_CHECK is
#            empty (CASES_SMALL=0 leaves it out).
#   sweep    per world of WORLDS_SWEEP (2 4): bench -a oneshot,twoshot, bf16 sum, 256 KiB -
#            SWEEP_MAX (256M) by 4x, eager, every call checked, for every ROUND x CHUNK x CTAS
#            (IPCREDUCE_STAGED_ROUND / _CHUNK / _CTAS; ROUNDS="0 4": 0 is the kernels without
#            the interleave, the order before it). World 4 sweeps CHUNKS_4 x CTAS_4 (smaller).
#   auto     per world of WORLDS_AUTO (2 4 8): bench -a auto,oneshot,twoshot, 8 B - SWEEP_MAX,
#            eager and graph, default knobs, AUTO_ROUNDS (1) rounds in turns (every world in
#            each round): auto against the best path at every size, on the medians of the
#            rounds (a size where auto ran the best path's own kernel is never over).
# Then OUT/sweep.txt and OUT/sweep.json (every row: world, knobs, algo, bytes, busbw, wrong),
# the best knobs per world, algorithm and size, auto against the best (auto.txt), and
# summary.txt (PASS/FAIL/SKIP per step; a row with wrong elements fails its step).
# Knobs: WORLDS_CHECK, CASES, CASES_SMALL (300), MAX_BYTES, WORLDS_SWEEP, ROUNDS, CHUNKS
#   ("512K 1M 2M 4M"), CTAS ("16 32 64"), CHUNKS_4 ("1M 4M"), CTAS_4 ("32 64"), SWEEP_MAX,
#   ITERS (8), WORLDS_AUTO, AUTO_ROUNDS (1), BUDGET (370).
set -u
# step, budget_fits, mps_on/mps_off, env_txt, summary_json.
# shellcheck source=lib/steps.sh source-path=SCRIPTDIR
. "$(dirname "$0")/lib/steps.sh" || exit 2
OUT=${1:?usage: staged-sweep.sh OUT_DIR}
BIN=${IPCREDUCE_BIN:-target/release/ipcreduce}
WORLDS_CHECK=${WORLDS_CHECK-2 4 8}
CASES=${CASES:-2000}
CASES_SMALL=${CASES_SMALL:-300}
MAX_BYTES=${MAX_BYTES:-256M}
WORLDS_SWEEP=${WORLDS_SWEEP-2 4}
ROUNDS=${ROUNDS-0 4}
CHUNKS=${CHUNKS-512K 1M 2M 4M}
CTAS=${CTAS-16 32 64}
CHUNKS_4=${CHUNKS_4-1M 4M}
CTAS_4=${CTAS_4-32 64}
SWEEP_MAX=${SWEEP_MAX:-256M}
ITERS=${ITERS:-8}
WORLDS_AUTO=${WORLDS_AUTO-2 4 8}
AUTO_ROUNDS=${AUTO_ROUNDS:-1}
BUDGET=${BUDGET:-370}
SUMMARY=$OUT/summary.txt
NGPU=1
status=0
mkdir -p "$OUT/json"
: >"$SUMMARY"
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
# Never NVLink multicast.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
unset IPCREDUCE_TOPOLOGY IPCREDUCE_DENY_PEER IPCREDUCE_BLOCKS IPCREDUCE_SLOT_BYTES \
  IPCREDUCE_STAGED_CHUNK IPCREDUCE_STAGED_CTAS IPCREDUCE_STAGED_ROUND IPCREDUCE_ALGO
export CUDA_VISIBLE_DEVICES=0 IPCREDUCE_TRANSPORT=host
env_txt "WORLDS_CHECK=$WORLDS_CHECK CASES=$CASES MAX_BYTES=$MAX_BYTES WORLDS_SWEEP=$WORLDS_SWEEP ROUNDS=$ROUNDS CHUNKS=$CHUNKS CTAS=$CTAS CHUNKS_4=$CHUNKS_4 CTAS_4=$CTAS_4 SWEEP_MAX=$SWEEP_MAX ITERS=$ITERS WORLDS_AUTO=$WORLDS_AUTO AUTO_ROUNDS=$AUTO_ROUNDS BUDGET=$BUDGET
$(nvidia-smi --query-gpu=pcie.link.gen.current,pcie.link.width.current --format=csv 2>&1)"
MPS_ENV="$OUT/env.txt" mps_on || exit 1

# check NAME LIMIT ARGS...: `check` on the host transport; PASS only with "N passed, 0 failed".
check() {
  local name=$1 limit=$2
  shift 2
  step "$name" "$limit" "$BIN" check --backend cuda --max-bytes "${CHECK_MAX:-$MAX_BYTES}" "$@"
  local rc=$?
  if [ $rc -eq 0 ] && ! grep -qE "^[0-9]+ passed, 0 failed$" "$OUT/$name.log"; then
    echo "FAIL $name: no '0 failed' summary line" | tee -a "$SUMMARY"
    status=1
  fi
}

# bytes SIZE: SIZE (K, M suffixes, powers of 1024) in bytes, as the IPCREDUCE_* knobs take it.
bytes() { numfmt --from=iec "$1"; }

# bench NAME LIMIT ARGS...: one bench into OUT/NAME.log and OUT/json/NAME.json.
bench() {
  local name=$1 limit=$2
  shift 2
  step "$name" "$limit" "$BIN" bench --backend cuda -d bfloat16 --json "$OUT/json/$name.json" "$@"
}

step warmup 60 "$BIN" warmup --world 8

for w in $WORLDS_CHECK; do
  check "check-host-w$w" $((40 + 12 * w)) --ranks "$w" --cases "$CASES" --seed "$w"
done
# Many chunks per call: every slot parity reused within a call and across calls.
[ "$CASES_SMALL" -gt 0 ] && IPCREDUCE_STAGED_CHUNK=65536 CHECK_MAX=16M \
  check check-host-w2-chunk64K 40 --ranks 2 --cases "$CASES_SMALL" --seed 21

for w in $WORLDS_SWEEP; do
  chunks=$CHUNKS ctas=$CTAS
  [ "$w" -gt 2 ] && chunks=$CHUNKS_4 ctas=$CTAS_4
  for r in $ROUNDS; do
    for c in $chunks; do
      for b in $ctas; do
        IPCREDUCE_STAGED_ROUND=$r IPCREDUCE_STAGED_CHUNK=$(bytes "$c") IPCREDUCE_STAGED_CTAS=$b \
          bench "sweep-w$w-r$r-c$c-b$b" 40 --ranks "$w" -a oneshot,twoshot -b 256K \
          -e "$SWEEP_MAX" -f 4 -n "$ITERS" -w 2 -G 0
      done
    done
  done
done

# Rounds in turns, so that a drift of the machine hits every world and path alike.
for n in $(seq 1 "$AUTO_ROUNDS"); do
  for w in $WORLDS_AUTO; do
    name=auto-w$w
    [ "$AUTO_ROUNDS" -gt 1 ] && name=auto-w$w-n$n
    bench "$name" $((30 + 10 * w)) --ranks "$w" -a auto,oneshot,twoshot -b 8 -e "$SWEEP_MAX" \
      -f 4 -n "$ITERS" -w 2 -G 5
  done
done

# The tables: every row, the best knobs, auto against the best path. A row with wrong elements
# fails the run.
python3 - "$OUT" <<'PY' | tee "$OUT/sweep.txt"
import glob, json, os, re, statistics, sys
out = sys.argv[1]
rows, wrong = [], []
for f in sorted(glob.glob(os.path.join(out, "json", "*.json"))):
    name = os.path.basename(f)[:-5]
    try:
        rs = json.load(open(f)).get("rows", [])
    except (OSError, ValueError) as e:
        print(f"# {name}: unreadable JSON ({e})")
        continue
    m = re.match(r"(sweep|auto)-w(\d+)(?:-r(\d+)-c(\w+)-b(\d+)|-n(\d+))?$", name)
    if not m:
        continue
    kind, w, r, c, b, n = m.groups()
    for x in rs:
        row = {"run": name, "kind": kind, "world": int(w), "round": r, "rep": int(n or 1),
               "chunk": c,
               "ctas_knob": b, "algo": x["algo"], "path": x.get("path"), "ctas": x.get("ctas"),
               "mode": x["mode"], "bytes": x["bytes"], "time_us": x["time_us"],
               "busbw_gbps": x["busbw_gbps"], "wrong": x.get("wrong", 0)}
        rows.append(row)
        if row["wrong"]:
            wrong.append(row)
json.dump({"rows": rows}, open(os.path.join(out, "sweep.json"), "w"), indent=1)
print("# world round chunk ctas algo path mode bytes time_us busbw wrong rep")
for x in rows:
    print(x["world"], x["round"] or "-", x["chunk"] or "-", x["ctas"], x["algo"], x["path"],
          x["mode"], x["bytes"], "%.1f" % x["time_us"], "%.2f" % x["busbw_gbps"], x["wrong"],
          x["rep"])
print("# best knobs per world, algorithm, size (sweep, eager)")
best = {}
for x in rows:
    if x["kind"] != "sweep":
        continue
    k = (x["world"], x["algo"], x["bytes"])
    if k not in best or x["busbw_gbps"] > best[k]["busbw_gbps"]:
        best[k] = x
for (w, a, n), x in sorted(best.items()):
    base = [y for y in rows if y["kind"] == "sweep" and y["world"] == w and y["algo"] == a
            and y["bytes"] == n and y["round"] == "0"]
    b0 = max((y["busbw_gbps"] for y in base), default=0)
    print("best w%d %-8s %10d round %s chunk %s ctas %s: %.2f GB/s (best without interleave %.2f)"
          % (w, a, n, x["round"], x["chunk"], x["ctas"], x["busbw_gbps"], b0))
auto_rows = [x for x in rows if x["kind"] == "auto"]
reps = len({x["rep"] for x in auto_rows})
print("# auto against the best path per world, mode, size (default knobs; medians of %d "
      "round(s) [min-max])" % reps)
for w in sorted({x["world"] for x in auto_rows}):
    for mode in ("eager", "graph"):
        sizes = sorted({x["bytes"] for x in auto_rows if x["world"] == w})
        for n in sizes:
            times, path = {}, {}
            for x in auto_rows:
                if x["world"] == w and x["mode"] == mode and x["bytes"] == n:
                    times.setdefault(x["algo"], []).append(x["time_us"])
                    path[x["algo"]] = x["path"]
            if "auto" not in times:
                continue
            t = {a: statistics.median(times[a]) for a in ("oneshot", "twoshot") if a in times}
            if not t:
                continue
            fast = min(t, key=t.get)
            a = times["auto"]
            med = statistics.median(a)
            ratio = med / t[fast]
            # The same kernel as the best path: any difference is the machine's.
            verdict = ("same kernel" if path["auto"] == path[fast]
                       else "ok" if ratio <= 1.05 else "OVER 5%")
            print("auto w%d %-5s %10d %-16s %8.1f us [%.1f-%.1f]  best %-7s %8.1f us  "
                  "auto/best %.3f %s" % (w, mode, n, path["auto"], med, min(a), max(a), fast,
                                         t[fast], ratio, verdict))
print("# rows with wrong elements: %d" % len(wrong))
sys.exit(1 if wrong else 0)
PY
[ $? -eq 0 ] || { echo "FAIL tables: rows with wrong elements (sweep.txt)" | tee -a "$SUMMARY"; status=1; }
grep -E "^auto " "$OUT/sweep.txt" >"$OUT/auto.txt"
mps_off
summary_json "$SUMMARY" >"$OUT/summary.json"
echo "== [$SECONDS s] done"
grep -E "^(best|auto) " "$OUT/sweep.txt"
cat "$SUMMARY"
exit $status
