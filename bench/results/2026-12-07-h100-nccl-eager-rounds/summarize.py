#!/usr/bin/env python3
"""The small all-reduce, bf16, out of place: nccl-tests with libipcreduce_nccl.so preloaded
against our own bench, run in turns in one session (rounds 1-5), eager (-G 0) and as CUDA
graph replays (-G 20). Prints the per-round times, their medians and the ratio preload / ours.
Usage: summarize.py [DIR] (default: this script's folder)."""
import glob, json, os, re, statistics, sys

d = sys.argv[1] if len(sys.argv) > 1 else os.path.dirname(os.path.abspath(__file__))
pre, ours = {}, {}
for g in (0, 20):
    for path in sorted(glob.glob(f"{d}/pre-G{g}-*.log")):
        for size, t in re.findall(r"^\s+(\d+)\s+\d+\s+bfloat16\s+sum\s+-?\d+\s+([\d.]+)\s", open(path).read(), re.M):
            pre.setdefault((int(size), "graph" if g else "eager"), []).append(float(t))
    for path in sorted(glob.glob(f"{d}/ours-G{g}-*.json")):
        for r in json.load(open(path))["rows"]:
            # Eager rows from the -G 0 runs (the -G 20 runs time eager calls too, later).
            if r["algo"] == "auto" and not r["registered"] and (r["mode"] == "graph") == (g == 20):
                ours.setdefault((r["bytes"], r["mode"]), []).append(r["time_us"])
print("| size | mode | preloaded nccl-tests, us (rounds) | ours, us (rounds) | median preload | median ours | preload - ours |")
print("|---|---|---|---|---|---|---|")
for key in sorted(pre):
    if key not in ours:
        continue
    a, b = pre[key], ours[key]
    ma, mb = statistics.median(a), statistics.median(b)
    fa = " ".join(f"{x:.2f}" for x in a)
    fb = " ".join(f"{x:.2f}" for x in b)
    print(f"| {key[0]} | {key[1]} | {fa} | {fb} | {ma:.2f} | {mb:.2f} | {ma - mb:+.2f} |")
