"""The summary of scripts/device/nccl-dropin.sh OUT: checks passed and failed per program,
losses plain against preloaded, calls per path (and which streams ran on ipcreduce), the
killed-rank result, nccl-tests' own verdicts, and the small all-reduce's times with and
without the library. Writes OUT/summary.json; exits 1 when anything is wrong."""

import glob
import json
import os
import re
import statistics
import sys

out = sys.argv[1]
problems: list = []
summary: dict = {}


def reports(prefix: str, tag: str) -> list:
    return [json.load(open(p)) for p in sorted(glob.glob(f"{out}/{prefix}-{tag}-rank*.json"))]


def worst_relative(a: list, b: list) -> float:
    return max((abs(x - y) / max(abs(x), 1e-12) for x, y in zip(a, b)), default=0.0)


# --- checks and losses of the PyTorch programs -------------------------------------------
for prefix, name in (("dropin", "torch"), ("fsdptp", "fsdp-tp")):
    if not os.path.exists(f"{out}/{'torch' if prefix == 'dropin' else 'fsdptp'}-plain.log"):
        continue
    plain, pre = reports(prefix, "plain"), reports(prefix, "preload")
    entry = {}
    for tag, reps in (("plain", plain), ("preload", pre)):
        checks = sum(r["checks"] for r in reps)
        failed = sum(len(r["failures"]) for r in reps)
        entry[tag] = {"ranks": len(reps), "checks": checks, "failed": failed}
        print(f"{name} {tag}: {len(reps)} ranks, {checks - failed} checks passed, {failed} failed")
        if len(reps) != 2:
            problems.append(f"{name} {tag}: {len(reps)} rank reports (want 2)")
        for r in reps:
            if r["failures"]:
                problems.append(f"{name} {tag} rank {r['rank']}: {r['failures'][:4]}")
    if plain and pre:
        more = sorted(set(sum((r.get("skipped", []) for r in pre), [])) -
                      set(sum((r.get("skipped", []) for r in plain), [])))
        if more:
            problems.append(f"{name}: skipped only when preloaded: {more}")
        elif pre[0].get("skipped"):
            print(f"{name}: skipped in both runs (PyTorch refused the handle): {pre[0]['skipped']}")
        if prefix == "dropin":
            pairs = {"ddp": (plain[0]["ddp_losses"], pre[0]["ddp_losses"], 1e-4)}
        else:
            # FSDP2 sums gradients in another order on ipcreduce (then AdamW); TP's SGD too.
            pairs = {k: (plain[0]["losses"].get(k, []), pre[0]["losses"].get(k, []), 1e-3)
                     for k in ("fsdp2", "tp", "tp_compiled", "tp_graph")}
        for k, (a, b, tol) in pairs.items():
            w = worst_relative(a, b)
            entry[f"{k}_worst_relative"] = w
            print(f"{name} {k} losses plain   {[round(v, 6) for v in a]}\n"
                  f"{' ' * len(name)} {k} losses preload {[round(v, 6) for v in b]}  worst relative {w:.2e}")
            if not a or len(a) != len(b):
                problems.append(f"{name} {k}: losses missing ({len(a)} plain, {len(b)} preloaded)")
            elif w > tol:
                problems.append(f"{name} {k}: losses differ by {w:.2e} (more than {tol:g})")
    summary[name] = entry

# --- calls per path ----------------------------------------------------------------------
LINE = re.compile(r"^ipcreduce-nccl: rank (\S+) pid \d+ (ncclAllReduce|ncclReduceScatter|ncclAllGather) "
                  r"(.*) -> (ipcreduce|nccl)$", re.M)
