#!/usr/bin/env python3
"""Per-kernel GPU time of one decode step, from two `ncu --csv --metrics gpu__time_duration.sum`
logs of the same prompt generating few and more tokens: the difference, divided by the decode
steps between them, is what one decode step runs (the prompt, loading and the first step cancel).

    ncu-diff.py short.csv long.csv N_LAYER

Steps are counted by the `route` kernel (one launch per layer per step). Prints a table by
kernel family and one by (kernel, grid) shape, in microseconds per step.
"""
import csv
import sys
from collections import defaultdict

UNIT = {"nsecond": 1e-3, "ns": 1e-3, "usecond": 1.0, "us": 1.0, "msecond": 1e3, "ms": 1e3, "second": 1e6, "s": 1e6}


def load(path):
    """[(kernel, grid, block, microseconds)] in launch order."""
    with open(path, newline="") as f:
        lines = [l for l in f if l.startswith('"')]
    rows = list(csv.reader(lines))
    head = rows[0]
    out = []
    if "Metric Name" in head:  # the details page: one row per (kernel, metric)
        ix = {h: i for i, h in enumerate(head)}
        for r in rows[1:]:
            if r[ix["Metric Name"]] != "gpu__time_duration.sum":
                continue
            v = float(r[ix["Metric Value"]].replace(",", "")) * UNIT.get(r[ix["Metric Unit"]], 1.0)
            out.append((r[ix["Kernel Name"]], r[ix.get("Grid Size", 0)], r[ix.get("Block Size", 0)], v))
    else:  # the raw page: a row of units, then one row per kernel
        ix = {h: i for i, h in enumerate(head)}
        units = rows[1]
        c = ix["gpu__time_duration.sum"]
        scale = UNIT.get(units[c], 1.0)
        for r in rows[2:]:
            grid = r[ix["Grid Size"]] if "Grid Size" in ix else ""
            block = r[ix["Block Size"]] if "Block Size" in ix else ""
            out.append((r[ix["Kernel Name"]], grid, block, float(r[c].replace(",", "")) * scale))
    return out


def family(name):
    n = name.split("(")[0]
    for key, fam in [
        ("moe_gate_up", "moe routed gate/up"),
        ("moe_down", "moe routed down"),
        ("moe_shared", "moe shared add"),
        ("moe", "moe other"),
        ("gemv_multi", "gemv (multi)"),
        ("gemv", "gemv"),
        ("matmul_mma", "mma"),
        ("matmul", "matmul other"),
        ("rms_norm", "rms_norm"),
        ("gate", "gate"),
        ("add", "add"),
        ("route", "route"),
        ("conv1d", "deltanet conv"),
        ("delta_prep", "deltanet prep"),
        ("delta", "deltanet rule"),
        ("attention", "attention"),
        ("attn_prep", "attention prep"),
        ("kv_append", "kv append"),
        ("get_rows", "embed"),
        ("select_rows", "select rows"),
    ]:
        if key in n:
            return fam
    return n


def main():
    short, long_, n_layer = load(sys.argv[1]), load(sys.argv[2]), int(sys.argv[3])
    routes = lambda rs: sum(1 for r in rs if r[0].split("(")[0] == "route")
    steps = (routes(long_) - routes(short)) / n_layer
    if steps <= 0:
        sys.exit(f"no decode steps between the logs (route launches {routes(short)} vs {routes(long_)})")

    def agg(rs, key):
        t, c = defaultdict(float), defaultdict(int)
        for r in rs:
            k = key(r)
            t[k] += r[3]
            c[k] += 1
        return t, c

    for title, key in [("family", lambda r: family(r[0])), ("kernel, grid", lambda r: (r[0].split("(")[0], r[1]))]:
        ts, cs = agg(short, key)
        tl, cl = agg(long_, key)
        keys = set(tl) | set(ts)
        d = {k: ((tl[k] - ts[k]) / steps, (cl[k] - cs[k]) / steps) for k in keys}
        total = sum(v[0] for v in d.values())
        print(f"\n### per decode step by {title} ({steps:g} steps; {total:.1f} us; {sum(v[1] for v in d.values()):.0f} launches)\n")
        print(f"| {title} | us / step | launches | us / launch | share |")
        print("| --- | ---: | ---: | ---: | ---: |")
        for k, (t, c) in sorted(d.items(), key=lambda kv: -kv[1][0]):
            if c < 0.5 and abs(t) < 0.5:
                continue
            name = k if isinstance(k, str) else f"{k[0]} {k[1]}"
            print(f"| {name} | {t:.1f} | {c:.1f} | {t / c if c else 0:.2f} | {100 * t / total:.1f} % |")


if __name__ == "__main__":
    main()
