#!/usr/bin/env bash
# Side by side on this machine: OpenMPI's MPI_Allreduce and ipcreduce's host backend, float32
# sum, same sizes and rank counts, one run. Writes raw results and a markdown table to OUT.
# Needs: openmpi-bin libopenmpi-dev (apt), python3. Usage: scripts/host/mpi-compare.sh OUT
set -euo pipefail
OUT=$(realpath -m "${1:?usage: mpi-compare.sh OUT_DIR}")
MIN=${MIN:-8} MAX=${MAX:-8388608} FACTOR=${FACTOR:-4} ITERS=${ITERS:-50} WARMUP=${WARMUP:-10}
RANKS=${RANKS:-"2 4 8"}
mkdir -p "$OUT" target/mpi
cd "$(dirname "$0")/../.."
mpicc -O2 -o target/mpi/mpi_allreduce bench/mpi/mpi_allreduce.c
cargo build --release --quiet
{
  echo "date: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
  echo "cores: $(nproc)"
  echo "cpu: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2- | xargs)"
  echo "mpi: $(mpirun --version | head -n1)"
  echo "commit: $(git rev-parse --short=12 HEAD)"
} >"$OUT/env.txt"
for r in $RANKS; do
  # vader = OpenMPI's shared-memory transport (with its default single-copy mechanism).
  # MPI keeps its default binding (one core per rank while ranks fit the cores), as do we.
  mpirun --allow-run-as-root --oversubscribe -n "$r" \
    --mca btl self,vader \
    target/mpi/mpi_allreduce "$MIN" "$MAX" "$FACTOR" "$ITERS" "$WARMUP" >"$OUT/mpi-$r.csv"
  target/release/ipcreduce bench --backend host --ranks "$r" -a auto -d float \
    -b "$MIN" -e "$MAX" -f "$FACTOR" -n "$ITERS" -w "$WARMUP" --json "$OUT/ipcreduce-$r.json" \
    >"$OUT/ipcreduce-$r.log"
done
python3 bench/mpi/compare.py "$OUT" $RANKS | tee "$OUT/table.md"
