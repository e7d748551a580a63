#!/usr/bin/env bash
# The library's GPU tests (crates/ipcreduce/tests/gpu.rs) on one GPU with
# several ranks per GPU under MPS: worlds 2/4/8, stale-data chains, CUDA graph replays,
# streams, teardown with work in flight, the low-latency wrap (200,704 LL calls, every result
# checked), graph replays interleaved with eager calls and replays after drop.
# Builds nothing: run scripts/build-gpu-tests.sh on the development machine first; it leaves
# target/gpu-tests/{gpu,gpu.commit}.
# Usage: scripts/device/gpu-tests.sh OUT_DIR
# Writes OUT_DIR/env.txt (with the commit and "MPS: on"), one log per test
# (OUT_DIR/<binary>.<test>.log) and OUT_DIR/gpu-tests.json: one entry per test listed, run
# (`ok`, `exit`, `seconds`), skipped (`"skipped": reason`) or ignored (`"ignored": true`, not
# run unless GPU_TESTS_IGNORED=1). A test passed only when its log says
# `test result: ok. 1 passed`. The last line printed is `N passed, N failed, N skipped,
# N ignored`. Exit status 0 only when every test run passed and MPS was on.
# Knobs: GPU_TESTS_SKIP (test names to leave out, space separated), GPU_TESTS_BINS (default
# "target/gpu-tests/gpu"), GPU_TESTS_FILTER (substrings of the test names to run, space
# separated: a test matching any runs), GPU_TESTS_IGNORED=1 (run ignored tests too), GPU_TEST_LL_CALLS (LL wrap
# length, default 200704), GPU_TESTS_WARMUP=0 (do not fill the kernel cache first with
# target/release/ipcreduce warmup, or GPU_TESTS_WARMUP_BIN).
set -u
OUT=${1:?usage: gpu-tests.sh OUT_DIR}
BINS=${GPU_TESTS_BINS:-${GPU_TESTS_BIN:-target/gpu-tests/gpu}}
mkdir -p "$OUT"
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
# Never NVLink multicast.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
# shellcheck source=lib/steps.sh source-path=SCRIPTDIR
. "$(dirname "$0")/lib/steps.sh" || exit 2

first=${BINS%% *}
COMMIT=$(cat "$(dirname "$first")/gpu.commit" 2>/dev/null || echo unknown)
{
  date -u +%Y-%m-%dT%H:%M:%SZ
  echo "commit: $COMMIT"
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
  for b in $BINS; do ls -l "$b"; done
} >"$OUT/env.txt" 2>&1
for b in $BINS; do
  if [ ! -x "$b" ]; then
    cat "$OUT/env.txt"
    echo "error: $b missing: run scripts/build-gpu-tests.sh first" >&2
    exit 2
  fi
done
[ "$COMMIT" != unknown ] || echo "warning: no gpu.commit beside $first: the commit under test is unknown" >&2

MPS_ENV="$OUT/env.txt" mps_on || { cat "$OUT/env.txt"; exit 1; }
# Kernels are compiled when a call first needs them (and cached on disk). The tests time how
# promptly every rank sees a peer's failure; a peer compiling its first kernel of a kind on a
# cold cache would add its compile time to that. So the cache is filled first, as for a
# deployed image (`ipcreduce warmup`), unless GPU_TESTS_WARMUP=0.
WARMUP_BIN=${GPU_TESTS_WARMUP_BIN:-target/release/ipcreduce}
if [ "${GPU_TESTS_WARMUP:-1}" != 0 ]; then
  if [ -x "$WARMUP_BIN" ]; then
    t0=$(date +%s)
    if "$WARMUP_BIN" warmup --world 8 >"$OUT/warmup.log" 2>&1; then
      echo "kernel cache: warmed up in $(($(date +%s) - t0)) s ($WARMUP_BIN warmup --world 8)" | tee -a "$OUT/env.txt"
    else
      echo "kernel cache: warmup FAILED (see warmup.log); tests compile as they go" | tee -a "$OUT/env.txt"
    fi
  else
    echo "kernel cache: no $WARMUP_BIN to warm it up; tests compile as they go" | tee -a "$OUT/env.txt"
  fi
fi
cat "$OUT/env.txt"

passed=0
failed=0
skipped=0
ignored=0
json="{\"commit\":\"$COMMIT\",\"tests\":["
for b in $BINS; do
  bin=$(basename "$b")
  ignored_list=" $("$b" --list --ignored 2>/dev/null | sed -n 's/: test$//p' | tr '\n' ' ') "
  # Tests named *_after_close_* fault their ranks' CUDA contexts on purpose: they go last.
  for t in $("$b" --list 2>/dev/null | sed -n 's/: test$//p' |
    awk '/_after_close_/ { last = last $0 "\n"; next } { print } END { printf "%s", last }'); do
    name="$bin::$t"
    matched=0
    for f in ${GPU_TESTS_FILTER:-""}; do
      case "$t" in *"$f"*) matched=1 ;; esac
    done
    [ -n "${GPU_TESTS_FILTER:-}" ] || matched=1
    [ $matched = 1 ] || {
      skipped=$((skipped + 1)); echo "skip   $name (GPU_TESTS_FILTER)"
      json="$json{\"test\":\"$name\",\"skipped\":\"not matched by GPU_TESTS_FILTER\"},"
      continue
    }
    case " ${GPU_TESTS_SKIP:-} " in *" $t "*)
      skipped=$((skipped + 1)); echo "skip   $name (GPU_TESTS_SKIP)"
      json="$json{\"test\":\"$name\",\"skipped\":\"GPU_TESTS_SKIP\"},"
      continue ;;
    esac
    extra=()
    case "$ignored_list" in *" $t "*)
      if [ "${GPU_TESTS_IGNORED:-0}" != 1 ]; then
        ignored=$((ignored + 1)); echo "ignore $name (#[ignore]; GPU_TESTS_IGNORED=1 runs it)"
        json="$json{\"test\":\"$name\",\"ignored\":true},"
        continue
      fi
      extra=(--include-ignored) ;;
    esac
    log="$OUT/$bin.$t.log"
    start=$(date +%s)
    # One test at a time; each test runs its worlds one after the other.
    timeout 540 "$b" --exact "$t" "${extra[@]}" --test-threads=1 --nocapture >"$log" 2>&1
    rc=$?
    secs=$(($(date +%s) - start))
    # The exit status alone would count a test that did not run (0 passed) as passed.
    if [ $rc -eq 0 ] && grep -q "test result: ok. 1 passed" "$log"; then
      passed=$((passed + 1)); ok=true; echo "ok     $name (${secs} s)"
    else
      failed=$((failed + 1)); ok=false; echo "FAILED $name (${secs} s, exit $rc)"
      grep -E "panicked|wrong|error|test result" "$log" | head -n 5
    fi
    json="$json{\"test\":\"$name\",\"ok\":$ok,\"exit\":$rc,\"seconds\":$secs},"
  done
done
echo "${json%,}]}" >"$OUT/gpu-tests.json"
echo "$passed passed, $failed failed, $skipped skipped, $ignored ignored"
[ "$failed" -eq 0 ] && [ "$passed" -gt 0 ]
