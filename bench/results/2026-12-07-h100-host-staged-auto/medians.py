"""Medians over the rounds r1..r5 of every (world, mode, size, algorithm) row of sweep.txt:
python3 medians.py [DIR] prints one line per world, mode and size (median [min-max] us, rounds)."""
import collections
import statistics as st
import sys
from pathlib import Path

root = Path(sys.argv[1] if len(sys.argv) > 1 else Path(__file__).parent)
rows = collections.defaultdict(list)
for sweep in sorted(root.glob("r*/sweep.txt")):
    for line in sweep.read_text().splitlines():
        f = line.split()
        if line.startswith(("#", "auto", "best")) or len(f) < 11:
            continue
        rows[(int(f[0]), f[6], int(f[7]), f[4])].append((float(f[8]), f[5]))
for w, mode, size in sorted({k[:3] for k in rows}):
    cells = []
    for algo in ("auto", "oneshot", "twoshot"):
        v = rows.get((w, mode, size, algo))
        if v:
            t = [x[0] for x in v]
            cells.append(f"{algo}={v[0][1]} {st.median(t):.1f} [{min(t):.1f}-{max(t):.1f}] n={len(t)}")
    print(w, mode, size, " | ".join(cells))
