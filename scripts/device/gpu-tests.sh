#!/usr/bin/env bash
# The library's GPU tests (crates/ipcreduce/tests/gpu.rs) on one GPU with several ranks per
# GPU under MPS: worlds 2/4/8, stale-data chains, CUDA graph replays, streams, teardown with
# work in flight, and the low-latency wrap (200,704 LL calls, every result checked).
# Builds nothing: run scripts/build-gpu-tests.sh on the development machine first; it leaves
# target/gpu-tests/gpu.
# Usage: scripts/device/gpu-tests.sh OUT_DIR
# Writes OUT_DIR/env.txt, one log per test (OUT_DIR/<test>.log) and OUT_DIR/gpu-tests.json;
# the last line printed is `N passed, N failed`. Exit status 0 only when every test passed.
# Knobs: GPU_TESTS_SKIP (test names to leave out, space separated), GPU_TESTS_BIN (default
# target/gpu-tests/gpu), GPU_TESTS_FILTER (substring of the test
# names to run), GPU_TEST_LL_CALLS (LL wrap length, default 200704).
set -u
OUT=${1:?usage: gpu-tests.sh OUT_DIR}
BIN=${GPU_TESTS_BIN:-target/gpu-tests/gpu}
mkdir -p "$OUT"
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
# Never NVLink multicast.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1

{
  date -u +%Y-%m-%dT%H:%M:%SZ
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
  ls -l "$BIN"
} >"$OUT/env.txt" 2>&1
cat "$OUT/env.txt"
if [ ! -x "$BIN" ]; then
  echo "error: $BIN missing: run scripts/build-gpu-tests.sh first" >&2
  exit 2
fi

export CUDA_MPS_PIPE_DIRECTORY=/tmp/mps-pipe CUDA_MPS_LOG_DIRECTORY=/tmp/mps-log
mkdir -p $CUDA_MPS_PIPE_DIRECTORY $CUDA_MPS_LOG_DIRECTORY
nvidia-cuda-mps-control -d
trap 'echo quit | nvidia-cuda-mps-control' EXIT

passed=0
failed=0
json="["
for t in $("$BIN" --list 2>/dev/null | sed -n 's/: test$//p'); do
  case "$t" in *"${GPU_TESTS_FILTER:-}"*) ;; *) continue ;; esac
  case " ${GPU_TESTS_SKIP:-} " in *" $t "*) echo "skip   $t (GPU_TESTS_SKIP)"; continue ;; esac
  start=$(date +%s)
  # One test at a time; each test runs its worlds one after the other.
  timeout 540 "$BIN" --exact "$t" --test-threads=1 --nocapture >"$OUT/$t.log" 2>&1
  rc=$?
  secs=$(($(date +%s) - start))
  if [ $rc -eq 0 ]; then
    passed=$((passed + 1)); ok=true; echo "ok     $t (${secs} s)"
  else
    failed=$((failed + 1)); ok=false; echo "FAILED $t (${secs} s, exit $rc)"
    grep -E "panicked|wrong|error" "$OUT/$t.log" | head -n 5
  fi
  json="$json{\"test\":\"$t\",\"ok\":$ok,\"exit\":$rc,\"seconds\":$secs},"
done
echo "${json%,}]" >"$OUT/gpu-tests.json"
echo "$passed passed, $failed failed"
[ "$failed" -eq 0 ] && [ "$passed" -gt 0 ]