paths: dict = {}
for log in ["torch-preload.log", "fsdptp-preload.log", "watchdog/rank0.log",
            *[os.path.basename(p) for p in sorted(glob.glob(f"{out}/nccl-tests-*-check.log"))]]:
    path = f"{out}/{log}"
    if not os.path.exists(path):
        continue
    text = open(path, errors="replace").read()
    counts, streams, reasons = {}, {}, {}
    for _rank, coll, what, where in LINE.findall(text):
        counts[f"{coll} {where}"] = counts.get(f"{coll} {where}", 0) + 1
        s = re.search(r" stream=(0x[0-9a-f]+)", what)
        if s and s.group(1) in ("0x0", "0x1", "0x2"):
            key = f"stream {s.group(1)} {where}"
            streams[key] = streams.get(key, 0) + 1
        if where == "nccl":
            why = re.search(r"\(([^()]*)\)$", what)
            if why:
                reasons[why.group(1)] = reasons.get(why.group(1), 0) + 1
    # Two ranks' lines interleaved would put two of our prefixes on one line (another
    # program's partial line before ours is that program's doing: counted apart).
    torn = sum(1 for ln in text.splitlines() if ln.count("ipcreduce-nccl: rank") > 1)
    after_other = sum(1 for ln in text.splitlines()
                      if "ipcreduce-nccl: rank" in ln and not ln.startswith("ipcreduce-nccl: rank"))
    paths[log] = {"calls": counts, "default_streams": streams, "forward_reasons": reasons,
                  "torn_lines": torn, "lines_after_other_output": after_other}
    print(f"{log}: {counts}")
    if streams:
        print(f"{' ' * len(log)}  default streams: {streams}")
    if reasons:
        print(f"{' ' * len(log)}  forwarded because: {reasons}")
    if torn:
        problems.append(f"{log}: {torn} lines holding two of our lines (interleaved)")
    # The checked program calls each collective on every path it may take.
    for c in ("ncclAllReduce", "ncclReduceScatter", "ncclAllGather"):
        if log.startswith("torch") and not counts.get(f"{c} ipcreduce"):
            problems.append(f"{log}: {c} never ran on ipcreduce")
    m = re.match(r"nccl-tests-(all_reduce|reduce_scatter|all_gather)-", log)
    if m:
        coll = {"all_reduce": "ncclAllReduce", "reduce_scatter": "ncclReduceScatter",
                "all_gather": "ncclAllGather"}[m.group(1)]
        if not counts.get(f"{coll} ipcreduce"):
            problems.append(f"{log}: no {coll} ran on ipcreduce")
    if "-stream0-" in log and not streams.get("stream 0x0 ipcreduce"):
        problems.append(f"{log}: no call on stream 0 ran on ipcreduce: {streams}")
    if "legacy default stream" in reasons:
        problems.append(f"{log}: calls forwarded for their stream: {reasons}")
    for line in re.findall(r"^ipcreduce-nccl: .*counts: .*$", text, re.M)[:2]:
        print(f"{' ' * len(log)}  {line}")
summary["paths"] = paths

# --- the killed rank ---------------------------------------------------------------------
wd = f"{out}/watchdog/watchdog.json"
if os.path.exists(wd):
    w = json.load(open(wd))
    summary["watchdog"] = w
    print(f"watchdog: async error {w.get('async_error')} {w.get('seconds_after_kill')} s after the kill "
          f"(bound {w.get('bound_s')} s), abort {w.get('abort')}, last error {w.get('last_error')!r}")
    problems += [f"watchdog: {p}" for p in w.get("problems", [])]
elif os.path.isdir(f"{out}/watchdog"):
    problems.append("watchdog: no watchdog.json (rank 0 did not finish)")

# --- nccl-tests' verdicts ----------------------------------------------------------------
for path in sorted(glob.glob(f"{out}/nccl-tests-*-check.log")):
    text = open(path, errors="replace").read()
    oob = re.findall(r"Out of bounds values\s*:\s*(\d+)\s*(\w+)", text)
    wrong = 0
    for row in re.findall(r"^\s+\d+\s+\d+\s+\S+\s+\S+\s+-?\d+\s+.*$", text, re.M):
        f = row.split()
        # size count type redop root time algbw busbw #wrong time algbw busbw #wrong
        if len(f) >= 13:
            wrong += sum(int(x) for x in (f[8], f[12]) if x.isdigit())
    name = os.path.basename(path)
    print(f"{name}: out of bounds {oob or 'line missing'}, #wrong total {wrong}")
    summary.setdefault("nccl_tests", {})[name] = {"out_of_bounds": oob, "wrong": wrong}
    if not oob or any(v != "0" or ok != "OK" for v, ok in oob) or wrong:
        problems.append(f"{name}: errors (out of bounds {oob}, #wrong {wrong})")

