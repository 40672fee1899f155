#!/usr/bin/env python3
"""Where a decode step's time goes, from an EMBER_CUDA_TRACE file (src/gpu/trace.rs).

Each line is one launch in order: `ns module grid_x grid_y`, ns the time its block 0 got past
the wait for the launch ahead (that launch's end). The gap from launch i to launch i + 1 is what
launch i costs the chain. Steps are cut at each `get_rows` launch (the embedding, once a step);
of the steps with the most common launch list, the median gap at each position is taken, then
summed per kernel (module and grid). The gap after a step's last launch also holds the host's
time between steps, shown on its own.

    trace.py TRACE [--skip N] [--top K]
"""
import statistics
import sys
from collections import Counter, defaultdict


def main():
    args = sys.argv[1:]
    path = args[0]
    skip = int(args[args.index("--skip") + 1]) if "--skip" in args else 2
    top = int(args[args.index("--top") + 1]) if "--top" in args else 40
    rows = []
    with open(path) as f:
        for line in f:
            t, m, gx, gy = line.split()
            rows.append((int(t), f"{m} {gx}x{gy}"))
    if not rows:
        sys.exit("empty trace")
    starts = [i for i, (_, k) in enumerate(rows) if k.startswith("get_rows ")]
    steps = []
    for a, b in zip(starts, starts[1:] + [len(rows)]):
        steps.append(rows[a:b])
    # Steps with the same launch list as most (decode at one length); the first `skip` left out.
    shapes = Counter(tuple(k for _, k in s) for s in steps[skip:-1])
    if not shapes:
        sys.exit(f"{len(steps)} steps: too few")
    shape, n_same = shapes.most_common(1)[0]
    same = [i for i, s in enumerate(steps) if skip <= i < len(steps) - 1 and tuple(k for _, k in s) == shape]
    n = len(shape)
    gaps = [[] for _ in range(n)]
    walls = []
    for i in same:
        s, nxt = steps[i], steps[i + 1]
        ts = [t for t, _ in s] + [nxt[0][0]]
        for p in range(n):
            gaps[p].append((ts[p + 1] - ts[p]) / 1e3)
        walls.append((ts[-1] - ts[0]) / 1e3)
    med = [statistics.median(g) for g in gaps]
    wall = statistics.median(walls)
    print(f"{len(rows)} launches, {len(steps)} steps; {n_same} steps of the same {n} launches, median step {wall:.1f} us "
          f"({1e6 / wall:.1f} steps/s); median gaps sum {sum(med):.1f} us, of which after the last launch "
          f"{med[-1]:.1f} us (host time between steps included)")
    per = defaultdict(lambda: [0, 0.0])
    for p in range(n - 1):
        per[shape[p]][0] += 1
        per[shape[p]][1] += med[p]
    print("\n| kernel (module grid) | launches a step | us a step | us a launch | share |")
    print("| --- | ---: | ---: | ---: | ---: |")
    for k, (c, us) in sorted(per.items(), key=lambda kv: -kv[1][1]):
        print(f"| {k} | {c} | {us:.1f} | {us / c:.2f} | {100 * us / wall:.1f} % |")
    print(f"| (after the step's last launch: {shape[-1]}) | 1 | {med[-1]:.1f} | | {100 * med[-1] / wall:.1f} % |")
    by_mod = defaultdict(float)
    for p in range(n - 1):
        by_mod[shape[p].split()[0]] += med[p]
    print("\nby module: " + ", ".join(f"{m} {us:.0f}" for m, us in sorted(by_mod.items(), key=lambda kv: -kv[1])))
    print(f"\nthe {top} longest positions (median us; the launches around them):")
    for p in sorted(range(n), key=lambda p: -med[p])[:top]:
        print(f"  [{p}] {shape[p]}: {med[p]:.2f} (before: {shape[p - 1] if p else '-'}; after: {shape[p + 1] if p + 1 < n else '-'})")
    # One layer's chain in order: the positions between the 2nd and 3rd launch of the step's
    # most frequent kernel are not a layer in general; print the first 60 positions instead.
    print("\nthe step's first 60 launches (median us):")
    for p in range(min(60, n)):
        print(f"  [{p}] {shape[p]}: {med[p]:.2f}")


if __name__ == "__main__":
    main()
