"""Checks a trace written by `ipcreduce trace export` of a cuda run with IPCREDUCE_TIMELINE=1
(used by scripts/device/flight.sh): two ranks, each with host call slices and device slices,
each device span starting no earlier than its host call (the call enqueues it) and the device
spans in order; with the kernels' phase stamps (IPCREDUCE_TRACE), every rank has block
tracks whose phase slices lie within their call's device span (20 us of slack) and are in
order per block; prints per slice name of rank 0 the median host and device time.
Usage: python3 trace_check.py TRACE.json   (exit 0: PASS)"""

import collections
import json
import statistics
import sys

t = json.load(open(sys.argv[1]))
host = collections.defaultdict(list)
dev = collections.defaultdict(list)
phase = collections.defaultdict(list)
for e in t["traceEvents"]:
    if e.get("ph") == "X":
        {"call": host, "device": dev, "phase": phase}[e["cat"]][e["pid"]].append(e)
ranks = sorted(host)
ok = len(ranks) == 2 and all(dev.get(p) for p in ranks)
print(f"ranks {ranks}: host slices {[len(host[p]) for p in ranks]}, "
      f"device slices {[len(dev.get(p, [])) for p in ranks]}")
for p in ranks:
    start = {e["args"]["seq"]: e["ts"] for e in host[p]}
    d = dev.get(p, [])
    # 5 us of slack: the anchor that puts device times on the host clock is that close.
    early = [e for e in d if e["ts"] + 5 < start.get(e["args"]["seq"], float("-inf"))]
    ordered = all(a["ts"] <= b["ts"] + 1 for a, b in zip(d, d[1:]))
    if early or not ordered:
        ok = False
        print(f"rank {p}: {len(early)} device spans before their host call; in order: {ordered}")
for p in ranks:
    span = {e["args"]["seq"]: (e["ts"], e["ts"] + e["dur"]) for e in dev.get(p, [])}
    ph = phase.get(p, [])
    outside = [e for e in ph if e["args"]["seq"] in span
               and not (span[e["args"]["seq"]][0] - 20 <= e["ts"]
                        and e["ts"] + e["dur"] <= span[e["args"]["seq"]][1] + 20)]
    per_block = collections.defaultdict(list)
    for e in ph:
        per_block[(e["args"]["seq"], e["tid"])].append(e)
    unordered = sum(1 for v in per_block.values()
                    if any(a["ts"] + a["dur"] > b["ts"] + 0.001 for a, b in zip(v, v[1:])))
    print(f"rank {p}: {len(ph)} phase slices on {len({e['tid'] for e in ph})} block tracks, "
          f"{len(outside)} outside their call's device span, {unordered} blocks out of order")
    if not ph or outside or unordered:
        ok = False
names = collections.defaultdict(lambda: ([], []))
for e in host.get(0, []):
    names[e["name"]][0].append(e["dur"])
for e in dev.get(0, []):
    names[e["name"]][1].append(e["dur"])
print(f"{'rank 0 call':<34} {'n':>5} {'host us':>9} {'device us':>10}")
for n, (h, d) in sorted(names.items(), key=lambda kv: -len(kv[1][0]))[:24]:
    def med(v):
        return f"{statistics.median(v):.2f}" if v else "-"
    print(f"{n:<34} {len(h):>5} {med(h):>9} {med(d):>10}")
print("PASS" if ok else "FAIL")
sys.exit(0 if ok else 1)