# --- the small all-reduce, with and without ----------------------------------------------
times = {}
plain, pre = reports("dropin", "plain"), reports("dropin", "preload")
if plain and pre:
    for k in ("allreduce_8k_bf16_eager_us", "allreduce_8k_bf16_graph_us"):
        times[f"torch {k}"] = {"plain": plain[0][k], "preload": pre[0][k]}
# nccl-tests' rounds (nccl-tests-time-MODE-GN[-rR].log; older runs have no round) and our own
# bench's of the same run (bench-ours[-rR].json, its auto rows on plain buffers): per size and
# mode, the median of the rounds, and every round's time.
rounds: dict = {}
TIME_LOG = re.compile(r"nccl-tests-time-(plain|preload)-G(\d+)(?:-r\d+)?\.log$")
for path in sorted(glob.glob(f"{out}/nccl-tests-time-*.log")):
    m = TIME_LOG.search(os.path.basename(path))
    if not m:
        continue
    mode = f"{m.group(1)}-G{m.group(2)}"
    for row in re.findall(r"^\s+(\d+)\s+\d+\s+bfloat16\s+\S+\s+-?\d+\s+([\d.]+)\s", open(path, errors="replace").read(), re.M):
        size, t = int(row[0]), float(row[1])
        rounds.setdefault(f"nccl-tests all_reduce {size} B bf16 out of place", {}).setdefault(mode, []).append(t)
for ours in sorted(glob.glob(f"{out}/bench-ours*.json")):
    if not re.search(r"bench-ours(-r\d+)?\.json$", ours):
        continue
    for r in json.load(open(ours))["rows"]:
        if r["algo"] == "auto" and not r["registered"]:
            mode = "ours-G0" if r["mode"] == "eager" else "ours-G20"
            rounds.setdefault(f"nccl-tests all_reduce {r['bytes']} B bf16 out of place", {}).setdefault(mode, []).append(r["time_us"])
for k, v in rounds.items():
    times[k] = {m: statistics.median(ts) for m, ts in v.items()}
# What the stand-in adds to our own calls per mode: (preloaded - ours, size), medians of the
# rounds; the goal: <= GOAL_US at every size (a verdict, never a problem: eager calls are bound
# by the host, whose pace moves between runs).
GOAL_US = 0.3
added: dict = {}
for k, v in times.items():
    cells = []
    for m, t in sorted(v.items()):
        ts = rounds.get(k, {}).get(m, [])
        spread = f" [{min(ts):.2f}-{max(ts):.2f}]" if len(ts) > 1 else ""
        cells.append(f"{m} {t:.2f}{spread}")
    print(f"time us {k}: " + ", ".join(cells))
    for g, name in (("G0", "eager"), ("G20", "graph")):
        if f"preload-{g}" in v and f"ours-{g}" in v:
            d = v[f"preload-{g}"] - v[f"ours-{g}"]
            added.setdefault(name, []).append((d, k))
            print(f"{' ' * 8}preload - ours, {name}: {d:+.2f} us")
for name, d in added.items():
    worst, at = max(d)
    over = sum(1 for x, _ in d if x > GOAL_US)
    print(f"goal preload - ours <= +{GOAL_US} us, {name}: "
          f"{'met' if over == 0 else 'missed'} at {len(d) - over} of {len(d)} sizes "
          f"(worst {worst:+.2f} us: {at})")
summary["times_us"] = times
summary["times_rounds_us"] = rounds
summary["added_us"] = {name: {k: x for x, k in d} for name, d in added.items()}

summary["problems"] = problems
json.dump(summary, open(f"{out}/summary.json", "w"), indent=1)
print("problems:", problems or "none")
sys.exit(1 if problems else 0)
