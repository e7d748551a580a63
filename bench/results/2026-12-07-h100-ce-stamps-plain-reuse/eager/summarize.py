#!/usr/bin/env python3
"""Eager bf16 all-reduce, 8 B - 8 KiB, two ranks: nccl-tests with libipcreduce_nccl.so
preloaded (pre-V-N.log, out of place) and our own bench (ours-V-N.json, plain buffers, auto),
V = before (13e6045) or after (6c93bd3's code), rounds N run in turns. Prints per size the
rounds and their medians. Usage: summarize.py [DIR] (default: this script's folder)."""
import glob, json, os, re, statistics, sys

d = sys.argv[1] if len(sys.argv) > 1 else os.path.dirname(os.path.abspath(__file__))
rows = {}
for v in ("before", "after"):
    for path in sorted(glob.glob(f"{d}/pre-{v}-*.log")):
        for size, t in re.findall(r"^\s+(\d+)\s+\d+\s+bfloat16\s+sum\s+-?\d+\s+([\d.]+)\s", open(path).read(), re.M):
            rows.setdefault((int(size), v, "preloaded"), []).append(float(t))
    for path in sorted(glob.glob(f"{d}/ours-{v}-*.json")):
        for r in json.load(open(path))["rows"]:
            if r["algo"] == "auto" and not r["registered"] and r["mode"] == "eager":
                rows.setdefault((r["bytes"], v, "ours"), []).append(r["time_us"])
print("| size B | build | preloaded nccl-tests, us (rounds) | ours, us (rounds) | median preloaded | median ours | preloaded - ours |")
print("|---|---|---|---|---|---|---|")
for size in sorted({k[0] for k in rows}):
    for v in ("before", "after"):
        a, b = rows.get((size, v, "preloaded")), rows.get((size, v, "ours"))
        if not a or not b:
            continue
        ma, mb = statistics.median(a), statistics.median(b)
        print(f"| {size} | {v} | {' '.join(f'{x:.2f}' for x in a)} | {' '.join(f'{x:.2f}' for x in b)} "
              f"| {ma:.2f} | {mb:.2f} | {ma - mb:+.2f} |")
